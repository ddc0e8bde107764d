#include "sparse_rows.h"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace bps {

std::string RowMerger::Add(const char* body, uint64_t len) {
  const uint64_t row_bytes = SparseRowBytes(width_);
  if (len % row_bytes != 0)
    return "a sparse push of " + std::to_string(len) + " bytes is not a whole number of " +
           std::to_string(width_) + "-wide rows with their ids";
  const uint64_t count = len / row_bytes;
  std::vector<int64_t> ids(count);
  if (count) std::memcpy(ids.data(), body, count * 8);
  for (uint64_t i = 0; i < count; ++i)
    if (ids[i] < 0 || (i && ids[i] <= ids[i - 1]))
      return "a sparse push whose row ids are not non-negative and strictly ascending (at position " +
             std::to_string(i) + ")";
  const float* rows = reinterpret_cast<const float*>(body + count * 8);
  for (uint64_t i = 0; i < count; ++i) {
    const auto [slot, fresh] = index_.Insert(ids[i]);
    const float* src = rows + i * width_;
    if (fresh) {
      ids_.push_back(ids[i]);
      rows_.insert(rows_.end(), src, src + width_);
    } else {
      float* dst = rows_.data() + slot * width_;
      for (uint32_t j = 0; j < width_; ++j) dst[j] += src[j];  // arrival order, as dense sums
    }
  }
  return "";
}

std::shared_ptr<Buffer> RowMerger::Result(BufferPool& pool) const {
  const size_t n = ids_.size();
  if (n == 0) return nullptr;  // an empty answer has no body
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ids_[a] < ids_[b]; });
  std::shared_ptr<Buffer> out = pool.Acquire(n * SparseRowBytes(width_));
  char* p = out->data();
  for (size_t i = 0; i < n; ++i) std::memcpy(p + i * 8, &ids_[order[i]], 8);
  float* rows = reinterpret_cast<float*>(p + n * 8);
  for (size_t i = 0; i < n; ++i) std::memcpy(rows + i * width_, rows_.data() + order[i] * width_, 4ull * width_);
  return out;
}

}  // namespace bps
