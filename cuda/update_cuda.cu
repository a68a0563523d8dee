// The causal_conv1d_update CUDA kernels and their XLA FFI handler. A decode step has batch *
// channels independent pieces of work; neighbouring threads take neighbouring channels.
//
// The common step (one token, a K-1 slot state, compile-time K) has its own kernel: a thread owns
// a vector of channels, loads their weights once and walks batch rows, each row's token and
// history loaded before the previous row's y and state are written. The generic kernel runs
// update_math.h one channel at a time, whose in-place state shift alternates loads and stores, so
// each state slot costs a memory round trip.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>
#include <string>

#include "cuda_vector.cuh"
#include "ffi_common.h"
#include "update_math.h"

namespace causal_conv {
namespace {

constexpr int kUpdateThreads = 256;
constexpr int64_t kUpdateMaxBlocks = int64_t{1} << 20;

template <typename T, typename A, int kWidth>
__global__ void update_kernel(UpdateParams p) {
  const Update<T, A, kWidth> op{p};
  const int64_t work = p.batch * p.channels;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < work;
       i += int64_t{gridDim.x} * blockDim.x) {
    op.run(i / p.channels, i % p.channels);
  }
}

// The V * K weights and V biases of a thread's channels, as A: stored in A, or in T when like_x
// (conv_math.h's load_param rule). The bias is always there (fill_update_params requires
// (groups, channels); the caller passes zeros for none). No thread of the kernel writes them:
// 16-byte read-only loads where the launch has checked the alignment (kWide), else one load per
// value. All are issued before the first is widened, so the thread waits for them once.
template <typename T, typename A, int K, int V, bool kWide>
__device__ __forceinline__ void load_token_params(const UpdateParams& p, int64_t channel0,
                                                  A (&w)[V * K], A (&bias)[V]) {
  with_param_type<T, A>(p.params_like_x, [&](auto stored_like_x) {
    using S = std::conditional_t<decltype(stored_like_x)::value, T, A>;
    constexpr int W = kWide ? 16 / static_cast<int>(sizeof(S)) : 1;
    static_assert(V % W == 0, "whole 16-byte words");
    using Word = RawFor<S, W>;
    const S* weight = static_cast<const S*>(p.weight) + channel0 * K;
    const S* bias_src = static_cast<const S*>(p.bias) + channel0;
    Word w_raw[V * K / W], bias_raw[V / W];
    for (int i = 0; i < V * K / W; ++i) w_raw[i] = __ldg(reinterpret_cast<const Word*>(weight) + i);
    for (int i = 0; i < V / W; ++i) {
      bias_raw[i] = __ldg(reinterpret_cast<const Word*>(bias_src) + i);
    }
    for (int i = 0; i < V * K / W; ++i) {
      widen(from_raw<S, W>(w_raw[i]), reinterpret_cast<A(&)[W]>(w[i * W]));
    }
    for (int i = 0; i < V / W; ++i) {
      widen(from_raw<S, W>(bias_raw[i]), reinterpret_cast<A(&)[W]>(bias[i * W]));
    }
  });
}

// The one-token kernel's rows. A thread walks batch rows of its channels, loading its weights
// once for all of them, and (kAhead) has two in flight: the next row's loads are issued before the
// current row's compute and stores, so they overlap those stores. Two rows at once was the best
// count when a thread took a fixed tile of rows and loaded them all before its first store (H200,
// B 256, D 8192, bf16, K 4, channel-last / channel-first, us per step: 1 row 17.3 / 20.4, 2 rows
// 13.2 / 14.3, 3 rows 13.9 / 16.5, 4 rows 16.1 / 17.0). Two rows' words and the weights fit
// kTokenRegisters 32-bit registers (with the addresses at most 128, two blocks of 256 per SM)
// up to K = 5 in 16-bit types and K = 7 in float (two rows of wider filters spilled up to 340
// bytes); a thread of a wider filter takes one row, the grid all rows at once. Walking rows, the
// grid is one wave of resident blocks (two waves of two-row tiles before), so no block waits for
// a second wave.
constexpr int kTokenRegisters = 80;
constexpr int kTokenBlocksPerSm = 2;

template <typename T, typename A, int K, int V>
constexpr bool token_ahead() {
  constexpr int weights = V * K * static_cast<int>(sizeof(A)) / 4;
  constexpr int row = K * ((V * static_cast<int>(sizeof(T)) + 3) / 4);
  return weights + 2 * row <= kTokenRegisters;
}

// The grid, in 32 bits (the launch checks that it fits): a thread takes V channels (vector x) of
// the rows y, y + gridDim.y * blockDim.y, ... of weight group z, so that it finds its work without
// an integer division. Grid x covers a group's channel vectors; a block is (vectors rounded up to
// a warp, at most kUpdateThreads) x (as many rows as fill kUpdateThreads), so neighbouring threads
// take neighbouring channels of the same rows and a warp's lanes take consecutive vectors of one
// row.
struct TokenGrid {
  uint32_t vectors;       // channels / V
  uint32_t group_rows;    // batch / groups
  int32_t state_channel;  // state stride of a channel
  int32_t state_word;     // state stride between a channel vector's loads of V elements
};

// One token per row, state_len == K - 1, shift or ring mode: V channels of several rows per thread.
// Each state load and store moves V elements. Channel-last, load j is history step j of the V
// channels; channel-first with V > 1 (kInterleaved, shift mode only), the V channels' K - 1 steps
// are contiguous and load j holds elements j * V .. j * V + V - 1 of them, channel-major, so the
// shift happens between registers.
//
// kStaged (channel-first, when a warp's 32 lanes take 32 consecutive vectors of the same rows):
// the warp's state words of a row are 32 * P contiguous words, which it moves between global and
// shared memory as P coalesced 512-byte accesses; each lane then takes its own P words from
// shared memory. Straight from global memory, a load instruction's 32 lanes touch words P apart
// (48 bytes at K = 4): on the H200 the decode step's kernel took 10.7 us (L2-warm) that way and
// 8.4 us staged, 13.2 -> 12.9 us a step in a jitted loop (eleventh session, trial-decode). A row's
// coalesced words pass through shared memory when the thread comes to compute it, a row after
// their loads were issued.
//
// Every store of y and the state is evict-first (streaming): the step writes both once and the
// next read of the state is a step later (12.4 -> 12.2 us a step channel-last, 13.2 -> 12.8
// channel-first, same trial).
//
// The kernel is latency-bound, so its instruction count is the lever: the activation is chosen
// once (the rows' compute is compiled for silu and for none, no select per element), the rows
// come from the grid's indices (no division of a flat index by run-time divisors before the
// first load), and bfloat16 words widen a pair per instruction (the token, the history, the
// weights and bias) and narrow a pair per instruction. bf16 K = 4, channel-last / staged
// channel-first: the silu path's static SASS instructions 704 / 688 -> 600 / 600, registers
// 113 / 115 -> 105 / 111 (two-row tiles, before the pipe).
//
// Its memory round trips are the other lever: a thread issues its loads before it waits for any.
// The first row's token and history go before the weights and bias (all of the params' loads
// issued before the first is widened), and each next row's before the current row's compute and
// stores; a staged row passes through shared memory when it is computed, its global loads issued
// a row earlier. kDirect (no state_indices, no cache_seqlens: the common step) drops the pool row
// lookup, the padding rows and the ring; only the kernels that walk rows have it. bf16 K = 4
// silu, channel-last / staged channel-first, SASS instructions a row: two-row tiles 249 / 281
// executed; the load order and kDirect on those tiles 192 / 240 executed, the first load of x or
// the state at instruction 203 / 205 -> 53 / 55; walking rows with both, the walk's loop 182 / 213
// static (a thread's 135 / 133 before the walk once), the first load at 51 / 54, registers 108 /
// 113. On the H200 (B 256, D 8192, bf16, K 4; us a step in a jitted loop, channel-last /
// channel-first): two-row tiles 12.2 / 12.35, with the load order and kDirect 11.75 / 12.45, the
// walk alone 11.55 / 11.8, both 11.6 / 11.55 (benchmarks/RESULTS.md, fourteenth session).
template <typename T, typename A, int K, int V, bool kInterleaved, bool kStaged, bool kDirect>
__global__ void __launch_bounds__(kUpdateThreads, kTokenBlocksPerSm)
    update_token_kernel(UpdateParams p, TokenGrid g) {
  static_assert(!kStaged || kInterleaved, "staging moves channel-first interleaved state");
  constexpr int P = K - 1;
  constexpr bool kAhead = token_ahead<T, A, K, V>();
  using Word = RawFor<T, V>;
  constexpr int kWarps = kUpdateThreads / kLanes;
  __shared__ Word stage[kStaged ? kWarps : 1][kStaged ? kLanes * P : 1];
  const uint32_t vector = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t first = blockIdx.y * blockDim.y + threadIdx.y, step = gridDim.y * blockDim.y;
  if (vector >= g.vectors || first >= g.group_rows) return;
  // blockDim.x is a multiple of 32: a warp is one row's, whole or (past the vectors) absent, and
  // its lanes walk the same rows.
  const int lane = threadIdx.x % kLanes, warp = (threadIdx.y * blockDim.x + threadIdx.x) / kLanes;
  // History element (channel c, step j) in a row's P loads.
  constexpr auto at = [](int c, int j) { return kInterleaved ? c * P + j : j * V + c; };
  const Update<T, A, K> op{p};
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  T* state = static_cast<T*>(p.state);
  const uint32_t group = blockIdx.z, d0 = vector * V;
  const int64_t group_b0 = int64_t{group} * g.group_rows;
  const int64_t channel0 = int64_t{group} * p.channels + d0;
  const uint32_t in_row = d0 * g.state_channel;

  // A row in flight. Plain loads, not read-only ones: this kernel writes the state it reads. Held
  // as raw words: arrays of Vec copied from loads become byte-wise copies before the loops unroll.
  struct Row {
    T* state;  // this thread's channels in the row's state; null for a padding row (never kDirect)
    Word token, history[P];  // staged: the warp's coalesced words until the row is computed
    int slot0;  // ring mode: the slot of history step 0, which the token replaces
  };
  // Ring mode, never with interleaved vectors (the launch keeps those to shift mode).
  const bool ring = !kDirect && !kInterleaved && p.cache_seqlens != nullptr;
  const auto fetch = [&](uint32_t r, Row& row) {
    const int64_t b = group_b0 + r;
    if constexpr (kDirect) {
      row.state = state + b * p.state_strides.batch + in_row;
    } else {
      const int64_t pool_row = op.pool_row(b);
      row.state = pool_row < 0 ? nullptr : state + pool_row * p.state_strides.batch + in_row;
      if (row.state == nullptr) return;
    }
    // One token: x and y have contiguous channels in either layout.
    row.token = *reinterpret_cast<const Word*>(x + b * p.x_strides.batch + d0);
    if constexpr (kStaged) {
      const Word* warp_words = reinterpret_cast<const Word*>(row.state) - lane * P;
      for (int m = 0; m < P; ++m) row.history[m] = warp_words[lane + kLanes * m];
    } else if (!ring) {
      for (int j = 0; j < P; ++j) {
        row.history[j] = *reinterpret_cast<const Word*>(row.state + j * g.state_word);
      }
    } else {
      // The ring has P slots: step j is position next - P + j, in slot (next + j) mod P. A
      // position below 0 was never written and reads as 0.
      const int next = p.cache_seqlens[b], slot = next % P;
      row.slot0 = slot < 0 ? slot + P : slot;
      for (int j = 0; j < P; ++j) {
        const int s = row.slot0 + j < P ? row.slot0 + j : row.slot0 + j - P;
        const Word word = *reinterpret_cast<const Word*>(row.state + s * g.state_word);
        row.history[j] = next < P - j ? Word{} : word;
      }
    }
  };

  // The first row's loads before the params': the params' loads overlap them, where the params'
  // widening waits.
  Row current;
  fetch(first, current);
  A w[V * K], bias[V];
  load_token_params<T, A, K, V, (V > 1)>(p, channel0, w, bias);

  // Row r from its words: y, then the state. The warp's shared-memory passes are ordered by its
  // __syncwarp()s: each lane writes the slots it reads before the next pass (own column, then own
  // P words), and a pass reads other lanes' slots only after a __syncwarp().
  const auto finish = [&](uint32_t r, Row& row, auto silu) {
    T* y_row = y + (group_b0 + r) * p.x_strides.batch + d0;
    T* dst = row.state;
    if (!kDirect && dst == nullptr) {
      store_streaming(y_row, zero_vec<T, V>());
      return;
    }
    if constexpr (kStaged) {
      for (int m = 0; m < P; ++m) stage[warp][lane + kLanes * m] = row.history[m];
      __syncwarp();
      for (int j = 0; j < P; ++j) row.history[j] = stage[warp][lane * P + j];
    }
    A now[V], past[P][V];
    widen(from_raw<T, V>(row.token), now);
    for (int j = 0; j < P; ++j) widen(from_raw<T, V>(row.history[j]), past[j]);
    A out[V];
    for (int v = 0; v < V; ++v) {
      A z = bias[v] + w[v * K + P] * now[v];
      for (int k = 0; k < P; ++k) z += w[v * K + k] * past[at(v, k) / V][at(v, k) % V];
      out[v] = activate(z, silu);
    }
    store_streaming(y_row, narrow<T, V>(out));
    if constexpr (kInterleaved) {
      // The shift moves the stored elements, not their widened copies.
      const Vec<T, V> token_vec = from_raw<T, V>(row.token);
      const auto element = [&](int c, int j) {
        return from_raw<T, V>(row.history[at(c, j) / V]).v[at(c, j) % V];
      };
      for (int j = 0; j < P; ++j) {
        Vec<T, V> shifted;
        for (int i = 0; i < V; ++i) {
          const int c = (j * V + i) / P, s = (j * V + i) % P;
          shifted.v[i] = s + 1 < P ? element(c, s + 1) : token_vec.v[c];
        }
        if constexpr (kStaged) {
          stage[warp][lane * P + j] = to_raw(shifted);  // the slots this lane read
        } else {
          store_streaming(dst + j * V, shifted);
        }
      }
      if constexpr (kStaged) {
        __syncwarp();
        Word* warp_words = reinterpret_cast<Word*>(dst) - lane * P;
        for (int m = 0; m < P; ++m) {
          store_streaming(reinterpret_cast<T*>(warp_words + lane + kLanes * m),
                          from_raw<T, V>(stage[warp][lane + kLanes * m]));
        }
      }
    } else if (ring) {
      store_streaming(dst + row.slot0 * g.state_word, from_raw<T, V>(row.token));
    } else {
      for (int j = 0; j + 1 < P; ++j) {
        store_streaming(dst + j * g.state_word, from_raw<T, V>(row.history[j + 1]));
      }
      store_streaming(dst + (P - 1) * g.state_word, from_raw<T, V>(row.token));
    }
  };

  with_bool_constant(p.silu, [&](auto silu) {
    if constexpr (kAhead) {
      for (uint32_t r = first;; r += step) {
        Row ahead;
        const bool more = g.group_rows - r > step;  // r + step < group_rows, without overflow
        if (more) fetch(r + step, ahead);
        finish(r, current, silu);
        if (!more) break;
        current = ahead;
      }
    } else {
      finish(first, current, silu);  // the launch gives the thread one row
    }
  });
}

int64_t update_blocks(int64_t threads) {
  return std::max<int64_t>(
      1, std::min(kUpdateMaxBlocks, (threads + kUpdateThreads - 1) / kUpdateThreads));
}

// The one-token kernel's blocks resident at once on the current device (one wave), as its
// launch bounds promise, or 0 if the runtime cannot say. The bound rather than the occupancy
// calculator (which resident_threads calls, also under graph capture: drivers from CUDA 12.3 on
// load kernels during a capture): where more blocks would fit, a wave of the bound's size only
// has each thread walk more rows, the shape the row walk was timed at.
int64_t token_wave_blocks() {
  return int64_t{current_device_attribute<cudaDevAttrMultiProcessorCount>()} *
         kTokenBlocksPerSm;
}

template <typename T, typename A, int K, int V, bool kInterleaved, bool kStaged, bool kDirect>
void launch_token(cudaStream_t stream, const UpdateParams& p) {
  const int64_t group_rows = p.batch / p.groups, vectors = p.channels / V;
  const TokenGrid g{static_cast<uint32_t>(vectors), static_cast<uint32_t>(group_rows),
                    static_cast<int32_t>(p.state_strides.channel),
                    static_cast<int32_t>(kInterleaved ? V : p.state_strides.time)};
  const uint32_t across = static_cast<uint32_t>(
      std::min<int64_t>(kUpdateThreads, (vectors + kLanes - 1) / kLanes * kLanes));
  const dim3 block(across, kUpdateThreads / across);
  const int64_t x_blocks = (vectors + block.x - 1) / block.x;
  const int64_t row_blocks = (group_rows + block.y - 1) / block.y;
  // Walking rows, one wave of blocks; without a wave (one row a thread, or the device count
  // unknown), every row at once.
  const int64_t wave = token_ahead<T, A, K, V>() ? token_wave_blocks() : 0;
  const int64_t y_blocks =
      wave > 0 ? std::min(row_blocks, std::max<int64_t>(1, wave / (x_blocks * p.groups)))
               : row_blocks;
  const dim3 grid(static_cast<uint32_t>(x_blocks), static_cast<uint32_t>(y_blocks),
                  static_cast<uint32_t>(p.groups));
  update_token_kernel<T, A, K, V, kInterleaved, kStaged, kDirect><<<grid, block, 0, stream>>>(p, g);
}

template <typename T, typename A, int kWidth>
ffi::Error launch_update(cudaStream_t stream, const UpdateParams& p) {
  const int64_t work = p.batch * p.channels;
  if (work == 0) return ffi::Error::Success();
  if constexpr (kWidth > 0) {
    // The token kernel indexes a row's state in 32 bits, and its grid's y and z dimensions (at
    // most one block a batch row, the weight groups) are at most 65535 blocks.
    constexpr int64_t kGridLimit = 65535;
    if (p.tokens == 1 && p.state_len == kWidth - 1 &&
        p.channels * p.state_len <= std::numeric_limits<int32_t>::max() &&
        p.batch / p.groups <= kGridLimit && p.groups <= kGridLimit) {
      constexpr int V = kPack<T>;
      // Channel vectors need channels that they tile and 16-byte aligned buffers. Channel-first,
      // a vector holds whole rings, whose rotation by cache_seqlens is not between fixed registers.
      const bool vectors = p.channels % V == 0 && aligned16(p.x) && aligned16(p.y) &&
                           aligned16(p.state) && aligned16(p.weight) && aligned16(p.bias);
      // The common step (no state_indices, no cache_seqlens) of the two common layouts has its
      // own kernels, without the pool row lookup and the ring, where a thread walks rows: a
      // direct one-row kernel of the widest 16-bit filters spilled (K = 8 half, channel-last).
      const bool direct = p.state_indices == nullptr && p.cache_seqlens == nullptr;
      const auto launch_vectors = [&](auto interleaved, auto staged) {
        constexpr bool kInterleaved = decltype(interleaved)::value;
        constexpr bool kStaged = decltype(staged)::value;
        if constexpr (token_ahead<T, A, kWidth, V>()) {
          with_bool_constant(direct, [&](auto d) {
            launch_token<T, A, kWidth, V, kInterleaved, kStaged, decltype(d)::value>(stream, p);
          });
        } else {
          launch_token<T, A, kWidth, V, kInterleaved, kStaged, false>(stream, p);
        }
      };
      // Staged, each warp's lanes take 32 consecutive vectors of the same rows: with the vectors a
      // multiple of 32 (and so the block's x extent), every warp is whole or past the vectors.
      if (vectors && p.channel_last) {
        launch_vectors(std::false_type{}, std::false_type{});
      } else if (vectors && p.cache_seqlens == nullptr && (p.channels / V) % kLanes == 0) {
        launch_vectors(std::true_type{}, std::true_type{});
      } else if (vectors && p.cache_seqlens == nullptr) {
        launch_token<T, A, kWidth, V, true, false, false>(stream, p);
      } else {
        launch_token<T, A, kWidth, 1, false, false, false>(stream, p);
      }
      return cuda_status("update token kernel");
    }
  }
  update_kernel<T, A, kWidth><<<update_blocks(work), kUpdateThreads, 0, stream>>>(p);
  return cuda_status("update kernel");
}

ffi::Error update_handler(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                          ffi::AnyBuffer bias, ffi::AnyBuffer conv_state,
                          ffi::Buffer<ffi::S32> cache_seqlens, ffi::Buffer<ffi::S32> state_indices,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> new_conv_state,
                          bool silu, bool channel_last) {
  UpdateParams p;
  if (auto err = fill_update_params(x, weight, bias, conv_state, cache_seqlens, state_indices, y,
                                    new_conv_state, silu, channel_last, p);
      err.failure()) {
    return err;
  }
  if (const void* from = unaliased_state(conv_state, p)) {
    const cudaError_t err =
        cudaMemcpyAsync(p.state, from, conv_state.size_bytes(), cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) {
      return ffi::Error::Internal(std::string("jax_causal_conv: state copy: ") +
                                 cudaGetErrorString(err));
    }
  }
  return dispatch_dtype<__half, __nv_bfloat16>(
      x.element_type(), [&](auto types) {
        using Types = decltype(types);
        return dispatch_width<kCudaMaxWidth>(p.width, [&](auto width) {
          return launch_update<typename Types::Storage, typename Types::Acc,
                               decltype(width)::value>(stream, p);
        });
      });
}

}  // namespace
}  // namespace causal_conv

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CausalConv1dUpdateCuda, causal_conv::update_handler,
    causal_conv::bind_update(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
