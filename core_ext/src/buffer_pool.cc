#include "buffer_pool.h"

#include <cstdlib>
#include <new>

namespace bps {

Buffer::Buffer(size_t size) : size_(size) {
  size_t rounded = (size + 63) / 64 * 64;
  data_ = static_cast<char*>(std::aligned_alloc(64, rounded ? rounded : 64));
  if (!data_) throw std::bad_alloc();
}

Buffer::~Buffer() { std::free(data_); }

std::shared_ptr<Buffer> BufferPool::Acquire(size_t size) {
  std::unique_ptr<Buffer> b;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      b = std::move(it->second.back());
      it->second.pop_back();
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
  auto& v = free_[b->size()];
  if (v.size() < max_free_) v.emplace_back(b);
  else delete b;
}

}  // namespace bps
