#include "reduce.h"

#include <cmath>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace bps {

#if defined(__x86_64__) && defined(__GNUC__)
#define BPS_MULTIVERSION __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#define BPS_HAVE_X86_DISPATCH 1
#else
#define BPS_MULTIVERSION
#endif

namespace {

template <typename T>
inline void SumLoop(T* __restrict d, const T* __restrict s, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(d[i] + s[i]);
}

BPS_MULTIVERSION void SumF32(float* d, const float* s, size_t n) { SumLoop(d, s, n); }
BPS_MULTIVERSION void SumF64(double* d, const double* s, size_t n) { SumLoop(d, s, n); }
BPS_MULTIVERSION void SumI8(int8_t* d, const int8_t* s, size_t n) {
  // Wrap-around on overflow (done in unsigned arithmetic to stay defined behaviour).
  SumLoop(reinterpret_cast<uint8_t*>(d), reinterpret_cast<const uint8_t*>(s), n);
}
BPS_MULTIVERSION void SumU8(uint8_t* d, const uint8_t* s, size_t n) { SumLoop(d, s, n); }
BPS_MULTIVERSION void SumI32(int32_t* d, const int32_t* s, size_t n) {
  SumLoop(reinterpret_cast<uint32_t*>(d), reinterpret_cast<const uint32_t*>(s), n);
}
BPS_MULTIVERSION void SumI64(int64_t* d, const int64_t* s, size_t n) {
  SumLoop(reinterpret_cast<uint64_t*>(d), reinterpret_cast<const uint64_t*>(s), n);
}

// bf16 is the top half of an fp32: conversions are shifts, which vectorise well.
inline float Bf16Bits(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t Bf16Round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
}

inline float H2F(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) u = sign;
    else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) { man <<= 1; --exp; }
      u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) u = sign | 0x7f800000u | (man << 13);
  else u = sign | ((exp + 112) << 23) | (man << 13);
  float f; std::memcpy(&f, &u, 4); return f;
}
inline uint16_t F2H(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (a < 0x38800000u) {  // subnormal or zero
    float v; std::memcpy(&v, &a, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(v * 16777216.0f)));
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;
  return static_cast<uint16_t>(sign | (r >> 13));
}

#ifdef BPS_HAVE_X86_DISPATCH
// F16C converts 8 halves per instruction; picked at run time (no -march=native).
__attribute__((target("avx2,f16c"))) void WidenHF16C(float* a, const uint16_t* s, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(a + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  for (; i < n; ++i) a[i] = H2F(s[i]);
}
__attribute__((target("avx2,f16c"))) void AccHF16C(float* a, const uint16_t* s, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    _mm256_storeu_ps(a + i, _mm256_add_ps(_mm256_loadu_ps(a + i), x));
  }
  for (; i < n; ++i) a[i] += H2F(s[i]);
}
__attribute__((target("avx2,f16c"))) void NarrowHF16C(uint16_t* d, const float* a, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(a + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) d[i] = F2H(a[i]);
}
bool DetectF16C() {
  __builtin_cpu_init();  // required before __builtin_cpu_supports in static initialisers
  return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
}
const bool kHasF16C = DetectF16C();
#else
constexpr bool kHasF16C = false;
void WidenHF16C(float*, const uint16_t*, size_t) {}
void AccHF16C(float*, const uint16_t*, size_t) {}
void NarrowHF16C(uint16_t*, const float*, size_t) {}
#endif

void WidenH(float* a, const uint16_t* s, size_t n) {
  if (kHasF16C) return WidenHF16C(a, s, n);
  for (size_t i = 0; i < n; ++i) a[i] = H2F(s[i]);
}
void AccH(float* a, const uint16_t* s, size_t n) {
  if (kHasF16C) return AccHF16C(a, s, n);
  for (size_t i = 0; i < n; ++i) a[i] += H2F(s[i]);
}
void NarrowH(uint16_t* d, const float* a, size_t n) {
  if (kHasF16C) return NarrowHF16C(d, a, n);
  for (size_t i = 0; i < n; ++i) d[i] = F2H(a[i]);
}
BPS_MULTIVERSION void WidenB(float* a, const uint16_t* s, size_t n) { for (size_t i = 0; i < n; ++i) a[i] = Bf16Bits(s[i]); }
BPS_MULTIVERSION void AccB(float* a, const uint16_t* s, size_t n) { for (size_t i = 0; i < n; ++i) a[i] += Bf16Bits(s[i]); }
BPS_MULTIVERSION void NarrowB(uint16_t* d, const float* a, size_t n) { for (size_t i = 0; i < n; ++i) d[i] = Bf16Round(a[i]); }

template <typename T>
void FloorDivide(T* d, size_t n, int64_t div) {
  const T q = static_cast<T>(div);
  for (size_t i = 0; i < n; ++i) {
    T x = d[i], r = static_cast<T>(x / q);
    if ((x % q != 0) && ((x < 0) != (q < 0))) --r;
    d[i] = r;
  }
}

}  // namespace

float HalfToFloat(uint16_t h) { return H2F(h); }
uint16_t FloatToHalf(float f) { return F2H(f); }
float BFloat16ToFloat(uint16_t b) { return Bf16Bits(b); }
uint16_t FloatToBFloat16(float f) { return Bf16Round(f); }

void SumInto(DType t, void* dst, const void* src, size_t n) {
  switch (t) {
    case DType::kFloat32: return SumF32(static_cast<float*>(dst), static_cast<const float*>(src), n);
    case DType::kFloat64: return SumF64(static_cast<double*>(dst), static_cast<const double*>(src), n);
    case DType::kInt8: return SumI8(static_cast<int8_t*>(dst), static_cast<const int8_t*>(src), n);
    case DType::kUInt8: return SumU8(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
    case DType::kInt32: return SumI32(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n);
    case DType::kInt64: return SumI64(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n);
    default: throw Error(Error::kGeneric, std::string("SumInto called for ") + DTypeName(t));
  }
}

void Widen(DType t, float* acc, const void* src, size_t n) {
  auto s = static_cast<const uint16_t*>(src);
  t == DType::kFloat16 ? WidenH(acc, s, n) : WidenB(acc, s, n);
}
void Accumulate(DType t, float* acc, const void* src, size_t n) {
  auto s = static_cast<const uint16_t*>(src);
  t == DType::kFloat16 ? AccH(acc, s, n) : AccB(acc, s, n);
}
void Narrow(DType t, void* dst, const float* acc, size_t n) {
  auto d = static_cast<uint16_t*>(dst);
  t == DType::kFloat16 ? NarrowH(d, acc, n) : NarrowB(d, acc, n);
}

void DivideInPlace(DType t, void* data, size_t n, int64_t divisor) {
  if (divisor == 1) return;
  switch (t) {
    case DType::kFloat32: {
      auto p = static_cast<float*>(data);
      const float inv = 1.0f / static_cast<float>(divisor);
      for (size_t i = 0; i < n; ++i) p[i] *= inv;
      return;
    }
    case DType::kFloat64: {
      auto p = static_cast<double*>(data);
      for (size_t i = 0; i < n; ++i) p[i] /= static_cast<double>(divisor);
      return;
    }
    case DType::kFloat16:
    case DType::kBFloat16: {
      auto p = static_cast<uint16_t*>(data);
      const float d = static_cast<float>(divisor);
      const bool half = t == DType::kFloat16;
      for (size_t i = 0; i < n; ++i)
        p[i] = half ? F2H(H2F(p[i]) / d) : Bf16Round(Bf16Bits(p[i]) / d);
      return;
    }
    case DType::kInt8: return FloorDivide(static_cast<int8_t*>(data), n, divisor);
    case DType::kUInt8: return FloorDivide(static_cast<uint8_t*>(data), n, divisor);
    case DType::kInt32: return FloorDivide(static_cast<int32_t*>(data), n, divisor);
    case DType::kInt64: return FloorDivide(static_cast<int64_t*>(data), n, divisor);
    case DType::kCompressed: throw Error(Error::kGeneric, "compressed blobs cannot be averaged in place");
  }
}

}  // namespace bps
