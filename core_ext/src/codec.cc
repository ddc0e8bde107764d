#include "codec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <thread>

#include "common.h"

namespace bps {
namespace codec {

namespace {
size_t Pad4(size_t n) { return (n + 3) & ~size_t(3); }

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // unaligned, little-endian host (x86/arm64)
  return v;
}

// Magnitudes for top-k: NaN sorts below everything, as in the numpy reference (argsort
// puts NaN last), and keeps the comparator a strict weak order.
float Magnitude(float v) { return std::isnan(v) ? -1.0f : std::fabs(v); }
// splitmix64: a tiny, fast, well-mixed stream; [0, 1) with 53 random bits.
double Uniform(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);
}
}  // namespace

size_t BlobBytes(uint8_t codec, uint32_t n, uint32_t k) {
  switch (codec) {
    case kOneBit: return kHeaderBytes + Pad4((size_t(n) + 7) / 8);
    case kTopK: return kHeaderBytes + 8 * size_t(k);
    case kDithering: return kHeaderBytes + Pad4(n);
    default: return 0;
  }
}

std::string Parse(const uint8_t* data, size_t len, std::vector<BlobHeader>* blobs) {
  blobs->clear();
  size_t off = 0;
  while (off < len) {
    const std::string at = "compressed blob " + std::to_string(blobs->size()) + " at byte " + std::to_string(off);
    if (len - off < kHeaderBytes) return at + ": truncated header";
    BlobHeader h;
    const uint8_t* p = data + off;
    h.codec = p[0];
    h.flags = p[1];
    h.param = Load<uint16_t>(p + 2);
    h.n = Load<uint32_t>(p + 4);
    h.k = Load<uint32_t>(p + 8);
    h.scale = Load<float>(p + 12);
    h.offset = off;
    if (h.codec < kOneBit || h.codec > kDithering) return at + ": unknown codec " + std::to_string(h.codec);
    if ((h.flags & ~(kFlagScaled | kFlagServerEF | kStateFlags)) || (h.flags & kStateFlags) == kStateFlags)
      return at + ": unknown flags " + std::to_string(h.flags);
    const bool state = h.flags & kStateFlags;
    if (state && !(h.scale >= 0 && h.scale < 16777216.0f && h.scale == std::floor(h.scale)))
      return at + ": state piece index is not a whole number";
    if (h.n == 0) return at + ": empty chunk";
    if (h.codec == kTopK ? (h.k == 0 || h.k > h.n) : h.k != h.n)
      return at + ": " + std::to_string(h.k) + " entries for " + std::to_string(h.n) + " elements";
    if (h.codec == kDithering ? (h.param < 1 || h.param > 127) : h.param != 0)
      return at + ": parameter " + std::to_string(h.param) + " out of range";
    const size_t size = BlobBytes(h.codec, h.n, h.k);
    if (size > len - off) return at + ": " + std::to_string(size) + " bytes announced, " +
                                 std::to_string(len - off) + " left";
    const uint8_t* payload = p + kHeaderBytes;
    if (state) {
      // a state payload is raw fp32 residual: any bits are acceptable
    } else if (h.codec == kTopK) {
      uint32_t prev = 0;
      for (uint32_t i = 0; i < h.k; ++i) {
        const uint32_t idx = Load<uint32_t>(payload + 4 * size_t(i));
        if (idx >= h.n || (i > 0 && idx <= prev)) return at + ": top-k indices not increasing within the chunk";
        prev = idx;
      }
    } else if (h.codec == kDithering) {
      const int8_t s = static_cast<int8_t>(h.param);
      for (uint32_t i = 0; i < h.n; ++i) {
        const int8_t q = static_cast<int8_t>(payload[i]);
        if (q > s || q < -s) return at + ": dithering level out of range";
      }
    }
    blobs->push_back(h);
    off += size;
  }
  return "";
}

size_t StateFloatsPerPiece(const BlobHeader& h) { return (BlobBytes(h.codec, h.n, h.k) - kHeaderBytes) / 4; }

namespace {
template <bool kAssign>
void DecodeChunk(const BlobHeader& h, const uint8_t* data, float* acc) {
  const uint8_t* payload = data + h.offset + kHeaderBytes;
  const float scale = Load<float>(data + h.offset + 12);  // this blob's own, not the first push's
  if (h.codec == kOneBit) {
    // Eight elements per payload byte; the inner loop has no branch, so it vectorises.
    const float sign[2] = {scale, -scale};
    for (uint32_t j0 = 0; j0 < h.n; j0 += 8) {
      const unsigned bits = payload[j0 >> 3];
      const uint32_t m = std::min<uint32_t>(8, h.n - j0);
      for (uint32_t t = 0; t < m; ++t) {
        const float v = sign[(bits >> t) & 1];
        acc[j0 + t] = kAssign ? v : acc[j0 + t] + v;
      }
    }
  } else if (h.codec == kTopK) {
    if (kAssign) std::fill(acc, acc + h.n, 0.0f);
    const uint8_t* values = payload + 4 * size_t(h.k);
    for (uint32_t i = 0; i < h.k; ++i) acc[Load<uint32_t>(payload + 4 * size_t(i))] += Load<float>(values + 4 * size_t(i));
  } else {
    const float step = scale / static_cast<float>(h.param);
    const int8_t* q = reinterpret_cast<const int8_t*>(payload);
    for (uint32_t j = 0; j < h.n; ++j) {
      const float v = static_cast<float>(q[j]) * step;
      acc[j] = kAssign ? v : acc[j] + v;
    }
  }
}
}  // namespace

namespace {
// The k largest magnitudes of x[0..n), ties to the lower index, as sorted indices: a
// strict total order, so the set is the numpy reference's whatever nth_element does.
// Selecting among all n indices compares through x at random and dominated the encode
// (0.4 GB/s); a threshold guessed from a strided sample of 4096 magnitudes, aimed at
// about 2k survivors, leaves nth_element a few k candidates. Every element of the top k
// has a magnitude >= the k-th largest >= the threshold whenever >= k survive, so the
// result is exact; fewer than k survivors (a pattern the sample missed) falls back to all n.
void TopKIndices(const float* x, uint32_t n, uint32_t k, std::vector<uint32_t>& idx) {
  auto before = [x](uint32_t a, uint32_t b) {
    const float ma = Magnitude(x[a]), mb = Magnitude(x[b]);
    return ma > mb || (ma == mb && a < b);
  };
  constexpr uint32_t kSamples = 4096;
  idx.clear();
  if (n >= 2 * kSamples && uint64_t(k) * 8 <= n) {
    std::vector<float> sample(kSamples);
    const double stride = static_cast<double>(n) / kSamples;
    for (uint32_t i = 0; i < kSamples; ++i) sample[i] = Magnitude(x[static_cast<uint32_t>(i * stride)]);
    const uint32_t rank = std::min<uint32_t>(kSamples - 1, static_cast<uint32_t>(2.0 * k / n * kSamples) + 16);
    std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<float>());
    const float threshold = sample[rank];
    if (threshold > 0) {  // 0 or NaN-only (-1) would keep most of the chunk: no gain
      idx.reserve(4 * size_t(k));
      for (uint32_t j = 0; j < n; ++j)
        if (Magnitude(x[j]) >= threshold) idx.push_back(j);
    }
    if (idx.size() < k) idx.clear();
  }
  if (idx.empty()) {
    idx.resize(n);
    std::iota(idx.begin(), idx.end(), 0u);
  }
  std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), before);
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
}
}  // namespace

void DecodeInto(const BlobHeader& h, const uint8_t* data, float* acc, bool assign) {
  assign ? DecodeChunk<true>(h, data, acc) : DecodeChunk<false>(h, data, acc);
}

void Encode(const BlobHeader& like, const float* x, uint8_t* out, uint64_t* rng) {
  const uint32_t n = like.n;
  const size_t size = BlobBytes(like.codec, n, like.k);
  std::memset(out, 0, size);
  uint8_t* payload = out + kHeaderBytes;
  float scale = 0;
  if (like.codec == kOneBit) {
    if (like.flags & kFlagScaled) {
      double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // independent sums vectorise; float64
      uint32_t j = 0;                             // keeps them equal to the reference's
      for (; j + 8 <= n; j += 8)
        for (int t = 0; t < 8; ++t) part[t] += std::fabs(static_cast<double>(x[j + t]));
      for (; j < n; ++j) part[0] += std::fabs(static_cast<double>(x[j]));
      double sum = 0;
      for (double p : part) sum += p;
      scale = static_cast<float>(sum / n);
    } else {
      scale = 1.0f;
    }
    for (uint32_t j0 = 0; j0 < n; j0 += 8) {
      const uint32_t m = std::min<uint32_t>(8, n - j0);
      unsigned bits = 0;
      for (uint32_t t = 0; t < m; ++t) bits |= static_cast<unsigned>(x[j0 + t] < 0) << t;
      payload[j0 >> 3] = static_cast<uint8_t>(bits);
    }
  } else if (like.codec == kTopK) {
    std::vector<uint32_t> idx;
    TopKIndices(x, n, like.k, idx);
    uint8_t* values = payload + 4 * size_t(like.k);
    for (uint32_t i = 0; i < like.k; ++i) {
      std::memcpy(payload + 4 * size_t(i), &idx[i], 4);
      std::memcpy(values + 4 * size_t(i), &x[idx[i]], 4);
    }
  } else {
    bool nan = false;  // max |x| propagates NaN, as numpy's max does
    for (uint32_t j = 0; j < n; ++j) {
      const float a = std::fabs(x[j]);
      if (std::isnan(a)) nan = true;
      else scale = std::max(scale, a);
    }
    if (nan) scale = NAN;
    if (scale > 0 && std::isfinite(scale)) {
      const double levels = like.param;
      for (uint32_t j = 0; j < n; ++j) {
        const double u = rng ? Uniform(rng) : 0.5;
        double q = std::floor(std::fabs(static_cast<double>(x[j])) / static_cast<double>(scale) * levels + u);
        q = std::min(q, levels);
        payload[j] = static_cast<uint8_t>(static_cast<int8_t>(x[j] < 0 ? -q : q));
      }
    }  // else zero levels (already zeroed) with the non-finite scale, as the reference
  }
  out[0] = like.codec;
  out[1] = like.flags;
  std::memcpy(out + 2, &like.param, 2);
  std::memcpy(out + 4, &n, 4);
  std::memcpy(out + 8, &like.k, 4);
  std::memcpy(out + 12, &scale, 4);
}

namespace {
uint32_t ChunkEntries(const TensorLayout& t, uint32_t n) {
  if (t.codec != kTopK) return n;
  // _codec.topk_count: min(n, max(1, ceil(ratio * n))), in double as Python computes it
  const double k = std::ceil(t.ratio * static_cast<double>(n));
  return static_cast<uint32_t>(std::min<double>(n, std::max(1.0, k)));
}
}  // namespace

size_t EncodedBytes(const TensorLayout& t, size_t numel) {
  if (t.chunk == 0) return 0;
  size_t total = 0;
  for (size_t first = 0; first < numel; first += t.chunk) {
    const uint32_t n = static_cast<uint32_t>(std::min<size_t>(t.chunk, numel - first));
    total += BlobBytes(t.codec, n, ChunkEntries(t, n));
  }
  return total;
}

void EncodeTensor(const TensorLayout& t, const float* x, size_t numel, uint8_t* out, float* residual,
                  uint64_t seed) {
  struct Job {
    BlobHeader h;
    size_t first;
  };
  std::vector<Job> jobs;
  size_t off = 0;
  for (size_t first = 0; first < numel; first += t.chunk) {
    Job j;
    j.h.codec = t.codec;
    j.h.flags = t.flags;
    j.h.param = t.param;
    j.h.n = static_cast<uint32_t>(std::min<size_t>(t.chunk, numel - first));
    j.h.k = ChunkEntries(t, j.h.n);
    j.h.offset = off;
    j.first = first;
    off += BlobBytes(t.codec, j.h.n, j.h.k);
    jobs.push_back(j);
  }
  auto run = [&](size_t i) {
    const Job& j = jobs[i];
    uint64_t state = seed ^ (0xD1B54A32D192ED03ull * (i + 1));
    Encode(j.h, x + j.first, out + j.h.offset, seed ? &state : nullptr);
    if (residual) {
      // `residual` may be `x` itself (the worker keeps one buffer and adds each gradient
      // into it): decode into scratch, then subtract.
      thread_local std::vector<float> sent;
      sent.resize(j.h.n);
      DecodeInto(j.h, out, sent.data(), true);
      float* r = residual + j.first;
      const float* xs = x + j.first;
      for (uint32_t e = 0; e < j.h.n; ++e) {
        const float v = xs[e] - sent[e];
        r[e] = std::isfinite(v) ? v : 0.0f;  // as the servers: never keep an overflow
      }
    }
  };
  // Chunks are independent: a large gradient (VGG-16's fc6 is 100 chunks) encodes on
  // several cores while the backward pass goes on with the rest.
  const size_t threads = std::min<size_t>(jobs.size(), std::max(1u, std::thread::hardware_concurrency()));
  if (threads <= 1) {
    for (size_t i = 0; i < jobs.size(); ++i) run(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (size_t w = 0; w + 1 < threads; ++w)
    pool.push_back(StartThread([&] {
      for (size_t i; (i = next.fetch_add(1)) < jobs.size();) run(i);
    }));
  for (size_t i; (i = next.fetch_add(1)) < jobs.size();) run(i);
  for (auto& th : pool) th.join();
}

}  // namespace codec
}  // namespace bps
