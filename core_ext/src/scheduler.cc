#include "scheduler.h"

#include <algorithm>
#include <cstdio>
#include <random>
#include <set>

#include "auth.h"
#include "tuning.h"

namespace bps {

// A connected node. Frames to it go through its outbox (never sent under mu_); its
// reader thread is ServeConnection.

Scheduler::Scheduler(const SchedulerOptions& opts)
    : opts_(opts), transport_(Transport::Get(opts.transport)), listener_(transport_->Listen(opts.host, opts.port)) {
  std::random_device rd;
  job_id_ = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  if (opts.num_workers < 1 || opts.num_servers < 1 || opts.local_size < 0)
    throw Error(Error::kConfig, "a job needs at least one worker host and one server. Received: workers=" +
                                    std::to_string(opts.num_workers) +
                                    ", servers=" + std::to_string(opts.num_servers) +
                                    ", local_size=" + std::to_string(opts.local_size));
  if (opts.max_workers < 0 || opts.max_workers > kMaxNodes || (opts.max_workers > 0 && !opts.fault_tolerance))
    throw Error(Error::kConfig, "comm.max_workers (more workers joining a running job) needs comm.fault_tolerance "
                                "and at most " + std::to_string(kMaxNodes) + ". Received: max_workers=" +
                                    std::to_string(opts.max_workers));
  server_load_.assign(opts.num_servers, 0);
  server_share_.assign(opts.num_servers, 1.0 / opts.num_servers);
  local_size_ = opts.local_size;
  if (local_size_ > 0) num_workers_ = opts.num_workers * local_size_;
  cluster_key_ = ClusterKey(opts.secret);
  job_key_ = RandomBytes(32);
}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::Start() {
  start_time_ = Clock::now();
  accept_thread_ = StartThread([this] { AcceptLoop(); });
  monitor_thread_ = StartThread([this] { MonitorLoop(); });
}

void Scheduler::Stop() {
  if (stopping_.exchange(true)) return;
  listener_->Close();
  std::vector<std::shared_ptr<Node>> nodes;
  {
    std::lock_guard<std::mutex> lk(mu_);
    nodes = nodes_;
    cv_.notify_all();
  }
  // What was posted last (the failure notice, terminate) still reaches the nodes: one
  // second for all of them together, not one per node.
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  for (auto& n : nodes)
    n->out->Close(std::max(0.0, std::chrono::duration<double>(deadline - Clock::now()).count()));
  if (accept_thread_.joinable()) accept_thread_.join();
  if (monitor_thread_.joinable()) monitor_thread_.join();
  conn_threads_.ShutdownLinks();  // also the connections still in their handshake
  conn_threads_.JoinAll();
}

Scheduler::Stats Scheduler::stats() {
  Stats st;
  st.threads = static_cast<int64_t>(conn_threads_.size());
  st.refused = slots_.refused();
  std::lock_guard<std::mutex> lk(mu_);
  st.nodes = static_cast<int64_t>(nodes_.size());
  return st;
}

bool Scheduler::Wait(double seconds) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, std::chrono::duration<double>(seconds),
               [&] { return finished_ || !failure_.empty(); });
  if (!failure_.empty()) throw Error(failure_kind_, failure_);
  return finished_;
}

void Scheduler::AcceptLoop() {
  RunAcceptLoop(*listener_, slots_, conn_threads_, stopping_,
                [this](std::shared_ptr<Link> link, std::shared_ptr<HandshakeSlots::Slot> slot) {
                  ServeConnection(std::move(link), std::move(slot));
                });
}

void Scheduler::SendError(const std::shared_ptr<Node>& node, const std::string& msg) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(MsgType::kError);
  node->out->Post(h, MetaWriter().Str(msg).bytes());
}

bool Scheduler::Register(const std::shared_ptr<Node>& node) {
  // Still a stranger until registered (there may be no secret): the same bounds as the
  // handshake, for the whole exchange and for the hello's size.
  node->conn->SetDeadline(kHandshakeSeconds);
  FrameHeader h;
  std::string meta;
  if (!node->conn->RecvFrame(&h, &meta, 0, kHandshakeMetaLen)) return false;
  if (h.type != static_cast<uint16_t>(MsgType::kHello))
    throw FrameError("expected a hello frame first, got type " + std::to_string(h.type));
  MetaReader r(meta);
  uint32_t role = r.U32();
  if (role != static_cast<uint32_t>(Role::kServer) && role != static_cast<uint32_t>(Role::kWorker))
    throw FrameError("hello with unknown role " + std::to_string(role));
  node->role = static_cast<Role>(role);
  node->rank_hint = r.I64();
  std::string endpoint = r.Str();
  std::string advertise = r.Str();
  node->pid = r.I64();
  node->hostname = r.Str();
  node->local_size = static_cast<int>(r.U32());
  std::string host_id = r.Str();
  node->host = advertise.empty() ? node->peer_ip : advertise;
  node->host_key = host_id.empty() ? node->host : host_id;
  if (node->role == Role::kServer) {
    try {
      node->endpoint = transport_->CompleteEndpoint(endpoint, node->host);
    } catch (const Error& e) {
      throw FrameError(std::string("server hello with a bad endpoint: ") + e.what());
    }
  }
  node->conn->SetDeadline(0);
  std::lock_guard<std::mutex> lk(mu_);
  if (node->role == Role::kWorker) {
    if (node->local_size < 1 || node->local_size > 4096)
      throw FrameError("hello with local size " + std::to_string(node->local_size));
    if (local_size_ == 0) {  // the first worker tells how many processes each host runs
      local_size_ = node->local_size;
      num_workers_ = opts_.num_workers * local_size_;
    } else if (node->local_size != local_size_) {
      std::string why = "every worker host must run the same number of processes: this job has "
                        "BYTEPS_LOCAL_SIZE=" + std::to_string(local_size_);
      LogWarn("refused a worker from " + node->peer_ip + ": " + why);
      SendError(node, why + ". Received: BYTEPS_LOCAL_SIZE=" + std::to_string(node->local_size));
      return false;
    }
  }
  if (goodbyes_ > 0 || finished_) {
    // This job is ending; the node belongs to the next one (init() after shutdown(),
    // or a restarted server): it reconnects until a launcher has started that one.
    FrameHeader retry;
    retry.type = static_cast<uint16_t>(MsgType::kRetryLater);
    node->out->Post(retry, MetaWriter().Str("the job's workers are shutting down").bytes());
    return false;
  }
  if (rendezvous_done_ && node->role == Role::kWorker && opts_.fault_tolerance && failure_.empty())
    return JoinLaterLocked(node);  // scheduler_membership.cc
  int have = 0;
  for (auto& n : nodes_) have += n->role == node->role;
  int want = WantLocked(node->role);
  std::string dup;
  for (auto& n : nodes_)
    if (n->role == node->role && node->rank_hint >= 0 && n->rank_hint == node->rank_hint)
      dup = n->Describe();
  if (rendezvous_done_ || have >= want || node->rank_hint >= want || !dup.empty()) {
    std::string why = rendezvous_done_ || have >= want
                          ? "the job already has all " + std::to_string(want) + " " + RoleName(node->role) + "s"
                          : !dup.empty() ? "rank " + std::to_string(node->rank_hint) + " is already taken by " + dup
                                         : "rank " + std::to_string(node->rank_hint) + " is out of range [0, " +
                                               std::to_string(want) + ")";
    LogWarn("refused a " + std::string(RoleName(node->role)) + " from " + node->peer_ip + ": " + why);
    SendError(node, why + ". Received: rank=" + std::to_string(node->rank_hint));
    return false;
  }
  node->registered = true;
  node->last_seen = Clock::now();
  nodes_.push_back(node);
  // num_workers_ is 0 until the first worker says how many processes its host runs.
  if (num_workers_ > 0 && static_cast<int>(nodes_.size()) == num_workers_ + opts_.num_servers)
    CompleteRendezvousLocked();
  return true;
}

int Scheduler::WantLocked(Role role) const {
  return role == Role::kServer ? opts_.num_servers : num_workers_;
}

void Scheduler::ComputeSharesLocked() {
  std::vector<std::string> server_hosts(opts_.num_servers);
  std::set<std::string> worker_hosts;
  for (auto& n : nodes_) {
    if (n->role == Role::kServer) server_hosts[n->rank] = n->host_key;
    else worker_hosts.insert(n->host_key);
  }
  server_share_ = MixedShares(server_hosts, worker_hosts, opts_.mixed_mode);
  int colocated = 0;
  double dedicated = 0;
  for (int s = 0; s < opts_.num_servers; ++s) {
    if (worker_hosts.count(server_hosts[s])) ++colocated;
    else dedicated += server_share_[s];
  }
  if (colocated == 0 || worker_hosts.size() <= 1) return;
  char line[200];
  std::snprintf(line, sizeof line,
                "mixed mode%s: %d of %d servers share hosts with workers (%zu worker hosts); "
                "%.3f of the bytes go to the dedicated servers",
                opts_.mixed_mode ? "" : " off (BYTEPS_ENABLE_MIXED_MODE=0)", colocated,
                opts_.num_servers, worker_hosts.size(), dedicated);
  LogInfo(line);
}

void Scheduler::CompleteRendezvousLocked() {
  // Honour requested ranks, then fill the gaps in arrival order.
  for (Role role : {Role::kServer, Role::kWorker}) {
    int want = WantLocked(role);
    std::vector<bool> taken(want, false);
    for (auto& n : nodes_)
      if (n->role == role && n->rank_hint >= 0) taken[n->rank = n->rank_hint] = true;
    int next = 0;
    for (auto& n : nodes_) {
      if (n->role != role || n->rank >= 0) continue;
      while (taken[next]) ++next;
      taken[next] = true;
      n->rank = next;
    }
  }
  server_endpoints_.assign(opts_.num_servers, "");
  for (auto& n : nodes_)
    if (n->role == Role::kServer) server_endpoints_[n->rank] = n->endpoint;
  ComputeSharesLocked();
  for (auto& n : nodes_) {
    FrameHeader h;
    h.type = static_cast<uint16_t>(MsgType::kWelcome);
    n->out->Post(h, WelcomeMetaLocked(*n, 0));  // a lost node: its reader thread reports it
    // Heartbeats start with the welcome: a node that registered long before the last
    // worker (a server, while workers import their framework) has not been silent.
    n->last_seen = Clock::now();
  }
  rendezvous_done_ = true;
  LogInfo("rendezvous complete: " + std::to_string(num_workers_) + " workers, " +
          std::to_string(opts_.num_servers) + " servers");
}

std::string Scheduler::WelcomeMetaLocked(const Node& n, uint32_t flags) const {
  MetaWriter w;
  const bool worker = n.role == Role::kWorker;
  // A scale-up joiner's rank is beyond the job's workers until its admission says more.
  const int workers = worker ? std::max(num_workers_, static_cast<int>(n.rank) + 1) : num_workers_;
  w.I64(n.rank).U32(static_cast<uint32_t>(workers)).U32(opts_.num_servers);
  for (const auto& endpoint : server_endpoints_) w.Str(endpoint);
  w.I64(static_cast<int64_t>(job_id_));
  // Pairwise data-connection credentials: only this worker and that server get
  // HMAC(job key, worker, server), so no other node can act as either on that link. A
  // server gets one for every rank a scale-up may give out.
  const int peers = worker ? opts_.num_servers : MaxWorkersLocked();
  w.U32(static_cast<uint32_t>(peers));
  for (int p = 0; p < peers; ++p)
    w.Str(HmacSha256(job_key_, MetaWriter().Str("data").I64(worker ? n.rank : p).I64(worker ? p : n.rank).bytes()));
  w.U32(flags | (opts_.fault_tolerance ? kWelcomeFaultTolerance : 0));
  w.U32(static_cast<uint32_t>(MaxWorkersLocked()));
  return w.bytes();
}

void Scheduler::ServeConnection(std::shared_ptr<Link> raw, std::shared_ptr<HandshakeSlots::Slot> slot) {
  const std::string from = raw->peer_host();
  std::shared_ptr<Link> link;
  try {
    std::string identity;
    link = SecureAccept(raw, [this](const std::string&, std::string* key) { *key = cluster_key_; return true; },
                        &identity);
  } catch (const FrameError& e) {
    slots_.NoteFailure(from, std::string("malformed frame in the handshake: ") + e.what());
  } catch (const std::exception& e) {
    slots_.NoteFailure(from, e.what());
  }
  if (!link) return;
  auto node = std::make_shared<Node>();
  node->peer_ip = from;
  node->conn = link;
  node->out = std::make_unique<Outbox>(node->conn.get());
  std::string why;
  try {
    const bool registered = Register(node);
    slot.reset();  // a registered node no longer counts against the strangers' limit
    if (!registered) {
      node->out->Close(1.0);  // a refused node still gets the reason it was refused
      return;
    }
    FrameHeader h;
    std::string meta;
    while (node->conn->RecvFrame(&h, &meta, 0)) HandleFrame(node, h, meta);
    why = "closed its connection";
  } catch (const FrameError& e) {
    if (node->registered) LogWarn("dropping connection from " + node->peer_ip + ": malformed frame: " + e.what());
    else slots_.NoteFailure(node->peer_ip, std::string("malformed frame: ") + e.what());
    why = std::string("sent a malformed frame (") + e.what() + ")";
  } catch (const std::exception& e) {
    why = std::string("lost its connection (") + e.what() + ")";
  }
  node->out->Close(node->registered ? 0.0 : 1.0);
  if (node->registered) OnDisconnect(node, why);
}

void Scheduler::HandleFrame(const std::shared_ptr<Node>& node, const FrameHeader& h,
                            const std::string& meta) {
  {
    // A node speaks only for itself: the rank it was given at rendezvous.
    std::lock_guard<std::mutex> lk(mu_);
    if (h.sender != node->rank)
      throw FrameError("a frame claiming to come from rank " + std::to_string(h.sender) + " on the connection of " +
                       node->Describe());
  }
  switch (static_cast<MsgType>(h.type)) {
    case MsgType::kHeartbeat: {
      std::lock_guard<std::mutex> lk(mu_);
      node->last_seen = Clock::now();
      return;
    }
    case MsgType::kDeclare:
      return HandleDeclare(node, meta);
    case MsgType::kBarrier: {
      std::lock_guard<std::mutex> lk(mu_);
      if (h.arg == kAdmissionBarrier) return OnAdmissionBarrierLocked(node);
      if (node->role != Role::kWorker || node->goodbye || node->joining)
        throw FrameError("a barrier from " + node->Describe() + ": only workers in the job take part in barriers");
      barrier_ranks_.push_back(node->rank);
      return TryReleaseBarrierLocked();
    }
    case MsgType::kMembershipAck: {
      std::lock_guard<std::mutex> lk(mu_);
      if (node->role != Role::kServer) throw FrameError("a membership ack from " + node->Describe());
      return OnMembershipAckLocked(node, h.key);
    }
    case MsgType::kGoodbye: {
      // An empty meta (or reason) is a clean shutdown; a reason is the exception that
      // stopped the worker, and the job cannot go on without it.
      std::string reason = meta.empty() ? "" : MetaReader(meta).Str();
      if (reason.size() > kMaxGoodbyeReason) throw FrameError("goodbye with an oversized reason");
      std::lock_guard<std::mutex> lk(mu_);
      if (node->role != Role::kWorker || node->goodbye) return;
      node->goodbye = true;
      if (!reason.empty()) {
        for (char& c : reason)
          if (c == '\n' || c == '\r' || static_cast<unsigned char>(c) < 0x20) c = ' ';  // one log line
        if (opts_.fault_tolerance && failure_.empty()) return DepartLocked(node, "stopped: " + reason);
        return FailLocked(node->Describe() + " stopped: " + reason + "; the job cannot continue");
      }
      ++goodbyes_;
      return TryTerminateLocked();
    }
    default:
      throw FrameError("unexpected frame type " + std::to_string(h.type) + " at the scheduler");
  }
}

void Scheduler::HandleDeclare(const std::shared_ptr<Node>& node, const std::string& meta) {
  MetaReader r(meta);
  std::string name = r.Str();
  Declaration d;
  d.dtype = static_cast<int>(r.U32());
  d.shape = r.I64Vec();
  d.partition_bytes = r.I64();
  d.participants = static_cast<int>(r.U32());
  d.link_bytes_per_s = r.I64();
  d.device = r.Str();
  d.layout = r.Str();
  if (!ValidDType(d.dtype) || d.partition_bytes < 0 || d.participants < 0 || d.participants > num_workers_ ||
      d.link_bytes_per_s < 0 || d.device.size() > 64 || d.layout.size() > 256)
    throw FrameError("declare with bad dtype/partition/participants/link/device/layout");
  for (int64_t dim : d.shape)
    if (dim < 0) throw FrameError("declare with a negative dimension");
  std::lock_guard<std::mutex> lk(mu_);
  if (node->role != Role::kWorker) throw FrameError("declare from a non-worker");
  auto reg = registry_.find(name);
  if (rejoined_.count(node->rank) && reg != registry_.end() && reg->second.decl == d && !pending_decls_.count(name)) {
    // A worker that joined later declares what the others declared before it: answered
    // alone, with the job's partition table (fault tolerance).
    FrameHeader h;
    h.type = static_cast<uint16_t>(MsgType::kDeclareReply);
    node->out->Post(h, MetaWriter().Str(name).U32(0).bytes() + reg->second.placement);
    return;
  }
  pending_decls_[name][node->rank].push_back(d);
  TryCompleteDeclarationLocked(name);
}

void Scheduler::TryCompleteDeclarationLocked(const std::string& name) {
  auto pit = pending_decls_.find(name);
  if (pit == pending_decls_.end()) return;
  auto& pend = pit->second;
  if (pend.empty()) {
    pending_decls_.erase(pit);
    return;
  }
  // Every worker of the job declares a whole-job tensor (participants 0: as many as the
  // job has, which fault tolerance changes): every worker still in it.
  const int participants = pend.begin()->second.front().participants;
  const int needed = participants == 0 || participants >= num_workers_ ? LiveWorkersLocked() : participants;
  if (static_cast<int>(pend.size()) < needed) return;

  // Every rank has declared `name`: compare their oldest declarations with each other.
  std::map<int64_t, Declaration> decls;
  for (auto it = pend.begin(); it != pend.end();) {
    decls[it->first] = it->second.front();
    it->second.pop_front();
    it = it->second.empty() ? pend.erase(it) : std::next(it);
  }
  if (pend.empty()) pending_decls_.erase(pit);
  auto describe = [](const Declaration& x) {
    std::string s = std::string("dtype=") + DTypeName(static_cast<DType>(x.dtype)) + " shape=" + ShapeString(x.shape);
    if (x.device != "cpu") s += " device=" + x.device;
    if (!x.layout.empty()) s += " layout=" + x.layout;
    return s;
  };
  std::string error;
  const Declaration* ref = &decls.begin()->second;
  int64_t ref_rank = decls.begin()->first;
  for (auto& [rank, decl] : decls) {
    if (decl == *ref) continue;
    error = "tensor '" + name + "' disagrees across ranks: rank " + std::to_string(ref_rank) + " has " +
            describe(*ref) + " but rank " + std::to_string(rank) + " has " + describe(decl);
    if (decl.device != ref->device) error += " (device " + ref->device + " vs " + decl.device + ")";
    if (decl.layout != ref->layout) error += " (layout '" + ref->layout + "' vs '" + decl.layout + "')";
    if (decl.partition_bytes != ref->partition_bytes)
      error += " (partition_bytes " + std::to_string(ref->partition_bytes) + " vs " +
               std::to_string(decl.partition_bytes) + ")";
    break;
  }
  MetaWriter w;
  w.Str(name);
  if (!error.empty()) {
    w.U32(1).Str(error + ". Use the same shape, dtype and device on every rank (or another name).");
  } else {
    auto reg = registry_.find(name);
    if (reg == registry_.end() || !(reg->second.decl == *ref)) {
      // First declaration, or every rank now declares the name with another shape: a
      // new tensor (new keys), placed afresh.
      Declaration placed = *ref;  // an auto partition size follows the slowest link
      for (auto& [rank, decl] : decls)
        if (decl.link_bytes_per_s > 0 && (placed.link_bytes_per_s == 0 || decl.link_bytes_per_s < placed.link_bytes_per_s))
          placed.link_bytes_per_s = decl.link_bytes_per_s;
      std::string place_error;
      std::string placement = PlaceLocked(next_tensor_id_, placed, &place_error);
      if (placement.empty()) {
        w.U32(2).Str("tensor '" + name + "': " + place_error);
        return SendToWorkersLocked(MsgType::kDeclareReply, w.bytes(), &decls);
      }
      if (reg != registry_.end()) ReleaseLocked(reg->second.placement);
      registry_[name] = Tensor{next_tensor_id_, *ref, std::move(placement)};
      reg = registry_.find(name);
      ++next_tensor_id_;
    }
    w.U32(0);
    return SendToWorkersLocked(MsgType::kDeclareReply, w.bytes() + reg->second.placement, &decls);
  }
  SendToWorkersLocked(MsgType::kDeclareReply, w.bytes(), &decls);
}

void Scheduler::SendToWorkersLocked(MsgType type, const std::string& meta,
                                    const std::map<int64_t, Declaration>* only, int64_t arg) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(type);
  h.arg = arg;
  for (auto& n : nodes_)
    if (n->role == Role::kWorker && !n->goodbye && (!only || only->count(n->rank))) n->out->Post(h, meta);
}

void Scheduler::ReleaseLocked(const std::string& placement) {
  MetaReader r(placement);
  r.I64();
  uint32_t n = r.U32();
  for (uint32_t p = 0; p < n; ++p) {
    r.I64();
    int64_t len = r.I64();
    uint32_t server = r.U32();
    server_load_[server] -= std::max<int64_t>(len, 1);
  }
}

std::string Scheduler::PlaceLocked(int64_t id, const Declaration& d, std::string* error) {
  int64_t elems = 1;
  for (int64_t s : d.shape) elems *= s;
  const int64_t esize = static_cast<int64_t>(DTypeSize(static_cast<DType>(d.dtype)));
  const int64_t total = elems * esize;
  // Partitions hold whole elements; an empty tensor still gets one (empty) partition so
  // the round structure stays the same.
  int64_t part = d.partition_bytes > 0
                     ? std::max<int64_t>(esize, d.partition_bytes / esize * esize)
                     : AutoPartitionBytes(static_cast<double>(d.link_bytes_per_s), total, LiveServersLocked(), esize);
  int64_t nparts = std::max<int64_t>(1, (total + part - 1) / part);
  if (nparts > kMaxPartitions) {
    *error = std::to_string(total) + " bytes in partitions of " + std::to_string(part) + " bytes make " +
             std::to_string(nparts) + " partitions, more than the " + std::to_string(kMaxPartitions) +
             " one tensor may have: raise partition_bytes (BPSTRAIN_PARTITION_BYTES) to at least " +
             std::to_string((total + kMaxPartitions - 1) / kMaxPartitions) + ", or 0 for automatic";
    return "";
  }
  MetaWriter w;
  w.I64(id).U32(static_cast<uint32_t>(nparts));
  for (int64_t p = 0; p < nparts; ++p) {
    int64_t off = p * part, len = std::min(part, total - off);
    // Byte-balanced placement (equal shares, or mixed mode's).
    w.I64(off).I64(len).U32(static_cast<uint32_t>(PickServerLocked(len)));
  }
  return w.bytes();
}

int Scheduler::PickServerLocked(int64_t len) {
  int server = 0;
  double best = 0;
  for (int s = 0; s < opts_.num_servers; ++s) {
    if (server_share_[s] <= 0) continue;
    double fill = static_cast<double>(server_load_[s] + std::max<int64_t>(len, 1)) / server_share_[s];
    if (best == 0 || fill < best) best = fill, server = s;
  }
  server_load_[server] += std::max<int64_t>(len, 1);
  return server;
}

void Scheduler::OnDisconnect(const std::shared_ptr<Node>& node, const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopping_ || finished_) return;
  if (node->role == Role::kWorker && node->goodbye) return;
  if (node->joining) return ForgetJoinerLocked(node, why);
  if (!rendezvous_done_) {  // not part of a job yet: forget it, a replacement may come
    nodes_.erase(std::remove(nodes_.begin(), nodes_.end(), node), nodes_.end());
    LogWarn(node->Describe() + " left before the rendezvous completed");
    return;
  }
  if (node->role == Role::kServer && node->goodbye) return;  // lost already (hung, then closed)
  if (opts_.fault_tolerance && failure_.empty())
    return node->role == Role::kWorker ? DepartLocked(node, why) : ServerLostLocked(node, why);
  FailLocked(node->Describe() + " " + why + "; the job cannot continue");
}

void Scheduler::TryReleaseBarrierLocked() {
  if (barrier_ranks_.empty() || static_cast<int>(barrier_ranks_.size()) < LiveWorkersLocked()) return;
  barrier_ranks_.clear();
  SendToWorkersLocked(MsgType::kBarrierReply);
}

void Scheduler::TryTerminateLocked() {
  if (finished_ || goodbyes_ == 0 || goodbyes_ < LiveWorkersLocked()) return;
  // Nobody joins a job that ended: stop listening before the servers hear of the end,
  // because under the launcher they connect again at once for the next job. One that
  // reached this listener while Stop() destroyed it crashed UCX 1.13 (its TCP connection
  // manager keeps a connection that arrived before the destroy and, when the client's
  // request comes in, calls back into the freed listener: a SIGSEGV in
  // ucp_cm_server_conn_request_cb). Refused now, it retries and finds the next job's.
  listener_->Close();
  FrameHeader r;
  r.type = static_cast<uint16_t>(MsgType::kTerminate);
  for (auto& n : nodes_)
    if (n->role == Role::kServer && !n->goodbye) n->out->Post(r);
  finished_ = true;
  cv_.notify_all();
}

void Scheduler::FailLocked(const std::string& msg) {
  if (!failure_.empty()) return;
  LogWarn(msg);
  failure_ = msg;
  FrameHeader h;
  h.type = static_cast<uint16_t>(MsgType::kPeerDead);
  std::string meta = MetaWriter().Str(msg).bytes();
  // Workers first: a server exits on this notice and closes its data connections, and
  // a worker should learn the real cause before it sees those close.
  for (Role role : {Role::kWorker, Role::kServer})
    for (auto& n : nodes_)
      if (n->role == role) n->out->Post(h, meta);
  cv_.notify_all();
}

void Scheduler::MonitorLoop() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stopping_ && !finished_ && failure_.empty()) {
    cv_.wait_for(lk, std::chrono::milliseconds(200));
    if (stopping_) return;
    if (!rendezvous_done_) {
      if (SecondsSince(start_time_) > opts_.rendezvous_timeout) {
        int w = 0, s = 0;
        for (auto& n : nodes_) (n->role == Role::kWorker ? w : s)++;
        failure_kind_ = Error::kTimeout;
        FailLocked("rendezvous timed out after " + std::to_string(static_cast<int>(opts_.rendezvous_timeout)) +
                   " s: " + std::to_string(w) + "/" +
                   (num_workers_ ? std::to_string(num_workers_)
                                 : std::to_string(opts_.num_workers) + " hosts x BYTEPS_LOCAL_SIZE") +
                   " workers and " +
                   std::to_string(s) + "/" + std::to_string(opts_.num_servers) + " servers joined");
      }
      continue;
    }
    // A copy: a departure can admit a waiting joiner, and a join or a forgotten joiner
    // takes nodes out of nodes_ (iterating nodes_ itself crashed there).
    const std::vector<std::shared_ptr<Node>> snapshot = nodes_;
    for (auto& n : snapshot) {
      if (n->goodbye) continue;
      double silent = SecondsSince(n->last_seen);
      if (silent > opts_.peer_timeout) {
        const std::string why = "sent no heartbeat for " + std::to_string(silent).substr(0, 4) +
                                " s (hung or unreachable)";
        if (n->joining) {
          ForgetJoinerLocked(n, why);
          continue;
        }
        if (opts_.fault_tolerance) {
          if (n->role == Role::kWorker) DepartLocked(n, why);
          else ServerLostLocked(n, why);
          if (!failure_.empty()) break;
          continue;
        }
        FailLocked(n->Describe() + " " + why + "; the job cannot continue");
        break;
      }
    }
  }
}

}  // namespace bps
