// Fault tolerance on a worker (comm.fault_tolerance): the scheduler's kMembership says
// which workers left; the servers answer rounds without them (kFlagReduced answers are
// averaged over the pushes they sum), and the adapters number the workers still in the
// job 0..live_size-1 (membership()).
#include <algorithm>

#include "worker.h"

namespace bps {

void Worker::OnMembership(const std::string& meta) {
  MembershipNotice notice = ParseMembershipNotice(meta, max_workers_);
  const int64_t epoch = notice.epoch;
  bool me = false, join = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (epoch <= membership_epoch_) return;
    if (notice.size < size_)
      throw FrameError("a membership notice of " + std::to_string(notice.size) + " workers after one of " +
                       std::to_string(size_.load()) + " (a job only grows)");
    membership_epoch_ = epoch;
    // The ranks this admission let in (replacements and scale-up's new ranks), the same
    // list on every rank, the joiners' own included.
    std::vector<int64_t> joined = notice.joined;
    size_ = notice.size;
    me = std::binary_search(notice.departed.begin(), notice.departed.end(), static_cast<int64_t>(rank_));
    if (joining_ && !me) {  // this worker's own admission: it hears of no membership before
      if (!std::binary_search(joined.begin(), joined.end(), static_cast<int64_t>(rank_)))
        throw FrameError("the membership that admits worker " + std::to_string(rank_) + " does not name it");
      joining_ = false;
      admitted_late_ = true;
    }
    departed_ = std::move(notice.departed);
    anyone_left_.store(true);
    join = !joined.empty();
    if (join) {
      // Everyone is at the admission, nothing in flight: rounds restart together at a
      // number no round of before the join had, and the answers from now on are computed
      // under this membership on every rank.
      joined_ = std::move(joined);
      registry_.RestartVersions(static_cast<uint64_t>(epoch) << kJoinVersionShift);
      answered_epoch_ = epoch;
      answered_departed_ = departed_;
    }
    cv_.notify_all();
  }
  if (me)  // declared gone while it hung: the others went on, its pushes are refused
    return Fail(Error::kPeer, "this worker (rank " + std::to_string(rank_) + ") was declared gone by the scheduler "
                              "(no heartbeat: hung or cut off) and the job went on without it; restart it to rejoin");
  LogWarn("fault tolerance: " + std::to_string(size_ - static_cast<int>(departed_.size())) + " workers " +
          (join ? "after a join" : "remain") + " (membership " + std::to_string(epoch) + ")");
}

void Worker::WaitForAdmission() {
  std::unique_lock<std::mutex> lk(mu_);
  LogInfo("joining the running job in the place of worker " + std::to_string(rank_) +
          ": waiting for the others' next admission (their state.commit() or engine.admit())");
  control_.Send(MsgType::kBarrier, "", 0, kAdmissionBarrier);
  const bool done = cv_.wait_for(lk, std::chrono::duration<double>(opts_.rendezvous_timeout),
                                 [&] { return admitted_late_ || failed_ || stopping_.load(); });
  if (!done) {
    lk.unlock();
    Fail(Error::kTimeout, "the job did not admit this worker within " +
                              std::to_string(static_cast<int>(opts_.rendezvous_timeout)) +
                              " s (comm.rendezvous_timeout): the workers in the job admit joiners between steps, "
                              "at state.commit() or engine.admit()");
  }
}

int64_t Worker::EnqueueAdmission() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!opts_.fault_tolerance)
    throw Error(Error::kConfig, "an admission (workers joining a running job) needs comm.fault_tolerance");
  if (const int running = RunningOpsLocked())
    throw Error(Error::kConfig, "an admission goes between steps: " + std::to_string(running) +
                                    " operations of this worker are still running (synchronize them first)");
  joined_.clear();
  return EnqueueBarrierLocked(kAdmissionBarrier);
}

void Worker::OnSchedulerLost(const std::string& why) {
  if (stopping_) return;
  if (!opts_.fault_tolerance) return Fail(Error::kPeer, why);
  int live = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_ || !scheduler_lost_.empty()) return;
    scheduler_lost_ = why;
    live = size_ - static_cast<int>(departed_.size());
    // No reply can come for a barrier or a declaration the scheduler had not answered.
    for (auto& b : barrier_waiters_) FailHandleLocked(b, Error::kPeer, SchedulerGoneLocked("a barrier"));
    barrier_waiters_.clear();
    for (auto& t : registry_.WithdrawAwaiting())
      FailWaitingLocked(*t, Error::kPeer, SchedulerGoneLocked("declaring tensor '" + t->name + "'"));
  }
  LogWarn("the scheduler is gone (" + why + "); fault tolerance: training goes on with the " + std::to_string(live) +
          " workers in the job, but until it ends a worker that dies or hangs ends it, and barriers and new "
          "tensors fail");
}

std::string Worker::SchedulerGoneLocked(const std::string& what) const {
  return what + " needs the scheduler, which is gone (" + scheduler_lost_ +
         "); fault tolerance keeps the job's push_pull of declared tensors running without it, but a scheduler "
         "cannot be restarted into a running job";
}

void Worker::NoteAnsweredMembership(const std::string& meta) {
  MembershipNotice notice = ParseMembershipNotice(meta, max_workers_);  // FrameError: the link drops
  std::lock_guard<std::mutex> lk(mu_);
  if (notice.epoch <= answered_epoch_) return;
  answered_epoch_ = notice.epoch;
  answered_departed_ = std::move(notice.departed);
}

Membership Worker::membership() {
  std::lock_guard<std::mutex> lk(mu_);
  Membership m;
  m.epoch = membership_epoch_;
  m.departed = departed_;
  m.answered_epoch = answered_epoch_;
  m.answered_departed = answered_departed_;
  m.scheduler_lost = !scheduler_lost_.empty();
  m.joined = joined_;
  m.admitted_late = admitted_late_;
  m.lost_servers.assign(lost_servers_.begin(), lost_servers_.end());
  m.live_size = size_ - static_cast<int>(departed_.size());
  m.live_rank = rank_ - static_cast<int>(std::lower_bound(departed_.begin(), departed_.end(), rank_) - departed_.begin());
  return m;
}

int Worker::RootRankLocked(int live_root) const {
  const int live = size_ - static_cast<int>(departed_.size());
  if (live_root < 0 || live_root >= live)
    throw Error(Error::kConfig, "broadcast root must be in [0, " + std::to_string(live) + ") (the workers still "
                                "in the job). Received: root_rank=" + std::to_string(live_root));
  int rank = 0;
  for (int seen = -1;; ++rank)
    if (!std::binary_search(departed_.begin(), departed_.end(), rank) && ++seen == live_root) return rank;
}

void Worker::SendGoodbye(DataConn* c) {
  // Fault tolerance: tells the server this worker shut down cleanly. While the scheduler
  // is gone, the server tells a finished worker from a dead one by this (server.cc).
  FrameHeader h;
  h.type = static_cast<uint16_t>(MsgType::kGoodbye);
  h.sender = rank_;
  try {
    c->link->Send(h);
  } catch (const Error&) {
    // The server is gone or going: nothing to tell.
  }
}

}  // namespace bps
