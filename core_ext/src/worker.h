// The worker side of push_pull: one per training process.
//
// Tensors are declared by name; the scheduler checks that every rank agrees on dtype,
// shape, device and layout and returns the partition table (TensorRegistry). Each
// operation becomes one task per partition; the SendPolicy decides which goes next
// (priority, credit, one global order). This file owns what is left: rendezvous, the
// handle table the adapters poll, the I/O threads (sender threads, connections_per_server
// per server, push the policy's choice; receiver threads write the reduced partition
// straight into the output buffer), the hierarchical glue and failure fan-out (a dead
// peer fails every open handle). No frame is sent while mu_ is held: data frames go out
// after the lock is released and control frames are queued (ControlClient's outbox).
//
// Usage:
//   bps::WorkerOptions o; o.scheduler_host = "127.0.0.1"; o.scheduler_port = 9000;
//   bps::Worker w(o);
//   w.Start(); while (!w.WaitReady(0.1)) {}       // rendezvous
//   bps::OpRequest req{"grad.fc1", bps::DType::kFloat32, {1024}, in, out, bps::Op::kAverage};
//   int64_t h = w.Enqueue(req);                    // returns at once
//   while (!w.WaitFor(h, 0.1)) {}                  // throws the op's error, if any
//   w.Shutdown();
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "answer_archive.h"
#include "common.h"
#include "control.h"
#include "op_request.h"
#include "param_store.h"
#include "send_policy.h"
#include "tensor_registry.h"
#include "transport.h"
#include "tuning.h"

namespace bps {

class LocalGroup;

struct WorkerOptions {
  std::string scheduler_host = "127.0.0.1";
  int scheduler_port = 0;
  int64_t rank_hint = -1;
  int local_rank = 0;
  int local_size = 1;
  // 0 = auto: the scheduler sizes each tensor's partitions from the link this worker
  // measures at rendezvous (see tuning.h); > 0 = this size for every tensor.
  int64_t partition_bytes = 0;
  int64_t credit_bytes = 0;  // bytes being written at once; 0 = auto (AutoCreditBytes)
  int connections_per_server = 1;
  bool priority = true;
  std::string numa = "auto";
  double rendezvous_timeout = 120.0;
  std::string secret;
  // Reduce inside the host through shared memory first: kOff, kOn (an error when the
  // layout does not allow it) or kAuto (on when several workers share the host and the
  // ranks follow BytePS's rules; otherwise flat, with a log line saying why).
  enum Hierarchical : int { kOff = 0, kOn = 1, kAuto = 2 };
  int hierarchical = kAuto;
  std::string advertise_host;  // DMLC_NODE_HOST: this host's address, for co-location
  std::string host_id;         // explicit machine identity (BPSTRAIN_HOST_ID); "" = address
  // SO_SNDBUF of data connections; -1 = auto (AutoSocketSendBuffer), 0 = kernel autotuning.
  int socket_send_buffer = -1;
  std::string transport = "tcp";  // "tcp" or "inproc" (Transport::Get)
  // Tag every data frame's body (secure_link.h). false leaves bodies untagged only when
  // the server is configured the same way; headers stay authenticated either way.
  bool authenticate_bodies = true;
  // k-of-n aggregation (comm.aggregate k:K, backup workers): a round of a sum or an
  // average over the whole job is answered once `aggregate` workers pushed it, averaged
  // over those; a later push gets the same answer and is dropped. 0 = every worker.
  int aggregate = 0;
  // comm.consistency: "sync" (workers step their optimizers), "ssp:<s>" or "async" (the
  // servers hold the weights and step them: OpRequest::param). staleness_lr: async
  // divides the learning rate by each push's staleness instead of the worker count.
  std::string consistency = "sync";
  bool staleness_lr = false;
  // comm.fault_tolerance: a worker that dies or hangs leaves the job and the others go
  // on (kMembership); the flat path only (a host's shared-memory group would wait for it).
  bool fault_tolerance = false;
};

// Fault tolerance: the workers still in the job. Worker::rank()/size() stay this
// worker's place at rendezvous (its identity on the wire); live_rank/live_size number the
// workers still in the job, in rank order (what the adapters report as rank and size).
struct Membership {
  int64_t epoch = 0;                // 0 = nobody left
  std::vector<int64_t> departed;    // rendezvous ranks of the workers that left, ascending
  int live_rank = 0, live_size = 0;
  // The newest membership the servers' answers were computed under (kFlagReduced): all
  // ranks receive the same answers, so between two steps this is the same on every rank,
  // unlike `epoch`, which each rank learns from the scheduler at its own moment.
  int64_t answered_epoch = 0;
  std::vector<int64_t> answered_departed;
  // The scheduler's connection was lost (fault tolerance only; without it the loss fails
  // the worker): training goes on, but barriers, new tensors and membership changes
  // need the scheduler, so they fail.
  bool scheduler_lost = false;
  std::vector<int64_t> joined;  // rendezvous ranks that joined at the newest admission
  bool admitted_late = false;   // this worker joined the running job (in a place that was free)
  std::vector<int64_t> lost_servers;  // servers that died or hung; their partitions moved
};

// Wall-clock microseconds (system_clock) of one finished operation's phases, recorded
// when tracing is on: the push phase spans the first to the last partition leaving this
// worker, the pull phase the first to the last reduced partition coming back.
struct TraceRecord {
  std::string name;
  int op;
  uint64_t version;
  int64_t bytes;
  int64_t enqueued_us, push_begin_us, push_end_us, pull_begin_us, done_us;
};

struct WorkerStats {
  int64_t bytes_pushed = 0;
  int64_t bytes_pulled = 0;
  int64_t partitions = 0;
  // Partitions whose round was answered before this worker's push arrived (k-of-n):
  // its gradient did not count.
  int64_t late_partitions = 0;
  // Server-held weights: answers received, and the largest staleness among them (ssp:
  // this worker's clocks not yet in the weights, at most s; async: updates applied
  // between its read and its push).
  int64_t weight_answers = 0;
  int64_t max_staleness = 0;
};

class Worker {
 public:
  explicit Worker(const WorkerOptions& opts);
  ~Worker();

  void Start();                    // begins the rendezvous in the background
  bool WaitReady(double seconds);  // true once joined; throws on failure
  int rank() const { return rank_; }
  int size() const { return size_; }
  Membership membership();
  // A reduced answer's membership (checked; it came off the network).
  void NoteAnsweredMembership(const std::string& meta);
  int num_servers() const { return static_cast<int>(servers_.size()); }
  const WorkerOptions& options() const { return opts_; }
  // What rendezvous measured and chose (valid once ready).
  const LinkEstimate& link() const { return link_; }
  int64_t credit_bytes() const { return credit_; }
  bool hierarchical() const { return group_ != nullptr; }

  // Tells the scheduler about `name` now (optional: ops declare on first use). Only
  // name, dtype, shape, device and layout of `req` are used.
  //
  // Re-declaring: a name keeps its declaration until a use with another dtype, shape,
  // device or layout; that use declares the name afresh (a new tensor for the
  // scheduler, checked across ranks like the first). Ranks must change it in the same
  // order; a rank that keeps using the old shape while the others moved on waits, as
  // with any op that not every rank calls (Describe() says so).
  void Declare(const OpRequest& req);
  // Queues an operation; returns a handle. Throws Error if the engine has failed.
  int64_t Enqueue(const OpRequest& req);
  int64_t EnqueueBarrier();
  // Fault tolerance: an admission, between steps (nothing in flight). Every worker in the
  // job calls it; workers waiting to join (a restarted or a new DMLC_ROLE=worker
  // process) join there. The handle completes once they are in (membership().joined).
  int64_t EnqueueAdmission();
  // True when done (the handle is then released). Throws the op's error (releasing it).
  bool Poll(int64_t handle);
  bool WaitFor(int64_t handle, double seconds);
  // Describes what a handle still waits for (for timeout messages).
  std::string Describe(int64_t handle);
  // The partition table of a tensor the scheduler has placed: (offset, bytes, server)
  // per partition; empty while its declaration is still pending or unknown.
  std::vector<std::array<int64_t, 3>> Partitions(const std::string& name);
  // Under k-of-n aggregation: rounds of `name` that the servers already answered and this
  // worker has not started (0 when it is not behind, or the name is unknown). A worker
  // that fell behind catches up with that many pull_only operations instead of computing
  // their gradients.
  int64_t RoundsBehind(const std::string& name);
  // Row-sparse push_pull: the merged rows a finished sparse operation got (ids then rows,
  // sparse_rows.h), once; empty when there were none or the handle is not a sparse op.
  std::string TakeSparseResult(int64_t handle);
  WorkerStats stats();
  void SetTrace(bool on);
  std::vector<TraceRecord> DrainTrace();
  // Leaves the job. A non-empty `reason` (the exception that stops this process) fails
  // the job at once for every other node, naming this worker and the reason, instead of
  // leaving them to wait for it until their op timeout.
  void Shutdown(const std::string& reason = "");

 private:
  struct DataConn {
    std::shared_ptr<Link> link;
    int server;
    std::thread sender, receiver;
    bool sender_done = false, receiver_done = false;  // under mu_: the loops returned
  };

  void Rendezvous();
  bool UseHierarchy() const;
  // Pushes that complete a round of `req` at the servers: opts_.aggregate for sums and
  // averages over the whole job (participants 0) under k-of-n aggregation, else every
  // participant.
  int CompleteAt(const OpRequest& req) const;
  // worker_request_checks.cc: throws Error(kConfig) for a request this job cannot run.
  void CheckRequest(const OpRequest& req) const;
  bool KOfN() const { return opts_.aggregate > 0 && opts_.aggregate < size_; }
  // worker_membership.cc: kMembership from the scheduler; a broadcast root named in the
  // live numbering, as its rendezvous rank (under mu_).
  void OnMembership(const std::string& meta);
  // The scheduler's connection broke: with fault tolerance the data path goes on (the
  // servers still serve), without it the worker fails.
  void OnSchedulerLost(const std::string& why);
  // A worker welcomed into a running job waits until the others admit it (or times out).
  void WaitForAdmission();
  int64_t EnqueueBarrierLocked(int64_t kind);  // kind: 0 or kAdmissionBarrier
  int RunningOpsLocked() const;  // operations (not barriers) not done yet
  std::string SchedulerGoneLocked(const std::string& what) const;
  int RootRankLocked(int live_root) const;
  void MeasureLinks(const std::vector<std::unique_ptr<DataConn>>& conns);
  void OnControl(const FrameHeader& h, const std::string& meta);
  void OnDeclareReply(const std::string& meta);
  void ScheduleLocked(const std::shared_ptr<OpHandle>& h, TensorDecl& t);
  void SenderLoop(DataConn* c);
  void SendGoodbye(DataConn* c);
  void ReceiverLoop(DataConn* c);
  void CompletePartLocked(const std::shared_ptr<OpHandle>& h);
  void FailHandleLocked(const std::shared_ptr<OpHandle>& h, Error::Kind kind, const std::string& msg);
  void Fail(Error::Kind kind, const std::string& msg);
  void FailWaitingLocked(TensorDecl& t, Error::Kind kind, const std::string& msg);  // its unfinished ops
  // A data connection to `server` broke (-1: during rendezvous). Where servers can be
  // replaced, waits for the scheduler to say it was lost (then returns quietly).
  void FailServerLost(int server, const std::string& msg);
  // worker_replacement.cc, fault tolerance: kServerLost from the scheduler. The lost
  // server's links close, its partitions move, what it had not answered is pushed again
  // and the answers kept in archive_ go to the new servers.
  void OnServerLost(const std::string& meta);
  // Whether a lost server can be replaced: fault tolerance, several servers, synchronous
  // rounds without k-of-n (the servers keep nothing beyond a round).
  bool ServersReplaceable() const;
  bool SendRecoveredAnswer(DataConn* c, const SendTask& t);  // false: the link broke
  void StartLocalGroup(uint64_t job_id);
  std::shared_ptr<TensorDecl> DeclareLocked(const OpRequest& req, int participants);
  std::shared_ptr<OpHandle> NewHandleLocked(const OpRequest& req);

  WorkerOptions opts_;
  ConsistencySpec consistency_;
  std::vector<int> cpus_;
  ControlClient control_;
  std::thread rendezvous_thread_;
  int rank_ = -1;
  // Worker ranks in the job: the welcome's, grown by a scale-up's membership (written
  // under mu_ at an admission, when nothing is in flight; read by the I/O threads).
  std::atomic<int> size_{0};
  int max_workers_ = 0;  // comm.max_workers, as the scheduler runs the job
  std::vector<int64_t> departed_;  // under mu_: fault tolerance, ranks that left (ascending)
  int64_t membership_epoch_ = 0;   // under mu_
  int64_t answered_epoch_ = 0;     // under mu_: Membership::answered_epoch
  std::vector<int64_t> answered_departed_;  // under mu_
  std::atomic<bool> anyone_left_{false};
  std::string scheduler_lost_;  // under mu_: why the scheduler's connection broke (fault tolerance)
  bool joining_ = false;         // under mu_: welcomed into a running job, waiting for the admission
  bool admitted_late_ = false;   // under mu_: ... and admitted
  std::vector<int64_t> joined_;  // under mu_: Membership::joined
  std::shared_ptr<Transport> transport_;
  std::vector<std::string> servers_;  // endpoints by server id
  std::vector<std::unique_ptr<DataConn>> conns_;
  std::set<int> lost_servers_;      // under mu_: fault tolerance, servers the scheduler declared lost
  bool server_held_state_ = false;  // under mu_: weights or tables on the servers were used
  AnswerArchive archive_;           // the last answer of each partition (ServersReplaceable)
  int64_t credit_ = 0;
  LinkEstimate link_;
  // How long a worker whose link to a server broke waits for the scheduler to declare that
  // server lost (fault tolerance) before it fails: the scheduler sees a killed server's
  // control connection close at once.
  static constexpr std::chrono::seconds kServerLossWait{10};
  static constexpr double kProbeSeconds = 0.02;        // shortest probe exchange that counts
  static constexpr uint64_t kProbeMaxBytes = 16 << 20;  // most one probe round may send

  std::mutex mu_;
  std::condition_variable cv_;       // handle completion, readiness
  std::condition_variable send_cv_;  // work or credit for the senders
  bool ready_ = false;
  bool failed_ = false;
  Error::Kind fail_kind_ = Error::kGeneric;
  std::string fail_msg_;
  std::atomic<bool> stopping_{false};
  TensorRegistry registry_;
  std::unordered_map<int64_t, std::shared_ptr<OpHandle>> handles_;  // the one handle table
  std::unique_ptr<SendPolicy> policy_;  // made once the credit is known
  std::map<std::pair<uint64_t, uint64_t>, SendTask> in_flight_;  // pushed, reply pending
  std::deque<std::shared_ptr<OpHandle>> barrier_waiters_;
  size_t senders_exited_ = 0;  // SenderLoop threads that returned
  int64_t next_handle_ = 1;
  WorkerStats stats_;
  // tensor id -> rounds the servers answered early (k-of-n): the newest answered + 1
  std::map<int64_t, uint64_t> answered_rounds_;
  std::unordered_map<int64_t, std::string> sparse_results_;  // handle -> merged rows
  std::unique_ptr<LocalGroup> group_;  // hierarchical mode only
  uint64_t next_group_ticket_ = 0;     // the order of group_->Submit (LocalGroup::Submit)
  bool trace_ = false;
  std::vector<TraceRecord> trace_records_;
};

}  // namespace bps
