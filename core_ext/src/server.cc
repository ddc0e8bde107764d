#include "server.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#include "affinity.h"
#include "reduce.h"

namespace bps {

// One worker's data link: a reader (ServeConnection) and an outbox, so the engine
// threads never block on the network.
namespace {

std::string ListenHost(const ServerOptions& o, const Transport& t) {
  if (!o.listen_host.empty()) return o.listen_host;
  if (!o.advertise_host.empty()) return o.advertise_host;
  std::string toward = t.LocalHostToward(t.Endpoint(o.scheduler_host, o.scheduler_port));
  return toward.empty() ? "0.0.0.0" : toward;
}

}  // namespace

Server::Server(const ServerOptions& opts)
    : opts_(opts),
      transport_(Transport::Get(opts.transport)),
      listener_(transport_->Listen(ListenHost(opts, *transport_), 0)) {
  if (!(opts.round_timeout > 0))
    throw Error(Error::kConfig, "round_timeout must be > 0 seconds. Received: " + std::to_string(opts.round_timeout));
  if (opts.engine_threads < 1 || opts.engine_threads > 256)
    throw Error(Error::kConfig, "engine_threads must be in [1, 256]. Received: engine_threads=" +
                                    std::to_string(opts.engine_threads));
  cpus_ = ResolveCpuSpec(opts.numa, 0);
}

Server::~Server() { Stop(); }

void Server::Start() { main_thread_ = StartThread([this] { Run(); }); }

void Server::Run() {
  SetupEngineThread("bps-srv-main", cpus_);
  try {
    NodeInfo me;
    me.role = Role::kServer;
    me.rank_hint = opts_.server_id;
    me.listen_endpoint = listener_->endpoint();
    me.advertise_host = opts_.advertise_host;
    me.secret = opts_.secret;
    me.host_id = opts_.host_id;
    Welcome w = control_.Connect(
        *transport_, transport_->Endpoint(opts_.scheduler_host, opts_.scheduler_port), me, opts_.rendezvous_timeout,
        [this](const FrameHeader& h, const std::string& m) { OnControl(h, m); },
        [this](const std::string& why) { OnSchedulerLost(why); }, &stopping_);
    SetLogPrefix("bpstrain server " + std::to_string(w.rank));
    std::string lost;
    {
      std::lock_guard<std::mutex> lk(mu_);
      num_workers_ = w.num_workers;
      max_workers_ = w.max_workers;
      worker_keys_ = w.peer_keys;
      fault_tolerance_ = w.fault_tolerance;
      welcomed_ = true;
      lost = scheduler_lost_;  // lost before these were set
    }
    if (!lost.empty()) GoOnWithoutScheduler(lost);
  } catch (const Error& e) {
    failure_kind_ = e.kind();
    Finish(e.what());
    return;
  }
  for (int i = 0; i < opts_.engine_threads; ++i) {
    engines_.push_back(std::make_unique<EngineThread>());
    EngineThread* et = engines_.back().get();
    et->handler = opts_.handler ? opts_.handler(pool_) : std::make_unique<SumHandler>(pool_);
    et->params = std::make_unique<ParamStore>(pool_);
    et->num_workers = num_workers_;
    et->thread = StartThread([this, et, i] { EngineLoop(et, i); });
  }
  accept_thread_ = StartThread([this] { AcceptLoop(); });
}

void Server::OnControl(const FrameHeader& h, const std::string& meta) {
  if (h.type == static_cast<uint16_t>(MsgType::kTerminate)) return Finish("");
  if (h.type == static_cast<uint16_t>(MsgType::kMembership)) return OnMembership(meta);
  if (h.type == static_cast<uint16_t>(MsgType::kPeerDead)) {
    MetaReader r(meta);
    return Finish(r.Str());
  }
}

void Server::Finish(const std::string& failure) {
  std::lock_guard<std::mutex> lk(mu_);
  if (done_) return;
  done_ = true;
  failure_ = failure;
  cv_.notify_all();
}

bool Server::Wait(double seconds) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, std::chrono::duration<double>(seconds), [&] { return done_; });
  if (done_ && !failure_.empty()) throw Error(failure_kind_, failure_);
  return done_;
}

void Server::Stop() {
  if (stopping_.exchange(true)) return;
  Finish("");
  if (main_thread_.joinable()) main_thread_.join();
  control_.Close();
  listener_->Close();
  if (accept_thread_.joinable()) accept_thread_.join();
  std::vector<std::shared_ptr<Conn>> conns;
  {
    std::lock_guard<std::mutex> lk(mu_);
    conns = conns_;
  }
  for (auto& c : conns) c->Close();
  conn_threads_.ShutdownLinks();  // also the connections still in their handshake
  conn_threads_.JoinAll();
  for (auto& e : engines_) {
    {
      std::lock_guard<std::mutex> lk(e->mu);
      e->queue.push_back(Task{});  // a task without a connection stops the thread
      e->cv.notify_one();
    }
    e->thread.join();
  }
}

Server::Stats Server::stats() {
  Stats st;
  {
    std::lock_guard<std::mutex> lk(mu_);
    st.connections = static_cast<int64_t>(conns_.size());
  }
  for (auto& e : engines_) {
    std::lock_guard<std::mutex> lk(e->mu);
    st.pending_rounds += e->pending.load();
  }
  st.threads = static_cast<int64_t>(conn_threads_.size());
  st.expired_rounds = expired_rounds_.load();
  return st;
}

void Server::AcceptLoop() {
  SetupEngineThread("bps-srv-accept", cpus_);
  RunAcceptLoop(*listener_, slots_, conn_threads_, stopping_,
                [this](std::shared_ptr<Link> link, std::shared_ptr<HandshakeSlots::Slot> slot) {
                  ServeConnection(std::move(link), std::move(slot));
                });
}

void Server::ServeConnection(std::shared_ptr<Link> raw, std::shared_ptr<HandshakeSlots::Slot> slot) {
  SetupEngineThread("bps-srv-recv", cpus_);
  const std::string from = raw->peer_host();
  // Only a worker of this job, proving the credential the scheduler issued for its rank
  // and this server, gets past the handshake.
  int64_t rank = -1;
  auto key_for = [&](const std::string& identity, std::string* key) {
    const std::string prefix = "worker ";
    char* end = nullptr;
    long r = identity.compare(0, prefix.size(), prefix) == 0 ? std::strtol(identity.c_str() + prefix.size(), &end, 10) : -1;
    if (!end || *end || r < 0 || r >= static_cast<long>(worker_keys_.size())) {
      *key = "not a worker of this job (identity '" + identity.substr(0, 40) + "')";
      return false;
    }
    rank = r;
    *key = worker_keys_[r];
    return true;
  };
  std::shared_ptr<Link> link;
  try {
    std::string identity;
    link = SecureAccept(raw, key_for, &identity, opts_.authenticate_bodies);
  } catch (const FrameError& e) {
    slots_.NoteFailure(from, std::string("malformed frame in the handshake: ") + e.what());
  } catch (const std::exception& e) {
    slots_.NoteFailure(from, e.what());
  }
  slot.reset();
  if (!link) return;
  link->set_peer("worker " + std::to_string(rank) + " at " + from);
  auto conn = std::make_shared<Conn>();
  conn->link = link;
  conn->out = std::make_unique<Outbox>(link.get());
  conn->worker_rank = rank;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) return conn->Close();
    conns_.push_back(conn);
    ever_connected_.insert(rank);
    ++open_by_worker_[rank];
  }
  try {
    FrameHeader h;
    std::string meta;
    while (link->RecvFrame(&h, &meta, kMaxBodyLen)) {
      if (h.sender != rank)
        throw FrameError("a frame claiming to come from worker " + std::to_string(h.sender) +
                         " on the connection of worker " + std::to_string(rank));
      if (h.type == static_cast<uint16_t>(MsgType::kProbe)) {
        // Link measurement at rendezvous: the body is thrown away, the reply says it came.
        if (h.body_len > kMaxProbeBytes)
          throw FrameError("probe of " + std::to_string(h.body_len) + " bytes exceeds " +
                           std::to_string(kMaxProbeBytes));
        link->DiscardBody(h.body_len);
        FrameHeader reply;
        reply.type = static_cast<uint16_t>(MsgType::kProbeReply);
        reply.key = h.key;
        conn->Reply(reply);
        continue;
      }
      if (h.type == static_cast<uint16_t>(MsgType::kGoodbye)) {  // fault tolerance: a clean shutdown
        if (h.body_len || !meta.empty()) throw FrameError("a goodbye with a body");
        std::lock_guard<std::mutex> lk(mu_);
        said_goodbye_.insert(rank);
        continue;
      }
      Task t{conn, ParsePush(h, meta)};
      t.push.sender = static_cast<int>(rank);
      if (h.body_len) {
        t.push.body = pool_->Acquire(h.body_len);
        link->RecvBody(t.push.body->data(), h.body_len);
      }
      EngineThread* et = engines_[h.key % engines_.size()].get();
      std::lock_guard<std::mutex> lk(et->mu);
      et->queue.push_back(std::move(t));
      et->cv.notify_one();
    }
  } catch (const FrameError& e) {
    LogWarn("dropping connection from " + link->peer() + ": malformed frame: " + e.what());
  } catch (const std::exception& e) {
    if (!stopping_) LogDebug("connection from " + link->peer() + " ended: " + e.what());
  }
  conn->Close();
  bool without_scheduler = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    conns_.erase(std::remove(conns_.begin(), conns_.end(), conn), conns_.end());
    if (--open_by_worker_[rank] == 0) open_by_worker_.erase(rank);
    without_scheduler = !scheduler_lost_.empty();
  }
  if (without_scheduler) CheckWorkersWithoutScheduler();
}

void Server::EngineLoop(EngineThread* et, int index) {
  SetupEngineThread("bps-srv-eng" + std::to_string(index), cpus_);
  auto last_sweep = Clock::now();
  for (;;) {
    Task t;
    {
      std::unique_lock<std::mutex> lk(et->mu);
      et->cv.wait_for(lk, std::chrono::seconds(1), [&] { return !et->queue.empty(); });
      if (et->queue.empty()) {
        lk.unlock();
        ExpireRounds(et);
        last_sweep = Clock::now();
        continue;
      }
      t = std::move(et->queue.front());
      et->queue.pop_front();
    }
    if (!t.from && t.membership) {
      ApplyMembership(et);
      continue;
    }
    if (!t.from) return;
    Process(et, t);
    et->pending.store(static_cast<int64_t>(et->rounds.size() + et->finished.size() + et->held.size() + et->sparse_rounds.size() +
                                             et->param_waiters.size()));
    if (SecondsSince(last_sweep) > 1.0) {
      ExpireRounds(et);
      last_sweep = Clock::now();
    }
  }
}

void Server::ExpireRounds(EngineThread* et) {
  // Only this engine thread touches et->rounds; `pending` mirrors its size for stats().
  const double limit = std::min(opts_.round_timeout, 1e9);
  // Expired rounds' waiters are told once `pending` no longer counts those rounds: a
  // worker (or a test) that reads stats() on the notice sees them gone.
  std::vector<std::tuple<std::shared_ptr<Conn>, FrameHeader, std::string>> notices;
  for (auto it = et->rounds.begin(); it != et->rounds.end();) {
    PendingRound& pr = it->second;
    if (SecondsSince(pr.started) <= limit) {
      ++it;
      continue;
    }
    FrameHeader e;
    e.type = static_cast<uint16_t>(MsgType::kError);
    e.key = pr.round.key;
    e.version = pr.round.version;
    const std::string why = MetaWriter().Str("partition " + std::to_string(pr.round.key) + " round " +
                                             std::to_string(pr.round.version) + " expired after " +
                                             std::to_string(static_cast<int>(limit)) + " s with " +
                                             std::to_string(pr.round.pushes) + " of " +
                                             std::to_string(pr.round.expected) + " pushes").bytes();
    for (auto& w : pr.waiters) notices.emplace_back(w, e, why);
    it = et->rounds.erase(it);
    ++expired_rounds_;
  }
  // Answers nobody came for (their workers died or left) and pushes held for them.
  std::vector<std::pair<uint64_t, uint64_t>> stale;
  for (const auto& f : et->finished)
    if (SecondsSince(f.second.finished) > limit) stale.push_back(f.first);
  for (const auto& k : stale) {
    auto it = et->finished.find(k);  // releasing held pushes may have changed the map
    if (it != et->finished.end()) ForgetFinished(et, it);
  }
  for (auto it = et->held.begin(); it != et->held.end();) {
    if (SecondsSince(it->arrived) <= limit) {
      ++it;
      continue;
    }
    Reject(*it, "partition " + std::to_string(it->push.key) + " round " + std::to_string(it->push.version) +
                    " waited " + std::to_string(static_cast<int>(limit)) + " s for a worker " +
                    std::to_string(kMaxLateRounds) + " rounds behind (k-of-n aggregation)");
    it = et->held.erase(it);
    ++expired_rounds_;
  }
  for (auto it = et->sparse_rounds.begin(); it != et->sparse_rounds.end();) {
    if (SecondsSince(it->second.started) <= limit) {
      ++it;
      continue;
    }
    FrameHeader e;
    e.type = static_cast<uint16_t>(MsgType::kError);
    e.key = it->first.first;
    e.version = it->first.second;
    const std::string why = MetaWriter().Str("sparse partition " + std::to_string(e.key) + " round " +
                                             std::to_string(e.version) + " expired after " +
                                             std::to_string(static_cast<int>(limit)) + " s with " +
                                             std::to_string(it->second.senders.size()) + " of " +
                                             std::to_string(it->second.expected) + " pushes").bytes();
    for (auto& w : it->second.waiters) notices.emplace_back(w, e, why);
    it = et->sparse_rounds.erase(it);
    ++expired_rounds_;
  }
  std::vector<ParamStore::Answer> expired;
  et->params->Expire(limit, &expired);
  expired_rounds_ += static_cast<int64_t>(expired.size());
  SendParamAnswers(et, expired);
  et->pending.store(static_cast<int64_t>(et->rounds.size() + et->finished.size() + et->held.size() + et->sparse_rounds.size() +
                                         et->param_waiters.size()));
  for (auto& [w, e, why] : notices) w->Reply(e, why);
}

void Server::ForgetFinished(EngineThread* et, std::map<std::pair<uint64_t, uint64_t>, FinishedRound>::iterator it) {
  const uint64_t key = it->first.first;
  const bool recovered = it->second.recovered;
  et->finished.erase(it);
  if (recovered) return;  // not part of k-of-n's backlog
  if (--et->backlog[key] <= 0) et->backlog.erase(key);
  ReleaseHeld(et, key);
}

void Server::ReleaseHeld(EngineThread* et, uint64_t key) {
  // In arrival order; Process may hold a task again (the backlog is still full).
  std::deque<Task> mine, rest;
  for (auto& t : et->held) (t.push.key == key ? mine : rest).push_back(std::move(t));
  et->held = std::move(rest);
  for (auto& t : mine) Process(et, t);
}

void Server::Reject(Task& t, const std::string& msg) {
  FrameHeader e;
  e.type = static_cast<uint16_t>(MsgType::kError);
  e.key = t.push.key;
  e.version = t.push.version;
  t.from->Reply(e, MetaWriter().Str(msg).bytes());
}

Push Server::ParsePush(const FrameHeader& h, const std::string& meta) const {
  // Nothing here is trusted: the header came off the network.
  if (h.type != static_cast<uint16_t>(MsgType::kPush))
    throw FrameError("unexpected frame type " + std::to_string(h.type) + " on a data connection");
  Push p;
  p.key = h.key;
  p.version = h.version;
  const int dtype = h.flags >> 8;
  const bool empty = h.flags & kFlagEmpty;
  if (!ValidDType(dtype)) throw FrameError("push with unknown dtype " + std::to_string(dtype));
  p.dtype = static_cast<DType>(dtype);
  p.len = static_cast<uint64_t>(h.arg);
  p.broadcast = h.flags & kFlagBroadcast;
  p.pull_only = empty && !p.broadcast;
  p.keep_own = h.flags & kFlagKeepOwn;
  if (p.keep_own && !p.broadcast) throw FrameError("push of key " + std::to_string(h.key) + " keeps its own result but is no broadcast");
  if (h.arg < 0 || p.len > kMaxBodyLen || p.len % DTypeSize(p.dtype) != 0 ||
      (empty ? h.body_len != 0 : h.body_len != p.len))
    throw FrameError("push of key " + std::to_string(h.key) + " has inconsistent lengths (arg=" +
                     std::to_string(h.arg) + ", body=" + std::to_string(h.body_len) + ")");
  const int workers = num_workers_;
  p.expected = workers;
  MetaReader r(meta);
  if (h.meta_len >= 4) p.expected = static_cast<int>(r.U32());
  if (h.meta_len >= 8) p.root = static_cast<int>(r.U32());
  if (p.expected < 1 || p.expected > workers)
    throw FrameError("push expects " + std::to_string(p.expected) + " contributions; the job has " +
                     std::to_string(workers) + " workers");
  p.complete_at = h.meta_len >= 12 ? static_cast<int>(r.U32()) : p.expected;
  if (p.complete_at < 1 || p.complete_at > p.expected || (p.broadcast && p.complete_at != p.expected))
    throw FrameError("push completes its round at " + std::to_string(p.complete_at) + " of " +
                     std::to_string(p.expected) + " pushes" + (p.broadcast ? " (a broadcast needs all)" : ""));
  if (p.pull_only && p.complete_at == p.expected)
    throw FrameError("a push without a body outside a broadcast or a k-of-n round");
  if (h.meta_len < 16) return p;
  const uint32_t param = r.U32();
  if (param == kParamInit) {
    if (!p.broadcast || p.dtype != DType::kFloat32)
      throw FrameError("a weights init that is not an fp32 broadcast");
    const std::string consistency = r.Str();
    const uint32_t staleness_lr = r.U32();
    const std::string optimizer = r.Str();
    std::string bad = ParseConsistency(consistency, &p.consistency);
    if (bad.empty() && p.consistency.mode == ConsistencySpec::kSync) bad = "a weights init under sync consistency";
    if (bad.empty()) bad = ParseServerOptimizer(optimizer, &p.optimizer);
    if (!bad.empty() || staleness_lr > 1) throw FrameError("weights init: " + (bad.empty() ? "bad flag" : bad));
    p.consistency.staleness_lr = staleness_lr == 1;
    p.param_spec = consistency + (staleness_lr ? " staleness_lr " : " ") + optimizer;
  } else if (param == kParamUpdate) {
    if (p.broadcast || empty || p.dtype != DType::kFloat32 || p.complete_at != p.expected)
      throw FrameError("a weights update that is not a full fp32 push");
    p.lr = r.F64();
  } else if (param == kSparseRows) {
    p.row_width = r.U32();
    if (p.broadcast || empty || p.dtype != DType::kFloat32 || p.complete_at != p.expected ||
        p.row_width < 1 || p.row_width > (1u << 20) || p.len % SparseRowBytes(p.row_width) != 0)
      throw FrameError("a sparse push that is not whole fp32 rows of width 1..2^20 with their ids");
  } else if (param == kRowsPull || param == kRowsPush) {
    p.row_width = r.U32();
    p.param_spec = r.Str();
    if (param == kRowsPush) p.lr = r.F64();
    if (param == kRowsPull && !r.AtEnd()) {
      p.table_after = r.I64();
      if (p.table_after < 0) throw FrameError("a table prefetch after " + std::to_string(p.table_after) + " pushes");
    }
    RowTableSpec spec;
    const uint64_t unit = param == kRowsPull ? 8 : SparseRowBytes(p.row_width);
    if (p.broadcast || empty || p.dtype != DType::kFloat32 || p.complete_at != p.expected ||
        p.row_width < 1 || p.row_width > (1u << 20) || p.len % unit != 0 || !std::isfinite(p.lr) || p.lr < 0 ||
        !ParseRowTableSpec(p.param_spec, &spec).empty())
      throw FrameError("an embedding-table operation with a bad width, length, learning rate or spec");
  } else if (param == kRecoveredAnswer) {
    if (!fault_tolerance_) throw FrameError("a lost server's answer in a job without fault tolerance");
    p.recovered_summed = r.I64();
    p.recovered_flags = static_cast<uint16_t>(r.U32());
    p.recovered_meta = r.Str();
    if (empty || p.complete_at != p.expected || p.recovered_summed < 1 || p.recovered_summed > p.expected ||
        (p.recovered_flags & ~kFlagReduced))
      throw FrameError("a recovered answer without its bytes, of a k-of-n round, or with a bad count or flags");
  } else {
    throw FrameError("push with unknown parameter operation " + std::to_string(param));
  }
  if (!r.AtEnd()) throw FrameError("push metadata has trailing bytes");
  p.param = static_cast<ParamOp>(param);
  return p;
}

void Server::Process(EngineThread* et, Task& t) {
  const Push& p = t.push;
  if (p.sender >= et->num_workers)  // a worker waiting to join as a new rank (scale-up)
    return Reject(t, "worker " + std::to_string(p.sender) + " pushed before the job admitted it (comm.max_workers: a "
                     "new worker joins at the others' next admission)");
  if (Departed(et, p.sender))
    return Reject(t, "worker " + std::to_string(p.sender) + " left the job (comm.fault_tolerance: the others went "
                     "on without it); its pushes are refused, it must rejoin");
  if (StaleAfterRejoin(et, p))
    return Reject(t, "worker " + std::to_string(p.sender) + " pushed round " + std::to_string(p.version) +
                     " of partition " + std::to_string(p.key) + ", from before that rank rejoined the job: a "
                     "stale process of a replaced worker is refused, not merged");
  if (p.param == kRecoveredAnswer) return ProcessRecoveredAnswer(et, t);
  if (p.param == kParamUpdate) return ProcessParamUpdate(et, t);
  if (p.param == kSparseRows || p.param == kRowsPush) return ProcessSparse(et, t);
  if (p.param == kRowsPull) return ProcessRowsPull(et, t);
  auto reject = [&](const std::string& msg) { Reject(t, msg); };
  // Only error messages need it: built on demand, not for every push.
  auto what = [&p] { return "partition " + std::to_string(p.key) + " round " + std::to_string(p.version); };
  auto done = et->finished.find({p.key, p.version});
  if (done != et->finished.end()) return AnswerLate(et, done, t);
  if (p.pull_only)  // never a contribution: only rounds the others completed are pulled
    return reject(what() + ": a catch-up pull for a round this server does not keep answered "
                         "(not complete yet, or forgotten after round_timeout)");
  auto it = et->rounds.find({p.key, p.version});
  if (it == et->rounds.end()) {
    if (p.complete_at < p.expected) {
      // k-of-n: versions of a key only grow, so an older round that is neither pending
      // nor kept finished without this worker and was forgotten (round_timeout).
      auto through = et->finished_through.find(p.key);
      if (through != et->finished_through.end() && p.version <= through->second)
        return reject(what() + " was answered without this worker and forgotten after round_timeout: "
                             "this worker is too far behind the others");
      auto backlog = et->backlog.find(p.key);
      if (backlog != et->backlog.end() && backlog->second >= kMaxLateRounds) {
        et->held.push_back(std::move(t));
        return;
      }
    }
    it = et->rounds.emplace(std::make_pair(p.key, p.version), PendingRound{}).first;
    it->second.round = RoundOf(p);
    it->second.param = p.param;
    it->second.param_spec = p.param_spec;
    it->second.consistency = p.consistency;
    it->second.optimizer = p.optimizer;
    it->second.meta_expected = p.expected;
    it->second.meta_complete_at = p.complete_at;
  }
  PendingRound& pr = it->second;
  Round& r = pr.round;
  if (r.dtype != p.dtype || r.len != p.len || pr.meta_expected != p.expected || r.broadcast != p.broadcast)
    return reject(what() + ": this push has dtype " + DTypeName(p.dtype) + " and " + std::to_string(p.len) +
                  " bytes, other workers pushed " + DTypeName(r.dtype) + " and " + std::to_string(r.len));
  if (pr.meta_complete_at != p.complete_at)
    return reject(what() + ": this worker completes rounds at " + std::to_string(p.complete_at) +
                  " pushes, another at " + std::to_string(r.complete_at) +
                  "; set the same comm.aggregate on every worker");
  if (std::find(pr.waiters.begin(), pr.waiters.end(), t.from) != pr.waiters.end())
    return reject("duplicate push of " + what() + " from the same worker");
  if (r.broadcast && p.root != r.root && pr.error.empty())
    // Horovod's rule: ranks that name different roots all get an error, none gets data.
    pr.error = "broadcast of " + what() + ": ranks disagree on the root (rank " +
               std::to_string(r.senders.empty() ? -1 : r.senders[0]) + " says root_rank=" + std::to_string(r.root) +
               ", rank " + std::to_string(p.sender) + " says root_rank=" + std::to_string(p.root) +
               "); pass the same root_rank on every rank";
  if ((pr.param != p.param || pr.param_spec != p.param_spec) && pr.error.empty())
    pr.error = what() + ": ranks disagree on the server-held weights (comm.consistency and the server "
                      "optimizer): '" + pr.param_spec + "' vs '" + p.param_spec + "'; every rank needs the same";
  if (r.complete_at < r.expected && p.dtype == DType::kCompressed && pr.error.empty())
    pr.error = what() + ": k-of-n aggregation (comm.aggregate) does not combine with compression";
  pr.waiters.push_back(t.from);
  pr.keep_own.push_back(p.keep_own);
  r.senders.push_back(p.sender);
  ++r.pushes;
  std::string error = pr.error.empty() ? et->handler->OnPush(r, p) : "";
  if (!error.empty()) {
    pr.waiters.pop_back();
    pr.keep_own.pop_back();
    r.senders.pop_back();
    --r.pushes;
    if (r.pushes == 0) et->rounds.erase(it);
    return reject(error);
  }
  FitToMembership(et, pr);
  if (et->handler->Complete(r)) CompleteRound(et, it);
}

void Server::CompleteRound(EngineThread* et, std::map<std::pair<uint64_t, uint64_t>, PendingRound>::iterator it) {
  PendingRound& pr = it->second;
  Round& r = pr.round;
  auto what = [&r] { return "partition " + std::to_string(r.key) + " round " + std::to_string(r.version); };
  if (!et->finished.empty()) ForgetRecoveredBefore(et, r.key, r.version);
  std::string error = pr.error.empty() ? et->handler->OnRoundComplete(r) : pr.error;
  if (error.empty() && pr.param == kParamInit) {
    // The weights start from the root's model (BytePS's async mode started from zeros).
    if (!r.result || r.result->size() < r.len) {
      error = what() + ": a weights init without the root's weights";
    } else {
      std::vector<ParamStore::Answer> dropped;
      et->params->Init(r.key, reinterpret_cast<const float*>(r.result->data()), r.len / sizeof(float), r.expected,
                       pr.consistency, pr.optimizer, &dropped);
      SendParamAnswers(et, dropped);
    }
  }
  FrameHeader reply;
  reply.type = static_cast<uint16_t>(error.empty() ? MsgType::kPullReply : MsgType::kError);
  reply.key = r.key;
  reply.version = r.version;
  reply.arg = r.pushes;  // how many pushes the answer sums (k-of-n workers average by it)
  if (pr.meta_expected == et->num_workers && r.pushes < et->num_workers) reply.flags |= kFlagReduced;  // one left
  std::string meta;
  if (!error.empty()) {
    meta = MetaWriter().Str(error).bytes();
  } else if (reply.flags & kFlagReduced && !et->departed.empty()) {
    meta = ReducedAnswerMeta(et);  // fault tolerance (no k-of-n): the membership it was fitted to
  } else if (r.complete_at < r.expected) {
    auto through = et->finished_through.find(r.key);
    const uint64_t newest = through == et->finished_through.end() ? r.version : std::max(through->second, r.version);
    meta = MetaWriter().I64(static_cast<int64_t>(newest)).bytes();
  }
  for (size_t i = 0; i < pr.waiters.size(); ++i) {
    std::shared_ptr<Buffer> body = error.empty() && !pr.keep_own[i] ? et->handler->OnPull(r, r.senders[i]) : nullptr;
    reply.body_len = body ? r.len : 0;
    pr.waiters[i]->Reply(reply, meta, std::move(body));
  }
  if (r.pushes < r.expected) {
    // Answered early (k-of-n): the other participants' pushes are still coming.
    FinishedRound f;
    f.error = error;
    f.answered = r.senders;
    r.acc.reset();  // only the answer is needed now
    f.round = std::move(r);
    et->finished.emplace(std::make_pair(r.key, r.version), std::move(f));
    ++et->backlog[r.key];
    uint64_t& through = et->finished_through[r.key];
    through = std::max(through, r.version);
  }
  et->rounds.erase(it);
}

void Server::AnswerLate(EngineThread* et, std::map<std::pair<uint64_t, uint64_t>, FinishedRound>::iterator it,
                        Task& t) {
  // A push for a round that was answered without it: the push is dropped, the worker
  // gets what the others got, so every worker applies the same update.
  const Push& p = t.push;
  FinishedRound& f = it->second;
  Round& r = f.round;
  const std::string what = "partition " + std::to_string(p.key) + " round " + std::to_string(p.version);
  if (r.dtype != p.dtype || r.len != p.len || r.expected != p.expected || r.complete_at != p.complete_at)
    return Reject(t, what + ": this late push has dtype " + DTypeName(p.dtype) + ", " + std::to_string(p.len) +
                         " bytes and completes at " + std::to_string(p.complete_at) + " pushes; the round had " +
                         DTypeName(r.dtype) + ", " + std::to_string(r.len) + " bytes and " +
                         std::to_string(r.complete_at));
  if (std::find(f.answered.begin(), f.answered.end(), p.sender) != f.answered.end())
    return Reject(t, "duplicate push of " + what + " from the same worker");
  FrameHeader reply;
  reply.type = static_cast<uint16_t>(f.error.empty() ? MsgType::kPullReply : MsgType::kError);
  reply.flags = f.recovered ? f.reply_flags : static_cast<uint16_t>(kFlagLate);
  reply.key = p.key;
  reply.version = p.version;
  reply.arg = r.pushes;
  std::shared_ptr<Buffer> body = f.recovered ? r.result : f.error.empty() ? et->handler->OnPull(r, p.sender) : nullptr;
  reply.body_len = body ? r.len : 0;
  const std::string meta = f.recovered       ? f.reply_meta
                           : f.error.empty() ? MetaWriter().I64(static_cast<int64_t>(et->finished_through[p.key])).bytes()
                                             : MetaWriter().Str(f.error).bytes();
  t.from->Reply(reply, meta, std::move(body));
  t.push.body.reset();  // the late gradient goes back to the pool now
  f.answered.push_back(p.sender);
  if (static_cast<int>(f.answered.size()) >= r.expected) ForgetFinished(et, it);
}

void Server::ProcessParamUpdate(EngineThread* et, Task& t) {
  const Push& p = t.push;
  const auto id = std::make_tuple(p.key, p.sender, p.version);
  if (et->param_waiters.count(id))
    return Reject(t, "duplicate push of partition " + std::to_string(p.key) + " round " + std::to_string(p.version) +
                         " from the same worker");
  std::vector<ParamStore::Answer> ready;
  const std::string error = et->params->Update(p.key, p.sender, p.version, reinterpret_cast<const float*>(p.body->data()),
                                               p.len / sizeof(float), p.lr, &ready);
  t.push.body.reset();  // the gradient is in the sums or applied: its buffer goes back now
  if (!error.empty()) return Reject(t, error);
  et->param_waiters.emplace(id, t.from);
  SendParamAnswers(et, ready);
}

void Server::SendParamAnswers(EngineThread* et, std::vector<ParamStore::Answer>& answers) {
  for (ParamStore::Answer& a : answers) {
    auto w = et->param_waiters.find(std::make_tuple(a.key, a.worker, a.version));
    if (w == et->param_waiters.end()) continue;
    FrameHeader reply;
    reply.type = static_cast<uint16_t>(a.error.empty() ? MsgType::kPullReply : MsgType::kError);
    reply.key = a.key;
    reply.version = a.version;
    reply.arg = et->num_workers;
    reply.body_len = a.weights ? a.weights->size() : 0;
    w->second->Reply(reply, a.error.empty() ? MetaWriter().I64(a.staleness).bytes() : MetaWriter().Str(a.error).bytes(),
                     a.error.empty() ? std::move(a.weights) : nullptr);
    et->param_waiters.erase(w);
  }
}

}  // namespace bps
