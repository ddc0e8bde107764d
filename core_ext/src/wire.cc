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

std::string MembershipNoticeMeta(int64_t epoch, const std::vector<int64_t>& departed) {
  return MetaWriter().I64(epoch).I64Vec(departed).bytes();
}

MembershipNotice ParseMembershipNotice(const std::string& meta, int num_workers) {
  MetaReader r(meta);
  MembershipNotice n;
  n.epoch = r.I64();
  n.departed = r.I64Vec();
  if (!r.AtEnd()) throw FrameError("membership notice with trailing bytes");
  if (n.epoch < 1) throw FrameError("membership notice of epoch " + std::to_string(n.epoch));
  std::sort(n.departed.begin(), n.departed.end());
  if (static_cast<int>(n.departed.size()) >= num_workers ||
      (!n.departed.empty() && (n.departed.front() < 0 || n.departed.back() >= num_workers)) ||
      std::adjacent_find(n.departed.begin(), n.departed.end()) != n.departed.end())
    throw FrameError("membership notice naming workers outside the job or twice");
  return n;
}

}  // namespace bps
