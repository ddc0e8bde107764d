// Summation kernels of the servers and the element-wise helpers of the workers.
//
// Each kernel is compiled twice (target_clones): an AVX2/FMA/F16C build picked at run
// time on CPUs that have it, and a portable default. No -march=native, so one wheel
// runs everywhere.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"

namespace bps {

// dst[i] += src[i] for dtypes summed natively (float32, float64 and the integers;
// integer sums wrap on overflow like the framework's own integer addition).
void SumInto(DType t, void* dst, const void* src, size_t n);

// fp16/bf16 are reduced in an fp32 accumulator: Widen starts it, Accumulate adds one
// more contribution, Narrow writes the rounded (nearest-even) result.
void Widen(DType t, float* acc, const void* src, size_t n);
void Accumulate(DType t, float* acc, const void* src, size_t n);
void Narrow(DType t, void* dst, const float* acc, size_t n);

inline bool AccumulatesInFloat(DType t) { return t == DType::kFloat16 || t == DType::kBFloat16; }

// data[i] /= divisor. Integers use floor division (documented in the README), so
// averaging [-3] over 2 ranks gives -2, as Python's // would.
void DivideInPlace(DType t, void* data, size_t n, int64_t divisor);

// Scalar conversions, exposed for tests.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace bps
