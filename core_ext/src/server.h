// A parameter server's I/O: accepts workers' data links, validates each push, groups
// pushes into rounds by (partition key, version) on several engine threads and sends
// the answers. What a round does with its pushes is the ServerHandler's (see
// server_handler.h); the default sums them.
//
// Usage (what `python -m bpstrain.launch` does with DMLC_ROLE=server):
//   bps::ServerOptions o; o.scheduler_host = "10.0.0.1"; o.scheduler_port = 9000;
//   bps::Server s(o);
//   s.Start();
//   while (!s.Wait(0.1)) {}  // true once the scheduler says every worker is gone;
//                            // throws Error(kPeer) when a node of the job died
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
#include <tuple>
#include <vector>

#include "buffer_pool.h"
#include "common.h"
#include "connection_threads.h"
#include "control.h"
#include "param_store.h"
#include "row_table.h"
#include "secure_link.h"
#include "sparse_rows.h"
#include "server_handler.h"
#include "transport.h"

namespace bps {

struct ServerOptions {
  std::string scheduler_host = "127.0.0.1";
  int scheduler_port = 0;
  // Where the data listener binds: "" = the advertised host if given, else this host's
  // address toward the scheduler (loopback for a local job); "0.0.0.0" = every interface.
  std::string listen_host;
  std::string advertise_host;  // DMLC_NODE_HOST; "" = what the scheduler sees
  std::string host_id;         // machine identity for mixed mode; "" = the address
  int server_id = -1;          // -1 = assigned by the scheduler
  int engine_threads = 2;
  std::string numa = "auto";
  double rendezvous_timeout = 120.0;
  std::string secret;
  std::string transport = "tcp";  // "tcp" or "inproc" (Transport::Get)
  HandlerFactory handler;         // per-key logic; empty = SumHandler
  // Seconds a round may wait for its last push before it is dropped and its pushers are
  // told (the workers' own operation timeout has fired by then): memory stays bounded.
  double round_timeout = 300.0;
  bool authenticate_bodies = true;  // see WorkerOptions::authenticate_bodies
};

class Server {
 public:
  explicit Server(const ServerOptions& opts);
  ~Server();
  int port() const { return listener_->port(); }
  // The data listener's endpoint (where it is bound).
  std::string endpoint() const { return listener_->endpoint(); }
  void Start();
  // Counters for tests and the fuzzer: rounds waiting for pushes, open data connections,
  // connection threads not yet reaped.
  struct Stats {
    int64_t pending_rounds = 0, connections = 0, threads = 0, expired_rounds = 0;
  };
  Stats stats();
  bool Wait(double seconds);
  void Stop();

 private:
  struct Conn;
  struct Task {
    std::shared_ptr<Conn> from;  // null stops the engine thread (unless `membership`)
    Push push;
    Clock::time_point arrived = Clock::now();
    bool membership = false;  // no push: the job's workers changed (server_membership.cc)
  };
  struct PendingRound {
    Round round;
    Clock::time_point started = Clock::now();
    std::string error;  // set when the pushes disagree: every waiter gets it at the end
    std::vector<std::shared_ptr<Conn>> waiters;  // in push order
    std::vector<bool> keep_own;                  // per waiter: answered with no body
    ParamOp param = kParamNone;  // kParamInit: the result becomes the servers' weights
    std::string param_spec;
    ConsistencySpec consistency;
    ServerOptimizer optimizer;
    // What the first push's meta said (rounds refit `round.expected` to the membership).
    int meta_expected = 0, meta_complete_at = 0;
  };
  // A k-of-n round answered before every participant pushed: the late pushers get the
  // same answer (their pushes are dropped), so it stays until each has it, or until
  // round_timeout (a late worker that never comes is dead or gone).
  struct FinishedRound {
    Round round;
    std::string error;        // what the round answered instead of data, if it failed
    std::vector<int> answered;  // ranks answered so far
    Clock::time_point finished = Clock::now();
    // Not k-of-n: a lost server's answer a worker handed over (kRecoveredAnswer), for the
    // workers that server had not answered; replied with its flags and meta.
    bool recovered = false;
    uint16_t reply_flags = 0;
    std::string reply_meta;
  };
  // A row-sparse round (kSparseRows): pushes of any length, merged by row id.
  struct SparseRound {
    int expected = 0;  // pushes to wait for (refit when workers leave)
    int meta_expected = 0;  // what the pushes' meta says
    uint32_t width = 0;
    std::unique_ptr<RowMerger> merged;
    std::vector<std::shared_ptr<Conn>> waiters;
    std::vector<int> senders;
    std::string error;  // pushes disagreed: every waiter gets it at the end
    Clock::time_point started = Clock::now();
    bool table = false;  // kRowsPush: apply the merged gradients to the key's RowTable
    double lr = 0;
    std::string spec;
  };
  struct EngineThread {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Task> queue;
    std::unique_ptr<ServerHandler> handler;
    std::map<std::pair<uint64_t, uint64_t>, PendingRound> rounds;  // (key, version) -> state
    std::map<std::pair<uint64_t, uint64_t>, FinishedRound> finished;  // k-of-n, awaiting late pushes
    std::map<uint64_t, int> backlog;              // key -> its rounds in `finished`
    std::map<uint64_t, uint64_t> finished_through;  // key -> newest version finished early
    // New rounds of a key whose backlog is full wait here for the late workers (memory
    // stays bounded: at most kMaxLateRounds finished rounds per key).
    std::deque<Task> held;
    // Server-held weights of this thread's keys, and the connections whose updates wait
    // for their answer, by (key, worker, version).
    std::unique_ptr<ParamStore> params;
    std::map<std::tuple<uint64_t, int, uint64_t>, std::shared_ptr<Conn>> param_waiters;
    std::map<std::pair<uint64_t, uint64_t>, SparseRound> sparse_rounds;  // (key, version)
    std::map<uint64_t, std::unique_ptr<RowTable>> tables;  // embedding storage, by key
    // Table prefetches waiting for the push they were asked after, by (key, worker):
    // that push's answer to the worker carries the rows of `ids` it changed.
    struct Prefetch {
      uint64_t after = 0;
      std::vector<int64_t> ids;  // ascending
    };
    std::map<std::pair<uint64_t, int>, Prefetch> prefetches;
    // Fault tolerance: the ranks that left the job, as this thread last heard, and that
    // membership's epoch (reduced answers carry both).
    std::vector<int64_t> departed;
    int64_t membership_epoch = 0;
    int num_workers = 0;  // worker ranks of that membership (a scale-up adds some)
    std::map<int64_t, uint64_t> rejoined_from;  // rank -> its first round number after it rejoined
    // rounds, finished and held together, for stats() from other threads
    std::atomic<int64_t> pending{0};
    std::thread thread;
  };

  // How many rounds of one key may wait for late workers under k-of-n aggregation
  // before the key's next round waits too: the fastest workers run at most this many
  // rounds ahead of the slowest, and a server keeps at most this many answers per key.
  static constexpr int kMaxLateRounds = 4;

  void Run();
  void AcceptLoop();
  void ServeConnection(std::shared_ptr<Link> raw, std::shared_ptr<HandshakeSlots::Slot> slot);
  void ExpireRounds(EngineThread* et);
  void EngineLoop(EngineThread* et, int index);
  void Process(EngineThread* et, Task& t);
  // Answers a dense round that has every push it waits for, and forgets it.
  void CompleteRound(EngineThread* et, std::map<std::pair<uint64_t, uint64_t>, PendingRound>::iterator it);
  void CompleteSparse(EngineThread* et, std::map<std::pair<uint64_t, uint64_t>, SparseRound>::iterator it);
  // Fault tolerance (server_membership.cc): kMembership from the scheduler.
  void OnMembership(const std::string& meta);
  // The scheduler's connection broke. With fault tolerance the server goes on serving the
  // workers in the job and ends once each has said goodbye (kGoodbye on its data
  // connections) and closed them; a worker that vanishes without one ends the job, since
  // only the scheduler can change the membership. Without it, the server fails.
  void OnSchedulerLost(const std::string& why);
  void GoOnWithoutScheduler(const std::string& why);  // once the welcome's fields are set
  void CheckWorkersWithoutScheduler();
  // A thread's share of a membership change: refit and, where complete, answer its rounds.
  void ApplyMembership(EngineThread* et);
  bool Departed(const EngineThread* et, int rank) const;
  // A push of a rank that rejoined, numbered before it rejoined (a stale process).
  bool StaleAfterRejoin(const EngineThread* et, const Push& p) const;
  // A kFlagReduced answer's meta: the membership this thread fitted the round to.
  std::string ReducedAnswerMeta(const EngineThread* et) const;
  // A whole-job round waits for every worker still in the job plus those that left after
  // pushing to it (`expected`, and `complete_at` of dense rounds, refit to that).
  void FitToMembership(const EngineThread* et, PendingRound& pr) const;
  void FitToMembership(const EngineThread* et, SparseRound& sr) const;
  void AnswerLate(EngineThread* et, std::map<std::pair<uint64_t, uint64_t>, FinishedRound>::iterator it,
                  Task& t);
  void ProcessParamUpdate(EngineThread* et, Task& t);
  // server_membership.cc: a lost server's answer (fault tolerance) answers the round here.
  void ProcessRecoveredAnswer(EngineThread* et, Task& t);
  // Forgets the recovered answers of `key` older than `version` (every worker is past them).
  void ForgetRecoveredBefore(EngineThread* et, uint64_t key, uint64_t version);
  void ProcessSparse(EngineThread* et, Task& t);
  void ProcessRowsPull(EngineThread* et, Task& t);
  // Rows of `ids` (ascending) as sparse rows (ids, rows), read from `table`; null for none.
  std::shared_ptr<Buffer> TableRows(RowTable& table, const std::vector<int64_t>& ids);
  // The key's table, created with this width and spec; null (and *error set) on a mismatch.
  RowTable* TableFor(EngineThread* et, uint64_t key, uint32_t width, const std::string& spec, std::string* error);
  void SendParamAnswers(EngineThread* et, std::vector<ParamStore::Answer>& answers);
  void ForgetFinished(EngineThread* et, std::map<std::pair<uint64_t, uint64_t>, FinishedRound>::iterator it);
  void ReleaseHeld(EngineThread* et, uint64_t key);
  static void Reject(Task& t, const std::string& msg);
  Push ParsePush(const FrameHeader& h, const std::string& meta) const;
  void OnControl(const FrameHeader& h, const std::string& meta);
  void Finish(const std::string& failure);

  ServerOptions opts_;
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<Listener> listener_;
  std::shared_ptr<BufferPool> pool_ = BufferPool::Create();
  ControlClient control_;
  std::vector<int> cpus_;
  // Worker ranks in the job (the newest membership's: a scale-up grows it; written under
  // mu_, read by connection threads to check pushes), and the most it may grow to.
  std::atomic<int> num_workers_{0};
  int max_workers_ = 0;
  std::vector<int64_t> departed_;  // under mu_: the newest membership (kMembership)
  int64_t membership_epoch_ = 0;   // under mu_
  std::map<int64_t, uint64_t> rejoined_from_;  // under mu_: EngineThread::rejoined_from
  bool welcomed_ = false;          // under mu_: num_workers_ and fault_tolerance_ are set
  bool fault_tolerance_ = false;   // the scheduler runs the job with comm.fault_tolerance
  std::string scheduler_lost_;     // under mu_: why the scheduler's connection broke
  std::set<int64_t> said_goodbye_;  // under mu_: workers that shut down cleanly (kGoodbye)
  std::set<int64_t> ever_connected_;  // under mu_: workers that opened a data connection
  std::map<int64_t, int> open_by_worker_;  // under mu_: open data connections by worker rank
  std::vector<std::unique_ptr<EngineThread>> engines_;
  std::thread main_thread_, accept_thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Conn>> conns_;  // open data connections
  ConnectionThreads conn_threads_;
  HandshakeSlots slots_;
  std::vector<std::string> worker_keys_;  // data credentials by worker rank (from the welcome)
  bool done_ = false;
  std::string failure_;
  Error::Kind failure_kind_ = Error::kPeer;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> expired_rounds_{0};
};

// One worker's data connection; replies go out through its outbox (never under a lock
// that waits for the network).
struct Server::Conn {
  std::shared_ptr<Link> link;
  std::unique_ptr<Outbox> out;
  int64_t worker_rank = -1;

  void Reply(const FrameHeader& h, std::string meta = "", std::shared_ptr<Buffer> body = nullptr) {
    const uint64_t len = body ? h.body_len : 0;
    const void* data = body ? body->data() : nullptr;
    out->Post(Outbox::Frame{h, std::move(meta), std::move(body), data, len});
  }
  void Close() { out->Close(); }
};

}  // namespace bps
