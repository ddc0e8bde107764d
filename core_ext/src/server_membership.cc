// Fault tolerance on the servers (comm.fault_tolerance): when the scheduler says workers
// left the job (kMembership), every round that waits for a whole-job set of pushes now
// waits only for the workers still in the job, plus the pushes the departed ones sent
// before they left (kept: the answer says how many pushes it sums, and averages divide
// by that). Rounds that already have them all are answered at once; pushes from a
// departed worker that arrive later are refused.
//
// When another server was lost, the workers push its partitions here instead; a worker
// that had its answer of a round hands it over (kRecoveredAnswer), so the workers it had
// not answered get the same bytes (ProcessRecoveredAnswer).
#include <algorithm>

#include "server.h"

namespace bps {

void Server::OnMembership(const std::string& meta) {
  MembershipNotice notice = ParseMembershipNotice(meta, max_workers_);
  const int64_t epoch = notice.epoch;
  bool joined = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (epoch <= membership_epoch_) return;  // an older notice
    if (notice.size < num_workers_)
      throw FrameError("a membership notice of " + std::to_string(notice.size) + " workers after one of " +
                       std::to_string(num_workers_.load()) + " (a job only grows)");
    membership_epoch_ = epoch;
    num_workers_ = notice.size;
    // Replacements and scale-up's new ranks: rounds of that rank numbered before this
    // membership come from the process it replaced.
    for (int64_t r : notice.joined) rejoined_from_[r] = static_cast<uint64_t>(epoch) << kJoinVersionShift;
    joined = !notice.joined.empty();
    departed_ = std::move(notice.departed);
  }
  LogWarn(joined ? "workers joined the job (fault tolerance, membership " + std::to_string(epoch) +
                       "): rounds from now on wait for them too"
                 : "workers left the job (fault tolerance, membership " + std::to_string(epoch) +
                       "): rounds now wait for the others");
  for (auto& e : engines_) {
    std::lock_guard<std::mutex> lk(e->mu);
    Task t;
    t.membership = true;
    e->queue.push_back(std::move(t));
    e->cv.notify_one();
  }
  // Every engine thread applies it before any push queued after this: a worker that
  // hears of a join only after this ack (the scheduler waits for every server's) finds
  // it applied here.
  control_.Send(MsgType::kMembershipAck, "", static_cast<uint64_t>(epoch));
}

bool Server::StaleAfterRejoin(const EngineThread* et, const Push& p) const {
  auto it = et->rejoined_from.find(p.sender);
  return it != et->rejoined_from.end() && p.version < it->second;
}

void Server::OnSchedulerLost(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (done_ || !scheduler_lost_.empty()) return;
    scheduler_lost_ = why;
    if (!welcomed_) return;  // Run() goes on once the welcome's fields are set
  }
  GoOnWithoutScheduler(why);
}

void Server::GoOnWithoutScheduler(const std::string& why) {
  if (!fault_tolerance_) return Finish(why);
  LogWarn("the scheduler is gone (" + why + "); fault tolerance: serving the workers in the job until each "
          "has shut down (a worker that vanishes now ends the job: only the scheduler changes the membership)");
  CheckWorkersWithoutScheduler();
}

void Server::CheckWorkersWithoutScheduler() {
  std::string failure;
  bool all_gone = true;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (done_ || scheduler_lost_.empty()) return;
    for (int64_t r = 0; r < num_workers_.load() && failure.empty(); ++r) {
      if (std::binary_search(departed_.begin(), departed_.end(), r) || said_goodbye_.count(r)) continue;
      // Still connected, or not connected yet (it has its welcome, so it can without
      // the scheduler): running.
      if (open_by_worker_.count(r) || !ever_connected_.count(r)) {
        all_gone = false;
        continue;
      }
      failure = "worker " + std::to_string(r) + " closed its connections without shutting down while the "
                "scheduler was gone (" + scheduler_lost_ + "): only the scheduler can take a worker out of "
                "the job (fault tolerance), so the job ends";
    }
  }
  if (!failure.empty()) {
    LogWarn(failure);
    return Finish(failure);  // failure_kind_ stays kPeer
  }
  if (all_gone) {
    LogInfo("every worker shut down; the job is over (its scheduler was gone)");
    Finish("");
  }
}

std::string Server::ReducedAnswerMeta(const EngineThread* et) const {
  return et->departed.empty() ? std::string()
                              : MembershipNoticeMeta(et->membership_epoch, et->num_workers, et->departed);
}

bool Server::Departed(const EngineThread* et, int rank) const {
  return !et->departed.empty() && std::binary_search(et->departed.begin(), et->departed.end(), rank);
}

void Server::FitToMembership(const EngineThread* et, PendingRound& pr) const {
  Round& r = pr.round;
  // Only rounds of the whole job in sync mode: hierarchical slices name their own
  // participants, k-of-n closes rounds by itself (both off with fault tolerance).
  if (et->departed.empty() || pr.meta_expected != et->num_workers || pr.meta_complete_at != pr.meta_expected) return;
  int left_after_pushing = 0;
  for (int s : r.senders) left_after_pushing += Departed(et, s) ? 1 : 0;
  r.expected = r.complete_at = et->num_workers - static_cast<int>(et->departed.size()) + left_after_pushing;
  if (r.broadcast && pr.error.empty() && Departed(et, r.root) &&
      std::find(r.senders.begin(), r.senders.end(), r.root) == r.senders.end())
    pr.error = "broadcast of partition " + std::to_string(r.key) + " round " + std::to_string(r.version) +
               ": its root, worker " + std::to_string(r.root) + ", left the job before sending it";
}

void Server::FitToMembership(const EngineThread* et, SparseRound& sr) const {
  if (et->departed.empty() || sr.meta_expected != et->num_workers) return;
  int left_after_pushing = 0;
  for (int s : sr.senders) left_after_pushing += Departed(et, s) ? 1 : 0;
  sr.expected = et->num_workers - static_cast<int>(et->departed.size()) + left_after_pushing;
}

void Server::ApplyMembership(EngineThread* et) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    et->departed.assign(departed_.begin(), departed_.end());
    et->membership_epoch = membership_epoch_;
    et->num_workers = num_workers_;
    et->rejoined_from = rejoined_from_;
  }
  for (auto it = et->rounds.begin(); it != et->rounds.end();) {
    auto next = std::next(it);
    FitToMembership(et, it->second);
    if (it->second.round.pushes > 0 && et->handler->Complete(it->second.round)) CompleteRound(et, it);
    it = next;
  }
  for (auto it = et->sparse_rounds.begin(); it != et->sparse_rounds.end();) {
    auto next = std::next(it);
    FitToMembership(et, it->second);
    if (!it->second.senders.empty() && static_cast<int>(it->second.senders.size()) >= it->second.expected)
      CompleteSparse(et, it);
    it = next;
  }
}

void Server::ProcessRecoveredAnswer(EngineThread* et, Task& t) {
  // A worker hands over the answer a lost server sent it (worker_replacement.cc). Workers
  // that server did not answer push the round here again; they get these bytes, so every
  // rank applies the same update. No reply: the worker that sends it has its answer.
  const Push& p = t.push;
  const auto id = std::make_pair(p.key, p.version);
  const int live = p.expected == et->num_workers ? et->num_workers - static_cast<int>(et->departed.size()) : p.expected;
  auto kept = et->finished.find(id);
  if (kept != et->finished.end()) {  // another worker handed it over first
    FinishedRound& f = kept->second;
    if (std::find(f.answered.begin(), f.answered.end(), p.sender) == f.answered.end()) f.answered.push_back(p.sender);
    if (static_cast<int>(f.answered.size()) >= live) ForgetFinished(et, kept);
    return;
  }
  FinishedRound f;
  f.recovered = true;
  f.reply_flags = p.recovered_flags;
  f.reply_meta = p.recovered_meta;
  f.answered.push_back(p.sender);
  f.round = RoundOf(p);
  Round& r = f.round;
  r.pushes = static_cast<int>(p.recovered_summed);
  r.result = t.push.body;
  auto pending = et->rounds.find(id);
  if (pending != et->rounds.end()) {  // the workers without the answer pushed it here again
    PendingRound& pr = pending->second;
    if (pr.round.dtype != r.dtype || pr.round.len != r.len) {
      LogWarn("worker " + std::to_string(p.sender) + " handed over an answer of partition " + std::to_string(p.key) +
              " round " + std::to_string(p.version) + " of another dtype or length than its pushes here; ignored");
      return;
    }
    FrameHeader reply;
    reply.type = static_cast<uint16_t>(MsgType::kPullReply);
    reply.flags = f.reply_flags;
    reply.key = r.key;
    reply.version = r.version;
    reply.arg = r.pushes;
    reply.body_len = r.len;
    for (size_t i = 0; i < pr.waiters.size(); ++i) {
      pr.waiters[i]->Reply(reply, f.reply_meta, r.result);
      f.answered.push_back(pr.round.senders[i]);
    }
    et->rounds.erase(pending);
  }
  if (static_cast<int>(f.answered.size()) < live) et->finished.emplace(id, std::move(f));
}

void Server::ForgetRecoveredBefore(EngineThread* et, uint64_t key, uint64_t version) {
  auto it = et->finished.lower_bound({key, 0});
  while (it != et->finished.end() && it->first.first == key && it->first.second < version) {
    auto next = std::next(it);
    if (it->second.recovered) ForgetFinished(et, it);
    it = next;
  }
}

}  // namespace bps
