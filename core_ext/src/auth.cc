#include "auth.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define BPS_HAVE_SHA_NI 1
#endif

namespace bps {

namespace {

constexpr uint32_t kK[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void CompressPortable(uint32_t h[8], const uint8_t* p, size_t blocks) {
  for (; blocks; --blocks, p += 64) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = (uint32_t(p[4 * i]) << 24) | (uint32_t(p[4 * i + 1]) << 16) | (uint32_t(p[4 * i + 2]) << 8) |
             uint32_t(p[4 * i + 3]);
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = Rotr(w[i - 15], 7) ^ Rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = Rotr(w[i - 2], 17) ^ Rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = hh + (Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25)) + ((e & f) ^ (~e & g)) + kK[i] + w[i];
      uint32_t t2 = (Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
  }
}

#ifdef BPS_HAVE_SHA_NI
#define BPS_SHA_TARGET __attribute__((target("sha,sse4.1,ssse3"), always_inline)) inline

// Four rounds of the SHA extensions' formulation of the compression function (Intel's
// reference layout: the state in two registers as ABEF / CDGH). G is the group, 0-15;
// w holds the message schedule's last four words-of-four. A template so every index is a
// constant and the schedule stays in registers.
template <int G>
BPS_SHA_TARGET void ShaNiRounds(__m128i& s0, __m128i& s1, __m128i (&w)[4], const uint8_t* p) {
  const __m128i kMask = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  if (G < 4) w[G] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * G)), kMask);
  const __m128i msg = _mm_add_epi32(w[G % 4], _mm_loadu_si128(reinterpret_cast<const __m128i*>(kK + 4 * G)));
  s1 = _mm_sha256rnds2_epu32(s1, s0, msg);
  if (G >= 3 && G <= 14) {  // the schedule's next four words
    __m128i& next = w[(G + 1) % 4];
    next = _mm_add_epi32(next, _mm_alignr_epi8(w[G % 4], w[(G + 3) % 4], 4));
    next = _mm_sha256msg2_epu32(next, w[G % 4]);
  }
  s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(msg, 0x0E));
  if (G >= 1 && G <= 12) w[(G + 3) % 4] = _mm_sha256msg1_epu32(w[(G + 3) % 4], w[G % 4]);
}

template <int... G>
BPS_SHA_TARGET void ShaNiBlock(__m128i& s0, __m128i& s1, const uint8_t* p, std::integer_sequence<int, G...>) {
  __m128i w[4];
  (ShaNiRounds<G>(s0, s1, w, p), ...);
}

__attribute__((target("sha,sse4.1,ssse3"))) void CompressShaNi(uint32_t h[8], const uint8_t* p, size_t blocks) {
  __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)), 0xB1);  // CDAB
  __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 4)), 0x1B);  // EFGH
  __m128i s0 = _mm_alignr_epi8(tmp, s1, 8);     // ABEF
  s1 = _mm_blend_epi16(s1, tmp, 0xF0);          // CDGH
  for (; blocks; --blocks, p += 64) {
    const __m128i abef = s0, cdgh = s1;
    ShaNiBlock(s0, s1, p, std::make_integer_sequence<int, 16>{});
    s0 = _mm_add_epi32(s0, abef);
    s1 = _mm_add_epi32(s1, cdgh);
  }
  tmp = _mm_shuffle_epi32(s0, 0x1B);    // FEBA
  s1 = _mm_shuffle_epi32(s1, 0xB1);     // DCHG
  s0 = _mm_blend_epi16(tmp, s1, 0xF0);  // DCBA
  s1 = _mm_alignr_epi8(s1, tmp, 8);     // HGFE
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h), s0);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h + 4), s1);
}

bool DetectShaNi() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool sse = (c & (1u << 19)) && (c & (1u << 9));  // SSE4.1, SSSE3
  if (!sse || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return b & (1u << 29);  // SHA
}
#endif

using CompressFn = void (*)(uint32_t*, const uint8_t*, size_t);

CompressFn PickCompress() {
#ifdef BPS_HAVE_SHA_NI
  if (DetectShaNi()) return CompressShaNi;
#endif
  return CompressPortable;
}

const CompressFn kCompress = PickCompress();

}  // namespace

bool Sha256Accelerated() { return kCompress != CompressPortable; }

Sha256::Sha256() {
  static constexpr uint32_t kInit[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                        0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::memcpy(h_, kInit, sizeof h_);
}

Sha256& Sha256::Update(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_ += n;
  if (buffered_) {
    const size_t take = std::min(n, kBlock - buffered_);
    std::memcpy(buf_ + buffered_, p, take);
    buffered_ += take, p += take, n -= take;
    if (buffered_ < kBlock) return *this;
    kCompress(h_, buf_, 1);
    buffered_ = 0;
  }
  if (n >= kBlock) {
    kCompress(h_, p, n / kBlock);
    p += n / kBlock * kBlock;
    n %= kBlock;
  }
  std::memcpy(buf_, p, n);
  buffered_ = n;
  return *this;
}

void Sha256::Final(uint8_t out[kDigest]) {
  const uint64_t bits = total_ * 8;
  uint8_t pad[kBlock * 2] = {0x80};
  const size_t padlen = (buffered_ < 56 ? 56 : 120) - buffered_;
  for (int i = 0; i < 8; ++i) pad[padlen + i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
  Update(pad, padlen + 8);
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(h_[i] >> (24 - 8 * j));
}

std::string Sha256::Final() {
  uint8_t d[kDigest];
  Final(d);
  return std::string(reinterpret_cast<char*>(d), kDigest);
}

Hmac::Hmac(const std::string& key) {
  uint8_t k[Sha256::kBlock] = {0};
  if (key.size() > Sha256::kBlock) Sha256().Update(key).Final(k);
  else std::memcpy(k, key.data(), key.size());
  uint8_t ipad[Sha256::kBlock];
  for (size_t i = 0; i < Sha256::kBlock; ++i) {
    ipad[i] = k[i] ^ 0x36;
    opad_[i] = k[i] ^ 0x5c;
  }
  inner_.Update(ipad, sizeof ipad);
}

std::string Hmac::Final() {
  const std::string inner = inner_.Final();
  return Sha256().Update(opad_, sizeof opad_).Update(inner).Final();
}

std::string HmacSha256(const std::string& key, const std::string& message) {
  return Hmac(key).Update(message).Final();
}

std::string Pbkdf2Sha256(const std::string& password, const std::string& salt, int iterations) {
  // One 32-byte block: U1 = HMAC(P, S || INT(1)), Ui = HMAC(P, Ui-1), T = U1 ^ ... ^ Uc.
  std::string u = HmacSha256(password, salt + std::string("\0\0\0\1", 4));
  std::string t = u;
  for (int i = 1; i < iterations; ++i) {
    u = HmacSha256(password, u);
    for (size_t j = 0; j < t.size(); ++j) t[j] ^= u[j];
  }
  return t;
}

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(&out[got], n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw Error(Error::kGeneric, std::string("getrandom() failed: ") + strerror(errno));
    got += static_cast<size_t>(r);
  }
  return out;
}

bool ConstantTimeEqual(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace bps
