// Fault tolerance on a worker (comm.fault_tolerance): the scheduler's kMembership says
// which workers left; the servers answer rounds without them (kFlagReduced answers are
// averaged over the pushes they sum), and the adapters number the workers still in the
// job 0..live_size-1 (membership()).
#include <algorithm>

#include "worker.h"

namespace bps {

void Worker::OnMembership(const std::string& meta) {
  MembershipNotice notice = ParseMembershipNotice(meta, size_);
  const int64_t epoch = notice.epoch;
  bool me = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (epoch <= membership_epoch_) return;
    membership_epoch_ = epoch;
    departed_ = std::move(notice.departed);
    me = std::binary_search(departed_.begin(), departed_.end(), static_cast<int64_t>(rank_));
    anyone_left_.store(true);
  }
  if (me)  // declared gone while it hung: the others went on, its pushes are refused
    return Fail(Error::kPeer, "this worker (rank " + std::to_string(rank_) + ") was declared gone by the scheduler "
                              "(no heartbeat: hung or cut off) and the job went on without it; restart it to rejoin");
  LogWarn("fault tolerance: " + std::to_string(size_ - static_cast<int>(departed_.size())) +
          " workers remain (membership " + std::to_string(epoch) + ")");
}

void Worker::NoteAnsweredMembership(const std::string& meta) {
  MembershipNotice notice = ParseMembershipNotice(meta, size_);  // FrameError: the link drops
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

}  // namespace bps
