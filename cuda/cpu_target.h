// The CPU kernels are compiled for baseline x86-64, x86-64-v3 (AVX2, FMA) and x86-64-v4
// (AVX-512), and the loader picks the best version the CPU supports (GCC function
// multi-versioning). What they call must inline into each version (conv_math.h forces it), or it
// runs as baseline code; hence no callbacks in the hot loops.
#pragma once

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && \
    __GNUC__ >= 12
#define CAUSAL_CONV_CPU_KERNEL \
  __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define CAUSAL_CONV_CPU_KERNEL
#endif
