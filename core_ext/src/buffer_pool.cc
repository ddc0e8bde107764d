#include "buffer_pool.h"

#include <cstdlib>
#include <new>

namespace bps {

size_t BufferSizeClass(size_t size) {
  if (size <= 4096) return size ? (size + 63) / 64 * 64 : 64;
  const size_t step = (size_t{1} << (63 - __builtin_clzll(size - 1))) / 4;
  return (size + step - 1) / step * step;
}

Buffer::Buffer(size_t size) : size_(size), capacity_(BufferSizeClass(size)) {
  data_ = static_cast<char*>(std::aligned_alloc(64, capacity_));
  if (!data_) throw std::bad_alloc();
}

Buffer::~Buffer() { std::free(data_); }

std::shared_ptr<Buffer> BufferPool::Acquire(size_t size) {
  std::unique_ptr<Buffer> b;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = free_.find(BufferSizeClass(size));
    if (it != free_.end() && !it->second.empty()) {
      b = std::move(it->second.back());
      it->second.pop_back();
      b->size_ = size;
    }
  }
  if (!b) b = std::make_unique<Buffer>(size);
  std::weak_ptr<BufferPool> weak = shared_from_this();
  return std::shared_ptr<Buffer>(b.release(), [weak](Buffer* p) {
    if (auto pool = weak.lock()) pool->Release(p);
    else delete p;
  });
}

void BufferPool::Release(Buffer* b) {
  std::lock_guard<std::mutex> lk(mu_);
  auto& v = free_[b->capacity()];
  if (v.size() < max_free_) v.emplace_back(b);
  else delete b;
}

}  // namespace bps
