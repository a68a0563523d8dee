// The forward's CUDA kernels, launchers and XLA FFI handler, on top of the conv math in
// conv_math.h. Compile-time widths (K <= 8) with float or half x and 16-byte aligned buffers take
// the vectorized kernels of forward_vector.cuh; the generic kernel here covers the rest, one
// thread per output element, walked in memory order (coalesced in both layouts).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "conv_math.h"
#include "cuda_launch.cuh"
#include "cuda_vector.cuh"
#include "ffi_common.h"
#include "forward_vector.cuh"

namespace causal_conv {
namespace {

int64_t grid_for(int64_t points) {
  return std::max<int64_t>(1, std::min(kMaxGridBlocks, (points + kThreads - 1) / kThreads));
}

template <typename T, typename A, int kWidth>
__global__ void forward_kernel(ConvParams p) {
  const Conv<T, A, kWidth> conv{p};
  const int64_t points = p.batch * p.length * p.channels;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < points;
       i += int64_t{gridDim.x} * blockDim.x) {
    const Point q = point_at(i, p.length, p.channels, p.channel_last);
    conv.store_x_like(p.y, q.b, q.t, q.d, conv.output(q.b, q.t, q.d));
  }
}

template <typename T, typename A, int kWidth>
__global__ void final_state_kernel(ConvParams p) {
  const Conv<T, A, kWidth> conv{p};
  const int64_t points = p.batch * conv.state_len() * p.channels;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < points;
       i += int64_t{gridDim.x} * blockDim.x) {
    const Point q = point_at(i, conv.state_len(), p.channels, p.channel_last);
    conv.store_state_like(p.final_state, q.b, q.t, q.d, conv.final_state(q.b, q.t, q.d));
  }
}

// Time steps per channel-last forward thread: 64 while that leaves at least 32768 threads (64
// against 32 took the main workload from 104 to 85 us when each halo row came from DRAM twice;
// pieces sized to one wave, 171 steps, were slower: 90.6 against 82.6 us), else halved down to 8
// while that leaves fewer (B=8 L=2048 D=256, 512 columns: 32-step pieces 7.5 us, 16-step 7.8,
// 8-step 10.8). Where 64 stays, the length from 32 to 40 with the fewest whole waves of
// `resident` threads x (steps + halo): fitted waves of shorter pieces won at 8 blocks per SM
// (main workload, kernel us: 64 steps, 1.94 waves, 72.2-72.7; 48 steps, 2.6 waves, 71.8-72.0; 32
// steps, 3.88 waves, 71.3-71.5), though their halos were then read from DRAM again (the downward
// pieces of forward_channel_last_kernel now find them in the L2). The reading: a piece's rows
// stream at the pace of its SM's share of the bandwidth, so the grid's end waits on pieces
// started up to a piece's time apart, less of it the shorter they are. The main workload runs 7
// blocks per SM: 36 steps, 3.95 waves, against 48 steps, 2.98 waves, before (H200, kernel us,
// two rounds: 70.85 / 70.72 -> 69.76 / 69.90). From 48 to 64 instead (long_pieces) with seq_idx
// (masked), whose kernel checks its steps 32 at a time (SegmentSteps), two checks a piece either
// way, and at K >= kLongPiecesWidth, where the 16-bit kernels run 4-5 blocks per SM (registers;
// 7 at K = 4): there the short pieces lost (bf16 B=8 L=2048 D=4096, kernel us, short against
// long pieces: K = 8 105.7 against 88.8, K = 7 81.9 against 75.5; twenty-second session).
constexpr int kLongPiecesWidth = 6;

// What the long fit counts, in tenths of a step, for a step that the unmasked kernel's step loop
// leaves to run_steps's one-by-one loop (steps % K of a piece), where the window slides by moves
// instead of register renaming (sm_90 SASS with silu, bf16 K = 8: 115-117 instructions such a
// step, 34 of them moves, against 80.5-83.5 a step of the unrolled loop; K = 7 107-109 against
// 75). Fitted without it, K = 8 took 63-step pieces at 4 blocks per SM (4.0 waves), 7 of each
// piece's steps one by one, where 64 needs no more waves (3.88) and leaves none. H200 trace, B=8
// L=2048 D=4096 BLD fwd (twenty-fifth session, two rounds): bf16 K = 8 77.8 / 77.7 -> 75.7 / 75.6
// us, f16 77.6 / 77.8 -> 75.7 / 75.9 (predicted about 76.3); K = 4 and 7 unchanged. The short fit
// keeps its timed lengths (with this count bf16 K = 5 would go from 34 to 35 steps).
constexpr int64_t kRolledStepTenths = 14;

// unroll: steps per iteration of the kernel's step loop (K; 1 with seq_idx, whose spans decide).
inline int64_t forward_time_chunk(int64_t columns, int64_t length, int64_t resident, int64_t halo,
                                  bool long_pieces, int unroll) {
  constexpr int64_t kLongest = 64, kShortest = 8, kMinThreads = 32768;
  const int64_t fit_from = long_pieces ? 48 : 32, fit_to = long_pieces ? kLongest : 40;
  const auto threads_for = [&](int64_t chunk) { return columns * ((length + chunk - 1) / chunk); };
  int64_t chunk = kLongest;
  while (chunk > kShortest && threads_for(chunk) < kMinThreads) chunk /= 2;
  if (chunk < kLongest || resident <= 0) return chunk;
  const auto cost = [&](int64_t steps) {
    const int64_t rolled = long_pieces ? steps % unroll : 0;
    return waves_cost(threads_for(steps), resident,
                      10 * steps + (kRolledStepTenths - 10) * rolled, 10 * halo);
  };
  chunk = fit_to;
  for (int64_t steps = fit_from; steps < fit_to; ++steps) {
    if (cost(steps) < cost(chunk)) chunk = steps;
  }
  return chunk;
}

// Returns whether the kernel wrote the final state (with seq_idx the channel-last kernel does, and
// the channel-first ones of channel_first_forward_final_state).
template <typename T, int K, bool kMasked>
bool launch_vector_forward(cudaStream_t stream, const ConvParams& p) {
  if (p.channel_last) {
    constexpr int C = channels_per_thread<T, K, kForwardBudget>();
    constexpr auto kernel = forward_channel_last_kernel<T, K, kMasked>;
    const int64_t columns = p.batch * (p.channels / C);
    const int64_t time_chunk = forward_time_chunk(columns, p.length,
                                                  resident_threads<kernel>(kForwardThreads), K - 1,
                                                  kMasked || K >= kLongPiecesWidth,
                                                  kMasked ? 1 : K);
    const int64_t threads = columns * ((p.length + time_chunk - 1) / time_chunk);
    const int64_t blocks =
        std::min(kMaxGridBlocks, (threads + kForwardThreads - 1) / kForwardThreads);
    // Odd pieces run down where a warp's 32 threads take packs of one piece (a row's packs whole
    // runs of 32), so that a warp never holds both directions, and their halos lie at or after
    // time 0; and only where x and y together pass the L2 (or the runtime cannot say its size).
    // Where they fit, a halo row's second read finds the L2 in either order, and a downward piece
    // costs its thread P more ring steps and a second memory round (weights, then biases) before
    // its first step, which at one wave of pieces the kernel's end waits for. H100 traces, BLD
    // fwd kernel us (fiftieth session; all pieces upward against alternating): bf16 B=8 L=2048
    // D=256 6.62-6.66 -> 6.30, K = 8 7.55 -> 7.23, B=8 L=1024 D=512 6.59-6.61 -> 6.34, B=4 L=2048
    // D=1024 10.72 -> 10.43, float32 D=256 8.99 -> 8.93; where they pass it the downward pieces
    // gain: B=8 L=2048 D=1024 25.09 against 25.18 upward, D=4096 93.8-94.0 against 94.8, K = 8
    // 94.9-95.1 against 98.3-98.5, B=1 L=65536 365.0-365.3 against 371.5-371.7.
    const int64_t x_bytes = p.batch * p.length * p.channels * int64_t{sizeof(T)};
    const int64_t l2_bytes = current_device_attribute<cudaDevAttrL2CacheSize>();
    const bool alternate =
        (p.channels / C) % kLanes == 0 && time_chunk >= K - 1 && 2 * x_bytes > l2_bytes;
    kernel<<<blocks, kForwardThreads, 0, stream>>>(p, time_chunk, alternate);
    return kMasked;
  }
  if (const int group = short_row_group(p.length, kPack<T>); group > 0) {
    const auto launch_short_rows = [&](auto features) {
      constexpr auto kernel = forward_short_rows_kernel<T, K, decltype(features)::value>;
      // Planned for the kernel with features' occupancy, as the backward (B=64 L=128 D=4096 bf16
      // K = 4 fwd, H200 traces: 37.5-37.8 us on the plain kernel's own plan, 36.6-36.9 on this).
      const ShortRowLaunch launch =
          short_row_launch<forward_short_rows_kernel<T, K, true>>(p, group);
      kernel<<<launch.blocks, kThreads, 0, stream>>>(p, group, launch.units);
    };
    with_bool_constant(kMasked || has_states(p), launch_short_rows);
    return false;
  }
  constexpr auto kernel = forward_channel_first_kernel<T, K, kMasked>;
  constexpr int kWidth = channel_first_forward_width<T, K, kMasked>();
  // With seq_idx the rows are cut in segments of 32 V times at either width, as many as
  // uniform_segments' masks (kUniformSegments segments of kWidth packs) cover: in the halves'
  // segments of 16 V times, channel_first_chunk's model would cut B=8 L=2048 D=4096's packed rows
  // in two (with items of four rows, 7 waves of half rows against 4 of whole ones; predicted
  // slower, each item's start and mask checks paid twice a row).
  constexpr int kChunkWidth = kMasked ? kLanes : kWidth;
  constexpr int kItemChannels = channel_first_forward_item_channels<T, K>();
  const int64_t chunk_len = channel_first_chunk_for<kernel, T, kMasked, kChunkWidth, kItemChannels>(
      p, forward_item_segments<kMasked>() * kWidth / kChunkWidth);
  const ChannelFirstSplit split(p, chunk_len, channels_per_item<kMasked, kWidth, kItemChannels>());
  const int64_t items = channel_first_items<kMasked, kWidth, kItemChannels>(p, split.chunks.d);
  kernel<<<grid_for_warps(items), kChannelFirstThreads, 0, stream>>>(p, split);
  return channel_first_forward_final_state<T, K, kMasked>();
}

// y: the vectorized kernels where they apply, else one thread per element. final_state_done: set
// where the kernel also wrote the final state.
template <typename T, typename A, int kWidth>
ffi::Error launch_output(cudaStream_t stream, const ConvParams& p, bool& final_state_done) {
  const int64_t points = p.batch * p.length * p.channels;
  if (points == 0) return ffi::Error::Success();
  if constexpr (std::is_same_v<A, float> && kWidth > 0) {
    if (vector_applies<T, kWidth>(p, false)) {
      final_state_done = p.seq_idx != nullptr ? launch_vector_forward<T, kWidth, true>(stream, p)
                                              : launch_vector_forward<T, kWidth, false>(stream, p);
      return cuda_status("vectorized forward kernel");
    }
  }
  forward_kernel<T, A, 0><<<grid_for(points), kThreads, 0, stream>>>(p);
  return cuda_status("forward kernel");
}

template <typename T, typename A, int kWidth>
ffi::Error launch_forward(cudaStream_t stream, const ConvParams& p) {
  bool final_state_done = false;
  if (auto err = launch_output<T, A, kWidth>(stream, p, final_state_done); err.failure()) {
    return err;
  }
  const int64_t state_points = p.batch * (p.width - 1) * p.channels;
  if (p.final_state != nullptr && state_points > 0 && !final_state_done) {
    final_state_kernel<T, A, 0><<<grid_for(state_points), kThreads, 0, stream>>>(p);
    return cuda_status("final state kernel");
  }
  return ffi::Error::Success();
}

ffi::Error forward_handler(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                           ffi::AnyBuffer bias, ffi::AnyBuffer initial_state,
                           ffi::Buffer<ffi::S32> seq_idx, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> final_state, bool silu, bool channel_last) {
  ConvParams p;
  if (auto err = fill_forward_params(x, weight, bias, initial_state, seq_idx, y, final_state, silu,
                                     channel_last, p);
      err.failure()) {
    return err;
  }
  return dispatch_dtype<__half, __nv_bfloat16>(
      x.element_type(), [&](auto types) {
        using Types = decltype(types);
        return dispatch_width<kCudaMaxWidth>(p.width, [&](auto width) {
          return launch_forward<typename Types::Storage, typename Types::Acc,
                                decltype(width)::value>(stream, p);
        });
      });
}

}  // namespace
}  // namespace causal_conv

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CausalConv1dForwardCuda, causal_conv::forward_handler,
    causal_conv::bind_forward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
