// The worker's partition scheduling policy: which partition goes on the wire next.
// Pure bookkeeping, no threads, no sockets, no locks (the worker holds its own while it
// calls in), so it is tested on its own (tests/engine/test_send_policy.py).
//
//  - one priority queue per server: higher priority first (adapters give front layers
//    higher priority), then first come first served;
//  - a byte credit: a new push starts only while the bytes being written stay within it
//    (one push may always go when nothing is in flight);
//  - one global order: a server's sender may take its queue's head only if no other
//    queue's head is more urgent, so the order does not depend on which thread wakes first;
//  - the spread of one operation's partitions: each server's partitions are spread evenly
//    over the operation, and rank r starts at server r, so that at any moment the workers
//    feed different servers instead of all crowding one link.
//
// Usage (the worker's sender thread for server s, under the worker's lock):
//   policy.AddOp(handle, key_base, version, priority, parts, rank);
//   wait until policy.Ready(s);  SendTask t = policy.Pop(s);
//   ... unlock, send t ..., lock;  policy.Done(t.len);
#pragma once

#include <cstdint>
#include <memory>
#include <queue>
#include <vector>

#include "op_request.h"

namespace bps {

struct RetainedAnswer;  // answer_archive.h

struct SendTask {
  std::shared_ptr<OpHandle> op;  // the worker's operation (null in tests and for recovered answers)
  uint64_t key = 0, version = 0;
  int64_t offset = 0, len = 0;
  int server = 0;
  int priority = 0;
  uint64_t seq = 0;  // position in the global order among equal priorities
  // Not a push: an answer of a lost server, for the partition's new server (fault
  // tolerance, answer_archive.h).
  std::shared_ptr<const RetainedAnswer> recovered;
};

class SendPolicy {
 public:
  SendPolicy(int num_servers, bool use_priority, int64_t credit_bytes);

  // Queues the partitions of one operation; partition i gets key `key_base | i`.
  void AddOp(std::shared_ptr<OpHandle> op, uint64_t key_base, uint64_t version, int priority,
             const std::vector<Part>& parts, int rank);
  // Whether server `s`'s sender may take its next partition now.
  bool Ready(int server) const;
  // Takes it (call only when Ready) and charges the credit.
  SendTask Pop(int server);
  // The push of `len` bytes has left this process: its credit returns.
  void Done(int64_t len) { in_flight_ -= len; }
  bool Empty(int server) const { return queues_[server].empty(); }
  // Fault tolerance, a server was lost: takes its queued partitions out, to be queued
  // again for their new servers (Requeue keeps each one's place in the order).
  std::vector<SendTask> Drain(int server);
  void Requeue(SendTask t) { queues_[t.server].push(std::move(t)); }
  // A recovered answer for `server`, ahead of every push: the other workers wait for it.
  void AddRecovered(std::shared_ptr<const RetainedAnswer> answer, uint64_t key, uint64_t version, int64_t len,
                    int server);
  int64_t bytes_in_flight() const { return in_flight_; }
  int64_t credit() const { return credit_; }

  // The send order of one operation's partitions (indexes into `servers`, the server of
  // each partition) for `rank` among `num_servers` servers.
  static std::vector<size_t> SpreadOrder(const std::vector<int>& servers, int rank, int num_servers);

 private:
  struct After {
    bool use_priority;
    bool operator()(const SendTask& a, const SendTask& b) const {  // true = a goes after b
      if (use_priority && a.priority != b.priority) return a.priority < b.priority;
      return a.seq > b.seq;
    }
  };
  bool GloballyNext(int server) const;

  After after_;
  int64_t credit_;
  int64_t in_flight_ = 0;
  uint64_t next_seq_ = 0;
  std::vector<std::priority_queue<SendTask, std::vector<SendTask>, After>> queues_;
};

}  // namespace bps
