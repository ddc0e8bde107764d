// The wire protocol: one fixed header per frame, then `meta_len` bytes of
// small structured metadata (MetaWriter/MetaReader), then `body_len` bytes of tensor
// data. Every field read off the network is bounds-checked before use; a frame that
// fails a check raises FrameError and the caller drops that connection.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common.h"

namespace bps {

constexpr uint32_t kFrameMagic = 0x32535042;  // "BPS2" little-endian (v2: authenticated handshake)
constexpr uint32_t kMaxMetaLen = 1 << 20;     // 1 MiB of metadata is far beyond any real frame
constexpr uint64_t kMaxBodyLen = 1ull << 31;  // one partition never exceeds 2 GiB
constexpr uint64_t kMaxProbeBytes = 4u << 20; // one link-probe frame
constexpr size_t kMaxGoodbyeReason = 1024;  // bytes of a worker's "why I stopped"
constexpr int64_t kMaxPartitions = 32768;     // per tensor: its table must fit one frame's metadata
constexpr double kSendTimeoutS = 60.0;        // a send that makes no progress this long fails

enum class MsgType : uint16_t {
  kHello = 1,         // node -> scheduler: role, rank hint, listen endpoint (after the handshake)
  kWelcome = 2,       // scheduler -> node: assigned rank, sizes, server address book
  kDeclare = 3,       // worker -> scheduler: name, dtype, shape, partition bytes
  kDeclareReply = 4,  // scheduler -> worker: tensor id + partition placement, or error
  kBarrier = 5,       // worker -> scheduler
  kBarrierReply = 6,  // scheduler -> worker
  kHeartbeat = 7,     // node -> scheduler
  kGoodbye = 8,       // worker -> scheduler: this worker shut down cleanly
  kTerminate = 9,     // scheduler -> server: every worker is gone, exit
  kPeerDead = 10,     // scheduler -> everyone: a node died; meta holds the reason
  kError = 11,        // any -> any: a refused request; meta holds the message
  kPush = 12,         // worker -> server: one partition of one round
  kPullReply = 13,    // server -> worker: the reduced partition of that round
  // 14 was v1's data-connection hello; the handshake's identity replaced it.
  kProbe = 15,        // worker -> server: `body_len` bytes that only measure the link
  kProbeReply = 16,   // server -> worker: the probe's body has fully arrived
  kAuthHello = 17,    // connecting side -> acceptor: nonce, identity (secure_link.h)
  kAuthChallenge = 18,  // acceptor -> connecting side: nonce, the acceptor's proof
  kAuthProof = 19,    // connecting side -> acceptor: its proof
  kAuthOk = 20,       // acceptor -> connecting side: accepted (the first authenticated frame)
  kRetryLater = 21,   // scheduler -> node: this job is ending (workers shut down); reconnect
                      // for the next one (a launcher restarts the roles; see roles.py)
  kMembership = 22,   // scheduler -> servers, workers (comm.fault_tolerance): workers left or
                      // rejoined; meta: u64 epoch, i64 vector of every rank out of the job now
  kMembershipAck = 23,  // server -> scheduler: applied the kMembership of epoch `key` (a
                        // join is announced to the workers only after every server has)
  kServerLost = 24,   // scheduler -> workers (comm.fault_tolerance): a server died or hung and
                      // its partitions moved; meta: u32 server id, u32 n, then n x (i64
                      // tensor id, u32 partition index, u32 new server)
};

// kBarrier / kBarrierReply `arg`: an ordinary barrier, or an admission (Worker::
// EnqueueAdmission): the workers in the job and those waiting to join meet there, and the
// waiting ones join (fault tolerance).
constexpr int64_t kAdmissionBarrier = 1;
// A worker that joins at membership epoch E, and every worker with it, numbers the rounds
// of each tensor from E << kJoinVersionShift on: rounds of before the join (a stale
// process of the same rank) never match a round after it.
constexpr int kJoinVersionShift = 32;

// Flags of kPush frames.
enum PushFlags : uint16_t {
  kFlagBroadcast = 1,  // round is a broadcast: the root's data is the result
  kFlagEmpty = 2,      // no body (a broadcast non-root); `arg` still holds the length
  kFlagKeepOwn = 4,    // a broadcast whose result this sender holds already (the root, or a
                       // worker whose state equals the root's while joiners receive it):
                       // answered with no body
};

// kPush meta: u32 participants (ranks whose pushes the round expects), then u32 root (a
// broadcast's; 0xffffffff otherwise), then u32 complete_at (k-of-n aggregation: the round
// is answered once this many pushes are in; absent = participants), then optionally u32
// ParamOp (param_store.h, comm.consistency ssp/async):
//   kParamInit (a broadcast from rank 0 whose result the servers keep as the weights):
//     str consistency ("ssp:<s>" | "async"), u32 staleness_lr, str server optimizer;
//   kParamUpdate (a gradient; the answer is the weights): f64 learning rate;
//   kSparseRows (row-sparse push_pull, sparse_rows.h; `arg` = the body's length, which
//     varies per push): u32 row width (floats);
//   kRowsPull / kRowsPush (the servers as embedding storage, row_table.h; body: ids /
//     ids and gradient rows): u32 row width, str table spec, and for a push f64 lr; a
//     pull may end with i64 `after`, which makes it a prefetch: the rows as of after
//     `after` pushes of the table, asked while push number `after` may still be in
//     flight. The server answers at once with the rows that push cannot change any more
//     and keeps the ids; the answer of push `after` to that worker then carries the rows
//     of those ids that it changed or that were held back;
//   kRecoveredAnswer (fault tolerance, a server was lost: the answer of round `version`
//     that this worker received from the lost server, so that the partition's new server
//     answers the workers that did not get it with the same bytes; no reply): i64 pushes
//     it summed, u32 its reply flags, str its reply meta. The body is the answer.
enum ParamOp : uint32_t {
  kParamNone = 0, kParamInit = 1, kParamUpdate = 2, kSparseRows = 3, kRowsPull = 4, kRowsPush = 5,
  kRecoveredAnswer = 6
};
// A kPush with kFlagEmpty that is not a broadcast is a catch-up pull: a k-of-n worker
// that fell behind takes an answered round's result without contributing.
// kPullReply: `arg` holds the number of pushes summed into the answer; a k-of-n round's
// answer has meta i64 = the newest round of that partition the server answered early
// (how far the others are); a kParamUpdate's answer has `arg` = participants and meta
// i64 = its staleness (ParamStore::Answer); a kSparseRows answer's body is the merged
// rows (any length), a kRowsPull answer's the rows asked for, a kRowsPush answer is
// empty (the round's merged gradients were applied). A prefetch's answer and a kRowsPush
// answer to a worker with a prefetch waiting are sparse rows (ids, rows) of some of the
// ids asked (sparse_rows.h). Flags:
enum ReplyFlags : uint16_t {
  kFlagLate = 1,  // the round completed before this worker's push; its push was dropped
  kFlagReduced = 2,  // a worker left (kMembership): the answer sums fewer pushes than the job
                     // had workers (`arg` says how many; averages divide by it). With fault
                     // tolerance its meta is the membership the round was fitted to, as in
                     // kMembership: every rank gets the same answers, so at a step boundary
                     // every rank knows the same membership (the data samplers deal by it).
};

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t type = 0;
  uint16_t flags = 0;
  uint32_t meta_len = 0;
  int32_t sender = -1;
  int64_t arg = 0;
  uint64_t key = 0;
  uint64_t version = 0;
  uint64_t body_len = 0;
};
#pragma pack(pop)
static_assert(sizeof(FrameHeader) == 48, "header layout is part of the protocol");

// Raised for a malformed frame; the connection that sent it is dropped.
class FrameError : public std::runtime_error {
 public:
  explicit FrameError(const std::string& m) : std::runtime_error(m) {}
};

// Validates magic, type range and lengths. `max_body` and `max_meta` are the receiver's
// own limits (small ones before a peer has authenticated).
void CheckHeader(const FrameHeader& h, uint64_t max_body, uint32_t max_meta = kMaxMetaLen);

class MetaWriter {
 public:
  MetaWriter& U32(uint32_t v) { return Raw(&v, 4); }
  MetaWriter& I64(int64_t v) { return Raw(&v, 8); }
  MetaWriter& F64(double v) { return Raw(&v, 8); }
  MetaWriter& Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    return Raw(s.data(), s.size());
  }
  MetaWriter& I64Vec(const std::vector<int64_t>& v) {
    U32(static_cast<uint32_t>(v.size()));
    for (int64_t x : v) I64(x);
    return *this;
  }
  const std::string& bytes() const { return buf_; }

 private:
  MetaWriter& Raw(const void* p, size_t n) {
    buf_.append(static_cast<const char*>(p), n);
    return *this;
  }
  std::string buf_;
};

class MetaReader {
 public:
  explicit MetaReader(const std::string& buf) : buf_(buf) {}
  uint32_t U32() { uint32_t v; Raw(&v, 4); return v; }
  int64_t I64() { int64_t v; Raw(&v, 8); return v; }
  double F64() { double v; Raw(&v, 8); return v; }
  bool AtEnd() const { return pos_ == buf_.size(); }
  std::string Str() {
    uint32_t n = U32();
    Need(n);
    std::string s = buf_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::vector<int64_t> I64Vec() {
    uint32_t n = U32();
    Need(static_cast<uint64_t>(n) * 8);
    std::vector<int64_t> v(n);
    for (auto& x : v) x = I64();
    return v;
  }

 private:
  void Need(uint64_t n) {
    if (pos_ + n > buf_.size())
      throw FrameError("metadata truncated: need " + std::to_string(n) + " more bytes, have " +
                       std::to_string(buf_.size() - pos_));
  }
  void Raw(void* p, size_t n) {
    Need(n);
    std::memcpy(p, buf_.data() + pos_, n);
    pos_ += n;
  }
  const std::string& buf_;
  size_t pos_ = 0;
};

// A kMembership notice, checked (it came off the network): its epoch, how many worker
// ranks the job has given out (the rendezvous' workers plus those a scale-up added, at
// most `max_workers`), the ranks out of the job now (left, not rejoined) and the ranks
// the newest admission let in (in the job; none in a notice of a departure alone), each
// ascending, in [0, size) once; fewer departed than size.
struct MembershipNotice {
  int64_t epoch = 0;
  int size = 0;
  std::vector<int64_t> departed;
  std::vector<int64_t> joined;
};
MembershipNotice ParseMembershipNotice(const std::string& meta, int max_workers);
std::string MembershipNoticeMeta(int64_t epoch, int size, const std::vector<int64_t>& departed,
                                 const std::vector<int64_t>& joined = {});

}  // namespace bps
