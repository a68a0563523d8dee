// Device helpers shared by the CUDA conv and update kernels: vector loads and stores of a few
// consecutive elements, and the launch-error check every handler ends with.
#pragma once

#include <cuda_pipeline.h>
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

// Per-thread 16-byte rows of kArrays buffers, fetched kDepth steps ahead with cp.async into
// shared memory. A copy in flight holds no registers; with the rows loaded into registers one step
// ahead, register pressure capped the vectorized kernels at 12-24% of warps active and DRAM at
// 16-28% of peak (ncu). Each thread reads back only the slots it filled, so the only
// synchronisation is the thread's own wait for its copies. Use: fetch steps 0 .. kDepth-1, then per
// step s: wait(), read(s, ...), and once those bytes are consumed, fetch(s + kDepth, ...) into the
// slots just read. Every fetch commits one copy group, empty when its sources are null, so that
// wait() always finds step s's group kDepth - 1 groups from the newest.
template <int kDepth, int kArrays>
struct RowRing {
  static_assert((kDepth & (kDepth - 1)) == 0, "kDepth must be a power of two");
  static constexpr int kSlots = kDepth * kArrays;  // uint4 slots per thread

  uint4* slots;  // [array][depth][thread] in shared memory: neighbouring threads, neighbouring banks

  __device__ __forceinline__ uint4* slot(int array, int64_t step) const {
    const int depth = static_cast<int>(step & (kDepth - 1));
    return slots + (array * kDepth + depth) * blockDim.x + threadIdx.x;
  }

  // Starts the copies of step's rows, src[a] for array a (none for a null source).
  __device__ __forceinline__ void fetch(int64_t step, const void* const (&src)[kArrays]) const {
    for (int a = 0; a < kArrays; ++a) {
      if (src[a] != nullptr) __pipeline_memcpy_async(slot(a, step), src[a], sizeof(uint4));
    }
    __pipeline_commit();
  }

  // Waits for the oldest step in flight.
  __device__ __forceinline__ void wait() const { __pipeline_wait_prior(kDepth - 1); }

  template <typename T, int N>
  __device__ __forceinline__ Vec<T, N> read(int array, int64_t step) const {
    static_assert(sizeof(Vec<T, N>) == sizeof(uint4), "rows are 16 bytes");
    const uint4 raw = *slot(array, step);
    Vec<T, N> out;
    memcpy(&out, &raw, sizeof raw);
    return out;
  }
};

}  // namespace causal_conv
