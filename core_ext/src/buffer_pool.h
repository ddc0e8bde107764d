// Reusable, 64-byte aligned byte buffers. Servers receive every partition into one and
// hand the reduced result to several sender threads through shared_ptr; recycling them
// avoids a fresh mmap + page faults for every 4 MB partition. Buffers are kept by size
// class (four per power of two), so messages whose length changes every round (sparse
// rows, embedding-table pulls) reuse them too.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace bps {

class Buffer {
 public:
  explicit Buffer(size_t size);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* data() { return data_; }
  size_t size() const { return size_; }  // the bytes asked for (capacity() may be more)
  size_t capacity() const { return capacity_; }

 private:
  friend class BufferPool;
  char* data_;
  size_t size_, capacity_;
};

// The capacity a buffer of `size` bytes gets: 64-byte steps up to 4 KiB, then four
// classes per power of two (at most 25 % unused).
size_t BufferSizeClass(size_t size);

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  static std::shared_ptr<BufferPool> Create(size_t max_free_per_size = 64) {
    return std::shared_ptr<BufferPool>(new BufferPool(max_free_per_size));
  }
  // A buffer of `size` bytes (size() == size); it returns to the pool when the last
  // owner drops it.
  std::shared_ptr<Buffer> Acquire(size_t size);

 private:
  explicit BufferPool(size_t max_free) : max_free_(max_free) {}
  void Release(Buffer* b);
  std::mutex mu_;
  std::map<size_t, std::vector<std::unique_ptr<Buffer>>> free_;
  size_t max_free_;
};

}  // namespace bps
