// Row-sparse push_pull on the servers: each worker pushes the rows it touched of one
// shard of an embedding-like table as (ids, rows); the server merges them by id and
// answers every worker with the union (ids ascending, the rows summed).
//
// Wire body of a push and of the answer (the row count follows from the length): `count`
// int64 ids (non-negative, strictly ascending: the worker sums duplicates first), then
// `count` x `width` float32 rows. Nothing in a push is trusted before Add checks it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "buffer_pool.h"
#include "id_index.h"

namespace bps {

inline uint64_t SparseRowBytes(uint32_t width) { return 8 + 4ull * width; }

class RowMerger {
 public:
  explicit RowMerger(uint32_t width) : width_(width) {}
  // Adds one push's body (len bytes). Returns "" or what is wrong with it (then nothing
  // of it was added).
  std::string Add(const char* body, uint64_t len);
  // The union: ids ascending, then their summed rows (null when no worker sent a row).
  std::shared_ptr<Buffer> Result(BufferPool& pool) const;
  size_t rows() const { return ids_.size(); }
  bool Contains(int64_t id) const { return index_.Find(id) >= 0; }

 private:
  uint32_t width_;
  IdIndex index_;  // id -> row in rows_
  std::vector<int64_t> ids_;
  std::vector<float> rows_;
};

}  // namespace bps
