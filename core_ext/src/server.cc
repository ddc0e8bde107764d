#include "server.h"

#include <algorithm>

#include "affinity.h"

namespace bps {

// One worker's data link: a reader (ServeConnection) and an outbox, so the engine
// threads never block on the network.
struct Server::Conn {
  std::unique_ptr<Link> link;
  std::unique_ptr<Outbox> out;
  int64_t worker_rank = -1;

  void Reply(const FrameHeader& h, std::string meta = "", std::shared_ptr<Buffer> body = nullptr) {
    const uint64_t len = body ? h.body_len : 0;
    const void* data = body ? body->data() : nullptr;
    out->Post(Outbox::Frame{h, std::move(meta), std::move(body), data, len});
  }
  void Close() { out->Close(); }
};

Server::Server(const ServerOptions& opts)
    : opts_(opts), transport_(Transport::Get(opts.transport)), listener_(transport_->Listen(opts.listen_host, 0)) {
  if (opts.engine_threads < 1 || opts.engine_threads > 256)
    throw Error(Error::kConfig, "engine_threads must be in [1, 256]. Received: engine_threads=" +
                                    std::to_string(opts.engine_threads));
  cpus_ = ResolveCpuSpec(opts.numa, 0);
}

Server::~Server() { Stop(); }

void Server::Start() { main_thread_ = std::thread([this] { Run(); }); }

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
        [this](const std::string& why) { Finish(why); }, &stopping_);
    SetLogPrefix("bpstrain server " + std::to_string(w.rank));
    num_workers_ = w.num_workers;
  } catch (const Error& e) {
    failure_kind_ = e.kind();
    Finish(e.what());
    return;
  }
  for (int i = 0; i < opts_.engine_threads; ++i) {
    engines_.push_back(std::make_unique<EngineThread>());
    EngineThread* et = engines_.back().get();
    et->handler = opts_.handler ? opts_.handler(pool_) : std::make_unique<SumHandler>(pool_);
    et->thread = std::thread([this, et, i] { EngineLoop(et, i); });
  }
  accept_thread_ = std::thread([this] { AcceptLoop(); });
}

void Server::OnControl(const FrameHeader& h, const std::string& meta) {
  if (h.type == static_cast<uint16_t>(MsgType::kTerminate)) return Finish("");
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
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lk(mu_);
    conns = conns_;
    threads.swap(conn_threads_);
  }
  for (auto& c : conns) c->Close();
  for (auto& t : threads) t.join();
  for (auto& e : engines_) {
    {
      std::lock_guard<std::mutex> lk(e->mu);
      e->queue.push_back(Task{});  // a task without a connection stops the thread
      e->cv.notify_one();
    }
    e->thread.join();
  }
}

void Server::AcceptLoop() {
  SetupEngineThread("bps-srv-accept", cpus_);
  for (;;) {
    std::unique_ptr<Link> link = listener_->Accept();
    if (!link) return;
    link->set_peer("worker at " + link->peer_host());
    auto conn = std::make_shared<Conn>();
    conn->link = std::move(link);
    conn->out = std::make_unique<Outbox>(conn->link.get());
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) return;
    conns_.push_back(conn);
    conn_threads_.emplace_back([this, conn] { ServeConnection(conn); });
  }
}

void Server::ServeConnection(std::shared_ptr<Conn> conn) {
  SetupEngineThread("bps-srv-recv", cpus_);
  Link& link = *conn->link;
  try {
    link.SetRecvTimeout(10.0);
    FrameHeader h;
    std::string meta;
    if (!link.RecvFrame(&h, &meta, 0)) return conn->Close();
    if (h.type != static_cast<uint16_t>(MsgType::kServerHello))
      throw FrameError("expected a worker hello first, got type " + std::to_string(h.type));
    MetaReader r(meta);
    conn->worker_rank = r.I64();
    if (r.Str() != SecretToken(opts_.secret)) {
      LogWarn("refused a data connection from " + link.peer() + ": wrong or missing cluster secret");
      return conn->Close();
    }
    link.SetRecvTimeout(0);
    while (link.RecvFrame(&h, &meta, kMaxBodyLen)) {
      if (h.type == static_cast<uint16_t>(MsgType::kProbe)) {
        // Link measurement at rendezvous: the body is thrown away, the reply says it came.
        if (h.body_len > kMaxProbeBytes)
          throw FrameError("probe of " + std::to_string(h.body_len) + " bytes exceeds " +
                           std::to_string(kMaxProbeBytes));
        link.DiscardBody(h.body_len);
        FrameHeader reply;
        reply.type = static_cast<uint16_t>(MsgType::kProbeReply);
        reply.key = h.key;
        conn->Reply(reply);
        continue;
      }
      Task t{conn, ParsePush(h, meta)};
      t.push.sender = static_cast<int>(conn->worker_rank);
      if (h.body_len) {
        t.push.body = pool_->Acquire(h.body_len);
        link.RecvBody(t.push.body->data(), h.body_len);
      }
      EngineThread* et = engines_[h.key % engines_.size()].get();
      std::lock_guard<std::mutex> lk(et->mu);
      et->queue.push_back(std::move(t));
      et->cv.notify_one();
    }
  } catch (const FrameError& e) {
    LogWarn("dropping connection from " + link.peer() + ": malformed frame: " + e.what());
  } catch (const std::exception& e) {
    if (!stopping_) LogDebug("connection from " + link.peer() + " ended: " + e.what());
  }
  conn->Close();
}

void Server::EngineLoop(EngineThread* et, int index) {
  SetupEngineThread("bps-srv-eng" + std::to_string(index), cpus_);
  for (;;) {
    Task t;
    {
      std::unique_lock<std::mutex> lk(et->mu);
      et->cv.wait(lk, [&] { return !et->queue.empty(); });
      t = std::move(et->queue.front());
      et->queue.pop_front();
    }
    if (!t.from) return;
    Process(et, t);
  }
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
  if (h.arg < 0 || p.len > kMaxBodyLen || p.len % DTypeSize(p.dtype) != 0 ||
      (empty ? h.body_len != 0 : h.body_len != p.len))
    throw FrameError("push of key " + std::to_string(h.key) + " has inconsistent lengths (arg=" +
                     std::to_string(h.arg) + ", body=" + std::to_string(h.body_len) + ")");
  p.expected = num_workers_;
  if (h.meta_len == 4) p.expected = static_cast<int>(MetaReader(meta).U32());
  if (p.expected < 1 || p.expected > num_workers_)
    throw FrameError("push expects " + std::to_string(p.expected) + " contributions; the job has " +
                     std::to_string(num_workers_) + " workers");
  return p;
}

void Server::Process(EngineThread* et, Task& t) {
  const Push& p = t.push;
  auto reject = [&](const std::string& msg) {
    FrameHeader e;
    e.type = static_cast<uint16_t>(MsgType::kError);
    e.key = p.key;
    e.version = p.version;
    t.from->Reply(e, MetaWriter().Str(msg).bytes());
  };
  auto it = et->rounds.find({p.key, p.version});
  if (it == et->rounds.end()) {
    it = et->rounds.emplace(std::make_pair(p.key, p.version), PendingRound{}).first;
    Round& r = it->second.round;
    r.key = p.key;
    r.version = p.version;
    r.dtype = p.dtype;
    r.len = p.len;
    r.expected = p.expected;
    r.broadcast = p.broadcast;
  }
  PendingRound& pr = it->second;
  Round& r = pr.round;
  if (r.dtype != p.dtype || r.len != p.len || r.expected != p.expected || r.broadcast != p.broadcast)
    return reject("partition " + std::to_string(p.key) + " round " + std::to_string(p.version) +
                  ": this push has dtype " + DTypeName(p.dtype) + " and " + std::to_string(p.len) +
                  " bytes, other workers pushed " + DTypeName(r.dtype) + " and " + std::to_string(r.len));
  if (std::find(pr.waiters.begin(), pr.waiters.end(), t.from) != pr.waiters.end())
    return reject("duplicate push of partition " + std::to_string(p.key) + " round " +
                  std::to_string(p.version) + " from the same worker");
  pr.waiters.push_back(t.from);
  r.senders.push_back(p.sender);
  ++r.pushes;
  std::string error = et->handler->OnPush(r, p);
  if (!error.empty()) {
    pr.waiters.pop_back();
    r.senders.pop_back();
    --r.pushes;
    if (r.pushes == 0) et->rounds.erase(it);
    return reject(error);
  }
  if (!et->handler->Complete(r)) return;

  error = et->handler->OnRoundComplete(r);
  FrameHeader reply;
  reply.type = static_cast<uint16_t>(error.empty() ? MsgType::kPullReply : MsgType::kError);
  reply.key = p.key;
  reply.version = p.version;
  const std::string meta = error.empty() ? "" : MetaWriter().Str(error).bytes();
  for (size_t i = 0; i < pr.waiters.size(); ++i) {
    std::shared_ptr<Buffer> body = error.empty() ? et->handler->OnPull(r, r.senders[i]) : nullptr;
    reply.body_len = body ? r.len : 0;
    pr.waiters[i]->Reply(reply, meta, std::move(body));
  }
  et->rounds.erase(it);
}

}  // namespace bps
