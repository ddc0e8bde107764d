#include "wire.h"

#include <algorithm>

namespace bps {

void CheckHeader(const FrameHeader& h, uint64_t max_body, uint32_t max_meta) {
  if (h.magic != kFrameMagic)
    throw FrameError("bad frame magic 0x" + [&] {
      char b[16];
      std::snprintf(b, sizeof b, "%08x", h.magic);
      return std::string(b);
    }() + " (not a bpstrain peer?)");
  if (h.type < static_cast<uint16_t>(MsgType::kHello) ||
      h.type > static_cast<uint16_t>(MsgType::kServerLost))
    throw FrameError("unknown frame type " + std::to_string(h.type));
  if (h.meta_len > max_meta)
    throw FrameError("metadata of " + std::to_string(h.meta_len) + " bytes exceeds the limit of " +
                     std::to_string(max_meta));
  if (h.body_len > max_body)
    throw FrameError("body of " + std::to_string(h.body_len) + " bytes exceeds the limit of " +
                     std::to_string(max_body));
}

std::string MembershipNoticeMeta(int64_t epoch, int size, const std::vector<int64_t>& departed,
                                 const std::vector<int64_t>& joined) {
  return MetaWriter().I64(epoch).U32(static_cast<uint32_t>(size)).I64Vec(departed).I64Vec(joined).bytes();
}

MembershipNotice ParseMembershipNotice(const std::string& meta, int max_workers) {
  MetaReader r(meta);
  MembershipNotice n;
  n.epoch = r.I64();
  const uint32_t size = r.U32();
  n.departed = r.I64Vec();
  n.joined = r.I64Vec();
  if (!r.AtEnd()) throw FrameError("membership notice with trailing bytes");
  if (n.epoch < 1) throw FrameError("membership notice of epoch " + std::to_string(n.epoch));
  if (size < 1 || size > static_cast<uint32_t>(max_workers))
    throw FrameError("membership notice of " + std::to_string(size) + " workers; the job allows at most " +
                     std::to_string(max_workers));
  n.size = static_cast<int>(size);
  // Both fewer than size: an admission needs workers already in the job.
  auto ranks_ok = [&](std::vector<int64_t>& v) {
    std::sort(v.begin(), v.end());
    return static_cast<int>(v.size()) < n.size && (v.empty() || (v.front() >= 0 && v.back() < n.size)) &&
           std::adjacent_find(v.begin(), v.end()) == v.end();
  };
  const bool departed_ok = ranks_ok(n.departed), joined_ok = ranks_ok(n.joined);
  if (!departed_ok || !joined_ok)
    throw FrameError("membership notice naming workers outside the job or twice");
  for (int64_t j : n.joined)
    if (std::binary_search(n.departed.begin(), n.departed.end(), j))
      throw FrameError("membership notice naming worker " + std::to_string(j) + " as departed and joined");
  return n;
}

}  // namespace bps
