#include "wire.h"

namespace bps {

void CheckHeader(const FrameHeader& h, uint64_t max_body, uint32_t max_meta) {
  if (h.magic != kFrameMagic)
    throw FrameError("bad frame magic 0x" + [&] {
      char b[16];
      std::snprintf(b, sizeof b, "%08x", h.magic);
      return std::string(b);
    }() + " (not a bpstrain peer?)");
  if (h.type < static_cast<uint16_t>(MsgType::kHello) ||
      h.type > static_cast<uint16_t>(MsgType::kMembership))
    throw FrameError("unknown frame type " + std::to_string(h.type));
  if (h.meta_len > max_meta)
    throw FrameError("metadata of " + std::to_string(h.meta_len) + " bytes exceeds the limit of " +
                     std::to_string(max_meta));
  if (h.body_len > max_body)
    throw FrameError("body of " + std::to_string(h.body_len) + " bytes exceeds the limit of " +
                     std::to_string(max_body));
}

}  // namespace bps
