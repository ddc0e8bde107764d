// One operation as the adapters hand it to a worker: the vocabulary shared by the worker,
// its send policy, its tensor registry and the hierarchical local group (which must not
// depend on the worker itself).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace bps {

enum class Op : int { kSum = 0, kAverage = 1, kBroadcast = 2 };

struct OpRequest {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  const void* input = nullptr;  // must stay valid until the op completes
  void* output = nullptr;       // may equal input (in place)
  Op op = Op::kSum;
  int root = 0;                 // broadcast only
  int priority = 0;             // larger = sooner; adapters pass -parameter_index
  int participants = 0;         // ranks taking part; 0 = all (hierarchical slices: hosts)
  // Where the adapter keeps the tensor ("cpu", "cuda", ...) and how it cut it into
  // engine tensors ("" = whole; e.g. "chunks:1048576"): both are part of the
  // declaration, so ranks that disagree fail with MismatchError instead of mixing.
  std::string device = "cpu";
  std::string layout;
  // > 0: this tensor's partition size, for an adapter that already cut a tensor into
  // pieces (CUDA staging chunks) that the engine should not cut again; 0 = the worker's.
  int64_t partition_bytes = 0;
  // k-of-n catch-up: take the result of a round the other workers already completed,
  // contributing nothing (`input` is not read). See Worker::RoundsBehind.
  bool pull_only = false;
  // A broadcast whose result this worker holds already: it takes part in the round but
  // receives no bytes, and `output` gets its own `input`. Used when the workers that
  // joined a job receive the state, which every other worker holds (engine.to_joiners).
  bool keep_own = false;
  // Server-held weights (comm.consistency ssp/async; param_store.h): 1 = init, a
  // broadcast whose result the servers keep as the weights and step with
  // `server_optimizer`; 2 = update, an Op::kSum push of the gradient answered with the
  // weights, `lr` this step's learning rate. 0 = neither.
  int param = 0;
  double lr = 0;
  std::string server_optimizer;
  // Row-sparse push_pull (sparse_rows.h): > 0 = the table's row width; `input` holds
  // `sparse_bytes` of ids then rows, the answer (the merged rows, any length) is kept for
  // Worker::TakeSparseResult and `output` is unused. Declared as shape {row_width}.
  // With `param` 4 (table pull: `input` holds ids only; the answer is their rows) or 5
  // (table push: ids and gradient rows, applied by the servers with `lr`; the answer is
  // empty), `server_optimizer` is the table spec (row_table.h).
  uint32_t sparse_row_width = 0;
  // A table pull that is a prefetch (>= 0): the rows as of after this many pushes of the
  // table, asked while the last of them may still be in flight (wire.h, kRowsPull).
  int64_t table_after = -1;
  uint64_t sparse_bytes = 0;
};

// A worker's record of one queued operation; the policy and the registry only hold it.
struct OpHandle {
  int64_t id = 0;
  bool barrier = false;
  OpRequest req;
  uint64_t version = 0;
  int total_parts = 0;
  int remaining = 0;
  bool done = false;
  Error::Kind kind = Error::kGeneric;
  std::string error;
  int64_t bytes = 0;
  int64_t enqueued_us = 0, push_begin_us = 0, push_end_us = 0, pull_begin_us = 0;
  int sent = 0;
  bool local_group = false;  // hierarchical: reduced by the host's local group
};

// One partition of a declared tensor: its bytes [offset, offset + len) live on `server`.
struct Part {
  int64_t offset = 0, len = 0;
  int server = 0;
};

}  // namespace bps
