// The worker side of push_pull: one per training process.
//
// Tensors are declared by name; the scheduler checks that every rank agrees on dtype
// and shape and returns the partition table (partitions of at most partition_bytes,
// placed on servers by bytes). Each operation becomes one task per partition in a
// per-server priority queue; sender threads (connections_per_server per server) take
// the most urgent task while the bytes in flight stay under the credit, push it, and
// receiver threads write the reduced partition straight into the output buffer.
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
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "control.h"
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
};

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
};

class Worker {
 public:
  explicit Worker(const WorkerOptions& opts);
  ~Worker();

  void Start();                    // begins the rendezvous in the background
  bool WaitReady(double seconds);  // true once joined; throws on failure
  int rank() const { return rank_; }
  int size() const { return size_; }
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
  // True when done (the handle is then released). Throws the op's error (releasing it).
  bool Poll(int64_t handle);
  bool WaitFor(int64_t handle, double seconds);
  // Describes what a handle still waits for (for timeout messages).
  std::string Describe(int64_t handle);
  // The partition table of a tensor the scheduler has placed: (offset, bytes, server)
  // per partition; empty while its declaration is still pending or unknown.
  std::vector<std::array<int64_t, 3>> Partitions(const std::string& name);
  WorkerStats stats();
  void SetTrace(bool on);
  std::vector<TraceRecord> DrainTrace();
  void Shutdown();

 private:
  struct Handle;
  struct Tensor;
  struct Part {
    int64_t offset, len;
    int server;
  };
  struct Task {
    std::shared_ptr<Handle> handle;
    uint64_t key, version;
    int64_t offset, len;
    int server;
    int priority;
    uint64_t seq;
  };
  struct TaskOrder {
    bool priority;
    bool operator()(const Task& a, const Task& b) const {  // true = a after b
      if (priority && a.priority != b.priority) return a.priority < b.priority;
      return a.seq > b.seq;
    }
  };
  struct DataConn {
    std::unique_ptr<Link> link;
    int server;
    std::thread sender, receiver;
  };

  void Rendezvous();
  bool UseHierarchy() const;
  void MeasureLinks(const std::vector<std::unique_ptr<DataConn>>& conns);
  void OnControl(const FrameHeader& h, const std::string& meta);
  void OnDeclareReply(const std::string& meta);
  std::vector<std::shared_ptr<Handle>> OnDeclareReplyLocked(const std::string& meta);
  void ScheduleLocked(const std::shared_ptr<Handle>& h, Tensor& t);
  void SenderLoop(DataConn* c);
  bool IsGlobalNextLocked(int server) const;
  void ReceiverLoop(DataConn* c);
  void CompletePartLocked(const std::shared_ptr<Handle>& h, int64_t len);
  void FailHandleLocked(const std::shared_ptr<Handle>& h, Error::Kind kind, const std::string& msg);
  void Fail(Error::Kind kind, const std::string& msg);
  void FailServerLost(const std::string& msg);  // a data connection broke
  std::shared_ptr<Handle> TakeHandle(int64_t id, bool* done);
  void SendDeclareLocked(Tensor& t);
  void StartLocalGroup(uint64_t job_id);
  Tensor& DeclareLocked(const OpRequest& req, int participants);

  WorkerOptions opts_;
  std::vector<int> cpus_;
  ControlClient control_;
  std::thread rendezvous_thread_;
  int rank_ = -1, size_ = 0;
  std::shared_ptr<Transport> transport_;
  std::vector<std::string> servers_;  // endpoints by server id
  std::vector<std::unique_ptr<DataConn>> conns_;
  int64_t credit_ = 0;
  LinkEstimate link_;
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
  std::unordered_map<std::string, std::shared_ptr<Tensor>> tensors_;  // current declaration
  // Declarations sent and not answered yet, per name, oldest first: the scheduler
  // answers one name's declarations in the order they were made.
  std::unordered_map<std::string, std::deque<std::shared_ptr<Tensor>>> awaiting_reply_;
  std::unordered_map<int64_t, std::shared_ptr<Handle>> handles_;
  std::vector<std::priority_queue<Task, std::vector<Task>, TaskOrder>> queues_;
  std::map<std::pair<uint64_t, uint64_t>, Task> in_flight_;
  std::deque<std::shared_ptr<Handle>> barrier_waiters_;
  int64_t bytes_in_flight_ = 0;
  int64_t next_handle_ = 1;
  uint64_t next_seq_ = 0;
  WorkerStats stats_;
  std::unique_ptr<LocalGroup> group_;  // hierarchical mode only
  bool trace_ = false;
  std::vector<TraceRecord> trace_records_;
};

}  // namespace bps
