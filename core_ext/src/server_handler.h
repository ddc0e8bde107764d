// The server's per-key logic, separate from its I/O (ps-lite's request handle): the
// server receives and validates pushes, groups them into rounds by (key, version) and
// sends the answers; a ServerHandler decides what a push does to a round, when the
// round is complete and what each worker gets back. Today's behaviour, "sum one round,
// answer everyone, forget it", is SumHandler; keeping weights and applying an optimizer
// (asynchronous training), decompress-sum-recompress, merging sparse rows or accepting
// k of n pushes are other handlers that plug in through ServerOptions::handler without
// touching the I/O code.
//
// Adding one:
//   class MaxHandler : public bps::ServerHandler {
//     std::string OnPush(Round& r, const Push& p) override { ...element-wise max into r.acc... }
//     std::string OnRoundComplete(Round& r) override { r.result = r.acc; return ""; }
//   };
//   opts.handler = [](std::shared_ptr<BufferPool> pool) { return std::make_unique<MaxHandler>(); };
//
// Threading: each engine thread has its own handler instance and owns the rounds of its
// keys (key % engine_threads), so a handler is never called from two threads at once.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "buffer_pool.h"
#include "common.h"
#include "param_store.h"
#include "wire.h"

namespace bps {

// One validated push: its dtype, length and contribution count already agree with the
// round's, and its sender has not pushed into this round before.
struct Push {
  uint64_t key = 0, version = 0;
  DType dtype = DType::kFloat32;
  uint64_t len = 0;        // bytes of the partition
  bool broadcast = false;  // the root's data is the result
  bool pull_only = false;  // a catch-up pull (k-of-n): no body, no contribution
  bool keep_own = false;   // a broadcast whose sender holds the result: answered with no body
  int expected = 0;        // participating ranks: every one of them pushes this round
  int complete_at = 0;     // pushes that complete it (k-of-n aggregation; = expected)
  int sender = -1;         // the worker's rank
  int root = -1;           // broadcast: the root this worker named (-1 = not said)
  std::shared_ptr<Buffer> body;  // null for an empty push (a broadcast's non-root)
  // Server-held weights (param_store.h): an init round or a gradient update.
  ParamOp param = kParamNone;
  std::string param_spec;       // init: the consistency and optimizer as sent (ranks must agree)
  ConsistencySpec consistency;  // init
  ServerOptimizer optimizer;    // init
  double lr = 0;                // update
  uint32_t row_width = 0;       // kSparseRows: floats per row
  int64_t table_after = -1;     // kRowsPull: a prefetch of the rows after this many pushes
  // kRecoveredAnswer (a lost server's answer of this round, from a worker that got it):
  // the reply's `arg`, flags and meta as that server sent them; `body` is the answer.
  int64_t recovered_summed = 0;
  uint16_t recovered_flags = 0;
  std::string recovered_meta;
};

// The state of one (key, version) round; the server creates it at the first push and
// drops it once every waiter has its answer.
struct Round {
  uint64_t key = 0, version = 0;
  DType dtype = DType::kFloat32;
  uint64_t len = 0;
  int expected = 0;
  int complete_at = 0;  // k-of-n: answered at this many pushes; later ones get the result
  bool broadcast = false;
  int root = -1;  // broadcast: the root the first push named
  int pushes = 0;
  std::vector<int> senders;        // ranks that pushed, in arrival order
  std::shared_ptr<Buffer> acc;     // the handler's accumulator
  std::shared_ptr<Buffer> result;  // the answer, set by OnRoundComplete
  std::shared_ptr<void> extra;     // anything else a handler keeps per round
};

// A new round as its first push describes it (key, version, dtype, length, expected and
// complete_at pushes, broadcast and root); nothing pushed yet.
Round RoundOf(const Push& first);

class ServerHandler {
 public:
  virtual ~ServerHandler() = default;
  // `push` joins `round` (round.pushes and senders already count it). Returns "" or an
  // error that goes back to this sender only.
  virtual std::string OnPush(Round& round, const Push& push) = 0;
  // Whether the round can be answered now. Default: `complete_at` pushes are in (every
  // participant's, unless the workers asked for k-of-n aggregation).
  virtual bool Complete(const Round& round) const { return round.pushes >= round.complete_at; }
  // Sets round.result (round.len bytes, or null for an empty round). Returns "" or an
  // error that goes to every worker waiting on the round.
  virtual std::string OnRoundComplete(Round& round) = 0;
  // What `worker` receives. Default: round.result. Under k-of-n aggregation it is also
  // asked for workers whose push came after the round completed (they are not among
  // round.senders and their push never reached OnPush).
  virtual std::shared_ptr<Buffer> OnPull(Round& round, int worker) { return round.result; }
};

// Makes the handler of one engine thread.
using HandlerFactory = std::function<std::unique_ptr<ServerHandler>(std::shared_ptr<BufferPool>)>;

// Sums the pushes of a round with the SIMD kernels (fp16/bf16 accumulate in fp32); a
// broadcast round answers with the root's data. Rounds of dtype "compressed" (codec.h)
// are decoded in rank order, summed in fp32, and encoded again with the workers' codec,
// keeping a per-partition error-feedback residual when the blobs ask for one.
class SumHandler : public ServerHandler {
 public:
  explicit SumHandler(std::shared_ptr<BufferPool> pool) : pool_(std::move(pool)) {}
  std::string OnPush(Round& round, const Push& push) override;
  std::string OnRoundComplete(Round& round) override;

 private:
  std::string OnCompressedPush(Round& round, const Push& push);
  std::string OnCompressedRoundComplete(Round& round);
  std::string OnStateRoundComplete(Round& round);

  std::shared_ptr<BufferPool> pool_;
  // key -> the server's error-feedback residual of that partition (its chunks' elements
  // in order). Rounds of one key complete in version order (each worker pushes them in
  // order on one connection), so the residual carries from each round to the next.
  std::map<uint64_t, std::vector<float>> residual_;
  std::vector<float> scratch_;
};

}  // namespace bps
