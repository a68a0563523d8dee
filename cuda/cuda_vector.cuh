// Device helpers shared by the CUDA conv and update kernels: vector loads and stores of a few
// consecutive elements, and the launch-error check every handler ends with.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "ffi_common.h"

namespace causal_conv {

// The status of the last launch as an FFI error, so a failed launch reaches Python as an
// exception instead of aborting the process.
inline ffi::Error cuda_status(const char* where) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_causal_conv: ") + where + ": " +
                              cudaGetErrorString(err));
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// N consecutive elements moved by one load or store instruction (N * sizeof(T) <= 16 bytes).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Elements per 16-byte access: the widest load, used where one thread's registers can hold it.
template <typename T>
constexpr int kPack = 16 / static_cast<int>(sizeof(T));

template <int kBytes>
struct RawWord;
template <>
struct RawWord<16> {
  using type = uint4;
};
template <>
struct RawWord<8> {
  using type = uint2;
};
template <>
struct RawWord<4> {
  using type = unsigned int;
};
template <>
struct RawWord<2> {
  using type = unsigned short;
};

// A load through the read-only (non-coherent) data path, for buffers no thread of the kernel
// writes: it lets the compiler issue later steps' loads ahead of this step's stores.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_readonly(const T* src) {
  using Raw = typename RawWord<sizeof(T) * N>::type;
  const Raw raw = __ldg(reinterpret_cast<const Raw*>(src));
  Vec<T, N> out;
  memcpy(&out, &raw, sizeof raw);
  return out;
}

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> zero_vec() {
  Vec<T, N> out;
  for (int v = 0; v < N; ++v) out.v[v] = T(0.0f);
  return out;
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* dst, const Vec<T, N>& value) {
  *reinterpret_cast<Vec<T, N>*>(dst) = value;
}

}  // namespace causal_conv
