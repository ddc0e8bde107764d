// Fault tolerance in the scheduler (comm.fault_tolerance): workers leave the job
// (DepartLocked: dead, hung, stopped by an exception) and join it in the place of one
// that left (JoinLaterLocked, then an admission). The membership is one list, the ranks
// out of the job now, with an epoch that grows at each change (kMembership).
//
// With comm.max_workers above the job's size, a worker that finds no such place free
// takes a new rank (scale-up): the job's size grows at its admission, and the membership
// notices carry it.
//
// A join is admitted only where every worker in the job waits for it (an admission
// barrier, between steps: nothing in flight) and after every server applied the new
// membership: a round of the new membership then counts the joiner everywhere, and all
// workers restart their round numbers at epoch << kJoinVersionShift together.
//
// A server that dies or hangs is lost (ServerLostLocked): its partitions are placed on the
// other servers as new ones would be, and the workers push to them again what it had not
// answered (worker_replacement.cc); synchronous rounds keep no state on a server beyond
// the round, so nothing else is lost.
#include <algorithm>

#include "scheduler.h"

namespace bps {

void Scheduler::DepartLocked(const std::shared_ptr<Node>& node, const std::string& why) {
  node->goodbye = true;  // out of barriers, goodbyes, heartbeat checks and worker broadcasts
  departed_.push_back(node->rank);
  ++membership_epoch_;
  if (LiveWorkersLocked() == 0) return FailLocked(node->Describe() + " " + why + "; no worker is left in the job");
  LogWarn(node->Describe() + " " + why + "; fault tolerance: the job goes on with " +
          std::to_string(LiveWorkersLocked()) + " workers");
  // Servers first: they finish the rounds that now have every push they will get.
  PostMembershipLocked(Role::kServer);
  PostMembershipLocked(Role::kWorker);
  // A hung worker that wakes up reads this notice first and stops (it names itself);
  // its connection stays until then, so the notice is not lost with it.
  FrameHeader h;
  h.type = static_cast<uint16_t>(MsgType::kMembership);
  node->out->Post(h, MembershipNoticeLocked());
  // A join waiting for the servers' acks now waits for their acks of this membership.
  if (!acks_awaited_.empty()) AwaitAcksLocked();
  barrier_ranks_.erase(std::remove(barrier_ranks_.begin(), barrier_ranks_.end(), node->rank), barrier_ranks_.end());
  admit_ranks_.erase(std::remove(admit_ranks_.begin(), admit_ranks_.end(), node->rank), admit_ranks_.end());
  std::vector<std::string> names;
  for (auto& [name, pend] : pending_decls_) {
    pend.erase(node->rank);
    names.push_back(name);
  }
  for (const std::string& name : names) TryCompleteDeclarationLocked(name);
  TryReleaseBarrierLocked();
  TryAdmitLocked();
  TryTerminateLocked();
}

bool Scheduler::JoinLaterLocked(const std::shared_ptr<Node>& node) {
  auto refuse = [&](const std::string& why) {
    LogWarn("refused a worker from " + node->peer_ip + ": " + why);
    SendError(node, why + ". Received: rank=" + std::to_string(node->rank_hint));
    return false;
  };
  std::set<int64_t> taken;  // by workers in the job or waiting to join
  for (auto& n : nodes_)
    if (n->role == Role::kWorker && (!n->goodbye || n->joining)) taken.insert(n->rank);
  int64_t slot = -1;
  for (int64_t r : departed_)
    if (!taken.count(r) && (node->rank_hint < 0 || node->rank_hint == r) && (slot < 0 || r < slot)) slot = r;
  // Scale-up (comm.max_workers): a new rank, the lowest free one above the job's, or the
  // one asked for; ranks it skips count as departed from its admission on.
  const int64_t most = MaxWorkersLocked();
  for (int64_t r = num_workers_; slot < 0 && r < most; ++r)
    if (!taken.count(r) && (node->rank_hint < 0 || node->rank_hint == r)) slot = r;
  if (slot < 0) {
    if (departed_.empty() && num_workers_ >= most)
      return refuse("the job already has all " + std::to_string(num_workers_) + " workers; a worker joins a "
                    "running job only in the place of one that left, or up to comm.max_workers (" +
                    std::to_string(most) + ") workers (fault tolerance)");
    std::string free;
    for (int64_t r : departed_)
      if (!taken.count(r)) free += (free.empty() ? "" : ", ") + std::to_string(r);
    for (int64_t r = num_workers_; r < most; ++r)
      if (!taken.count(r)) free += (free.empty() ? "" : ", ") + std::to_string(r);
    return refuse(free.empty() ? "every free place in the job is taken by a worker waiting to join"
                               : "rank " + std::to_string(node->rank_hint) + " is not a free place in the job; "
                                 "free: " + free + " (or no DMLC_WORKER_ID)");
  }
  node->rank = slot;
  node->joining = true;
  node->goodbye = true;  // not in barriers, goodbyes or worker broadcasts until it joins
  node->registered = true;
  node->last_seen = Clock::now();
  nodes_.push_back(node);
  FrameHeader h;
  h.type = static_cast<uint16_t>(MsgType::kWelcome);
  node->out->Post(h, WelcomeMetaLocked(*node, kWelcomeJoining));
  LogInfo(node->Describe() + " waits to join the job " +
          (slot < num_workers_ ? "in the place of worker " + std::to_string(slot) : std::string("as a new worker")) +
          " (at the next admission of the others)");
  return true;
}

void Scheduler::OnAdmissionBarrierLocked(const std::shared_ptr<Node>& node) {
  if (node->role != Role::kWorker || (node->goodbye && !node->joining))
    throw FrameError("an admission from " + node->Describe() + ": only workers in the job or joining it");
  if (node->joining) node->ready_to_join = true;
  else admit_ranks_.push_back(node->rank);
  TryAdmitLocked();
}

void Scheduler::TryAdmitLocked() {
  if (!acks_awaited_.empty() || admit_ranks_.empty() || static_cast<int>(admit_ranks_.size()) < LiveWorkersLocked())
    return;
  for (auto& n : nodes_)
    if (n->joining && n->ready_to_join) joining_.push_back(n);
  if (joining_.empty()) {  // nobody to admit: an ordinary barrier
    admit_ranks_.clear();
    return SendToWorkersLocked(MsgType::kBarrierReply, "", nullptr, kAdmissionBarrier);
  }
  std::string who;
  int grown = num_workers_;
  for (auto& j : joining_) grown = std::max(grown, static_cast<int>(j->rank) + 1);
  // Scale-up: the new ranks a joiner skipped (one that waits or left while waiting) are
  // places of workers out of the job, free for the next joiners.
  for (int64_t r = num_workers_; r < grown; ++r) departed_.push_back(r);
  num_workers_ = grown;
  for (auto& j : joining_) {
    departed_.erase(std::remove(departed_.begin(), departed_.end(), j->rank), departed_.end());
    rejoined_.insert(j->rank);
    who += (who.empty() ? "" : ", ") + j->Describe();
    // The node of that rank's earlier life (gone, or hung and declared gone) is forgotten.
    nodes_.erase(std::remove_if(nodes_.begin(), nodes_.end(),
                                [&](const std::shared_ptr<Node>& n) {
                                  return n != j && n->role == Role::kWorker && n->rank == j->rank;
                                }),
                 nodes_.end());
  }
  ++membership_epoch_;
  LogWarn(who + " joined the job (fault tolerance, membership " + std::to_string(membership_epoch_) + "): " +
          std::to_string(LiveWorkersLocked()) + " workers");
  AwaitAcksLocked();
  PostMembershipLocked(Role::kServer);  // the workers hear of it once every server applied it
}

void Scheduler::AwaitAcksLocked() {
  acks_awaited_.clear();
  for (auto& n : nodes_)
    if (n->role == Role::kServer && !n->goodbye) acks_awaited_.insert(n->rank);
}

void Scheduler::OnMembershipAckLocked(const std::shared_ptr<Node>& server, uint64_t epoch) {
  if (epoch != membership_epoch_ || acks_awaited_.empty()) return;  // an older change's ack
  acks_awaited_.erase(server->rank);
  if (acks_awaited_.empty()) FinishAdmissionLocked();
}

void Scheduler::FinishAdmissionLocked() {
  for (auto& j : joining_) {
    j->joining = j->ready_to_join = false;
    j->goodbye = false;
    j->last_seen = Clock::now();
  }
  PostMembershipLocked(Role::kWorker);  // before the reply: they read it first
  joining_.clear();
  admit_ranks_.clear();
  SendToWorkersLocked(MsgType::kBarrierReply, "", nullptr, kAdmissionBarrier);
  TryReleaseBarrierLocked();
}

void Scheduler::ForgetJoinerLocked(const std::shared_ptr<Node>& node, const std::string& why) {
  node->joining = node->ready_to_join = false;
  if (std::find(joining_.begin(), joining_.end(), node) != joining_.end()) {
    // Admitted (the servers count it already): it leaves as a worker of the job does.
    joining_.erase(std::remove(joining_.begin(), joining_.end(), node), joining_.end());
    node->goodbye = false;
    return DepartLocked(node, why + " while it joined");
  }
  LogWarn(node->Describe() + ", waiting to join, " + why + "; its place stays free");
  nodes_.erase(std::remove(nodes_.begin(), nodes_.end(), node), nodes_.end());
}

std::string Scheduler::MembershipNoticeLocked() const {
  // The joiners of an admission not yet announced to the workers are in the notice of
  // a departure meanwhile too: a worker that hears of that one first learns of them there.
  std::vector<int64_t> joined;
  for (auto& j : joining_) joined.push_back(j->rank);
  return MembershipNoticeMeta(static_cast<int64_t>(membership_epoch_), num_workers_, departed_, joined);
}

void Scheduler::PostMembershipLocked(Role role) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(MsgType::kMembership);
  const std::string meta = MembershipNoticeLocked();
  for (auto& n : nodes_)
    if (n->role == role && !n->goodbye) n->out->Post(h, meta);  // not a departed worker or a lost server
}

void Scheduler::ServerLostLocked(const std::shared_ptr<Node>& node, const std::string& why) {
  const int64_t lost = node->rank;
  if (LiveServersLocked() <= 1)
    return FailLocked(node->Describe() + " " + why + "; no other server is left to take its partitions");
  node->goodbye = true;  // out of heartbeat checks, membership notices and the end of the job
  lost_servers_.insert(lost);
  server_endpoints_[lost].clear();  // a worker that joins later does not connect to it
  server_share_[lost] = 0;
  double left = 0;
  for (int s = 0; s < opts_.num_servers; ++s) left += server_share_[s];
  if (left <= 0)  // mixed mode gave the others no share: the survivors share equally
    for (int s = 0; s < opts_.num_servers; ++s) server_share_[s] = lost_servers_.count(s) ? 0 : 1.0;
  // Its partitions go where a new tensor's would; the registry's tables say so from now
  // on (a rank that declares later gets them), the workers hear it in kServerLost.
  MetaWriter moves;
  uint32_t moved = 0;
  for (auto& [name, t] : registry_) {
    MetaReader r(t.placement);
    MetaWriter w;
    w.I64(r.I64());
    const uint32_t parts = r.U32();
    w.U32(parts);
    for (uint32_t p = 0; p < parts; ++p) {
      const int64_t off = r.I64(), len = r.I64();
      uint32_t server = r.U32();
      if (server == static_cast<uint32_t>(lost)) {
        server = static_cast<uint32_t>(PickServerLocked(len));
        moves.I64(t.id).U32(p).U32(server);
        ++moved;
      }
      w.I64(off).I64(len).U32(server);
    }
    t.placement = w.bytes();
  }
  server_load_[lost] = 0;
  LogWarn(node->Describe() + " " + why + "; fault tolerance: its " + std::to_string(moved) +
          " partitions move to the " + std::to_string(LiveServersLocked()) + " other servers");
  const std::string notice = MetaWriter().U32(static_cast<uint32_t>(lost)).U32(moved).bytes() + moves.bytes();
  FrameHeader lost_notice;
  lost_notice.type = static_cast<uint16_t>(MsgType::kServerLost);
  for (auto& n : nodes_)  // the workers in the job and those waiting to join it
    if (n->role == Role::kWorker && (!n->goodbye || n->joining)) n->out->Post(lost_notice, notice);
  // A hung server that wakes up reads this first and stops.
  FrameHeader h;
  h.type = static_cast<uint16_t>(MsgType::kPeerDead);
  node->out->Post(h, MetaWriter().Str("this server was declared gone (" + why + ") and its partitions moved to "
                                      "the other servers").bytes());
  // A join waiting for its acks does not wait for this one.
  if (!acks_awaited_.empty() && acks_awaited_.erase(lost) && acks_awaited_.empty()) FinishAdmissionLocked();
}

}  // namespace bps
