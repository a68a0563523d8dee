// The backward's CUDA kernels, launchers and XLA FFI handler, on top of the conv math in
// conv_math.h. Compile-time widths (K <= 8) with float or half x and 16-byte aligned buffers take
// the vectorized kernels of backward_vector.cuh. The generic kernel here covers the rest: a block
// owns a (batch row, time tile, channel chunk). It keeps delta for its tile plus the right halo of
// P rows in shared memory, writes dx only for the times it owns (and dS on the first tile), and
// writes its dw/db sums for the times it owns to a scratch workspace. A second kernel reduces the
// workspace in a fixed order, so dw and db are bitwise deterministic. The workspace is an extra
// output of the custom call (XLA allocates it with the other buffers), sized by
// backward_workspace_elements, which Python asks for at lowering time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backward_vector.cuh"
#include "conv_math.h"
#include "cuda_launch.cuh"
#include "cuda_vector.cuh"
#include "ffi_common.h"

namespace causal_conv {
namespace {

constexpr int64_t kTileLen = 64;

int64_t tile_count(int64_t length) {
  return std::max<int64_t>(1, (length + kTileLen - 1) / kTileLen);
}

// Channels per backward block: keeps the delta tile within 48 KB for every width up to 256.
template <typename A>
constexpr int64_t tile_channels() {
  return sizeof(A) == 8 ? 16 : 32;
}

// Row r and channel c of a (rows x channels) tile for linear index i: channels fastest for the
// channel-last layout, rows (times) fastest otherwise, so a warp reads contiguous memory.
__device__ __forceinline__ void tile_point(int64_t i, int64_t rows, int64_t channels,
                                           bool channel_last, int64_t& r, int64_t& c) {
  if (channel_last) {
    r = i / channels;
    c = i % channels;
  } else {
    r = i % rows;
    c = i / rows;
  }
}

// grid = (time tiles, channel chunks, batch). partials: (batch, tiles, channels, width + 1).
template <typename T, typename A, int kWidth>
__global__ void __launch_bounds__(kThreads)
    backward_tile_kernel(ConvParams p, A* partials, int64_t tiles) {
  constexpr int64_t DC = tile_channels<A>();
  extern __shared__ unsigned char shared_raw[];
  A* delta = reinterpret_cast<A*>(shared_raw);  // (kTileLen + P) x DC
  const Conv<T, A, kWidth> conv{p};
  const int64_t K = conv.width(), P = conv.state_len();
  const int64_t b = blockIdx.z, tile = blockIdx.x, d0 = int64_t{blockIdx.y} * DC;
  const int64_t a = tile * kTileLen;
  const int64_t tile_end = a + kTileLen < p.length ? a + kTileLen : p.length;
  const int64_t delta_rows = kTileLen + P;

  for (int64_t i = threadIdx.x; i < delta_rows * DC; i += blockDim.x) {
    int64_t r, c;
    tile_point(i, delta_rows, DC, p.channel_last, r, c);
    const int64_t d = d0 + c;
    delta[r * DC + c] = d < p.channels ? conv.delta(b, a + r, d) : A(0);
  }
  __syncthreads();

  // dx for the owned times, and dS = dx on [-P, 0) in the first tile.
  const int64_t first_u = (tile == 0 && p.dinitial_state != nullptr) ? -P : a;
  const int64_t owned = tile_end - first_u;
  for (int64_t i = threadIdx.x; i < owned * DC; i += blockDim.x) {
    int64_t r, c;
    tile_point(i, owned, DC, p.channel_last, r, c);
    const int64_t u = first_u + r, d = d0 + c;
    if (d >= p.channels) continue;
    const auto delta_at = [&](int64_t t) { return delta[(t - a) * DC + c]; };
    const A g = conv.input_grad(b, u, d, delta_at);
    if (u >= 0) {
      conv.store_x_like(p.dx, b, u, d, g);
    } else {
      conv.store_state_like(p.dinitial_state, b, u + P, d, g);
    }
  }

  // dw[k] (k < K) and db (k == K) over the owned times only: halo rows belong to the next tile.
  A* out = partials + (b * tiles + tile) * p.channels * (K + 1);
  for (int64_t i = threadIdx.x; i < (K + 1) * DC; i += blockDim.x) {
    const int64_t c = i % DC, k = i / DC, d = d0 + c;
    if (d >= p.channels) continue;
    A sum = A(0);
    for (int64_t t = a; t < tile_end; ++t) {
      const A delta_t = delta[(t - a) * DC + c];
      sum += k == K ? delta_t : conv.weight_grad_term(b, t, k, d, delta_t);
    }
    out[d * (K + 1) + k] = sum;
  }
}

// Sums the partials of each weight group in a fixed order. A block owns kColumns consecutive
// (channel, k) columns of one group; its thread (column c, lane l) keeps kSums running sums, the
// u-th adding slices l + u * lanes, l + (kSums + u) * lanes, ... of column c (their loads in
// flight together), then lane 0 adds the lane sums in order. No atomics: bitwise deterministic.
// The sums are stored in the params' type: A, or T when like_x.
template <typename T, typename A, int kColumns, int kSums>
__global__ void __launch_bounds__(kThreads)
    reduce_partials_kernel(const A* partials, int64_t groups, int64_t rows_per_group,
                           int64_t slices, int64_t channels, int64_t width, bool like_x,
                           void* dweight, void* dbias) {
  constexpr int kLanesPerColumn = kThreads / kColumns;
  __shared__ A lane_sums[kLanesPerColumn][kColumns];
  const int64_t per_group = channels * (width + 1);
  const int64_t column_blocks = (per_group + kColumns - 1) / kColumns;
  const int column = threadIdx.x % kColumns, lane = threadIdx.x / kColumns;
  const int64_t count = rows_per_group * slices;
  wait_for_prior_grid();  // the kernel that wrote the partials (launch_dependent)
  for (int64_t block = blockIdx.x; block < groups * column_blocks; block += gridDim.x) {
    const int64_t g = block / column_blocks;
    const int64_t j = (block % column_blocks) * kColumns + column;
    A sums[kSums];
#pragma unroll
    for (int u = 0; u < kSums; ++u) sums[u] = A(0);
    if (j < per_group) {
      const A* first = partials + g * count * per_group + j;
      for (int64_t s = lane; s < count; s += kLanesPerColumn * kSums) {
#pragma unroll
        for (int u = 0; u < kSums; ++u) {
          const int64_t slice = s + int64_t{u} * kLanesPerColumn;
          if (kSums == 1 || slice < count) sums[u] += first[slice * per_group];
        }
      }
    }
    A sum = sums[0];
#pragma unroll
    for (int u = 1; u < kSums; ++u) sum += sums[u];
    lane_sums[lane][column] = sum;
    __syncthreads();
    if (lane == 0 && j < per_group) {
      A total = A(0);
      for (int l = 0; l < kLanesPerColumn; ++l) total += lane_sums[l][column];
      const int64_t d = j / (width + 1), k = j % (width + 1);
      if (k == width) {
        store_param<T, A>(dbias, g * channels + d, total, like_x);
      } else {
        store_param<T, A>(dweight, (g * channels + d) * width + k, total, like_x);
      }
    }
    __syncthreads();
  }
}

// Where the dw/db partials lie: per weight group, rows_per_group rows of `slices` slices of
// D x (K + 1) sums each, in that order (the batch rows of a group and their tiles or chunks, or one
// row of the short-row backward's runs). reduced: the kernel wrote dweight and dbias itself (one
// slice a weight group), so that no reduction runs.
struct PartialSlices {
  int64_t rows_per_group, slices;
  bool reduced = false;
};

// The reduction's two shapes. Wide blocks (32 columns x 8 lanes, one sum: each warp reads 128
// contiguous bytes a slice) serve most problems; below kReduceMinBlocks wide blocks (few
// channels: D = 256, K = 4 makes 40) the SMs would mostly idle, so narrow blocks of 8 columns x
// 32 lanes take 4x as many blocks, each thread with 4 loads in flight (H200, B=8 L=2048 D=256 bf16
// backward 29.1 -> 23.0 us; at B=64 L=128 D=4096, 640 wide blocks, narrow ones lost 11%).
constexpr int64_t kReduceMinBlocks = 256;
constexpr int kWideColumns = 32, kNarrowColumns = 8;

// The blocks of `columns` (channel, k) columns each that cover every weight group's columns.
int64_t reduce_blocks(const ConvParams& p, int columns) {
  return p.groups * ((p.channels * (p.width + 1) + columns - 1) / columns);
}

template <typename T, typename A, int kColumns, int kSums>
void launch_reduce(cudaStream_t stream, const ConvParams& p, const A* partials,
                   PartialSlices slices, void* dweight, void* dbias) {
  const int64_t blocks = std::max<int64_t>(1, std::min(kMaxGridBlocks, reduce_blocks(p, kColumns)));
  launch_dependent(reduce_partials_kernel<T, A, kColumns, kSums>,
                   dim3(static_cast<unsigned>(blocks)), dim3(kThreads), stream, partials, p.groups,
                   slices.rows_per_group, slices.slices, p.channels, p.width, p.params_like_x,
                   dweight, dbias);
}

// Time steps per thread (a tile) for the channel-last backward, whose threads each stream one
// column (batch row, channel pack) over a tile of the time axis: the longest tiles (at least
// min_steps, which the workspace bounds; see the launch) that still make kBackwardMinThreads
// threads, or `resident` where the device holds fewer. Each tile adds a prologue and a slice of
// dw/db partials (written, then read by the reduction; measured before the launch grouped tiles
// into slices, see kSliceTiles), and more threads than that did not move the bytes faster. On
// the H200, main workload (bf16 B=8 L=2048 D=4096 K=4, 8192 columns; kernel + reduction, us):
// 256-step tiles (65536 threads, about one wave) 116.4-117.2, 384 122.8, 512 (32768 threads)
// 113.1-113.4, 1024 139.5, 2048 243; D=8192: 512 217.2, 1024 (32768 threads) 215.2, 2048 268.8;
// B=1 L=65536: 1024 421, 2048 (32768 threads) 414.8, 4096 527.5 (benchmarks/RESULTS.md,
// fifteenth session).
constexpr int64_t kBackwardMinThreads = 32768;
inline int64_t steps_per_thread(int64_t columns, int64_t length, int64_t resident,
                                int64_t min_steps) {
  constexpr int64_t kMaxSteps = int64_t{1} << 24;  // the kernels count steps in an int
  const int64_t threads =
      resident > 0 ? std::min(kBackwardMinThreads, resident) : kBackwardMinThreads;
  const int64_t per_piece = std::max<int64_t>(columns, 1);
  const int64_t pieces = std::max<int64_t>(1, (threads + per_piece - 1) / per_piece);
  return std::min(kMaxSteps, std::max(min_steps, (length + pieces - 1) / pieces));
}

// Launches kClustered (a channel-first backward with kClusterSums) in clusters that each take
// every item of a weight group's channel group (ClusterPlace), whose first block sums their dw/db
// (ClusterSums), so that the reduction's launch goes; or returns false where kPlain, its twin
// without clusters, is to run instead: where a cluster of at most 8 blocks cannot hold those
// items in whole blocks, and where the grid would not fill the device once (kPlain's
// occupancy). H100, BDL bwd by bench.py's loop (fifty-second and fifty-third sessions): B=8
// L=2048 D=4096 bf16 143.5 -> 142.0 us, float16 143.4 -> 142.0, D = 8192 280.1 -> 278.1; the
// tensor-core kernel at K = 8 147.1 -> 144.8 and K = 7 146.6 -> 145.1 (fifty-fourth). In one
// partial wave (B=8 L=2048 D=256 bf16: 2048 warps, 2640 resident) the clustered kernel took
// 10.4-10.5 us against main's 8.8-8.9 and its reduction, no gain by the loop, and neither
// spreading its clusters over the SMs nor capping blocks an SM mended that.
template <auto kPlain, auto kClustered>
bool launch_cluster_sums(cudaStream_t stream, const ConvParams& p, const ChannelFirstSplit& split,
                         float* partials, void* dweight, void* dbias) {
  constexpr int64_t kWarps = kChannelFirstThreads / kLanes;
  const int64_t cluster_items = ClusterPlace::slots(split);
  const int64_t cluster_blocks = cluster_items / kWarps;
  const int64_t blocks = p.groups * split.channel_groups.d * cluster_blocks;
  const int64_t resident_warps = resident_threads<kPlain>(kChannelFirstThreads) / kLanes;
  // cluster_blocks >= 2: the warps hand their sums to the leader by st.async, which needs a
  // cluster of two blocks or more (compute-sanitizer's memcheck flags it in one of one block:
  // "Cluster needs to have at least 2 blocks"), so one block's items take kPlain and the reduction.
  if (cluster_items % kWarps != 0 || cluster_items > kMaxClusterItems || cluster_blocks < 2 ||
      blocks > kMaxGridBlocks || resident_warps == 0 || blocks * kWarps < resident_warps ||
      current_device_attribute<cudaDevAttrClusterLaunch>() == 0) {
    return false;
  }
  launch_clustered(kClustered, dim3(static_cast<unsigned>(blocks)), dim3(kChannelFirstThreads),
                   static_cast<unsigned>(cluster_blocks), stream, p, partials, dweight, dbias,
                   split);
  return true;
}

// Launches dx, dS and the dw/db partials (or dweight and dbias themselves); returns where the
// partials lie.
template <typename T, int K, bool kMasked>
PartialSlices launch_vector_backward(cudaStream_t stream, const ConvParams& p, float* partials,
                                     void* dweight, void* dbias) {
  const int64_t rows_per_group = p.batch / p.groups;
  if (p.channel_last) {
    constexpr int C = channels_per_thread<T, K, kBackwardBudget>();
    constexpr auto kernel = backward_channel_last_kernel<T, K, kMasked>;
    const int64_t packs = p.channels / C, columns = p.batch * packs;
    // The workspace holds tile_count(L) slices a row, enough for kTileLen-step tiles ungrouped
    // and for tiles down to kTileLen / kSliceTiles grouped (a slice per kSliceTiles tiles), which
    // a row whose packs are whole runs of 32 may take. Such rows go down to 32-step tiles where
    // columns are few: B=8 L=2048 D=256 bf16 K = 4 (512 columns) runs 256 blocks, not 128.
    // H100 traces, BLD bwd kernel (forty-second session, us): with seq_idx and states 17.0 ->
    // 15.45, without 11.0-11.1 -> 10.9-11.0; 16-step tiles (512 blocks) took 12.3-12.4 without.
    const bool whole_runs = packs % kLanes == 0;
    const int64_t tile_len =
        steps_per_thread(columns, p.length, resident_threads<kernel>(kBackwardThreads),
                         whole_runs ? kTileLen / 2 : kTileLen);
    const int64_t tiles = (p.length + tile_len - 1) / tile_len;
    // A slice per kSliceTiles tiles where a row's packs are whole runs of 32 and there are that
    // many tiles (with fewer, most of a block's warps would idle to save a slice or two), or more
    // tiles than the workspace holds slices ungrouped (tiles shorter than kTileLen).
    const bool group = whole_runs && (tiles >= kSliceTiles || tiles > tile_count(p.length));
    const int64_t slices = group ? (tiles + kSliceTiles - 1) / kSliceTiles : tiles;
    // The kernel's reading of grouping (fewer slices than tiles), taken here too, so that the two
    // cannot disagree: their own rules once did, for rows of one tile (which this leaves
    // ungrouped). The kernel does not take a flag: at its register cap, the f16 K = 2 kernel
    // spilled 8 bytes with one.
    const bool grouped = slices < tiles;
    const int64_t threads = columns * (grouped ? slices * kSliceTiles : tiles);
    const int64_t blocks =
        std::min(kMaxGridBlocks, (threads + kBackwardThreads - 1) / kBackwardThreads);
    const ChannelLastTiles split{tile_len, tiles, FastDivisor(grouped ? packs / kLanes : packs),
                                 FastDivisor(slices)};
    auto* chosen = kernel;
    if constexpr (backward_edge_copies_by_tile<T, K, kMasked>()) {
      // The same registers and blocks an SM as `kernel` (sm_90 ptxas: bf16 214 against 202,
      // float16 208 against 206, 2 blocks either way), so tile_len's plan holds for it.
      if (tile_len >= kCheckedEdgesMinTile) {
        chosen = backward_channel_last_kernel<T, K, kMasked, false>;
      }
    }
    chosen<<<blocks, kBackwardThreads, 0, stream>>>(p, partials, split);
    return {rows_per_group, slices};
  }
  if (const int group = short_row_group(p.length, kPack<T>); group > 0) {
    // With one run a weight group, a unit's sums are its channels' dw and db: the kernel stores
    // them, and the reduction's launch (and the gap before it) goes.
    const auto launch_short_rows = [&](auto features) {
      constexpr auto kernel = backward_short_rows_kernel<T, K, decltype(features)::value>;
      // Units and grid planned for the kernel with features' occupancy (2 blocks an SM) whichever
      // runs: planned for the plain kernel's 3, B=64 L=128 D=4096 took runs of 22 rows and kept
      // the reduction. H200 traces, bf16 K = 4 bwd: main 64.1-64.4 us, plain kernels on their
      // own plan 60.4-60.7, on this one 54.7-54.9 (thirty-sixth session).
      const ShortRowLaunch launch =
          short_row_launch<backward_short_rows_kernel<T, K, true>>(p, group);
      const bool reduced = launch.units.runs.d == 1;
      kernel<<<launch.blocks, kThreads, 0, stream>>>(p, partials, reduced ? dweight : nullptr,
                                                     reduced ? dbias : nullptr, group,
                                                     launch.units);
      return PartialSlices{1, launch.units.runs.d, reduced};
    };
    return with_bool_constant(kMasked || has_states(p), launch_short_rows);
  }
  if constexpr (std::is_same_v<T, __nv_bfloat16> && !kMasked && (K == 7 || K == 8)) {
    // The tensor-core kernel leaves the states to the scalar one (its first and last blocks
    // would need their taps).
    constexpr auto kernel = backward_channel_first_mma_kernel<K>;
    const int64_t rows = p.batch * p.channels;
    const int64_t chunk_len = channel_first_chunk(
        rows, p.length, kMmaBlock, resident_threads<kernel>(kChannelFirstThreads) / kLanes,
        kUnlimitedSegments);
    if (!has_states(p) &&
        chunk_len >= kMmaMinItemBlocks * kMmaBlock) {
      const ChannelFirstSplit split(p, chunk_len, 1);
      if (launch_cluster_sums<kernel, backward_channel_first_mma_kernel<K, true>>(
              stream, p, split, partials, dweight, dbias)) {
        return {rows_per_group, split.chunks.d, true};
      }
      kernel<<<grid_for_warps(rows * split.chunks.d), kChannelFirstThreads, 0, stream>>>(
          p, partials, nullptr, nullptr, split);
      return {rows_per_group, split.chunks.d};
    }
  }
  constexpr auto kernel = backward_channel_first_kernel<T, K, kMasked>;
  constexpr int kWidth = channel_first_backward_width<T, K, kMasked>();
  const int64_t chunk_len = channel_first_chunk_for<kernel, T, kMasked, kWidth>(
      p, backward_item_segments<kMasked>(p.length, int64_t{kWidth} * kPack<T>));
  const ChannelFirstSplit split(p, chunk_len, channels_per_item<kMasked, kWidth>());
  if constexpr (!kMasked) {
    if (launch_cluster_sums<kernel, backward_channel_first_kernel<T, K, false, true>>(
            stream, p, split, partials, dweight, dbias)) {
      return {rows_per_group, split.chunks.d, true};
    }
  }
  const int64_t items = channel_first_items<kMasked, kWidth>(p, split.chunks.d);
  kernel<<<grid_for_warps(items), kChannelFirstThreads, 0, stream>>>(p, partials, nullptr,
                                                                    nullptr, split);
  return {rows_per_group, split.chunks.d};
}

// Launches the dw/db partial sums (and dx, dS) kernel; sets where it wrote them, or returns an
// error.
template <typename T, typename A, int kWidth>
ffi::Error launch_backward_partials(cudaStream_t stream, const ConvParams& p, A* partials,
                                    void* dweight, void* dbias, PartialSlices& slices) {
  if constexpr (std::is_same_v<A, float> && kWidth > 0) {
    if (vector_applies<T, kWidth>(p, true)) {
      slices = p.seq_idx != nullptr
                   ? launch_vector_backward<T, kWidth, true>(stream, p, partials, dweight, dbias)
                   : launch_vector_backward<T, kWidth, false>(stream, p, partials, dweight, dbias);
      return cuda_status("vectorized backward kernel");
    }
  }
  constexpr int64_t DC = tile_channels<A>();
  slices = {p.batch / p.groups, tile_count(p.length)};
  const int64_t chunks = (p.channels + DC - 1) / DC;
  if (p.batch > 65535 || chunks > 65535) {
    return invalid("backward supports at most 65535 batch rows and 65535 * 32 channels");
  }
  const size_t shared_bytes = sizeof(A) * static_cast<size_t>((kTileLen + p.width - 1) * DC);
  const dim3 grid(static_cast<unsigned>(slices.slices), static_cast<unsigned>(chunks),
                  static_cast<unsigned>(p.batch));
  backward_tile_kernel<T, A, 0><<<grid, kThreads, shared_bytes, stream>>>(p, partials,
                                                                          slices.slices);
  return cuda_status("backward tile kernel");
}

template <typename T, typename A, int kWidth>
ffi::Error launch_backward(cudaStream_t stream, const ConvParams& p, void* dweight, void* dbias,
                           size_t workspace_elements, A* partials) {
  const int64_t per_slice = p.channels * (p.width + 1);
  // Every kernel above writes at most tile_count(L) slices per row.
  if (workspace_elements < static_cast<size_t>(p.batch * tile_count(p.length) * per_slice)) {
    return invalid("workspace is too small");
  }
  PartialSlices slices{p.batch / p.groups, 0};
  if (p.batch > 0 && p.channels > 0) {
    if (auto err = launch_backward_partials<T, A, kWidth>(stream, p, partials, dweight, dbias,
                                                          slices);
        err.failure()) {
      return err;
    }
  }
  if (slices.reduced) return ffi::Error::Success();
  if (reduce_blocks(p, kWideColumns) >= kReduceMinBlocks) {
    launch_reduce<T, A, kWideColumns, 1>(stream, p, partials, slices, dweight, dbias);
  } else {
    launch_reduce<T, A, kNarrowColumns, 4>(stream, p, partials, slices, dweight, dbias);
  }
  return cuda_status("reduce kernel");
}

ffi::Error backward_handler(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                            ffi::AnyBuffer initial_state, ffi::Buffer<ffi::S32> seq_idx,
                            ffi::AnyBuffer dy, ffi::AnyBuffer dfinal_state,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                            ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::AnyBuffer> dinitial_state,
                            ffi::Result<ffi::AnyBuffer> workspace, bool silu, bool channel_last) {
  ConvParams p;
  if (auto err = fill_backward_params(x, weight, bias, initial_state, seq_idx, dy, dfinal_state, dx,
                                      dweight, dbias, dinitial_state, silu, channel_last, p);
      err.failure()) {
    return err;
  }
  if (workspace->element_type() != accumulation_type(x.element_type())) {
    return invalid("the backward workspace must have x's accumulation dtype");
  }
  return dispatch_dtype<__half, __nv_bfloat16>(
      x.element_type(), [&](auto types) {
        using Types = decltype(types);
        using A = typename Types::Acc;
        return dispatch_width<kCudaMaxWidth>(p.width, [&](auto width) {
          return launch_backward<typename Types::Storage, A, decltype(width)::value>(
              stream, p, dweight->untyped_data(), dbias->untyped_data(),
              workspace->element_count(), static_cast<A*>(workspace->untyped_data()));
        });
      });
}

}  // namespace

int64_t backward_workspace_elements(int64_t batch, int64_t length, int64_t channels,
                                    int64_t width) {
  return batch * tile_count(length) * channels * (width + 1);
}

}  // namespace causal_conv

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CausalConv1dBackwardCuda, causal_conv::backward_handler,
    causal_conv::bind_backward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
