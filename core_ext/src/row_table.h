// The parameter servers as embedding storage (issue 16's storage mode): a table's rows
// live only on the servers (each server the ids of its shard), are created on first
// touch with a deterministic initialiser, and are updated by a sparse optimizer on the
// server; workers pull the rows they need and push gradients for them, never holding
// the table.
//
// Table spec (sent with every operation; the first one creates the table, later ones
// must match): "init=<zeros|uniform:<a>> seed=<s> optimizer=<sgd|adagrad|adam> [eps=<e>]
// [initial_accumulator=<v>] [beta1=<b>] [beta2=<b>]". Initial row j of id i: uniform in [-a, a) from
// splitmix64(seed ^ (i * width + j)) (bpstrain/_sparse.py has the numpy twin).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "id_index.h"

namespace bps {

struct RowTableSpec {
  enum Optimizer { kSgd, kAdagrad, kAdam };
  double init_scale = 0;  // 0 = zeros
  uint64_t seed = 0;
  Optimizer optimizer = kSgd;
  double eps = 1e-10, initial_accumulator = 0;
  double beta1 = 0.9, beta2 = 0.999;
};

// Returns "" or what is wrong.
std::string ParseRowTableSpec(const std::string& text, RowTableSpec* out);

class RowTable {
 public:
  RowTable(uint32_t width, const RowTableSpec& spec, std::string text)
      : width_(width), spec_(spec), text_(std::move(text)) {}
  uint32_t width() const { return width_; }
  const std::string& text() const { return text_; }
  // The rows of `ids` (count of them), created on first touch, into out (count x width).
  void Read(const int64_t* ids, uint64_t count, float* out);
  // One optimizer step on the rows of `ids` with their averaged gradients (count x width).
  // Called for every step of the table, rows or none: Adam's bias correction counts steps.
  void Apply(const int64_t* ids, uint64_t count, const float* grads, double lr);
  size_t rows() const { return index_.size(); }
  uint64_t steps() const { return steps_; }  // Apply calls so far: the table's pushes

 private:
  // Rows live in chunks of kChunkRows, so a growing table never moves (copies) the
  // rows it has; the optimizer state the same: Adagrad's accumulators in accum_, Adam's
  // first moments in accum_ and second moments in accum2_.
  static constexpr uint64_t kChunkRows = 4096;
  // The row of `id` (and its slot), created on first touch.
  float* Row(int64_t id, uint64_t* slot);
  float* At(std::vector<std::unique_ptr<float[]>>& chunks, uint64_t slot) {
    return chunks[slot / kChunkRows].get() + (slot % kChunkRows) * width_;
  }

  uint32_t width_;
  RowTableSpec spec_;
  std::string text_;
  IdIndex index_;
  std::vector<std::unique_ptr<float[]>> data_, accum_, accum2_;
  uint64_t steps_ = 0;
};

}  // namespace bps
