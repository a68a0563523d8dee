// The causal_conv1d_update CUDA kernels and their XLA FFI handler. A decode step has batch *
// channels independent pieces of work; neighbouring threads take neighbouring channels.
//
// The common step (one token, a K-1 slot state, compile-time K) has its own kernel: a thread owns
// a vector of channels in a few batch rows, loads the weights once and every row's token and
// history before it writes anything, then writes y and the state. The generic kernel runs
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
    for (int i = 0; i < V / W; ++i) bias_raw[i] = __ldg(reinterpret_cast<const Word*>(bias_src) + i);
    for (int i = 0; i < V * K / W; ++i) {
      widen(from_raw<S, W>(w_raw[i]), reinterpret_cast<A(&)[W]>(w[i * W]));
    }
    for (int i = 0; i < V / W; ++i) {
      widen(from_raw<S, W>(bias_raw[i]), reinterpret_cast<A(&)[W]>(bias[i * W]));
    }
  });
}

// Batch rows per thread in the one-token kernel. The thread loads its channels' weights once for
// all of them (re-read for every row, they were as many L2 bytes as the data) and has all their
// loads in flight before its first store. The rows' words and the weights stay within
// kTokenRegisters 32-bit registers: with the addresses at most 128, two blocks of 256 per SM. At
// most kMaxTokenRows: more rows leave too few threads to cover the latency (H200, B 256, D 8192,
// bf16, K 4, channel-last / channel-first, us per step: 1 row 17.3 / 20.4, 2 rows 13.2 / 14.3,
// 3 rows 13.9 / 16.5, 4 rows 16.1 / 17.0).
constexpr int kTokenRegisters = 80;
constexpr int kMaxTokenRows = 2;

template <typename T, typename A, int K, int V>
constexpr int token_rows() {
  constexpr int weights = V * K * static_cast<int>(sizeof(A)) / 4;
  constexpr int row = K * ((V * static_cast<int>(sizeof(T)) + 3) / 4);
  return std::clamp((kTokenRegisters - weights) / row, 1, kMaxTokenRows);
}

// The one-token kernel's grid, in 32 bits (the launch checks that it fits): a thread takes V
// channels (vector x) of up to token_rows() batch rows (row tile y) of weight group z, so that it
// finds its work without an integer division. Grid x covers a group's channel vectors, y its row
// tiles, z the groups; a block is (vectors rounded up to a warp, at most kUpdateThreads) x (as many
// tiles as fill kUpdateThreads), so neighbouring threads take neighbouring channels of the same
// rows and a warp's lanes take consecutive vectors of one tile.
struct TokenGrid {
  uint32_t vectors;     // channels / V
  uint32_t tiles;       // ceil(group_rows / rows per thread)
  uint32_t group_rows;  // batch / groups
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
// 8.4 us staged, 13.2 -> 12.9 us a step in a jitted loop (eleventh session, trial-decode).
//
// Every store of y and the state is evict-first (streaming): the step writes both once and the
// next read of the state is a step later (12.4 -> 12.2 us a step channel-last, 13.2 -> 12.8
// channel-first, same trial).
//
// The kernel is latency-bound, so its instruction count is the lever: the activation is chosen
// once (the rows' compute is compiled for silu and for none, no select per element), the tile
// comes from the grid's indices (no division of a flat index by run-time divisors before the
// first load), and bfloat16 words widen a pair per instruction (the token, the history, the
// weights and bias) and narrow a pair per instruction. bf16 K = 4, channel-last / staged
// channel-first: the silu path's static SASS instructions 704 / 688 -> 600 / 600, registers
// 113 / 115 -> 105 / 111.
//
// Its memory round trips are the other lever: every load of a thread is issued before it waits
// for the first. The rows' token and history go first, the weights and bias after them (widened
// once all are in flight), a staged row's shared-memory pass after the params' loads. Before,
// the thread waited for its weights, then its bias, then (staged) each row in turn before the
// next load was issued. kDirect (no state_indices, no cache_seqlens: the common step) drops the
// pool row lookup and the ring. bf16 K = 4 silu, params in x's dtype, 2 rows, channel-last /
// staged channel-first (executed SASS instructions on that path, static): 498 / 562 -> 383 / 480
// a thread, the first load of x or the state at instruction 203 / 205 -> 53 / 55; registers
// 105 / 111 -> 101 / 124.
template <typename T, typename A, int K, int V, bool kInterleaved, bool kStaged, bool kDirect>
__global__ void __launch_bounds__(kUpdateThreads, 2)
    update_token_kernel(UpdateParams p, TokenGrid g) {
  static_assert(!kStaged || kInterleaved, "staging moves channel-first interleaved state");
  constexpr int P = K - 1, R = token_rows<T, A, K, V>();
  using Word = RawFor<T, V>;
  constexpr int kWarps = kUpdateThreads / kLanes;
  __shared__ Word stage[kStaged ? kWarps : 1][kStaged ? R : 1][kStaged ? kLanes * P : 1];
  const uint32_t vector = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t tile = blockIdx.y * blockDim.y + threadIdx.y;
  if (vector >= g.vectors || tile >= g.tiles) return;
  // blockDim.x is a multiple of 32: a warp is one tile's, whole or (past the vectors) absent.
  const int lane = threadIdx.x % kLanes, warp = (threadIdx.y * blockDim.x + threadIdx.x) / kLanes;
  // History element (channel c, step j) in a row's P loads.
  constexpr auto at = [](int c, int j) { return kInterleaved ? c * P + j : j * V + c; };
  const Update<T, A, K> op{p};
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  T* state = static_cast<T*>(p.state);
  const uint32_t group = blockIdx.z, d0 = vector * V, first = tile * R;
  const int rows = static_cast<int>(min(uint32_t{R}, g.group_rows - first));
  const int64_t b0 = int64_t{group} * g.group_rows + first;
  const int64_t channel0 = int64_t{group} * p.channels + d0;

  // One token: x and y have contiguous channels in either layout.
  const int64_t x0 = b0 * p.x_strides.batch + d0;
  const uint32_t in_row = d0 * g.state_channel;
  // This thread's channels in each row's state; null for padding rows. kDirect: row b0 + r, whose
  // address is one multiply-add from row b0's, and only rows past the tile's end are padding.
  T* rows_state[R];
  for (int r = 0; r < R; ++r) {
    if constexpr (kDirect) {
      rows_state[r] = state + (b0 + r) * p.state_strides.batch + in_row;
    } else {
      const int64_t row = r < rows ? op.pool_row(b0 + r) : -1;
      rows_state[r] = row < 0 ? nullptr : state + row * p.state_strides.batch + in_row;
    }
  }
  const auto live = [&](int r) { return kDirect ? r < rows : rows_state[r] != nullptr; };
  // Plain loads, not read-only ones: this kernel writes the state it reads. Held as raw words:
  // arrays of Vec copied from loads become byte-wise copies before the loops unroll.
  Word token[R], history[R][P];
  // Ring mode, never with interleaved vectors (the launch keeps those to shift mode).
  const bool ring = !kDirect && !kInterleaved && p.cache_seqlens != nullptr;
  int slot0[R];  // ring mode: the slot of history step 0, which the token replaces
  for (int r = 0; r < R; ++r) {
    if (!live(r)) continue;
    const T* src = rows_state[r];
    token[r] = *reinterpret_cast<const Word*>(x + x0 + r * p.x_strides.batch);
    if constexpr (kStaged) {
      // The warp's coalesced words, held in history until they pass through shared memory.
      const Word* warp_words = reinterpret_cast<const Word*>(src) - lane * P;
      for (int m = 0; m < P; ++m) history[r][m] = warp_words[lane + kLanes * m];
    } else if (!ring) {
      for (int j = 0; j < P; ++j) {
        history[r][j] = *reinterpret_cast<const Word*>(src + j * g.state_word);
      }
    } else {
      // The ring has P slots: step j is position next - P + j, in slot (next + j) mod P. A
      // position below 0 was never written and reads as 0.
      const int next = p.cache_seqlens[b0 + r], slot = next % P;
      slot0[r] = slot < 0 ? slot + P : slot;
      for (int j = 0; j < P; ++j) {
        const int s = slot0[r] + j < P ? slot0[r] + j : slot0[r] + j - P;
        const Word word = *reinterpret_cast<const Word*>(src + s * g.state_word);
        history[r][j] = next < P - j ? Word{} : word;
      }
    }
  }
  // After the rows' loads: the params' loads overlap them, where the params' widening waits.
  A w[V * K], bias[V];
  load_token_params<T, A, K, V, (V > 1)>(p, channel0, w, bias);
  if constexpr (kStaged) {
    // A shared store waits for its global load, so the staging comes after the params' loads.
    for (int r = 0; r < R; ++r) {
      if (!live(r)) continue;
      for (int m = 0; m < P; ++m) stage[warp][r][lane + kLanes * m] = history[r][m];
    }
    __syncwarp();
    for (int r = 0; r < R; ++r) {
      if (!live(r)) continue;
      for (int j = 0; j < P; ++j) history[r][j] = stage[warp][r][lane * P + j];
    }
  }

  with_bool_constant(p.silu, [&](auto silu) {
#pragma unroll
    for (int r = 0; r < R && r < rows; ++r) {
      T* y_row = y + x0 + r * p.x_strides.batch;
      T* dst = rows_state[r];
      if (!live(r)) {
        store_streaming(y_row, zero_vec<T, V>());
        continue;
      }
      A now[V], past[P][V];
      widen(from_raw<T, V>(token[r]), now);
      for (int j = 0; j < P; ++j) widen(from_raw<T, V>(history[r][j]), past[j]);
      A out[V];
      for (int v = 0; v < V; ++v) {
        A z = bias[v] + w[v * K + P] * now[v];
        for (int k = 0; k < P; ++k) z += w[v * K + k] * past[at(v, k) / V][at(v, k) % V];
        out[v] = activate(z, silu);
      }
      store_streaming(y_row, narrow<T, V>(out));
      if constexpr (kInterleaved) {
        // The shift moves the stored elements, not their widened copies.
        const Vec<T, V> token_vec = from_raw<T, V>(token[r]);
        const auto element = [&](int c, int j) {
          return from_raw<T, V>(history[r][at(c, j) / V]).v[at(c, j) % V];
        };
        for (int j = 0; j < P; ++j) {
          Vec<T, V> shifted;
          for (int i = 0; i < V; ++i) {
            const int c = (j * V + i) / P, s = (j * V + i) % P;
            shifted.v[i] = s + 1 < P ? element(c, s + 1) : token_vec.v[c];
          }
          if constexpr (kStaged) {
            stage[warp][r][lane * P + j] = to_raw(shifted);  // the slots this lane read
          } else {
            store_streaming(dst + j * V, shifted);
          }
        }
        if constexpr (kStaged) {
          __syncwarp();
          Word* warp_words = reinterpret_cast<Word*>(dst) - lane * P;
          for (int m = 0; m < P; ++m) {
            store_streaming(reinterpret_cast<T*>(warp_words + lane + kLanes * m),
                            from_raw<T, V>(stage[warp][r][lane + kLanes * m]));
          }
        }
      } else if (ring) {
        store_streaming(dst + slot0[r] * g.state_word, from_raw<T, V>(token[r]));
      } else {
        for (int j = 0; j + 1 < P; ++j) {
          store_streaming(dst + j * g.state_word, from_raw<T, V>(history[r][j + 1]));
        }
        store_streaming(dst + (P - 1) * g.state_word, from_raw<T, V>(token[r]));
      }
    }
  });
}

int64_t update_blocks(int64_t threads) {
  return std::max<int64_t>(
      1, std::min(kUpdateMaxBlocks, (threads + kUpdateThreads - 1) / kUpdateThreads));
}

template <typename T, typename A, int K, int V, bool kInterleaved, bool kStaged, bool kDirect>
void launch_token(cudaStream_t stream, const UpdateParams& p) {
  constexpr int R = token_rows<T, A, K, V>();
  const int64_t group_rows = p.batch / p.groups, vectors = p.channels / V;
  const TokenGrid g{static_cast<uint32_t>(vectors),
                    static_cast<uint32_t>((group_rows + R - 1) / R),
                    static_cast<uint32_t>(group_rows),
                    static_cast<int32_t>(p.state_strides.channel),
                    static_cast<int32_t>(kInterleaved ? V : p.state_strides.time)};
  const uint32_t across = static_cast<uint32_t>(
      std::min<int64_t>(kUpdateThreads, (vectors + kLanes - 1) / kLanes * kLanes));
  const dim3 block(across, kUpdateThreads / across);
  const dim3 grid((g.vectors + block.x - 1) / block.x, (g.tiles + block.y - 1) / block.y,
                  static_cast<uint32_t>(p.groups));
  update_token_kernel<T, A, K, V, kInterleaved, kStaged, kDirect><<<grid, block, 0, stream>>>(p, g);
}

template <typename T, typename A, int kWidth>
ffi::Error launch_update(cudaStream_t stream, const UpdateParams& p) {
  const int64_t work = p.batch * p.channels;
  if (work == 0) return ffi::Error::Success();
  if constexpr (kWidth > 0) {
    // The token kernel indexes a row's state in 32 bits, and its grid's y and z dimensions (at
    // most one row tile a batch row, the weight groups) are at most 65535 blocks.
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
      // own kernels, without the pool row lookup and the ring.
      const bool direct = p.state_indices == nullptr && p.cache_seqlens == nullptr;
      // Staged, each warp's lanes take 32 consecutive vectors of the same rows: with the vectors a
      // multiple of 32 (and so the block's x extent), every warp is whole or past the vectors.
      if (vectors && p.channel_last) {
        with_bool_constant(direct, [&](auto d) {
          launch_token<T, A, kWidth, V, false, false, decltype(d)::value>(stream, p);
        });
      } else if (vectors && p.cache_seqlens == nullptr && (p.channels / V) % kLanes == 0) {
        with_bool_constant(direct, [&](auto d) {
          launch_token<T, A, kWidth, V, true, true, decltype(d)::value>(stream, p);
        });
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
