// Hierarchical mode: the worker processes of one host reduce through shared memory
// before any byte goes to the servers.
//
// For each tensor the host shares one segment: a slot per local rank for its input and
// one result buffer. Round r of tensor X on local rank i:
//   1. copy the input into slot i                        (after every rank released r-1)
//   2. sum slice i over all slots into the result        (after every rank arrived)
//   3. push_pull slice i through the servers, with only one process per host taking
//      part (skipped on a one-host job)
//   4. copy the whole result out                         (after every slice is done)
// Progress is a state machine driven by one thread per process, so ranks may submit
// tensors in different orders (backward hooks do) without deadlocking. State lives in
// per-rank sequence numbers (single writer each); a futex "doorbell" wakes waiters.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "op_request.h"

namespace bps {

class LocalGroup {
 public:
  struct Hooks {
    // Queues a push_pull of a slice through the servers; returns its handle.
    std::function<int64_t(const OpRequest&)> enqueue;
    // 0 = running, 1 = done, -1 = failed (kind/message out). Forgets finished handles.
    std::function<int(int64_t, Error::Kind* kind, std::string* error)> poll;
    // Finishes the user's operation (error empty = success); `reduced_us` is when the
    // reduced result of this rank's slice was ready (WallMicros, 0 if never).
    std::function<void(int64_t, Error::Kind, const std::string& error, int64_t reduced_us)> complete;
  };
  struct Layout {
    uint64_t job_id;
    int host, num_hosts, local_rank, local_size, world_size;
  };

  LocalGroup(const Layout& layout, Hooks hooks, std::vector<int> cpus);
  ~LocalGroup();
  // Thread-safe. `req.op` is kSum or kAverage. `ticket` numbers the submissions 0, 1, 2,
  // ... in the order the caller decided them (under its own lock): ops are taken in
  // ticket order whatever order the Submit calls race in, so the k-th op on a name gets
  // the k-th round on every rank.
  void Submit(int64_t handle, const OpRequest& req, uint64_t ticket);
  void Stop();

 private:
  struct Segment;
  struct PendingOp;

  void Loop();
  bool Advance(PendingOp& op);  // true if it made progress
  Segment& SegmentFor(const OpRequest& req);
  void Ring();

  Layout layout_;
  Hooks hooks_;
  std::vector<int> cpus_;
  std::mutex mu_;
  std::map<uint64_t, std::unique_ptr<PendingOp>> pending_;  // by ticket
  uint64_t next_ticket_ = 0;                                // guarded by mu_
  std::map<std::string, std::unique_ptr<Segment>> segments_;  // each name's current segment
  // Segments of names declared again with another size or dtype, kept mapped until the
  // ops that still use them finish (only the local-group thread touches these).
  std::vector<std::unique_ptr<Segment>> retired_;
  std::atomic<uint32_t>* bell_ = nullptr;  // in a small host-wide segment
  void* bell_map_ = nullptr;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace bps
