// Server-held weights for the parameter-server consistency modes (comm.consistency
// ssp:<s> and async), the mode BytePS's BYTEPS_ENABLE_ASYNC meant to be: the servers
// keep each partition's fp32 weights, started from rank 0's model (an init round, a
// broadcast), and apply the optimizer themselves (SGD with momentum/Nesterov/weight
// decay, Adam), their state on the servers. A worker pushes a gradient and pulls the
// weights; it never steps an optimizer of its own.
//
//   ssp:<s>  the gradients of one clock (the c-th push of every worker) are averaged
//            and applied as one optimizer step once all of them are in, clocks in order;
//            a worker's push of clock c is answered once clock c - s is applied, so no
//            worker runs more than s clocks ahead of the slowest. ssp:0 is synchronous
//            training with the optimizer on the server: the same sum (arrival order, as
//            SumHandler), the same division and torch's own fused multiply-adds, so it
//            equals worker-side sync training bit for bit (2 workers; more add in
//            arrival order in both).
//   async    each push is applied at once as its own step, with the learning rate
//            divided by the number of workers (n pushes make one global step, as in sync
//            training) or, with staleness_lr, by the push's staleness (updates applied
//            since this worker last read, at least 1; Zhang et al. 2016).
//
// One ParamStore per server engine thread (it owns the keys of that thread), so nothing
// here is shared across threads.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "buffer_pool.h"
#include "common.h"

namespace bps {

struct ConsistencySpec {
  enum Mode : int { kSync = 0, kSsp = 1, kAsync = 2 } mode = kSync;
  int staleness = 0;          // ssp: clocks a worker may run ahead of the slowest
  bool staleness_lr = false;  // async: divide the learning rate by the push's staleness
};

// "sync" | "ssp:<s>" (0 <= s <= kMaxStaleness) | "async". Returns "" or what is wrong.
std::string ParseConsistency(const std::string& text, ConsistencySpec* out);
constexpr int kMaxStaleness = 1000;

// The optimizer the servers apply, with torch.optim's semantics and defaults.
struct ServerOptimizer {
  enum Kind : int { kSgd = 0, kAdam = 1 } kind = kSgd;
  double momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
};

// "sgd [momentum=M] [dampening=D] [nesterov=0|1] [weight_decay=W]" or
// "adam [beta1=B1] [beta2=B2] [eps=E] [weight_decay=W]". Returns "" or what is wrong.
std::string ParseServerOptimizer(const std::string& text, ServerOptimizer* out);

class ParamStore {
 public:
  explicit ParamStore(std::shared_ptr<BufferPool> pool) : pool_(std::move(pool)) {}

  // What one waiting push gets: the weights, or an error.
  struct Answer {
    uint64_t key = 0, version = 0;
    int worker = -1;
    int64_t staleness = 0;  // ssp: own clocks missing from the weights; async: updates since its read
    std::shared_ptr<Buffer> weights;
    std::string error;
  };

  // (Re)starts `key` from `weights` (n fp32 values, rank 0's): optimizer state, clocks
  // and waiting pushes start afresh (waiting ones are answered with an error).
  void Init(uint64_t key, const float* weights, size_t n, int workers, const ConsistencySpec& consistency,
            const ServerOptimizer& optimizer, std::vector<Answer>* ready);
  // One worker's gradient for `key`. Returns "" or an error for this push alone (it is
  // then not counted); appends the answers that are due now (this push's, and waiting
  // ones this push released).
  std::string Update(uint64_t key, int worker, uint64_t version, const float* grad, size_t n, double lr,
                     std::vector<Answer>* ready);
  // Answers pushes that waited longer than `limit` seconds with an error.
  void Expire(double limit, std::vector<Answer>* ready);
  size_t waiting() const;

 private:
  struct Clocked {  // the gradients of one ssp clock
    std::vector<float> sum;
    int pushes = 0;
    double lr = 0;
  };
  struct Waiter {
    int worker;
    uint64_t version;
    int64_t clock;
    Clock::time_point since;
  };
  struct Entry {
    ConsistencySpec consistency;
    ServerOptimizer optimizer;
    int workers = 0;
    std::vector<float> weights, m, v;  // m: momentum buffer / Adam's first moment; v: second
    bool has_m = false;
    int64_t steps = 0;               // optimizer steps applied
    int64_t applied = 0;             // ssp: clocks applied, in order
    std::vector<int64_t> pushed;     // per worker: clocks pushed (ssp) / pushes (async)
    std::vector<int64_t> read_at;    // async: steps when each worker last got the weights
    std::map<int64_t, Clocked> pending;
    std::deque<Waiter> waiting;      // ssp pushes whose answer waits for the slowest
  };

  void Step(Entry& e, const float* grad, double lr);
  std::shared_ptr<Buffer> Snapshot(const Entry& e);

  std::shared_ptr<BufferPool> pool_;
  std::map<uint64_t, Entry> entries_;
};

}  // namespace bps
