// Device helpers shared by the CUDA conv and update kernels: vector loads and stores of a few
// consecutive elements, and the launch-error check every handler ends with.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

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

// The current device, or -1 where the runtime cannot say. A failed query's error is cleared here
// (as in device_attribute), so that it does not surface as the next launch's.
inline int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

// An attribute of `device` (current_device's), or 0 where the runtime cannot say.
inline int device_attribute(int device, cudaDeviceAttr attribute) {
  int value = 0;
  if (device < 0 || cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return value;
}

// Devices whose answers the launch code caches; one beyond them is asked on every call.
constexpr int kCachedDevices = 64;

// ask(device) for the current device, kept in `cached` once known: the launch code reads such
// answers on every call, and the runtime's queries cost host time. A 0 (unknown, or a capability
// the device lacks) is asked again, as is every answer for no device or one past kCachedDevices.
template <typename V, typename Ask>
V cached_per_device(std::atomic<V> (&cached)[kCachedDevices], Ask ask) {
  const int device = current_device();
  if (device < 0 || device >= kCachedDevices) return ask(device);
  if (const V known = cached[device].load(std::memory_order_relaxed); known != 0) return known;
  const V value = ask(device);
  cached[device].store(value, std::memory_order_relaxed);
  return value;
}

// device_attribute of the current device, asked once a device (cached_per_device).
template <cudaDeviceAttr kAttribute>
int current_device_attribute() {
  static std::atomic<int> cached[kCachedDevices] = {};
  return cached_per_device(cached, [](int device) { return device_attribute(device, kAttribute); });
}

// Programmatic dependent launch (compute capability 9.0 and later): a grid launched by
// launch_dependent may start once every block of the grid before it in the stream has called
// allow_dependent_grid or exited, and holds in wait_for_prior_grid until that grid has finished
// and its writes are visible. So the launch and the first blocks' start overlap the end of the grid
// before, instead of following it.
__device__ __forceinline__ void allow_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The configuration of a launch with one attribute, which must outlive it.
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, cudaStream_t stream,
                                        cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// kernel<<<grid, block, 0, stream>>>(args...) with one launch attribute. A failed launch leaves
// its error for cuda_status, as <<<>>> does.
template <typename... Params, typename... Args>
void launch_with_attribute(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                           cudaLaunchAttribute attribute, Args&&... args) {
  const cudaLaunchConfig_t config = launch_config(grid, block, stream, &attribute);
  cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// kernel<<<grid, block, 0, stream>>>(args...), as a dependent launch where the device has them.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                      Args&&... args) {
  if (current_device_attribute<cudaDevAttrComputeCapabilityMajor>() < 9) {
    kernel<<<grid, block, 0, stream>>>(std::forward<Args>(args)...);
    return;
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  launch_with_attribute(kernel, grid, block, stream, attribute, std::forward<Args>(args)...);
}

// A warp's lanes, and the mask of all of them for the *_sync intrinsics.
constexpr int kLanes = 32;
constexpr unsigned kFullWarp = 0xffffffffu;

// The launch attribute of 1-D clusters of cluster_blocks consecutive blocks.
inline cudaLaunchAttribute cluster_dimension(unsigned cluster_blocks) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster_blocks;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  return attribute;
}

// kernel<<<grid, block, 0, stream>>>(args...) in clusters of cluster_blocks consecutive blocks
// (compute capability 9.0 and later; grid a multiple of cluster_blocks, at most 8).
template <typename... Params, typename... Args>
void launch_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, unsigned cluster_blocks,
                      cudaStream_t stream, Args&&... args) {
  launch_with_attribute(kernel, grid, block, stream, cluster_dimension(cluster_blocks),
                        std::forward<Args>(args)...);
}

// ClusterSums' stand-in in kernels launched without clusters.
struct NoSums {};

// This block's rank in its cluster, and its cluster's index in the grid (launch_clustered's 1-D
// clusters; 0 and blockIdx.x without clusters).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
#endif
  return rank;
}

__device__ __forceinline__ uint32_t cluster_index() {
  uint32_t index = blockIdx.x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mov.u32 %0, %%clusterid.x;" : "=r"(index));
#endif
  return index;
}

// Sums that each warp of a cluster (launch_clustered) hands to the cluster's first block, its
// leader, without global memory: a warp stores its row of kColumns values into the leader's
// shared `rows` by st.async, which counts the bytes on the leader's mbarrier, and the leader
// waits for the count, then reads the rows in their order (so the sums it makes are bitwise
// deterministic). Neither a fence nor the warps' other stores stand between a warp's values and
// the leader: a fence (as a second kernel's launch, or a global-memory handover's
// __threadfence) waits for every store the thread has in flight. The protocol, each step by
// every thread of every block of the cluster: start (the mbarrier's set-up, and the cluster
// barrier's first arrival), then hand_over (a warp's row, or none), then the leader's
// total(column, rows) as often as it needs, then finish (which keeps the cluster's other blocks
// resident until the leader has every row: the shared memory they store into must outlive
// their stores). sm_90 and later, in clusters of two blocks or more (st.async needs a peer block:
// launch_cluster_sums takes no smaller cluster); on older devices the launchers take no cluster.
template <int kRows, int kColumns>
struct ClusterSums {
  float rows[kRows][kColumns];
  uint64_t arrived;  // the leader's mbarrier: one arrival (its own) and the rows' bytes

  __device__ __forceinline__ void start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&arrived))
                   : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
#endif
  }

  // Stores the thread's value (where has_value) into column `column` of the leader's row `row`,
  // once every block has started; the leader then waits for rows_expected whole rows.
  __device__ __forceinline__ void hand_over(int row, int column, bool has_value, float value,
                                            int rows_expected) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait;" ::: "memory");
    if (leader() && threadIdx.x == 0) announce(rows_expected);
    if (has_value) store_to_leader(row, column, value);
    if (leader()) wait_for_rows();
    asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
#endif
  }

  // The leader's arrival on its mbarrier, announcing the bytes of rows_expected whole rows (one
  // thread of the leader, once).
  __device__ __forceinline__ void announce(int rows_expected) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t bytes = static_cast<uint32_t>(rows_expected * kColumns * sizeof(float));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                     shared_address(&arrived)),
                 "r"(bytes)
                 : "memory");
#endif
  }

  // value into the leader's rows[row][column] by st.async, its bytes counted on the leader's
  // mbarrier.
  __device__ __forceinline__ void store_to_leader(int row, int column, float value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t at = leader_address(&rows[row][column]);
    const uint32_t barrier = leader_address(&arrived);
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(at),
        "r"(__float_as_uint(value)), "r"(barrier)
        : "memory");
#endif
  }

  // The leader's wait until every byte its expect_tx announced has arrived in `rows`.
  __device__ __forceinline__ void wait_for_rows() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t done = 0;
    do {
      asm volatile(
          "{\n .reg .pred complete;\n"
          " mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], 0;\n"
          " selp.u32 %0, 1, 0, complete;\n}"
          : "=r"(done)
          : "r"(shared_address(&arrived))
          : "memory");
    } while (!done);
#endif
  }

  // The leader's sum of column `column` over rows 0 .. count - 1, in that order.
  __device__ __forceinline__ float total(int column, int count) const {
    float sum = 0.0f;
    for (int r = 0; r < count; ++r) sum += rows[r][column];
    return sum;
  }

  __device__ __forceinline__ void finish() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait;" ::: "memory");
#endif
  }

  __device__ __forceinline__ static bool leader() { return cluster_rank() == 0; }

  __device__ __forceinline__ static uint32_t shared_address(const void* at) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(at));
  }

  // The address of the leader's copy of this block's `at` (a member of this struct).
  __device__ __forceinline__ static uint32_t leader_address(const void* at) {
    uint32_t remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(remote) : "r"(shared_address(at)));
#endif
    return remote;
  }
};

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

template <typename T, int N>
using RawFor = typename RawWord<sizeof(T) * N>::type;

// Loads and stores move Vec values through one raw word: a Vec of half types copied as a struct
// compiles to one access per 4 bytes, not one 16-byte access.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> from_raw(const RawFor<T, N>& raw) {
  Vec<T, N> out;
  memcpy(&out, &raw, sizeof raw);
  return out;
}

template <typename T, int N>
__device__ __forceinline__ RawFor<T, N> to_raw(const Vec<T, N>& value) {
  RawFor<T, N> raw;
  memcpy(&raw, &value, sizeof raw);
  return raw;
}

// A load through the read-only (non-coherent) data path, for buffers no thread of the kernel
// writes: it lets the compiler issue later steps' loads ahead of this step's stores.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_readonly(const T* src) {
  return from_raw<T, N>(__ldg(reinterpret_cast<const RawFor<T, N>*>(src)));
}

// load_readonly's raw word where live, else zero. Kept in registers across loop iterations (loads
// in flight), words move as 4-byte registers; a Vec of 16-bit values selected or copied there
// compiled to two PRMTs per element.
template <typename T, int N>
__device__ __forceinline__ RawFor<T, N> load_readonly_or_zero(const T* src, bool live) {
  return live ? __ldg(reinterpret_cast<const RawFor<T, N>*>(src)) : RawFor<T, N>{};
}

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> zero_vec() {
  Vec<T, N> out;
  for (int v = 0; v < N; ++v) out.v[v] = T(0.0f);
  return out;
}

// Through the __stwb intrinsic: a plain store of the raw word reaches the compiler's back end as
// four 4-byte stores in unrolled loops, where it cannot prove the alignment.
template <typename T, int N>
__device__ __forceinline__ void store_vec(T* dst, const Vec<T, N>& value) {
  __stwb(reinterpret_cast<RawFor<T, N>*>(dst), to_raw(value));
}

// store_vec with the evict-first (streaming) cache hint, for output no later step of the kernel
// reads. With x and dy also loaded evict-first, it took the channel-first backward from 143 to
// 139.5 us on the main workload (eleventh session, trial-chains); those loads now go through a
// cp.async ring (.cg) instead.
template <typename T, int N>
__device__ __forceinline__ void store_streaming(T* dst, const Vec<T, N>& value) {
  __stcs(reinterpret_cast<RawFor<T, N>*>(dst), to_raw(value));
}

// N elements of T as A, and back (16-bit pairs convert with one instruction). A bfloat16 is the
// high half of a float, so a pair widens with one shift and one mask (the conversion intrinsics
// spend an extra PRMT on the high element; the one-token decode kernel extracted and shifted each
// element on its own).
template <typename A, typename T, int N>
__device__ __forceinline__ void widen(const Vec<T, N>& in, A (&out)[N]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && std::is_same_v<A, float> && N % 2 == 0) {
    for (int v = 0; v < N; v += 2) {
      uint32_t pair;
      memcpy(&pair, &in.v[v], sizeof pair);
      out[v] = __uint_as_float(pair << 16);
      out[v + 1] = __uint_as_float(pair & 0xffff0000u);
    }
  } else {
    for (int v = 0; v < N; ++v) out[v] = to_acc<A>(in.v[v]);
  }
}

template <typename T, int N, typename A>
__device__ __forceinline__ Vec<T, N> narrow(const A (&in)[N]) {
  Vec<T, N> out;
  if constexpr (std::is_same_v<T, __nv_bfloat16> && std::is_same_v<A, float> && N % 2 == 0) {
    for (int v = 0; v < N; v += 2) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(in[v], in[v + 1]);
      memcpy(&out.v[v], &pair, sizeof pair);
    }
  } else if constexpr (std::is_same_v<T, __half> && std::is_same_v<A, float> && N % 2 == 0) {
    for (int v = 0; v < N; v += 2) {
      const __half2 pair = __floats2half2_rn(in[v], in[v + 1]);
      memcpy(&out.v[v], &pair, sizeof pair);
    }
  } else {
    for (int v = 0; v < N; ++v) out.v[v] = from_acc<T>(in[v]);
  }
  return out;
}

// N consecutive elements of T from src as floats, in read-only loads of runs of the largest power
// of two bytes, up to 16, that divides N * sizeof(T): src must be aligned to a run, as is any
// N-element row of a 16-byte aligned buffer of such rows. (With one load an element, each of a
// warp's load instructions looks up every L1 line that its threads' rows span.) Zeros where not
// live (src may then be nullptr, the N elements one run), by predicated loads rather than a
// branch: ptxas put a branch's loads after the conversions before it, which waited for their own
// loads (see load_param_rows).
template <typename T, int N>
__device__ __forceinline__ void load_runs(const T* src, float (&out)[N], bool live = true) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  constexpr int kRunBytes = (kBytes & -kBytes) < 16 ? (kBytes & -kBytes) : 16;
  constexpr int kRun = kRunBytes / static_cast<int>(sizeof(T));
  for (int r = 0; r < N; r += kRun) {
    float run[kRun];
    widen(from_raw<T, kRun>(load_readonly_or_zero<T, kRun>(src + r, live)), run);
    for (int v = 0; v < kRun; ++v) out[r + v] = run[v];
  }
}

// Starts a cp.async copy of kBytes (4, 8 or 16) from global src to the shared-window address dst.
template <int kBytes>
__device__ __forceinline__ void copy_async(uint32_t dst, const void* src) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async moves 4, 8 or 16 bytes");
  if constexpr (kBytes == 16) {  // .cg: streamed rows need no L1 copy
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(kBytes)
                 : "memory");
  }
}

// copy_async, or zeros into dst where !copy (cp.async's ignore-src: src is not read; the callers
// still pass an address inside a buffer).
template <int kBytes>
__device__ __forceinline__ void copy_async_or_zeros(uint32_t dst, const void* src, bool copy) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async moves 4, 8 or 16 bytes");
  const uint32_t zeros = !copy;
  if constexpr (kBytes == 16) {
    asm volatile(
        "{\n\t.reg .pred z;\n\tsetp.ne.u32 z, %2, 0;\n\t"
        "cp.async.cg.shared.global [%0], [%1], 16, z;\n\t}\n" ::"r"(dst),
        "l"(src), "r"(zeros)
        : "memory");
  } else {
    asm volatile(
        "{\n\t.reg .pred z;\n\tsetp.ne.u32 z, %2, 0;\n\t"
        "cp.async.ca.shared.global [%0], [%1], %3, z;\n\t}\n" ::"r"(dst),
        "l"(src), "r"(zeros), "n"(kBytes)
        : "memory");
  }
}

// Per-thread rows (one Row word of 4, 8 or 16 bytes) of one buffer, fetched kDepth steps ahead
// with cp.async into shared memory. A copy in flight holds no registers; with the rows loaded into
// registers one step ahead, register pressure capped the vectorized kernels at 12-24% of warps
// active and DRAM at 16-28% of peak (ncu). Each thread reads back only the slots it filled, so the
// only synchronisation is the thread's own wait for its copies. Use: fetch steps 0 .. kDepth-1,
// then per step s: ring_wait<kDepth - 1>(), read(s), and once those bytes are consumed, fetch
// step s + kDepth into the slot just read; every step's fetches (of all rings, live or not) end
// with one ring_commit(), so that the wait always finds step s's group kDepth - 1 groups from the
// newest. The slot addresses are computed once: converting a generic pointer to the shared window
// per copy cost the step loop a special-register read and two address instructions per copy.
template <int kDepth, typename Row, int kBlockThreads>
struct RowRing {
  static_assert((kDepth & (kDepth - 1)) == 0, "kDepth must be a power of two");
  static constexpr int kSlots = kDepth * kBlockThreads;  // Row slots per block: [depth][thread]
  static constexpr int kBytes = static_cast<int>(sizeof(Row));

  const Row* mine;      // the thread's slot at depth 0; neighbouring threads, neighbouring banks
  uint32_t mine_shared;  // the same slot as a shared-window address, for cp.async

  __device__ __forceinline__ explicit RowRing(Row* slots)
      : mine(slots + threadIdx.x),
        mine_shared(static_cast<uint32_t>(__cvta_generic_to_shared(slots + threadIdx.x))) {}

  // Starts the copy of step's row from src, if live.
  __device__ __forceinline__ void fetch(int step, const void* src, bool live) const {
    const uint32_t dst = mine_shared + (step & (kDepth - 1)) * (kBlockThreads * kBytes);
    if (live) copy_async<kBytes>(dst, src);
  }

  // Where fetched, starts the copy of step's row from src, or of zeros where !live (src unread but
  // inside some buffer all the same): a slot read back then holds no stale values.
  __device__ __forceinline__ void fetch_or_zeros(int step, const void* src, bool fetched,
                                                 bool live) const {
    const uint32_t dst = mine_shared + (step & (kDepth - 1)) * (kBlockThreads * kBytes);
    if (fetched) copy_async_or_zeros<kBytes>(dst, src, live);
  }

  __device__ __forceinline__ Row read(int step) const {
    return mine[(step & (kDepth - 1)) * kBlockThreads];
  }

  template <typename T, int N>
  __device__ __forceinline__ Vec<T, N> read(int step) const {
    static_assert(sizeof(Vec<T, N>) == sizeof(Row), "a row is one Row word");
    return from_raw<T, N>(read(step));
  }
};

// kRows per-thread rows of one buffer that a thread needs only late in its work, copied once with
// cp.async into shared memory inside a RowRing's copy group: a ring wait that covers that group
// makes them readable, with no load on the thread's late steps' dependency chains. As in RowRing,
// each thread reads back only the slots it filled.
template <int kRows, typename Row, int kBlockThreads>
struct RowSlots {
  static constexpr int kSlots = kRows * kBlockThreads;  // Row slots per block: [row][thread]
  static constexpr int kBytes = static_cast<int>(sizeof(Row));

  const Row* mine;
  uint32_t mine_shared;

  __device__ __forceinline__ explicit RowSlots(Row* slots)
      : mine(slots + threadIdx.x),
        mine_shared(static_cast<uint32_t>(__cvta_generic_to_shared(slots + threadIdx.x))) {}

  // Starts the copy of row `row` (< kRows) from src.
  __device__ __forceinline__ void fetch(int row, const void* src) const {
    copy_async<kBytes>(mine_shared + row * (kBlockThreads * kBytes), src);
  }

  template <typename T, int N>
  __device__ __forceinline__ Vec<T, N> read(int row) const {
    static_assert(sizeof(Vec<T, N>) == sizeof(Row), "a row is one Row word");
    return from_raw<T, N>(mine[row * kBlockThreads]);
  }
};

// Closes the copy group of one step's fetches.
__device__ __forceinline__ void ring_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most kPending copy groups are in flight.
template <int kPending>
__device__ __forceinline__ void ring_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace causal_conv
