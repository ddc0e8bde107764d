// Loops of std::fma compile to a call into libm per element unless the compiler may
// assume FMA instructions, which the baseline x86-64 target may not. BPS_FMA_CLONES
// builds a function twice (with FMA instructions, and for the baseline) and the loader
// picks the one this CPU runs. The results are the same bits: fma rounds once either way.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define BPS_FMA_CLONES __attribute__((target_clones("fma", "default")))
#else
#define BPS_FMA_CLONES
#endif
