// The authenticator of one frame's body (secure_link.h): what the two ends of a data
// connection agreed on in their handshake.
//
//   kPoly1305   Poly1305 with a one-time key per frame, HMAC(session, "poly1305" | seq);
//               from the system's libcrypto.so.3 (OpenSSL 3), loaded at run time when
//               present: 2-4x the speed of SHA-256 on the same core. Used when both ends
//               have it.
//   kHmacSha256 HMAC-SHA256(session, seq | body), built in (auth.h); always available.
//   kNone       no body tag (headers and metadata are still authenticated): only when
//               both ends were configured with comm.authenticate_bodies=false, for a
//               network the user trusts not to alter packets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace bps {

enum class BodyAuth : uint32_t { kHmacSha256 = 0, kPoly1305 = 1, kNone = 2 };
const char* BodyAuthName(BodyAuth mode);

// True when Poly1305 can be used: libcrypto.so.3 was found and BPSTRAIN_NO_LIBCRYPTO is
// not set (read on every call, so tests can turn it off).
bool Poly1305Available();

// One-shot Poly1305 (RFC 8439) with a 32-byte key; throws Error when unavailable.
std::string Poly1305(const std::string& key, const void* data, size_t n);

class BodyMac {
 public:
  static constexpr size_t kTag = 16;
  BodyMac(BodyAuth mode, const std::string& session_key, uint64_t seq);
  ~BodyMac();
  BodyMac(const BodyMac&) = delete;
  BodyMac& operator=(const BodyMac&) = delete;
  void Update(const void* data, size_t n);
  std::string Final();  // kTag bytes (zeros for kNone)

 private:
  struct Impl;
  BodyAuth mode_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bps
