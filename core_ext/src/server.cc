#include "server.h"

#include <algorithm>

#include "affinity.h"
#include "reduce.h"

namespace bps {

namespace {
struct OutFrame {
  FrameHeader h;
  std::string meta;
  std::shared_ptr<Buffer> body;
};
}  // namespace

// One worker's data connection: a reader (ServeConnection) and a writer thread, so the
// engine threads never block on the network.
struct Server::Conn {
  std::unique_ptr<Connection> link;
  int64_t worker_rank = -1;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<OutFrame> out;
  bool closed = false;
  std::thread writer;

  void Enqueue(OutFrame f) {
    std::lock_guard<std::mutex> lk(mu);
    if (closed) return;
    out.push_back(std::move(f));
    cv.notify_one();
  }
  void WriterLoop() {
    for (;;) {
      OutFrame f;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return closed || !out.empty(); });
        if (out.empty()) return;
        f = std::move(out.front());
        out.pop_front();
      }
      try {
        link->Send(f.h, f.meta, f.body ? f.body->data() : nullptr, f.body ? f.h.body_len : 0);
      } catch (const std::exception&) {
        link->Shutdown();  // the reader notices and ends this connection
        return;
      }
    }
  }
  void Close() {
    {
      std::lock_guard<std::mutex> lk(mu);
      closed = true;
      cv.notify_all();
    }
    link->Shutdown();
  }
};

Server::Server(const ServerOptions& opts) : opts_(opts), listener_(opts.listen_host, 0) {
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
    me.listen_port = listener_.port();
    me.advertise_host = opts_.advertise_host;
    me.secret = opts_.secret;
    me.host_id = opts_.host_id;
    Welcome w = control_.Connect(
        opts_.scheduler_host, opts_.scheduler_port, me, opts_.rendezvous_timeout,
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
  listener_.Close();
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
  for (auto& c : conns)
    if (c->writer.joinable()) c->writer.join();
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
    std::string ip;
    int fd = listener_.Accept(&ip);
    if (fd < 0) return;
    auto conn = std::make_shared<Conn>();
    conn->link = std::make_unique<Connection>(fd, "worker at " + ip);
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) return;
    conns_.push_back(conn);
    conn_threads_.emplace_back([this, conn] { ServeConnection(conn); });
  }
}

void Server::ServeConnection(std::shared_ptr<Conn> conn) {
  SetupEngineThread("bps-srv-recv", cpus_);
  Connection& link = *conn->link;
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
    conn->writer = std::thread([conn] { conn->WriterLoop(); });
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
        conn->Enqueue(OutFrame{reply, "", nullptr});
        continue;
      }
      if (h.type != static_cast<uint16_t>(MsgType::kPush))
        throw FrameError("unexpected frame type " + std::to_string(h.type) + " on a data connection");
      const int dtype = h.flags >> 8;
      const uint64_t len = static_cast<uint64_t>(h.arg);
      const bool empty = h.flags & kFlagEmpty;
      if (!ValidDType(dtype)) throw FrameError("push with unknown dtype " + std::to_string(dtype));
      if (h.arg < 0 || len > kMaxBodyLen || len % DTypeSize(static_cast<DType>(dtype)) != 0 ||
          (empty ? h.body_len != 0 : h.body_len != len))
        throw FrameError("push of key " + std::to_string(h.key) + " has inconsistent lengths (arg=" +
                         std::to_string(h.arg) + ", body=" + std::to_string(h.body_len) + ")");
      int expected = num_workers_;
      if (h.meta_len == 4) expected = static_cast<int>(MetaReader(meta).U32());
      if (expected < 1 || expected > num_workers_)
        throw FrameError("push expects " + std::to_string(expected) + " contributions; the job has " +
                         std::to_string(num_workers_) + " workers");
      Task t{conn, h, nullptr, expected};
      if (!empty) {
        t.body = pool_->Acquire(len);
        link.RecvBody(t.body->data(), len);
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

void Server::Process(EngineThread* et, Task& t) {
  const FrameHeader& h = t.h;
  const DType dtype = static_cast<DType>(h.flags >> 8);
  const uint64_t len = static_cast<uint64_t>(h.arg);
  const size_t n = len / DTypeSize(dtype);
  const bool broadcast = h.flags & kFlagBroadcast;
  auto reject = [&](const std::string& msg) {
    FrameHeader e;
    e.type = static_cast<uint16_t>(MsgType::kError);
    e.key = h.key;
    e.version = h.version;
    t.from->Enqueue(OutFrame{e, MetaWriter().Str(msg).bytes(), nullptr});
  };
  Round& r = et->rounds[{h.key, h.version}];
  if (r.pushes == 0) {
    r.dtype = dtype;
    r.len = len;
    r.expected = t.expected;
  } else if (r.dtype != dtype || r.len != len || r.expected != t.expected) {
    return reject("partition " + std::to_string(h.key) + " round " + std::to_string(h.version) +
                  ": this push has dtype " + DTypeName(dtype) + " and " + std::to_string(len) +
                  " bytes, other workers pushed " + DTypeName(r.dtype) + " and " + std::to_string(r.len));
  }
  if (std::find(r.waiters.begin(), r.waiters.end(), t.from) != r.waiters.end())
    return reject("duplicate push of partition " + std::to_string(h.key) + " round " +
                  std::to_string(h.version) + " from the same worker");
  r.waiters.push_back(t.from);
  ++r.pushes;
  if (broadcast) {
    if (t.body) r.root_data = t.body;
  } else if (t.body) {
    if (AccumulatesInFloat(dtype)) {
      if (!r.acc) {
        r.acc = pool_->Acquire(n * sizeof(float));
        Widen(dtype, reinterpret_cast<float*>(r.acc->data()), t.body->data(), n);
      } else {
        Accumulate(dtype, reinterpret_cast<float*>(r.acc->data()), t.body->data(), n);
      }
    } else if (!r.acc) {
      r.acc = t.body;  // the first push becomes the accumulator: no copy
    } else {
      SumInto(dtype, r.acc->data(), t.body->data(), n);
    }
  }
  if (r.pushes < r.expected) return;

  std::shared_ptr<Buffer> result;
  std::string error;
  if (broadcast) {
    result = r.root_data;
    if (!result && len) error = "broadcast round without a root payload";
  } else if (AccumulatesInFloat(dtype) && r.acc) {
    result = pool_->Acquire(len);
    Narrow(dtype, result->data(), reinterpret_cast<float*>(r.acc->data()), n);
  } else {
    result = r.acc;
  }
  FrameHeader reply;
  reply.type = static_cast<uint16_t>(error.empty() ? MsgType::kPullReply : MsgType::kError);
  reply.key = h.key;
  reply.version = h.version;
  reply.body_len = error.empty() && result ? len : 0;
  std::string meta = error.empty() ? "" : MetaWriter().Str(error).bytes();
  for (auto& w : r.waiters) w->Enqueue(OutFrame{reply, meta, error.empty() ? result : nullptr});
  et->rounds.erase({h.key, h.version});
}

}  // namespace bps
