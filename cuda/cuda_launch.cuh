// Host-side launch rules shared by the forward (forward_cuda.cu) and backward (backward_cuda.cu)
// launchers: which kernels apply, and grid sizes from the device's resident threads.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "conv_vector.cuh"
#include "cuda_vector.cuh"
#include "ffi_common.h"

namespace causal_conv {

inline constexpr int64_t kMaxGridBlocks = int64_t{1} << 20;

// Whether the vectorized kernels apply: a compile-time width, float or half x, packs that tile
// the contiguous dimension, and 16-byte aligned buffers (the weight and bias too: the channel-last
// forward loads them in runs, load_weight_runs; in the backward dy, dF and the gradients' too: the
// masked channel-last backward copies dF's rows by cp.async).
template <typename T, int kWidth>
bool vector_applies(const ConvParams& p, bool backward) {
  if constexpr (kWidth == 0 || std::is_same_v<T, double>) {
    return false;
  } else {
    const int64_t contiguous = p.channel_last ? p.channels : p.length;
    const bool forward_ok = contiguous % kPack<T> == 0 && aligned16(p.x) && aligned16(p.y) &&
                            aligned16(p.weight) && (p.bias == nullptr || aligned16(p.bias)) &&
                            (p.initial_state == nullptr || aligned16(p.initial_state)) &&
                            (p.seq_idx == nullptr || aligned16(p.seq_idx));
    const bool state_ok = (p.dinitial_state == nullptr || aligned16(p.dinitial_state)) &&
                          (p.dfinal_state == nullptr || aligned16(p.dfinal_state));
    return forward_ok && (!backward || (aligned16(p.dy) && aligned16(p.dx) && state_ok));
  }
}

// Blocks of kChannelFirstThreads for a kernel in which each warp takes whole items (channel-first
// rows or pieces of them).
inline int64_t grid_for_warps(int64_t items) {
  const int64_t blocks = (items * kLanes + kChannelFirstThreads - 1) / kChannelFirstThreads;
  return std::max<int64_t>(1, std::min(kMaxGridBlocks, blocks));
}

// Threads of kKernel (launched in blocks of block_threads) that the device holds at once, or 0 if
// the runtime cannot say. Cached per device (cached_per_device): the occupancy query costs host
// time on every launch.
template <auto kKernel>
int64_t resident_threads(int block_threads) {
  static std::atomic<int64_t> cached[kCachedDevices] = {};
  return cached_per_device(cached, [block_threads](int device) -> int64_t {
    const int sms = device_attribute(device, cudaDevAttrMultiProcessorCount);
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, block_threads, 0) !=
        cudaSuccess) {
      cudaGetLastError();  // a failed query must not surface as the launch's error
      return 0;
    }
    return int64_t{sms} * blocks * block_threads;
  });
}

// The short-row kernels' units (ShortRowUnits) for a device that holds resident_warps of their
// warps (0: unknown): runs of batch rows cut by channel_first_chunk's model of waves, a batch row
// standing for a segment (and a unit's weights and ring fill, and the backward's reduction, for
// an item's fixed cost), so that many channels take long runs and few channels short ones that
// fill the device. B=64 L=128 D=4096 (bf16: 2048 channel blocks of 2 rows) takes whole 64-row
// runs in the backward (2112 warps on the H200), a unit a warp, and 32-row runs in the forward
// (K = 4: 4224 warps), 4096 units.
inline ShortRowUnits short_row_units(const ConvParams& p, int group, int64_t resident_warps) {
  const int64_t rows_per_item = kLanes / group;
  const int64_t blocks = (p.channels + rows_per_item - 1) / rows_per_item;
  const int64_t batch_per_group = p.batch / p.groups;
  const int64_t chunk = channel_first_chunk(p.groups * blocks, batch_per_group, 1, resident_warps,
                                            kUnlimitedSegments);
  const int64_t runs = (batch_per_group + chunk - 1) / chunk;
  return ShortRowUnits{chunk, FastDivisor(runs), FastDivisor(blocks), batch_per_group,
                       p.groups * runs * blocks};
}

// A short-row kernel's launch: its units, and blocks of kThreads for a warp per unit but no more
// warps than the device holds at once, so that each takes its units in turn.
struct ShortRowLaunch {
  ShortRowUnits units;
  int64_t blocks;
};

template <auto kKernel>
ShortRowLaunch short_row_launch(const ConvParams& p, int group) {
  const int64_t resident_warps = resident_threads<kKernel>(kThreads) / kLanes;
  const ShortRowUnits units = short_row_units(p, group, resident_warps);
  const int64_t warps = resident_warps > 0 ? std::min(units.count, resident_warps) : units.count;
  const int64_t blocks = (warps * kLanes + kThreads - 1) / kThreads;
  return {units, std::max<int64_t>(1, std::min(kMaxGridBlocks, blocks))};
}

// channel_first_chunk for kKernel's launch: its warp items of one chunk per row (as
// channel_first_items), and the warps the device holds of it; segments of kWidth packs.
template <auto kKernel, typename T, bool kMasked, int kWidth = kLanes,
          int kMaskedChannels = kUniformChannels>
int64_t channel_first_chunk_for(const ConvParams& p, int64_t max_segments) {
  const int64_t resident_warps = resident_threads<kKernel>(kChannelFirstThreads) / kLanes;
  return channel_first_chunk(channel_first_items<kMasked, kWidth, kMaskedChannels>(p, 1),
                             p.length, int64_t{kWidth} * kPack<T>, resident_warps, max_segments);
}

}  // namespace causal_conv
