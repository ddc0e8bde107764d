#include "control.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "secure_link.h"

namespace bps {

const char* RoleName(Role r) {
  switch (r) {
    case Role::kScheduler: return "scheduler";
    case Role::kServer: return "server";
    default: return "worker";
  }
}

bool ControlClient::Hello(Transport& transport, const std::string& endpoint, const NodeInfo& me,
                          Clock::time_point start, double timeout_s, const std::atomic<bool>* cancel,
                          FrameHeader* r, std::string* meta) {
  const double left = std::max(0.1, timeout_s - SecondsSince(start));
  conn_ = ConnectSecure(transport, endpoint, ClusterKey(me.secret), RoleName(me.role), left, cancel);
  conn_->set_peer("scheduler " + endpoint);
  char hostname[256] = {0};
  gethostname(hostname, sizeof hostname - 1);
  MetaWriter w;
  w.U32(static_cast<uint32_t>(me.role)).I64(me.rank_hint).Str(me.listen_endpoint);
  w.Str(me.advertise_host).I64(getpid()).Str(hostname);
  w.U32(static_cast<uint32_t>(me.local_size)).Str(me.host_id);
  FrameHeader h;
  h.type = static_cast<uint16_t>(MsgType::kHello);
  conn_->Send(h, w.bytes());

  // Wait for kWelcome in short slices so `cancel` (Ctrl-C, shutdown) is honoured.
  conn_->SetRecvTimeout(0.2);
  for (;;) {
    try {
      if (!conn_->RecvFrame(r, meta, 0)) {
        // A scheduler that is ending (the previous job of a launcher that serves job
        // after job) may close without a word; a refusal always comes as kError first.
        if (SecondsSince(start) > timeout_s)
          throw Error(Error::kPeer, "the scheduler closed the connection during rendezvous");
        return false;  // reconnect, as for kRetryLater
      }
      break;
    } catch (const Error& e) {
      if (e.kind() != Error::kTimeout) throw;
      if (cancel && cancel->load()) throw Error(Error::kShutdown, "rendezvous cancelled");
      if (SecondsSince(start) > timeout_s)
        throw Error(Error::kTimeout,
                    "rendezvous did not complete within " + std::to_string(static_cast<int>(timeout_s)) +
                        " s: the scheduler is up but not every worker/server has joined (check "
                        "DMLC_NUM_WORKER / DMLC_NUM_SERVER and that every process was started)");
    } catch (const FrameError& e) {
      throw Error(Error::kPeer, std::string("malformed frame from the scheduler: ") + e.what());
    }
  }
  if (r->type != static_cast<uint16_t>(MsgType::kRetryLater)) return true;
  if (SecondsSince(start) > timeout_s)
    throw Error(Error::kTimeout, "rendezvous did not complete within " +
                                     std::to_string(static_cast<int>(timeout_s)) +
                                     " s: the scheduler still serves the previous job, whose "
                                     "workers are shutting down");
  return false;
}

Welcome ControlClient::Connect(Transport& transport, const std::string& endpoint, const NodeInfo& me,
                               double timeout_s, Handler on_frame, LostHandler on_lost,
                               const std::atomic<bool>* cancel) {
  auto start = Clock::now();
  FrameHeader r;
  std::string meta;
  // A job that is ending (some workers shut down, the rest about to) answers
  // kRetryLater: a process that called init() again after shutdown() joins the next
  // generation of the job, which its launcher starts once this one is over.
  while (!Hello(transport, endpoint, me, start, timeout_s, cancel, &r, &meta)) {
    conn_.reset();
    for (int i = 0; i < 5; ++i) {
      if (cancel && cancel->load()) throw Error(Error::kShutdown, "rendezvous cancelled");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  conn_->SetRecvTimeout(0);
  MetaReader rd(meta);
  if (r.type == static_cast<uint16_t>(MsgType::kError))
    throw Error(Error::kConfig, "the scheduler refused this node: " + rd.Str());
  if (r.type == static_cast<uint16_t>(MsgType::kPeerDead))
    throw Error(Error::kPeer, "the job failed during rendezvous: " + rd.Str());
  if (r.type != static_cast<uint16_t>(MsgType::kWelcome))
    throw Error(Error::kPeer, "unexpected frame type " + std::to_string(r.type) + " during rendezvous");
  Welcome wel;
  try {
    wel.rank = rd.I64();
    const uint32_t workers = rd.U32(), servers = rd.U32();
    if (workers < 1 || servers < 1 || workers > kMaxNodes || servers > kMaxNodes)
      throw FrameError("a job of " + std::to_string(workers) + " workers and " + std::to_string(servers) + " servers");
    wel.num_workers = static_cast<int>(workers);
    wel.num_servers = static_cast<int>(servers);
    if (wel.rank < 0 || wel.rank >= (me.role == Role::kWorker ? wel.num_workers : wel.num_servers))
      throw FrameError("assigned rank " + std::to_string(wel.rank) + " is out of range");
    for (int i = 0; i < wel.num_servers; ++i) wel.servers.push_back(rd.Str());
    wel.job_id = static_cast<uint64_t>(rd.I64());
    const uint32_t keys = rd.U32();
    if (keys > kMaxNodes) throw FrameError("a welcome with " + std::to_string(keys) + " credentials");
    for (uint32_t i = 0; i < keys; ++i) {
      wel.peer_keys.push_back(rd.Str());
      if (wel.peer_keys.back().size() != 32) throw FrameError("a data-connection credential is not 32 bytes");
    }
    const uint32_t flags = rd.AtEnd() ? 0 : rd.U32();
    if (flags & ~(kWelcomeFaultTolerance | kWelcomeJoining))
      throw FrameError("unknown welcome flags " + std::to_string(flags));
    const uint32_t most = rd.AtEnd() ? workers : rd.U32();
    if (most < workers || most > kMaxNodes || (most > workers && !(flags & kWelcomeFaultTolerance)))
      throw FrameError("a job of at most " + std::to_string(most) + " workers with " + std::to_string(workers));
    wel.max_workers = static_cast<int>(most);
    if (!rd.AtEnd()) throw FrameError("trailing bytes after the welcome");
    const int64_t peers = me.role == Role::kWorker ? wel.num_servers : wel.max_workers;
    if (keys != peers) throw FrameError("the welcome's credentials do not match the job's size");
    wel.fault_tolerance = (flags & kWelcomeFaultTolerance) != 0;
    wel.joining = (flags & kWelcomeJoining) != 0;
    if (wel.joining && (me.role != Role::kWorker || !wel.fault_tolerance))
      throw FrameError("a join without fault tolerance, or for a server");
  } catch (const FrameError& e) {
    throw Error(Error::kPeer, std::string("malformed welcome from the scheduler: ") + e.what());
  }
  my_rank_ = wel.rank;
  outbox_ = std::make_unique<Outbox>(conn_.get());
  on_frame_ = std::move(on_frame);
  on_lost_ = std::move(on_lost);
  reader_ = StartThread([this] { ReadLoop(); });
  heartbeat_ = StartThread([this] { HeartbeatLoop(); });
  return wel;
}

void ControlClient::Send(MsgType type, const std::string& meta, uint64_t key, int64_t arg) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(type);
  h.key = key;
  h.arg = arg;
  h.sender = static_cast<int32_t>(my_rank_);
  if (!outbox_) throw Error(Error::kGeneric, "the control connection is not open");
  outbox_->Post(h, meta);
}

void ControlClient::ReadLoop() {
  std::string reason;
  try {
    FrameHeader h;
    std::string meta;
    while (conn_->RecvFrame(&h, &meta, 0)) on_frame_(h, meta);
    reason = "the scheduler closed the control connection";
  } catch (const std::exception& e) {
    reason = std::string("control connection to the scheduler failed: ") + e.what();
  }
  if (!closing_.load() && on_lost_) on_lost_(reason);
}

void ControlClient::HeartbeatLoop() {
  std::unique_lock<std::mutex> lk(hb_mu_);
  while (!closing_.load()) {
    // Four a second: a scheduler with a short peer timeout (comm.timeout of a few seconds,
    // for fault tolerance) does not mistake a busy node for a hung one.
    hb_cv_.wait_for(lk, std::chrono::milliseconds(250));
    if (closing_.load()) break;
    if (outbox_->broken()) break;  // the reader reports the loss
    Send(MsgType::kHeartbeat);
  }
}

void ControlClient::Close(double flush_s) {
  if (closing_.exchange(true)) return;
  hb_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  if (outbox_) outbox_->Close(flush_s);
  if (conn_) conn_->Shutdown();
  if (reader_.joinable()) {
    if (reader_.get_id() == std::this_thread::get_id()) reader_.detach();
    else reader_.join();
  }
}

}  // namespace bps
