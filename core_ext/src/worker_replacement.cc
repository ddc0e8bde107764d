// Fault tolerance on a worker when a server is lost (comm.fault_tolerance, several
// servers): the scheduler moved the lost server's partitions to the others (kServerLost).
// Synchronous rounds keep nothing on a server beyond the round, so what it had not
// answered is pushed again to the new servers (the gradients are still in the input
// buffers), and the answers this worker kept (answer_archive.h) go to them too, for the
// workers the lost server had not answered yet. The result equals a run without the loss.
#include <algorithm>
#include <cstring>

#include "worker.h"

namespace bps {

namespace {
constexpr int kPartBits = 20;  // as worker.cc: key = tensor id << 20 | partition index
}  // namespace

bool Worker::ServersReplaceable() const {
  return opts_.fault_tolerance && servers_.size() > 1 && consistency_.mode == ConsistencySpec::kSync && !KOfN();
}

void Worker::OnServerLost(const std::string& meta) {
  // Checked before anything changes: it came off the network.
  MetaReader r(meta);
  const uint32_t lost = r.U32(), count = r.U32();
  if (lost >= servers_.size()) throw FrameError("a lost server " + std::to_string(lost) + " out of range");
  std::map<uint64_t, int> moved_to;  // partition key -> its new server
  for (uint32_t i = 0; i < count; ++i) {
    const int64_t id = r.I64();
    const uint32_t part = r.U32(), to = r.U32();
    if (id < 0 || id >= (int64_t{1} << (64 - kPartBits - 1)) || part >= (1u << kPartBits) || to >= servers_.size() ||
        to == lost)
      throw FrameError("a moved partition (tensor " + std::to_string(id) + ", partition " + std::to_string(part) +
                       ", server " + std::to_string(to) + ") out of range");
    moved_to[(static_cast<uint64_t>(id) << kPartBits) | part] = static_cast<int>(to);
  }
  if (!r.AtEnd()) throw FrameError("trailing bytes after a lost server's moves");
  const std::string who = "server " + std::to_string(lost) + " (" + servers_[lost] + ")";
  auto new_server = [&](int64_t id, size_t part) {
    auto m = moved_to.find((static_cast<uint64_t>(id) << kPartBits) | part);
    return m == moved_to.end() ? -1 : m->second;
  };
  std::vector<DataConn*> dead;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_ || stopping_ || !lost_servers_.insert(static_cast<int>(lost)).second) return;
    if (!policy_)  // still joining: its data links are not up yet, and a link to the lost server fails it
      return registry_.MoveParts(new_server);
    cv_.notify_all();       // a receiver waiting in FailServerLost returns
    send_cv_.notify_all();  // its senders return
    for (auto& dc : conns_)
      if (dc->server == static_cast<int>(lost)) dead.push_back(dc.get());
  }
  if (!ServersReplaceable() || server_held_state_)
    return Fail(Error::kPeer, who + " was lost, and the job cannot go on without it: " +
                                  (server_held_state_ ? std::string("it held weights or embedding rows (comm.consistency "
                                                                    "ssp/async, the parameter-server tables)")
                                                      : "fault tolerance replaces servers only in synchronous "
                                                        "training without k-of-n aggregation"));
  for (DataConn* dc : dead) dc->link->Shutdown();  // a hung server's sender and receiver return too
  int pushed_again = 0, handed_over = 0;
  {
    std::unique_lock<std::mutex> lk(mu_);
    const bool quiet = cv_.wait_for(lk, kServerLossWait, [&] {
      return failed_ || stopping_ ||
             std::all_of(dead.begin(), dead.end(), [](DataConn* dc) { return dc->sender_done && dc->receiver_done; });
    });
    if (failed_ || stopping_) return;
    if (!quiet) {
      lk.unlock();
      return Fail(Error::kPeer, who + " was lost, and its connections did not close within " +
                                    std::to_string(kServerLossWait.count()) + " s");
    }
    {
      registry_.MoveParts(new_server);
      // Everything this worker had for the lost server: queued, or pushed and unanswered.
      std::vector<SendTask> again = policy_->Drain(static_cast<int>(lost));
      for (auto it = in_flight_.begin(); it != in_flight_.end();) {
        if (it->second.server == static_cast<int>(lost)) {
          again.push_back(std::move(it->second));
          it = in_flight_.erase(it);
        } else {
          ++it;
        }
      }
      for (SendTask& t : again) {
        auto m = moved_to.find(t.key);
        if (t.op && t.op->done) continue;  // failed meanwhile
        if (m == moved_to.end()) {  // not in the scheduler's registry (a declaration it replaced)
          if (t.op) FailHandleLocked(t.op, Error::kPeer, who + " was lost and the scheduler did not move partition " +
                                                             std::to_string(t.key) + " of '" + t.op->req.name + "'");
          continue;
        }
        t.server = m->second;
        pushed_again += t.op != nullptr;
        policy_->Requeue(std::move(t));
      }
      for (auto& a : archive_.Take([&](uint64_t key) { return moved_to.count(key) > 0; })) {
        policy_->AddRecovered(a, a->key, a->version, static_cast<int64_t>(a->bytes.size()), moved_to[a->key]);
        ++handed_over;
      }
      send_cv_.notify_all();
    }
  }
  LogWarn(who + " was lost; fault tolerance: its " + std::to_string(moved_to.size()) +
          " partitions moved to the other servers, " + std::to_string(pushed_again) + " pushes go again and " +
          std::to_string(handed_over) + " kept answers go to their new servers");
}

bool Worker::SendRecoveredAnswer(DataConn* c, const SendTask& t) {
  const RetainedAnswer& a = *t.recovered;
  FrameHeader h;
  h.type = static_cast<uint16_t>(MsgType::kPush);
  h.key = a.key;
  h.version = a.version;
  h.arg = static_cast<int64_t>(a.bytes.size());
  h.sender = rank_;
  h.flags = static_cast<uint16_t>((static_cast<int>(a.dtype) << 8) | (a.broadcast ? kFlagBroadcast : 0));
  MetaWriter meta;
  meta.U32(a.participants).U32(a.root).U32(a.complete_at).U32(kRecoveredAnswer);
  meta.I64(a.summed).U32(a.flags).Str(a.meta);
  try {
    c->link->Send(h, meta.bytes(), a.bytes.data(), a.bytes.size());
    return true;
  } catch (const Error&) {
    return false;  // this server's link broke too: its receiver decides (FailServerLost)
  }
}

void Worker::FailServerLost(int server, const std::string& msg) {
  // A server leaves when the scheduler declares another node dead, at about the moment
  // the scheduler's notice reaches this worker's control connection. Give that notice
  // a moment to arrive, so the error names the node that really died. Where servers are
  // replaced, the notice may instead say this one was lost: the scheduler sees a killed
  // server at once, a hung one after its peer timeout.
  {
    std::unique_lock<std::mutex> lk(mu_);
    const bool replaceable = server >= 0 && ServersReplaceable();
    cv_.wait_for(lk, replaceable ? kServerLossWait : std::chrono::seconds(1), [&] {
      return failed_ || stopping_.load() || (replaceable && lost_servers_.count(server));
    });
    if (server >= 0 && lost_servers_.count(server)) return;
  }
  if (stopping_) return;
  std::string why = msg;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!scheduler_lost_.empty())
      why += " (the scheduler is gone too: without it the job cannot go on without a worker that died or left, "
             "and the servers end it; their log names the worker)";
  }
  Fail(Error::kPeer, why);
}

}  // namespace bps
