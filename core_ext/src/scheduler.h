// The scheduler: rendezvous, the tensor registry, barriers and liveness.
//
// Usage (what `python -m bpstrain.launch` does with DMLC_ROLE=scheduler):
//   bps::SchedulerOptions o; o.num_workers = 2; o.num_servers = 1; o.port = 9000;
//   bps::Scheduler s(o);   // binds now; s.port() is the real port when o.port == 0
//   s.Start();             // background threads
//   while (!s.Wait(0.1)) { /* check Ctrl-C */ }   // returns true when the job is over;
//                          // throws Error(kPeer) if a node died, kTimeout on rendezvous
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "connection_threads.h"
#include "control.h"
#include "secure_link.h"
#include "transport.h"

namespace bps {

struct SchedulerOptions {
  // BytePS's rule: DMLC_NUM_WORKER counts worker *hosts*, each running local_size worker
  // processes, so the job has num_workers x local_size workers. local_size 0 = learn it
  // from the workers' hellos (BYTEPS_LOCAL_SIZE; every worker must agree).
  int num_workers = 1;
  int local_size = 0;
  int num_servers = 1;
  bool mixed_mode = true;  // co-located servers (on worker hosts) get BytePS's mixed share
  std::string host = "0.0.0.0";
  int port = 0;
  double rendezvous_timeout = 120.0;  // seconds until every node must have joined
  double peer_timeout = 30.0;         // seconds without a heartbeat before a node is dead
  // comm.fault_tolerance: a worker that dies or hangs leaves the job (kMembership to
  // everyone) instead of failing it; servers and the scheduler itself still fail it.
  bool fault_tolerance = false;
  // comm.max_workers: with fault tolerance, workers that register after the rendezvous
  // with no departed worker's place free get new ranks (scale-up) up to this many worker
  // processes in all; 0 = no more than the rendezvous' num_workers x local_size.
  int max_workers = 0;
  std::string secret;
  std::string transport = "tcp";  // "tcp" or "inproc" (Transport::Get)
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerOptions& opts);
  ~Scheduler();
  int port() const { return listener_->port(); }
  void Start();
  // Counters for tests and the fuzzer: connection threads not yet reaped, connections
  // refused at the door (too many in their handshake), registered nodes.
  struct Stats {
    int64_t threads = 0, refused = 0, nodes = 0;
  };
  Stats stats();
  // True once every worker has said goodbye and the servers were told to exit.
  // Throws the job's failure (a dead node, a rendezvous timeout).
  bool Wait(double seconds);
  void Stop();

 private:
  struct Node;
  struct Declaration {
    int dtype;
    std::vector<int64_t> shape;
    int64_t partition_bytes;  // 0 = auto (from link_bytes_per_s)
    int participants;  // ranks that declare it: all, or one per host for hierarchical slices
    int64_t link_bytes_per_s = 0;  // the declaring worker's measured link; not compared
    std::string device;  // where the adapter keeps it ("cpu", "cuda")
    std::string layout;  // how the adapter cut it into engine tensors ("" = whole)
    bool operator==(const Declaration& o) const {
      return dtype == o.dtype && shape == o.shape && partition_bytes == o.partition_bytes &&
             participants == o.participants && device == o.device && layout == o.layout;
    }
  };
  struct Tensor {
    int64_t id;
    Declaration decl;
    std::string placement;  // serialized partition table sent to every worker
  };

  void AcceptLoop();
  // One connection from the first byte: the secure handshake, registration, then its frames.
  void ServeConnection(std::shared_ptr<Link> raw, std::shared_ptr<HandshakeSlots::Slot> slot);
  bool Register(const std::shared_ptr<Node>& node);
  void HandleFrame(const std::shared_ptr<Node>& node, const FrameHeader& h, const std::string& meta);
  void HandleDeclare(const std::shared_ptr<Node>& node, const std::string& meta);
  void CompleteRendezvousLocked();
  void ComputeSharesLocked();
  int WantLocked(Role role) const;
  void OnDisconnect(const std::shared_ptr<Node>& node, const std::string& why);
  void FailLocked(const std::string& msg);
  // Fault tolerance: `node` (a worker) leaves the job; everyone hears the new membership
  // and whatever waited for it (barrier, declarations, goodbyes) is decided without it.
  void DepartLocked(const std::shared_ptr<Node>& node, const std::string& why);
  // Fault tolerance, scheduler_membership.cc: a worker registering after rendezvous takes
  // the place of one that left (its rank, its data credentials), or a new rank below
  // max_workers (scale-up), and waits to join; it joins at the next admission
  // (kAdmissionBarrier) of the workers in the job, once every server applied the new
  // membership (kMembershipAck).
  bool JoinLaterLocked(const std::shared_ptr<Node>& node);
  void OnAdmissionBarrierLocked(const std::shared_ptr<Node>& node);
  void TryAdmitLocked();
  void OnMembershipAckLocked(const std::shared_ptr<Node>& server, uint64_t epoch);
  void ForgetJoinerLocked(const std::shared_ptr<Node>& node, const std::string& why);
  void AwaitAcksLocked();     // every server in the job must ack the current membership
  void FinishAdmissionLocked();  // ... and has: the joiners are in
  // Fault tolerance: `node` (a server) died or hung; its partitions move to the others
  // (PickServerLocked) and the workers hear where (kServerLost), then push again what it
  // had not answered. Fails the job when no server would be left.
  void ServerLostLocked(const std::shared_ptr<Node>& node, const std::string& why);
  int LiveServersLocked() const { return opts_.num_servers - static_cast<int>(lost_servers_.size()); }
  void PostMembershipLocked(Role role);  // the current membership, to every such node in the job
  std::string MembershipNoticeLocked() const;  // the current membership's kMembership meta
  std::string WelcomeMetaLocked(const Node& n, uint32_t flags) const;
  int LiveWorkersLocked() const { return num_workers_ - static_cast<int>(departed_.size()); }
  // The most worker ranks the job gives out: the rendezvous' and the scale-up's.
  int MaxWorkersLocked() const { return std::max(opts_.max_workers, opts_.num_workers * local_size_); }
  // Answers the declarations of `name` once every rank that must has declared it.
  void TryCompleteDeclarationLocked(const std::string& name);
  void TryReleaseBarrierLocked();
  void TryTerminateLocked();
  void MonitorLoop();
  // The partition table of a new tensor; "" with `error` set when it cannot be placed.
  std::string PlaceLocked(int64_t id, const Declaration& d, std::string* error);
  // Byte-balanced placement: the server that stays furthest below its share with a
  // partition of `len` more bytes (charged to it).
  int PickServerLocked(int64_t len);
  // To every worker still in the job, or only to the ranks in `only`; `arg` in the header.
  void SendToWorkersLocked(MsgType type, const std::string& meta = "",
                           const std::map<int64_t, Declaration>* only = nullptr, int64_t arg = 0);
  void ReleaseLocked(const std::string& placement);  // a re-declared tensor's old bytes
  void SendError(const std::shared_ptr<Node>& node, const std::string& msg);

  SchedulerOptions opts_;
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<Listener> listener_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Node>> nodes_;  // registered (handshake done)
  ConnectionThreads conn_threads_;  // one per connection, reaped when it ends
  HandshakeSlots slots_;            // connections not yet registered
  std::string cluster_key_;         // from opts_.secret ("" = unauthenticated control plane)
  std::string job_key_;             // random; issues the data-connection credentials
  std::thread accept_thread_, monitor_thread_;
  bool rendezvous_done_ = false;
  bool finished_ = false;
  std::string failure_;
  Error::Kind failure_kind_ = Error::kPeer;
  std::atomic<bool> stopping_{false};
  Clock::time_point start_time_;
  // name -> rank -> that rank's declarations not yet matched, oldest first (a rank may
  // re-declare a name before a slower rank declared it the first time).
  std::map<std::string, std::map<int64_t, std::deque<Declaration>>> pending_decls_;
  std::map<std::string, Tensor> registry_;
  std::vector<int64_t> server_load_;
  std::vector<double> server_share_;  // fraction of all bytes each server should hold
  int local_size_ = 0;                // learned from the first worker unless configured
  int num_workers_ = 0;               // worker ranks given out, once local_size_ is known (grows
                                      // when a scale-up joiner is admitted)
  int64_t next_tensor_id_ = 0;
  std::vector<int64_t> barrier_ranks_;  // workers waiting in the current barrier
  int goodbyes_ = 0;
  std::vector<int64_t> departed_;  // fault tolerance: ranks out of the job (left, not rejoined)
  uint64_t membership_epoch_ = 0;
  std::vector<std::string> server_endpoints_;  // by server id, from rendezvous on
  std::vector<int64_t> admit_ranks_;           // workers in the job waiting in an admission
  std::vector<std::shared_ptr<Node>> joining_;  // admitted, not yet announced to the workers
  std::set<int64_t> acks_awaited_;              // servers yet to apply the join's membership
  std::set<int64_t> lost_servers_;  // fault tolerance: servers that died or hung (their partitions moved)
  std::set<int64_t> rejoined_;  // ranks that joined after rendezvous: declarations answered alone
  uint64_t job_id_ = 0;
};

// One registered node's connection and what the scheduler knows of it.
struct Scheduler::Node {
  std::shared_ptr<Link> conn;
  std::unique_ptr<Outbox> out;
  std::string peer_ip;
  Role role = Role::kWorker;
  int64_t rank_hint = -1;
  int64_t rank = -1;  // worker rank or server id once rendezvous completes
  std::string endpoint;  // servers: where workers reach their data listener
  std::string host;  // the host it runs on: DMLC_NODE_HOST or the address it came from
  int64_t pid = 0;
  std::string hostname;
  int local_size = 1;    // workers: BYTEPS_LOCAL_SIZE of its host
  std::string host_key;  // which machine it runs on: BPSTRAIN_HOST_ID or its address
  bool goodbye = false;
  bool registered = false;
  bool joining = false;        // fault tolerance: registered after rendezvous, not in the job yet
  bool ready_to_join = false;  // ... and waiting in an admission (its data links are up)
  Clock::time_point last_seen = Clock::now();

  std::string Describe() const {
    std::string who = std::string(RoleName(role)) + (rank >= 0 ? " " + std::to_string(rank) : "");
    return who + " (pid " + std::to_string(pid) + " on " + hostname + ")";
  }
};

}  // namespace bps
