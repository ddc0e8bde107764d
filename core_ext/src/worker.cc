#include "worker.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "affinity.h"
#include "local_group.h"
#include "reduce.h"
#include "secure_link.h"
#include "row_table.h"
#include "sparse_rows.h"

namespace bps {


namespace {
constexpr int kPartBits = 20;  // key = tensor id << 20 | partition index
}  // namespace

Worker::Worker(const WorkerOptions& opts) : opts_(opts), transport_(Transport::Get(opts.transport)) {
  if (opts.partition_bytes < 0)
    throw Error(Error::kConfig, "partition_bytes must be positive, or 0 to let the engine choose. "
                                "Received: partition_bytes=" + std::to_string(opts.partition_bytes));
  if (opts.hierarchical < WorkerOptions::kOff || opts.hierarchical > WorkerOptions::kAuto)
    throw Error(Error::kConfig, "hierarchical must be off (0), on (1) or auto (2). Received: " +
                                    std::to_string(opts.hierarchical));
  if (opts.connections_per_server < 1 || opts.connections_per_server > 64)
    throw Error(Error::kConfig, "connections_per_server must be in [1, 64]. Received: " +
                                    std::to_string(opts.connections_per_server));
  if (opts.local_size < 1 || opts.local_rank < 0 || opts.local_rank >= opts.local_size)
    throw Error(Error::kConfig, "local_rank must be in [0, local_size). Received: local_rank=" +
                                    std::to_string(opts.local_rank) + ", local_size=" +
                                    std::to_string(opts.local_size));
  const std::string bad_consistency = ParseConsistency(opts.consistency, &consistency_);
  if (!bad_consistency.empty()) throw Error(Error::kConfig, bad_consistency);
  consistency_.staleness_lr = opts.staleness_lr;
  if (consistency_.mode != ConsistencySpec::kSync && opts.aggregate > 0)
    throw Error(Error::kConfig, "comm.aggregate k-of-n is for synchronous training; comm.consistency " +
                                    opts.consistency + " already lets fast workers go ahead. Set one of them");
  if (opts.aggregate < 0)
    throw Error(Error::kConfig, "aggregate must be >= 0 (0 = every worker). Received: " +
                                    std::to_string(opts.aggregate));
  cpus_ = ResolveCpuSpec(opts.numa, opts.local_rank);
}

Worker::~Worker() { Shutdown(); }

void Worker::Start() { rendezvous_thread_ = StartThread([this] { Rendezvous(); }); }

void Worker::Rendezvous() {
  bool joined = false;  // welcomed: a server that closes on us now may be leaving a failed job
  try {
    NodeInfo me;
    me.role = Role::kWorker;
    me.rank_hint = opts_.rank_hint;
    me.secret = opts_.secret;
    me.local_size = opts_.local_size;
    me.advertise_host = opts_.advertise_host;
    me.host_id = opts_.host_id;
    Welcome w = control_.Connect(
        *transport_, transport_->Endpoint(opts_.scheduler_host, opts_.scheduler_port), me, opts_.rendezvous_timeout,
        [this](const FrameHeader& h, const std::string& m) { OnControl(h, m); },
        [this](const std::string& why) { OnSchedulerLost(why); },
        &stopping_);
    joined = true;
    {
      std::lock_guard<std::mutex> lk(mu_);
      joining_ = w.joining;
    }
    rank_ = static_cast<int>(w.rank);
    size_ = w.num_workers;
    max_workers_ = w.max_workers;
    servers_ = w.servers;
    SetLogPrefix("bpstrain worker " + std::to_string(rank_));
    if (opts_.aggregate > size_)
      throw Error(Error::kConfig, "comm.aggregate k:" + std::to_string(opts_.aggregate) + " needs K <= the " +
                                      std::to_string(size_) + " workers of this job");
    if (KOfN() && rank_ == 0)
      LogInfo("k-of-n aggregation: a round is answered once " + std::to_string(opts_.aggregate) + " of " +
              std::to_string(size_) + " workers pushed it; late pushes get the same answer and are dropped");
    std::vector<std::unique_ptr<DataConn>> conns;
    for (int s = 0; s < static_cast<int>(servers_.size()); ++s) {
      if (servers_[s].empty()) {  // lost before this worker joined: its partitions moved
        std::lock_guard<std::mutex> lk(mu_);
        lost_servers_.insert(s);
        continue;
      }
      for (int c = 0; c < opts_.connections_per_server; ++c) {
        auto dc = std::make_unique<DataConn>();
        dc->server = s;
        // Authenticated with the credential the scheduler issued for this worker and
        // server: the server knows it is this rank, and this worker that it is the server.
        dc->link = ConnectSecure(*transport_, servers_[s], w.peer_keys[s], "worker " + std::to_string(rank_),
                                 opts_.rendezvous_timeout, &stopping_, opts_.authenticate_bodies);
        dc->link->set_peer("server " + std::to_string(s) + " at " + servers_[s]);
        // A small kernel send buffer keeps the credit meaningful: otherwise the kernel
        // takes megabytes per socket at once and the partitions' global order and the
        // rank rotation only decide what waits in kernel buffers (emulated 4x4 hosts at
        // 64 MB: 0.83 of the bound with autotuning, 0.89 with 256 KiB, 0.92 with 128 KiB).
        // (auto: the probe runs with kProbeSendBuffer, then MeasureLinks resizes.)
        const int sndbuf = opts_.socket_send_buffer < 0 ? kProbeSendBuffer : opts_.socket_send_buffer;
        if (sndbuf > 0) dc->link->SetSendBuffer(sndbuf);
        conns.push_back(std::move(dc));
      }
    }
    MeasureLinks(conns);
    std::unique_lock<std::mutex> lk(mu_);
    if (stopping_) return;
    policy_ = std::make_unique<SendPolicy>(static_cast<int>(servers_.size()), opts_.priority, credit_);
    conns_ = std::move(conns);
    for (auto& dc : conns_) {
      DataConn* p = dc.get();
      p->sender = StartThread([this, p] { SenderLoop(p); });
      p->receiver = StartThread([this, p] { ReceiverLoop(p); });
    }
    if (UseHierarchy()) StartLocalGroup(w.job_id);
    if (joining_) {
      lk.unlock();
      WaitForAdmission();  // worker_membership.cc
      lk.lock();
      if (stopping_ || failed_) return;
    }
    ready_ = true;
    cv_.notify_all();
  } catch (const Error& e) {
    // A server closing during the connect or the link probe is most often the job
    // failing elsewhere (a worker that already stopped): wait for the scheduler's notice.
    if (joined && e.kind() == Error::kPeer) FailServerLost(-1, e.what());
    else Fail(e.kind(), e.what());
  } catch (const std::exception& e) {
    Fail(Error::kGeneric, e.what());
  }
}

void Worker::MeasureLinks(const std::vector<std::unique_ptr<DataConn>>& conns) {
  // The probe runs only when something is left to the engine: the partition size (the
  // scheduler sizes partitions from the slowest participant's estimate), the credit or
  // the socket send buffer.
  const bool auto_part = opts_.partition_bytes == 0;
  const bool auto_sndbuf = opts_.socket_send_buffer < 0;
  if ((auto_part || opts_.credit_bytes == 0 || auto_sndbuf) && transport_->has_links()) {
    std::vector<Link*> links;
    for (const auto& dc : conns)
      if (links.size() < static_cast<size_t>(dc->server + 1)) links.push_back(dc->link.get());
    for (Link* c : links) c->SetRecvTimeout(opts_.rendezvous_timeout);
    link_ = ProbeLinks(links, kProbeSeconds, kProbeMaxBytes, rank_);
    for (Link* c : links) c->SetRecvTimeout(0);
  }
  const int64_t part = auto_part ? AutoPartitionBytes(link_.bytes_per_s, INT64_MAX / 2,
                                                      static_cast<int>(servers_.size()), 1)
                                 : opts_.partition_bytes;
  credit_ = opts_.credit_bytes > 0 ? opts_.credit_bytes : AutoCreditBytes(part, link_, static_cast<int>(servers_.size()));
  const int peers = std::max(static_cast<int>(servers_.size()), size_.load());
  const int sndbuf = auto_sndbuf ? AutoSocketSendBuffer(link_, peers) : opts_.socket_send_buffer;
  if (auto_sndbuf)
    for (const auto& dc : conns) dc->link->SetSendBuffer(sndbuf);
  const auto* secure = conns.empty() ? nullptr : dynamic_cast<const SecureLink*>(conns[0]->link.get());
  char line[360];
  std::snprintf(line, sizeof line,
                "link to %zu server(s): %.1f MB/s, rtt %.0f us; partitions %s%lld bytes, credit %lld bytes, "
                "socket send buffer %d bytes, body tags %s%s",
                servers_.size(), link_.bytes_per_s / 1e6, link_.rtt_s * 1e6, auto_part ? "up to " : "",
                static_cast<long long>(part), static_cast<long long>(credit_), sndbuf,
                secure ? BodyAuthName(secure->body_auth()) : "none",
                auto_part ? " (auto)" : " (partition_bytes set by the user: auto-tuning of partitions is off)");
  if (rank_ == 0 || !auto_part) LogInfo(line);
  else LogDebug(line);
}

int Worker::CompleteAt(const OpRequest& req) const {
  // Only ops over the whole job as such (participants 0): a caller that names the
  // participants (hierarchical slices) sums and divides by itself, over all of them.
  if (!KOfN() || req.op == Op::kBroadcast || req.participants != 0 || req.sparse_row_width)
    return req.participants ? req.participants : size_.load();
  return opts_.aggregate;
}

bool Worker::WaitReady(double seconds) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, std::chrono::duration<double>(seconds), [&] { return ready_ || failed_; });
  if (failed_) throw Error(fail_kind_, fail_msg_);
  return ready_;
}

void Worker::Declare(const OpRequest& req) {
  std::lock_guard<std::mutex> lk(mu_);
  DeclareLocked(req, 0);
}

std::shared_ptr<TensorDecl> Worker::DeclareLocked(const OpRequest& req, int participants) {
  if (failed_) throw Error(fail_kind_, "the engine failed earlier: " + fail_msg_);
  if (!ready_) throw Error(Error::kGeneric, "the worker is not initialized; call init() first");
  std::string declare;
  const int64_t partition = req.partition_bytes > 0 ? req.partition_bytes : opts_.partition_bytes;
  auto previous = scheduler_lost_.empty() ? nullptr : registry_.Find(req.name);
  // participants 0 = the whole job, however many workers it has when the round runs.
  auto t = registry_.Use(req, participants, partition, link_.bytes_per_s, &declare);
  if (!declare.empty() && !scheduler_lost_.empty()) {
    registry_.Withdraw(t, previous);  // no reply can come: the name keeps what it had
    throw Error(Error::kPeer, SchedulerGoneLocked("declaring tensor '" + req.name + "' (new, or a new shape or dtype)"));
  }
  if (!declare.empty()) control_.Send(MsgType::kDeclare, declare);  // queued, not sent under mu_
  return t;
}

std::shared_ptr<OpHandle> Worker::NewHandleLocked(const OpRequest& req) {
  auto h = std::make_shared<OpHandle>();
  h->id = next_handle_++;
  h->req = req;
  if (trace_) h->enqueued_us = WallMicros();
  handles_[h->id] = h;
  return h;
}

int64_t Worker::Enqueue(const OpRequest& in) {
  // Adapters name broadcast roots by the live numbering (membership()): the same ranks
  // until a worker leaves the job.
  const bool map_root = in.op == Op::kBroadcast && anyone_left_.load();
  OpRequest mapped;
  if (map_root) {
    mapped = in;
    std::lock_guard<std::mutex> lk(mu_);
    mapped.root = RootRankLocked(in.root);
  }
  const OpRequest& req = map_root ? mapped : in;
  CheckRequest(req);
  // Compressed blobs cannot be summed byte-wise in shared memory, so every rank pushes
  // its own to the servers (they decode, sum and re-encode).
  if (group_ && req.op != Op::kBroadcast && req.participants == 0 && req.dtype != DType::kCompressed &&
      !req.sparse_row_width) {
    // Hierarchical: the local group reduces on this host and pushes one slice per rank.
    // The whole tensor is declared with the scheduler first, as on the flat path, so a
    // shape or dtype that differs on any rank of any host fails on every rank (and the
    // job goes on) instead of only on the ranks of one host that notice it.
    std::shared_ptr<OpHandle> h;
    uint64_t ticket;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto t = DeclareLocked(req, 0);
      h = NewHandleLocked(req);
      h->total_parts = h->remaining = 1;
      h->local_group = true;
      h->version = t->next_version++;  // rounds of the timeline
      h->bytes = static_cast<int64_t>(DTypeSize(req.dtype));
      for (int64_t d : req.shape) h->bytes *= d;
      if (!t->declared) {
        t->waiting.push_back(h);
        return h->id;
      }
      ticket = next_group_ticket_++;
    }
    group_->Submit(h->id, req, ticket);
    return h->id;
  }
  if (req.keep_own && req.output != req.input) {
    size_t bytes = DTypeSize(req.dtype);
    for (int64_t d : req.shape) bytes *= static_cast<size_t>(d);
    std::memmove(req.output, req.input, bytes);  // its result: nothing comes back
  }
  std::lock_guard<std::mutex> lk(mu_);
  auto t = DeclareLocked(req, req.participants);
  auto h = NewHandleLocked(req);
  h->version = t->next_version++;
  if (t->declared) ScheduleLocked(h, *t);
  else t->waiting.push_back(h);
  return h->id;
}

int64_t Worker::EnqueueBarrier() {
  std::lock_guard<std::mutex> lk(mu_);
  return EnqueueBarrierLocked(0);
}

int64_t Worker::EnqueueBarrierLocked(int64_t kind) {
  if (failed_) throw Error(fail_kind_, "the engine failed earlier: " + fail_msg_);
  if (!ready_) throw Error(Error::kGeneric, "the worker is not initialized; call init() first");
  if (!scheduler_lost_.empty())
    throw Error(Error::kPeer, SchedulerGoneLocked(kind == kAdmissionBarrier ? "an admission" : "a barrier"));
  OpRequest barrier;
  barrier.name = kind == kAdmissionBarrier ? "<admission>" : "<barrier>";
  auto h = NewHandleLocked(barrier);
  h->enqueued_us = 0;
  h->barrier = true;
  barrier_waiters_.push_back(h);
  control_.Send(MsgType::kBarrier, "", 0, kind);
  return h->id;
}

void Worker::ScheduleLocked(const std::shared_ptr<OpHandle>& h, TensorDecl& t) {
  h->total_parts = h->remaining = static_cast<int>(t.parts.size());
  if (h->req.param != kParamNone) server_held_state_ = true;  // weights or a table: lost with a server
  policy_->AddOp(h, static_cast<uint64_t>(t.id) << kPartBits, h->version, h->req.priority, t.parts, rank_);
  send_cv_.notify_all();
}

void Worker::OnControl(const FrameHeader& h, const std::string& meta) {
  switch (static_cast<MsgType>(h.type)) {
    case MsgType::kDeclareReply:
      return OnDeclareReply(meta);
    case MsgType::kBarrierReply: {
      std::lock_guard<std::mutex> lk(mu_);
      if (barrier_waiters_.empty()) return;
      auto b = barrier_waiters_.front();
      barrier_waiters_.pop_front();
      b->done = true;
      cv_.notify_all();
      return;
    }
    case MsgType::kPeerDead:
      return Fail(Error::kPeer, MetaReader(meta).Str());
    case MsgType::kMembership:
      return OnMembership(meta);
    case MsgType::kServerLost:
      return OnServerLost(meta);
    case MsgType::kError:
      return Fail(Error::kGeneric, "the scheduler reported: " + MetaReader(meta).Str());
    default:
      return;
  }
}

void Worker::OnDeclareReply(const std::string& meta) {
  // Local-group ops are submitted after mu_ is released (the group's thread calls back
  // into Enqueue, which takes mu_), with tickets taken under it: the group keeps their
  // order against ops that Enqueue submits meanwhile.
  std::vector<std::pair<std::shared_ptr<OpHandle>, uint64_t>> to_group;  // with its ticket
  {
    std::lock_guard<std::mutex> lk(mu_);
    std::string error;
    Error::Kind kind = Error::kMismatch;
    auto t = registry_.OnReply(meta, static_cast<int>(servers_.size()), &error, &kind);
    if (!error.empty()) FailWaitingLocked(*t, kind, error);
    for (auto& h : t->waiting) {
      if (h->done) continue;  // failed meanwhile (shutdown, a dead peer)
      if (h->local_group) to_group.emplace_back(h, next_group_ticket_++);
      else ScheduleLocked(h, *t);
    }
    t->waiting.clear();
  }
  for (auto& [h, ticket] : to_group) group_->Submit(h->id, h->req, ticket);
}

void Worker::StartLocalGroup(uint64_t job_id) {
  // Called with mu_ held, before ready_: the layout must be uniform across hosts.
  const int L = opts_.local_size;
  if (size_ % L != 0 || opts_.rank_hint != rank_)
    throw Error(Error::kConfig,
                "hierarchical mode needs DMLC_WORKER_ID on every worker and DMLC_NUM_WORKER divisible by "
                "BYTEPS_LOCAL_SIZE. Received: size=" + std::to_string(size_) + ", local_size=" +
                    std::to_string(L) + ", rank hint=" + std::to_string(opts_.rank_hint));
  LocalGroup::Hooks hooks;
  hooks.enqueue = [this](const OpRequest& r) { return Enqueue(r); };
  hooks.poll = [this](int64_t id, Error::Kind* kind, std::string* err) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = handles_.find(id);
    if (it == handles_.end()) return -1;
    auto h = it->second;
    if (!h->done) return 0;
    handles_.erase(it);
    if (h->error.empty()) return 1;
    *kind = h->kind;
    *err = h->error;
    return -1;
  };
  hooks.complete = [this](int64_t id, Error::Kind kind, const std::string& err, int64_t reduced_us) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = handles_.find(id);
    if (it == handles_.end()) return;
    OpHandle& h = *it->second;
    // Timeline: "push" = the host's reduce and its slice through the servers, "pull" =
    // gathering the whole result.
    h.push_begin_us = h.enqueued_us;
    h.push_end_us = h.pull_begin_us = reduced_us;
    if (err.empty()) CompletePartLocked(it->second);
    else FailHandleLocked(it->second, kind, err);
  };
  LocalGroup::Layout layout{job_id, rank_ / L, size_ / L, opts_.local_rank, L, size_};
  group_ = std::make_unique<LocalGroup>(layout, std::move(hooks), cpus_);
}

void Worker::SenderLoop(DataConn* c) {
  SetupEngineThread("bps-send" + std::to_string(c->server), cpus_);
  struct Exit {  // Shutdown waits (briefly) for the goodbyes, OnServerLost for a lost server's
    Worker* w;
    DataConn* c;
    ~Exit() {
      std::lock_guard<std::mutex> lk(w->mu_);
      ++w->senders_exited_;
      c->sender_done = true;
      w->cv_.notify_all();
    }
  } exit_note{this, c};
  for (;;) {
    SendTask t;
    {
      std::unique_lock<std::mutex> lk(mu_);
      send_cv_.wait(lk, [&] {
        return stopping_ || failed_ || policy_->Ready(c->server) || lost_servers_.count(c->server);
      });
      if (lost_servers_.count(c->server)) return;
      if (stopping_ && !failed_ && opts_.fault_tolerance) {
        lk.unlock();
        return SendGoodbye(c);
      }
      if (stopping_ || failed_) return;
      t = policy_->Pop(c->server);
      send_cv_.notify_all();  // another queue's head may now be the global next
      if (t.recovered) {
        lk.unlock();
        const bool sent = SendRecoveredAnswer(c, t);
        lk.lock();
        policy_->Done(t.len);
        if (!sent) return;
        continue;
      }
      if (t.op->done) {       // its op already failed
        policy_->Done(t.len);
        continue;
      }
      in_flight_[{t.key, t.version}] = t;
      if (trace_ && !t.op->push_begin_us) t.op->push_begin_us = WallMicros();
    }
    const OpRequest& req = t.op->req;
    const bool bcast = req.op == Op::kBroadcast;
    const bool send_body = !req.pull_only && (!bcast || req.root == rank_);
    const bool sparse = req.sparse_row_width > 0;  // one partition: the whole (ids, rows) body
    const char* body = sparse ? static_cast<const char*>(req.input) : static_cast<const char*>(req.input) + t.offset;
    const uint64_t body_len = sparse ? req.sparse_bytes : static_cast<uint64_t>(t.len);
    FrameHeader h;
    h.type = static_cast<uint16_t>(MsgType::kPush);
    h.key = t.key;
    h.version = t.version;
    h.arg = static_cast<int64_t>(body_len);
    h.sender = rank_;
    h.flags = static_cast<uint16_t>((static_cast<int>(req.dtype) << 8) | (bcast ? kFlagBroadcast : 0) |
                                    (send_body ? 0 : kFlagEmpty) | (req.keep_own ? kFlagKeepOwn : 0));
    const uint32_t participants = static_cast<uint32_t>(req.participants ? req.participants : size_.load());
    try {
      MetaWriter meta;
      meta.U32(participants);
      const int complete_at = CompleteAt(req);
      // The server checks every rank names the same root.
      if (bcast || complete_at != static_cast<int>(participants) || req.param || sparse)
        meta.U32(bcast ? static_cast<uint32_t>(req.root) : UINT32_MAX);
      if (complete_at != static_cast<int>(participants) || req.param || sparse)
        meta.U32(static_cast<uint32_t>(complete_at));
      if (req.param == kParamInit)
        meta.U32(kParamInit).Str(opts_.consistency).U32(consistency_.staleness_lr ? 1 : 0).Str(req.server_optimizer);
      if (req.param == kParamUpdate) meta.U32(kParamUpdate).F64(req.lr);
      if (sparse && req.param == kParamNone) meta.U32(kSparseRows).U32(req.sparse_row_width);
      if (sparse && req.param == kRowsPull) {
        meta.U32(kRowsPull).U32(req.sparse_row_width).Str(req.server_optimizer);
        if (req.table_after >= 0) meta.I64(req.table_after);
      }
      if (sparse && req.param == kRowsPush)
        meta.U32(kRowsPush).U32(req.sparse_row_width).Str(req.server_optimizer).F64(req.lr);
      c->link->Send(h, meta.bytes(), send_body ? body : nullptr, send_body ? body_len : 0);
    } catch (const Error& e) {
      if (stopping_) return;
      if (!ServersReplaceable()) return Fail(Error::kPeer, e.what());
      // The receiver waits for the scheduler's word on this server (FailServerLost); if
      // it was lost, this push goes again to the partition's new server.
      std::lock_guard<std::mutex> lk(mu_);
      policy_->Done(t.len);
      send_cv_.notify_all();
      return;
    }
    // Credit returns once the push has left this process, not when the sum comes back:
    // waiting for the round to complete would tie one worker's credit to other workers'
    // progress, and two workers whose credit is full of different partitions would wait
    // for each other forever.
    std::lock_guard<std::mutex> lk(mu_);
    stats_.bytes_pushed += send_body ? static_cast<int64_t>(body_len) : 0;
    policy_->Done(t.len);
    t.op->bytes += t.len;
    if (trace_ && ++t.op->sent == t.op->total_parts) t.op->push_end_us = WallMicros();
    send_cv_.notify_all();
  }
}

void Worker::ReceiverLoop(DataConn* c) {
  SetupEngineThread("bps-recv" + std::to_string(c->server), cpus_);
  struct Exit {  // OnServerLost waits for a lost server's receivers
    Worker* w;
    DataConn* c;
    ~Exit() {
      std::lock_guard<std::mutex> lk(w->mu_);
      c->receiver_done = true;
      w->cv_.notify_all();
    }
  } exit_note{this, c};
  SendTask t;
  bool receiving = false;  // `t` was taken out of in_flight_ and is not complete yet
  auto put_back = [&] {    // a reply cut off: the partition is pushed again if its server is lost
    std::lock_guard<std::mutex> lk(mu_);
    if (receiving && !t.op->done) in_flight_[{t.key, t.version}] = t;
  };
  try {
    FrameHeader h;
    std::string meta;
    while (c->link->RecvFrame(&h, &meta, kMaxBodyLen)) {
      const bool ok = h.type == static_cast<uint16_t>(MsgType::kPullReply);
      if (!ok && h.type != static_cast<uint16_t>(MsgType::kError))
        throw FrameError("unexpected frame type " + std::to_string(h.type) + " from a server");
      bool discard = false;
      {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = in_flight_.find({h.key, h.version});
        if (it == in_flight_.end())
          throw FrameError("reply for a partition that is not in flight (key " + std::to_string(h.key) + ")");
        t = it->second;
        receiving = true;
        in_flight_.erase(it);
        discard = t.op->done;
        if (trace_ && !t.op->pull_begin_us) t.op->pull_begin_us = WallMicros();
      }
      const OpRequest& req = t.op->req;
      const bool sparse = req.sparse_row_width > 0;
      // Sparse answers: merged (id, row)s; a table pull's rows, one per id asked; a table
      // push's acknowledgement, empty or the rows that refresh a prefetch (ids, rows); a
      // prefetch's (ids, rows), at most one per id asked. The adapter checks the ids.
      const uint64_t asked_rows = 4ull * req.sparse_row_width * (req.sparse_bytes / 8);
      const uint64_t row_bytes = SparseRowBytes(req.sparse_row_width);
      const bool prefetch = req.param == kRowsPull && req.table_after >= 0;
      if (ok && (sparse ? (prefetch ? h.body_len % row_bytes != 0 || h.body_len / row_bytes > req.sparse_bytes / 8
                           : req.param == kRowsPull ? h.body_len != asked_rows
                                                    : h.body_len % row_bytes != 0)
                        : req.keep_own ? h.body_len != 0 && h.body_len != static_cast<uint64_t>(t.len)
                                       : h.body_len != static_cast<uint64_t>(t.len)))
        throw FrameError("reply of " + std::to_string(h.body_len) + " bytes for a partition of " +
                         std::to_string(t.len) + (sparse ? " (sparse: not whole rows)" : ""));
      // The answer sums `h.arg` pushes: every participant's, or at least the k of k-of-n.
      const int64_t participants = req.participants ? req.participants : size_.load();
      const int64_t summed = h.arg;
      const int complete_at = CompleteAt(req);
      // A worker left (kFlagReduced): the round sums the pushes it got, at least one.
      const bool reduced = (h.flags & kFlagReduced) && summed >= 1 && participants == size_;
      if (ok && ((summed < complete_at && !reduced) || summed > participants))
        throw FrameError("reply summing " + std::to_string(summed) + " pushes for a round of " +
                         std::to_string(participants) + " participants");
      char* dst = static_cast<char*>(req.output) + t.offset;
      std::string merged;
      if (!ok || discard || req.keep_own) {  // (a kept-own answer has a body only when recovered)
        c->link->DiscardBody(h.body_len);
      } else if (sparse) {
        // The worker keeps the answer, whatever its length, for TakeSparseResult; the
        // adapter checks the ids (sorted, in range) when it unpacks them.
        merged.resize(h.body_len);
        c->link->RecvBody(merged.data(), h.body_len);
      } else if (ServersReplaceable() && req.param == kParamNone) {
        // Kept for a lost server's new one (answer_archive.h), and only then copied out.
        auto kept = archive_.Slot(h.key, h.body_len);
        c->link->RecvBody(kept->bytes.data(), h.body_len);
        kept->version = h.version;
        kept->dtype = req.dtype;
        kept->broadcast = req.op == Op::kBroadcast;
        kept->participants = static_cast<uint32_t>(participants);
        kept->root = kept->broadcast ? static_cast<uint32_t>(req.root) : UINT32_MAX;
        kept->complete_at = static_cast<uint32_t>(complete_at);
        kept->summed = summed;
        kept->flags = h.flags;
        kept->meta = meta;
        std::memcpy(dst, kept->bytes.data(), h.body_len);
        archive_.Keep(std::move(kept));
      } else {
        c->link->RecvBody(dst, h.body_len);
      }
      if (ok && !discard && !sparse && req.op == Op::kAverage) {
        // A k-of-n answer is averaged over the workers it sums (participants 0 = size_).
        DivideInPlace(req.dtype, dst, static_cast<size_t>(t.len) / DTypeSize(req.dtype),
                      summed < participants ? summed : size_.load());
      }
      // k-of-n answers say the newest round the server answered early: how far the
      // other workers are (RoundsBehind).
      int64_t newest = -1;
      if (ok && complete_at < participants) {
        newest = MetaReader(meta).I64();
        if (newest < static_cast<int64_t>(h.version))
          throw FrameError("reply for round " + std::to_string(h.version) + " says round " +
                           std::to_string(newest) + " is the newest answered");
      }
      if (ok && reduced && complete_at == participants && req.param != kParamUpdate && !meta.empty())
        NoteAnsweredMembership(meta);
      int64_t staleness = -1;
      if (ok && req.param == kParamUpdate) {
        staleness = MetaReader(meta).I64();
        if (staleness < 0) throw FrameError("weights answer with staleness " + std::to_string(staleness));
      }
      std::lock_guard<std::mutex> lk(mu_);
      if (sparse && ok && !discard) sparse_results_[t.op->id] = std::move(merged);
      if (staleness >= 0) {
        ++stats_.weight_answers;
        stats_.max_staleness = std::max(stats_.max_staleness, staleness);
      }
      if (newest >= 0) {
        uint64_t& answered = answered_rounds_[static_cast<int64_t>(h.key >> kPartBits)];
        answered = std::max(answered, static_cast<uint64_t>(newest) + 1);
      }
      stats_.bytes_pulled += ok ? static_cast<int64_t>(h.body_len) : 0;
      stats_.late_partitions += ok && (h.flags & kFlagLate) ? 1 : 0;
      ++stats_.partitions;
      if (!ok) FailHandleLocked(t.op, Error::kGeneric, "server: " + MetaReader(meta).Str());
      CompletePartLocked(t.op);
      receiving = false;
      send_cv_.notify_all();
    }
    FailServerLost(c->server, c->link->peer() + " closed the connection (server died?)");
  } catch (const FrameError& e) {
    Fail(Error::kPeer, "malformed frame from " + c->link->peer() + ": " + e.what());
  } catch (const Error& e) {
    put_back();
    FailServerLost(c->server, e.what());
  }
}

void Worker::CompletePartLocked(const std::shared_ptr<OpHandle>& h) {
  if (--h->remaining <= 0 && !h->done) {
    h->done = true;
    if (trace_ && h->enqueued_us && !h->barrier) {
      // A reply can overtake the sender's bookkeeping of its last push (the push is on
      // the wire before the sender re-takes the lock): then the push ended by the time
      // the first reply arrived.
      int64_t push_end = h->push_end_us ? h->push_end_us : h->pull_begin_us;
      trace_records_.push_back(TraceRecord{h->req.name, static_cast<int>(h->req.op), h->version, h->bytes,
                                           h->enqueued_us, h->push_begin_us, push_end,
                                           h->pull_begin_us, WallMicros()});
    }
    cv_.notify_all();
  }
}

void Worker::FailWaitingLocked(TensorDecl& t, Error::Kind kind, const std::string& msg) {
  for (auto& h : t.waiting)
    if (!h->done) FailHandleLocked(h, kind, msg);  // else failed meanwhile (shutdown, a dead peer)
}

void Worker::FailHandleLocked(const std::shared_ptr<OpHandle>& h, Error::Kind kind, const std::string& msg) {
  if (h->error.empty()) {
    h->error = msg;
    h->kind = kind;
  }
  h->done = true;
  cv_.notify_all();
}

void Worker::Fail(Error::Kind kind, const std::string& msg) {
  std::lock_guard<std::mutex> lk(mu_);
  if (failed_) return;
  failed_ = true;
  fail_kind_ = kind;
  fail_msg_ = msg;
  for (auto& [id, h] : handles_)
    if (!h->done) FailHandleLocked(h, kind, msg);
  cv_.notify_all();
  send_cv_.notify_all();
}

int Worker::RunningOpsLocked() const {
  int running = 0;
  for (const auto& [id, h] : handles_) running += !h->done && !h->barrier;
  return running;
}

bool Worker::Poll(int64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = handles_.find(id);
  if (it == handles_.end())
    throw Error(Error::kConfig, "unknown handle " + std::to_string(id) + " (already synchronized?)");
  auto h = it->second;
  if (!h->done) return false;
  handles_.erase(it);
  if (!h->error.empty()) throw Error(h->kind, h->error);
  return true;
}

bool Worker::WaitFor(int64_t id, double seconds) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = handles_.find(id);
  if (it == handles_.end())
    throw Error(Error::kConfig, "unknown handle " + std::to_string(id) + " (already synchronized?)");
  auto h = it->second;
  cv_.wait_for(lk, std::chrono::duration<double>(seconds), [&] { return h->done; });
  if (!h->done) return false;
  handles_.erase(h->id);
  if (!h->error.empty()) throw Error(h->kind, h->error);
  return true;
}

std::string Worker::Describe(int64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = handles_.find(id);
  if (it == handles_.end()) return "unknown handle";
  const OpHandle& h = *it->second;
  if (h.barrier) return "barrier (waiting for every rank to reach it)";
  auto t = registry_.Find(h.req.name);
  bool declared = t && t->declared;
  std::string what = h.req.op == Op::kBroadcast ? "broadcast" : "push_pull";
  if (!declared)
    return what + " of '" + h.req.name + "' is waiting for every rank to declare it (did every rank call it?)";
  return what + " of '" + h.req.name + "' round " + std::to_string(h.version) + ": " +
         std::to_string(h.remaining) + " of " + std::to_string(h.total_parts) +
         " partitions still waiting for other ranks or servers";
}

std::string Worker::TakeSparseResult(int64_t handle) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = sparse_results_.find(handle);
  if (it == sparse_results_.end()) return "";
  std::string out = std::move(it->second);
  sparse_results_.erase(it);
  return out;
}

int64_t Worker::RoundsBehind(const std::string& name) {
  std::lock_guard<std::mutex> lk(mu_);
  auto t = registry_.Find(name);
  if (!t || t->id < 0) return 0;
  auto it = answered_rounds_.find(t->id);
  if (it == answered_rounds_.end() || it->second <= t->next_version) return 0;
  return static_cast<int64_t>(it->second - t->next_version);
}

std::vector<std::array<int64_t, 3>> Worker::Partitions(const std::string& name) {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::array<int64_t, 3>> out;
  auto t = registry_.Find(name);
  if (!t || !t->declared) return out;
  for (const Part& p : t->parts) out.push_back({p.offset, p.len, p.server});
  return out;
}

void Worker::SetTrace(bool on) {
  std::lock_guard<std::mutex> lk(mu_);
  trace_ = on;
}

std::vector<TraceRecord> Worker::DrainTrace() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<TraceRecord> out;
  out.swap(trace_records_);
  return out;
}

WorkerStats Worker::stats() {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

void Worker::Shutdown(const std::string& reason) {
  if (stopping_.exchange(true)) return;
  if (group_) group_->Stop();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (ready_ && !failed_)  // queued: Close() flushes it
      control_.Send(MsgType::kGoodbye, MetaWriter().Str(reason.substr(0, kMaxGoodbyeReason)).bytes());
    for (auto& [id, h] : handles_)
      if (!h->done) FailHandleLocked(h, Error::kShutdown, "the operation was still running when shutdown() was called");
    send_cv_.notify_all();
    cv_.notify_all();
  }
  if (rendezvous_thread_.joinable()) rendezvous_thread_.join();
  if (opts_.fault_tolerance) {  // the senders' goodbyes go out first (a blocked one gets 2 s)
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, std::chrono::seconds(2), [&] { return senders_exited_ >= conns_.size(); });
  }
  for (auto& c : conns_) c->link->Shutdown();
  for (auto& c : conns_) {
    if (c->sender.joinable()) c->sender.join();
    if (c->receiver.joinable()) c->receiver.join();
  }
  control_.Close(/*flush_s=*/2.0);
}

}  // namespace bps
