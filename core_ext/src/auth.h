// The cryptographic primitives of the control plane: SHA-256, HMAC-SHA256, PBKDF2,
// fresh random bytes and a constant-time comparison. Self-contained (no OpenSSL at build
// time); SHA-256 uses the CPU's SHA extensions when it has them (about 2 GB/s instead of
// about 0.4 GB/s), because every frame's body is authenticated (secure_link.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace bps {

class Sha256 {
 public:
  static constexpr size_t kDigest = 32, kBlock = 64;
  Sha256();
  Sha256& Update(const void* data, size_t n);
  Sha256& Update(const std::string& s) { return Update(s.data(), s.size()); }
  // Writes 32 bytes; the object must not be updated afterwards.
  void Final(uint8_t out[kDigest]);
  std::string Final();

 private:
  uint32_t h_[8];
  uint8_t buf_[kBlock];
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

// HMAC-SHA256 (RFC 2104) over a message given in pieces.
class Hmac {
 public:
  explicit Hmac(const std::string& key);
  Hmac& Update(const void* data, size_t n) {
    inner_.Update(data, n);
    return *this;
  }
  Hmac& Update(const std::string& s) { return Update(s.data(), s.size()); }
  Hmac& U64(uint64_t v) { return Update(&v, sizeof v); }
  std::string Final();  // 32 bytes

 private:
  Sha256 inner_;
  uint8_t opad_[Sha256::kBlock];
};

std::string HmacSha256(const std::string& key, const std::string& message);

// PBKDF2-HMAC-SHA256 (RFC 8018), 32 bytes: the cluster key is derived from the user's
// secret with many iterations, so a transcript an observer captured does not let them
// test guesses of a weak secret quickly.
std::string Pbkdf2Sha256(const std::string& password, const std::string& salt, int iterations);

// `n` bytes from the kernel's CSPRNG (getrandom); throws Error when it is unavailable.
std::string RandomBytes(size_t n);

// Compares without an early exit, so the time taken says nothing about where a forged
// tag first differs.
bool ConstantTimeEqual(const std::string& a, const std::string& b);

// True when SHA-256 runs on the CPU's SHA extensions.
bool Sha256Accelerated();

}  // namespace bps
