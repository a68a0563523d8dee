// CUDA kernels and their XLA FFI handlers, on top of the conv math in conv_math.h.
//
// Compile-time widths with 16-byte aligned buffers take the vectorized kernels (16-byte loads and
// stores; in the channel-last layout a thread streams one pack of channels down a chunk of time,
// its next rows in flight through a RowRing of shared memory). The generic kernels cover the rest:
// Forward: one thread per output element, walked in memory order (coalesced in both layouts).
// Backward: a block owns a (batch row, time tile, channel chunk). It keeps delta for its tile plus
// the right halo of P rows in shared memory, writes dx only for the times it owns (and dS on the
// first tile), and writes its dw/db sums for the times it owns to a scratch workspace. A second
// kernel reduces the workspace in a fixed order, so dw and db are bitwise deterministic. The
// workspace is an extra output of the custom call (XLA allocates it with the other buffers), sized
// by backward_workspace_elements, which Python asks for at lowering time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "conv_math.h"
#include "cuda_vector.cuh"
#include "ffi_common.h"

namespace causal_conv {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTileLen = 64;
constexpr int64_t kMaxGridBlocks = int64_t{1} << 20;

int64_t tile_count(int64_t length) { return std::max<int64_t>(1, (length + kTileLen - 1) / kTileLen); }

// Channels per backward block: keeps the delta tile within 48 KB for every width up to 256.
template <typename A>
constexpr int64_t tile_channels() {
  return sizeof(A) == 8 ? 16 : 32;
}

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

// ---- vectorized forward for compile-time widths: 16-byte loads and stores ----

// 16 bytes of T: one load or store instruction.
template <typename T>
using Pack = Vec<T, kPack<T>>;

// Time steps per thread in the channel-last forward: the K-1 halo rows it re-reads come from L2.
constexpr int64_t kForwardTimeChunk = 32;

template <typename T, typename A, int K>
__device__ __forceinline__ void load_pack(const Conv<T, A, K>& conv, int64_t b, int64_t u,
                                          int64_t d0, A (&out)[kPack<T>]) {
  const ConvParams& p = conv.p;
  const T* src = nullptr;
  if (u >= 0) {
    src = static_cast<const T*>(p.x) + offset(p.x_strides, b, u, d0);
  } else if (p.initial_state != nullptr) {
    src = static_cast<const T*>(p.initial_state) + offset(p.state_strides, b, u + K - 1, d0);
  }
  if (src == nullptr) {
    for (int v = 0; v < kPack<T>; ++v) out[v] = A(0);
    return;
  }
  const Pack<T> pack = load_readonly<T, kPack<T>>(src);
  for (int v = 0; v < kPack<T>; ++v) out[v] = to_acc<A>(pack.v[v]);
}

// Rows in flight per thread in the channel-last kernels (RowRing depth): the forward's ring is
// 8 x 16 bytes x 256 threads = 32 KB of shared memory per block, the backward's (x and dy) 4 x 2
// x 16 x 256 = 32 KB.
constexpr int kForwardDepth = 8;
constexpr int kBackwardDepth = 4;

// (B, L, D), D a multiple of the pack: a thread owns one pack of channels over a chunk of time
// and slides a K-row register window down it; its next rows arrive through a RowRing.
template <typename T, typename A, int K>
__global__ void __launch_bounds__(kThreads) forward_channel_last_kernel(ConvParams p) {
  constexpr int V = kPack<T>;
  constexpr int P = K - 1;
  using Ring = RowRing<kForwardDepth, 1>;
  __shared__ uint4 ring_slots[Ring::kSlots * kThreads];
  const Ring ring{ring_slots};
  const Conv<T, A, K> conv{p};
  const int64_t packs = p.channels / V;
  const int64_t chunks = (p.length + kForwardTimeChunk - 1) / kForwardTimeChunk;
  const int64_t total = p.batch * chunks * packs;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d0 = (i % packs) * V;
    const int64_t chunk = (i / packs) % chunks, b = i / (packs * chunks);
    const int64_t t0 = chunk * kForwardTimeChunk;
    const int64_t steps = (t0 + kForwardTimeChunk < p.length ? t0 + kForwardTimeChunk : p.length) - t0;
    const T* x_rows = static_cast<const T*>(p.x) + offset(p.x_strides, b, t0, d0);
    T* y_rows = static_cast<T*>(p.y) + offset(p.x_strides, b, t0, d0);
    const auto x_row = [&](int64_t step) -> const void* {
      return step < steps ? x_rows + step * p.x_strides.time : nullptr;
    };
    for (int64_t step = 0; step < kForwardDepth; ++step) ring.fetch(step, {x_row(step)});
    A w[K][V], bias[V];
    for (int v = 0; v < V; ++v) {
      const A* row = conv.weight_row(b, d0 + v);
      for (int k = 0; k < K; ++k) w[k][v] = row[k];
      bias[v] = conv.bias(b, d0 + v);
    }
    A window[K][V];  // window[k] holds x_{t-P+k}
    int32_t segment[K] = {};
    for (int k = 0; k < P; ++k) {
      load_pack(conv, b, t0 - P + k, d0, window[k]);
      if (p.seq_idx != nullptr) segment[k] = conv.segment(b, t0 - P + k);
    }
#pragma unroll 4
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t t = t0 + step;
      ring.wait();
      const Pack<T> in = ring.read<T, V>(0, step);
      for (int v = 0; v < V; ++v) window[P][v] = to_acc<A>(in.v[v]);
      if (p.seq_idx != nullptr) segment[P] = conv.segment(b, t);
      Pack<T> out;
      for (int v = 0; v < V; ++v) {
        A z = bias[v];
        for (int k = 0; k < K; ++k) {
          const bool used = p.seq_idx == nullptr || same_segment(segment[P], segment[k]);
          z += used ? w[k][v] * window[k][v] : A(0);
        }
        const bool padding = p.seq_idx != nullptr && segment[P] < 0;
        out.v[v] = from_acc<T>(padding ? A(0) : activate(z, p.silu));
      }
      store_vec(y_rows + step * p.x_strides.time, out);
      ring.fetch(step + kForwardDepth, {x_row(step + kForwardDepth)});
      for (int k = 0; k < P; ++k) {
        segment[k] = segment[k + 1];
        for (int v = 0; v < V; ++v) window[k][v] = window[k + 1][v];
      }
    }
  }
}

// (B, D, L), L a multiple of the pack: a thread owns one pack of consecutive times of one
// channel; the K-1 inputs before it are scalar loads that hit the neighbouring lane's lines in L1.
template <typename T, typename A, int K>
__global__ void __launch_bounds__(kThreads) forward_channel_first_kernel(ConvParams p) {
  constexpr int V = kPack<T>;
  constexpr int P = K - 1;
  const Conv<T, A, K> conv{p};
  const int64_t packs = p.length / V;
  const int64_t total = p.batch * p.channels * packs;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t0 = (i % packs) * V;
    const int64_t d = (i / packs) % p.channels, b = i / (packs * p.channels);
    const A* w = conv.weight_row(b, d);
    const A bias = conv.bias(b, d);
    A xs[P + V];  // xs[j] = x_{t0-P+j}
    int32_t segment[P + V] = {};
    for (int j = 0; j < P; ++j) xs[j] = conv.input(b, t0 - P + j, d);
    const Pack<T> in = load_readonly<T, kPack<T>>(static_cast<const T*>(p.x) + offset(p.x_strides, b, t0, d));
    for (int v = 0; v < V; ++v) xs[P + v] = to_acc<A>(in.v[v]);
    if (p.seq_idx != nullptr) {
      for (int j = 0; j < P + V; ++j) segment[j] = conv.segment(b, t0 - P + j);
    }
    Pack<T> out;
    for (int v = 0; v < V; ++v) {
      A z = bias;
      for (int k = 0; k < K; ++k) {
        const bool used = p.seq_idx == nullptr || same_segment(segment[P + v], segment[v + k]);
        z += used ? w[k] * xs[v + k] : A(0);
      }
      const bool padding = p.seq_idx != nullptr && segment[P + v] < 0;
      out.v[v] = from_acc<T>(padding ? A(0) : activate(z, p.silu));
    }
    *reinterpret_cast<Pack<T>*>(static_cast<T*>(p.y) + offset(p.x_strides, b, t0, d)) = out;
  }
}

// Whether the vectorized forward applies: a compile-time width, packs that tile the contiguous
// dimension, and 16-byte aligned buffers.
template <typename T>
bool vector_forward_applies(const ConvParams& p, int width) {
  constexpr int V = kPack<T>;
  const int64_t contiguous = p.channel_last ? p.channels : p.length;
  return width > 0 && contiguous % V == 0 && aligned16(p.x) && aligned16(p.y) &&
         (p.initial_state == nullptr || aligned16(p.initial_state));
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

// ---- vectorized backward for compile-time widths ----

template <typename T, typename A>
__device__ __forceinline__ void load_pack_at(const void* base, int64_t element,
                                             A (&out)[kPack<T>]) {
  const Pack<T> pack = load_readonly<T, kPack<T>>(static_cast<const T*>(base) + element);
  for (int v = 0; v < kPack<T>; ++v) out[v] = to_acc<A>(pack.v[v]);
}

template <typename T, typename A>
__device__ __forceinline__ void store_pack_at(void* base, int64_t element,
                                              const A (&values)[kPack<T>]) {
  Pack<T> pack;
  for (int v = 0; v < kPack<T>; ++v) pack.v[v] = from_acc<T>(values[v]);
  *reinterpret_cast<Pack<T>*>(static_cast<T*>(base) + element) = pack;
}

// (B, L, D), D a multiple of the pack. A thread owns one pack of channels over one 64-step tile
// [t0, t1) and streams s from t0 to t1 + P - 1 with three K-row register windows: x_{s-P..s},
// delta_{s-P..s} and their segment ids. At step s it finishes delta_s, adds delta_s's dw/db terms
// when it owns s, and emits dx_{s-P}, whose deltas (s-P .. s) are all in the window by then.
// Partial sums go to partials[b, tile, d, 0..K] (no other thread owns those channels and steps).
template <typename T, typename A, int K>
__global__ void __launch_bounds__(kThreads)
    backward_channel_last_kernel(ConvParams p, A* partials, int64_t tiles) {
  constexpr int V = kPack<T>;
  constexpr int P = K - 1;
  using Ring = RowRing<kBackwardDepth, 2>;  // x and dy
  __shared__ uint4 ring_slots[Ring::kSlots * kThreads];
  const Ring ring{ring_slots};
  const Conv<T, A, K> conv{p};
  const bool masked = p.seq_idx != nullptr;
  const int64_t packs = p.channels / V;
  const int64_t total = p.batch * tiles * packs;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d0 = (i % packs) * V;
    const int64_t tile = (i / packs) % tiles, b = i / (packs * tiles);
    const int64_t t0 = tile * kTileLen;
    const int64_t t1 = t0 + kTileLen < p.length ? t0 + kTileLen : p.length;
    const int64_t first_u = (tile == 0 && p.dinitial_state != nullptr) ? -P : t0;
    // Step j streams time t0 + j: the tile and the P rows after it that exist.
    const int64_t live_steps = (t1 + P < p.length ? t1 + P : p.length) - t0;
    const int64_t rows = offset(p.x_strides, b, t0, d0);
    const auto fetch = [&](int64_t step) {
      const int64_t at = rows + step * p.x_strides.time;
      const bool live = step < live_steps;
      ring.fetch(step, {live ? static_cast<const T*>(p.x) + at : nullptr,
                        live ? static_cast<const T*>(p.dy) + at : nullptr});
    };
    for (int64_t step = 0; step < kBackwardDepth; ++step) fetch(step);
    A w[K][V], bias[V], dw[K][V], db[V];
    for (int v = 0; v < V; ++v) {
      const A* row = conv.weight_row(b, d0 + v);
      for (int k = 0; k < K; ++k) {
        w[k][v] = row[k];
        dw[k][v] = A(0);
      }
      bias[v] = conv.bias(b, d0 + v);
      db[v] = A(0);
    }
    A x[K][V], delta[K][V];
    int32_t segment[K] = {};
    for (int k = 0; k < P; ++k) {
      load_pack(conv, b, t0 - P + k, d0, x[k]);
      if (masked) segment[k] = conv.segment(b, t0 - P + k);
      for (int v = 0; v < V; ++v) delta[k][v] = A(0);
    }
#pragma unroll 2
    for (int64_t s = t0; s < t1 + P; ++s) {
      const bool live = s < p.length;
      A dy[V];
      ring.wait();
      if (live) {
        const Pack<T> x_in = ring.read<T, V>(0, s - t0), dy_in = ring.read<T, V>(1, s - t0);
        for (int v = 0; v < V; ++v) {
          x[P][v] = to_acc<A>(x_in.v[v]);
          dy[v] = to_acc<A>(dy_in.v[v]);
        }
        if (masked) segment[P] = conv.segment(b, s);
      } else {
        for (int v = 0; v < V; ++v) x[P][v] = dy[v] = A(0);
        segment[P] = -1;
      }
      fetch(s - t0 + kBackwardDepth);  // into the slots just read
      const bool output = live && !(masked && segment[P] < 0);
      for (int v = 0; v < V; ++v) {
        A z = bias[v];
        for (int k = 0; k < K; ++k) {
          z += (!masked || same_segment(segment[P], segment[k])) ? w[k][v] * x[k][v] : A(0);
        }
        delta[P][v] = output ? dy[v] * activation_grad(z, p.silu) : A(0);
      }
      if (s < t1) {
        for (int v = 0; v < V; ++v) {
          db[v] += delta[P][v];
          for (int k = 0; k < K; ++k) {
            const bool used = !masked || same_segment(segment[P], segment[k]);
            dw[k][v] += used ? delta[P][v] * x[k][v] : A(0);
          }
        }
      }
      const int64_t u = s - P;  // tap k of output time s - k reads x_u; its delta is delta[P - k]
      if (u >= first_u) {
        A g[V];
        for (int v = 0; v < V; ++v) {
          A acc = A(0);
          for (int k = 0; k < K; ++k) {
            // Skipped, not multiplied by a zero delta, outside [0, L): a non-finite tap must
            // reach dx only through outputs that exist, as in the reference.
            const bool exists = s - k >= 0 && s - k < p.length;
            const bool used = exists && (!masked || same_segment(segment[P - k], segment[0]));
            acc += used ? w[k][v] * delta[P - k][v] : A(0);
          }
          g[v] = acc;
        }
        if (u >= p.length - P) {
          for (int v = 0; v < V; ++v) g[v] += conv.final_state_grad(b, u, d0 + v);
        }
        if (u >= 0) {
          store_pack_at<T>(p.dx, offset(p.x_strides, b, u, d0), g);
        } else {
          store_pack_at<T>(p.dinitial_state, offset(p.state_strides, b, u + P, d0), g);
        }
      }
      for (int k = 0; k < P; ++k) {
        segment[k] = segment[k + 1];
        for (int v = 0; v < V; ++v) {
          x[k][v] = x[k + 1][v];
          delta[k][v] = delta[k + 1][v];
        }
      }
    }
    A* out = partials + ((b * tiles + tile) * p.channels + d0) * (K + 1);
    for (int v = 0; v < V; ++v) {
      for (int k = 0; k < K; ++k) out[v * (K + 1) + k] = dw[k][v];
      out[v * (K + 1) + K] = db[v];
    }
  }
}

// Time steps covered by one warp of the channel-first backward (32 packs of one channel row).
template <typename T>
constexpr int64_t channel_first_group_len() {
  return 32 * kPack<T>;
}

// (B, D, L), L a multiple of the pack. A warp owns 32 consecutive packs of one (b, d) row, a
// lane one pack of V times: it rebuilds delta on [t0, t0 + V + P) from scalar halo loads (L1 hits
// of its neighbours' lines), writes dx for its V times (and dS in the row's first pack), and the
// warp sums its dw/db terms with a fixed shuffle tree into partials[b, group, d, 0..K].
template <typename T, typename A, int K>
__global__ void __launch_bounds__(kThreads)
    backward_channel_first_kernel(ConvParams p, A* partials, int64_t groups) {
  constexpr int V = kPack<T>;
  constexpr int P = K - 1;
  constexpr int kLanes = 32;
  const Conv<T, A, K> conv{p};
  const bool masked = p.seq_idx != nullptr;
  const int lane = threadIdx.x % kLanes;
  const int64_t packs = p.length / V;
  const int64_t warps = p.batch * p.channels * groups;
  const int64_t warps_per_grid = int64_t{gridDim.x} * (blockDim.x / kLanes);
  for (int64_t wi = blockIdx.x * int64_t{blockDim.x / kLanes} + threadIdx.x / kLanes; wi < warps;
       wi += warps_per_grid) {
    const int64_t group = wi % groups, d = (wi / groups) % p.channels;
    const int64_t b = wi / (groups * p.channels);
    const int64_t pack = group * kLanes + lane;
    A dw[K + 1] = {};  // dw[K] is db
    if (pack < packs) {
      const int64_t t0 = pack * V;
      const A* w = conv.weight_row(b, d);
      const A bias = conv.bias(b, d);
      A x[2 * P + V];  // x_{t0-P+j}
      A delta[V + P];  // delta_{t0+j}
      int32_t segment[2 * P + V] = {};
      for (int j = 0; j < P; ++j) x[j] = conv.input(b, t0 - P + j, d);
      load_pack_at<T>(p.x, offset(p.x_strides, b, t0, d), reinterpret_cast<A(&)[V]>(x[P]));
      for (int j = P + V; j < 2 * P + V; ++j) {
        const int64_t u = t0 - P + j;
        x[j] = u < p.length ? conv.input(b, u, d) : A(0);
      }
      if (masked) {
        for (int j = 0; j < 2 * P + V; ++j) {
          const int64_t u = t0 - P + j;
          segment[j] = u < p.length ? conv.segment(b, u) : -1;
        }
      }
      A dy[V];
      load_pack_at<T>(p.dy, offset(p.x_strides, b, t0, d), dy);
      for (int j = 0; j < V + P; ++j) {
        const int64_t t = t0 + j;
        const int32_t seg_t = segment[P + j];
        if (t >= p.length || (masked && seg_t < 0)) {
          delta[j] = A(0);
          continue;
        }
        A z = bias;
        for (int k = 0; k < K; ++k) {
          z += (!masked || same_segment(seg_t, segment[j + k])) ? w[k] * x[j + k] : A(0);
        }
        const A g = j < V ? dy[j] : to_acc<A>(static_cast<const T*>(p.dy)[offset(p.x_strides, b, t, d)]);
        delta[j] = g * activation_grad(z, p.silu);
      }
      for (int j = 0; j < V; ++j) {
        dw[K] += delta[j];
        for (int k = 0; k < K; ++k) {
          const bool used = !masked || same_segment(segment[P + j], segment[j + k]);
          dw[k] += used ? delta[j] * x[j + k] : A(0);
        }
      }
      A g[V];
      for (int j = 0; j < V; ++j) {
        A acc = A(0);
        for (int k = 0; k < K; ++k) {  // output time t0 + j + P - k, delta index j + P - k
          if (j + P - k >= V + P || t0 + j + P - k >= p.length) continue;  // no such output
          const bool used = !masked || same_segment(segment[2 * P + j - k], segment[P + j]);
          acc += used ? w[k] * delta[j + P - k] : A(0);
        }
        g[j] = acc + conv.final_state_grad(b, t0 + j, d);
      }
      store_pack_at<T>(p.dx, offset(p.x_strides, b, t0, d), g);
      if (t0 == 0 && p.dinitial_state != nullptr) {
        const auto delta_at = [&](int64_t t) { return delta[t]; };
        for (int64_t u = -P; u < 0; ++u) {
          conv.store_state_like(p.dinitial_state, b, u + P, d, conv.input_grad(b, u, d, delta_at));
        }
      }
    }
    for (int k = 0; k <= K; ++k) {
      for (int offset_lanes = kLanes / 2; offset_lanes > 0; offset_lanes /= 2) {
        dw[k] += __shfl_xor_sync(0xffffffffu, dw[k], offset_lanes);
      }
    }
    if (lane == 0) {
      A* out = partials + ((b * groups + group) * p.channels + d) * (K + 1);
      for (int k = 0; k <= K; ++k) out[k] = dw[k];
    }
  }
}

// Sums the partials of each weight group in a fixed order. A block owns 32 consecutive
// (channel, k) columns of one group; its thread (column c, lane l) adds slices l, l + 8, ... of
// column c, and lane 0 then adds the 8 lane sums in order. No atomics: bitwise deterministic.
constexpr int kReduceColumns = 32;
constexpr int kReduceLanes = kThreads / kReduceColumns;

template <typename A>
__global__ void __launch_bounds__(kThreads)
    reduce_partials_kernel(const A* partials, int64_t groups, int64_t rows_per_group,
                           int64_t slices, int64_t channels, int64_t width, A* dweight,
                           A* dbias) {
  __shared__ A lane_sums[kReduceLanes][kReduceColumns];
  const int64_t per_group = channels * (width + 1);
  const int64_t column_blocks = (per_group + kReduceColumns - 1) / kReduceColumns;
  const int column = threadIdx.x % kReduceColumns, lane = threadIdx.x / kReduceColumns;
  const int64_t count = rows_per_group * slices;
  for (int64_t block = blockIdx.x; block < groups * column_blocks; block += gridDim.x) {
    const int64_t g = block / column_blocks;
    const int64_t j = (block % column_blocks) * kReduceColumns + column;
    A sum = A(0);
    if (j < per_group) {
      const A* first = partials + g * count * per_group + j;
      for (int64_t slice = lane; slice < count; slice += kReduceLanes) {
        sum += first[slice * per_group];
      }
    }
    lane_sums[lane][column] = sum;
    __syncthreads();
    if (lane == 0 && j < per_group) {
      A total = A(0);
      for (int l = 0; l < kReduceLanes; ++l) total += lane_sums[l][column];
      const int64_t d = j / (width + 1), k = j % (width + 1);
      if (k == width) {
        dbias[g * channels + d] = total;
      } else {
        dweight[(g * channels + d) * width + k] = total;
      }
    }
    __syncthreads();
  }
}

// y: the vectorized kernels where they apply, else one thread per element.
template <typename T, typename A, int kWidth>
ffi::Error launch_output(cudaStream_t stream, const ConvParams& p) {
  const int64_t points = p.batch * p.length * p.channels;
  if (points == 0) return ffi::Error::Success();
  if constexpr (kWidth > 0) {
    if (vector_forward_applies<T>(p, kWidth)) {
      constexpr int64_t V = kPack<T>;
      if (p.channel_last) {
        const int64_t chunks = (p.length + kForwardTimeChunk - 1) / kForwardTimeChunk;
        forward_channel_last_kernel<T, A, kWidth>
            <<<grid_for(p.batch * chunks * (p.channels / V)), kThreads, 0, stream>>>(p);
      } else {
        forward_channel_first_kernel<T, A, kWidth><<<grid_for(points / V), kThreads, 0, stream>>>(p);
      }
      return cuda_status("vectorized forward kernel");
    }
  }
  forward_kernel<T, A, kWidth><<<grid_for(points), kThreads, 0, stream>>>(p);
  return cuda_status("forward kernel");
}

template <typename T, typename A, int kWidth>
ffi::Error launch_forward(cudaStream_t stream, const ConvParams& p) {
  if (auto err = launch_output<T, A, kWidth>(stream, p); err.failure()) return err;
  const int64_t state_points = p.batch * (p.width - 1) * p.channels;
  if (p.final_state != nullptr && state_points > 0) {
    final_state_kernel<T, A, kWidth><<<grid_for(state_points), kThreads, 0, stream>>>(p);
    return cuda_status("final state kernel");
  }
  return ffi::Error::Success();
}

// Whether the vectorized backward applies (the forward's conditions plus aligned gradients).
template <typename T>
bool vector_backward_applies(const ConvParams& p, int width) {
  return vector_forward_applies<T>(p, width) && aligned16(p.dy) && aligned16(p.dx) &&
         (p.dinitial_state == nullptr || aligned16(p.dinitial_state));
}

// Launches the dw/db partial sums (and dx, dS) kernel; returns how many partial slices per batch
// row it wrote, or an error.
template <typename T, typename A, int kWidth>
ffi::Error launch_backward_partials(cudaStream_t stream, const ConvParams& p, A* partials,
                                    int64_t& slices) {
  if constexpr (kWidth > 0) {
    if (vector_backward_applies<T>(p, kWidth)) {
      constexpr int64_t V = kPack<T>;
      if (p.channel_last) {
        slices = tile_count(p.length);
        backward_channel_last_kernel<T, A, kWidth>
            <<<grid_for(p.batch * slices * (p.channels / V)), kThreads, 0, stream>>>(p, partials,
                                                                                     slices);
      } else {
        slices = (p.length + channel_first_group_len<T>() - 1) / channel_first_group_len<T>();
        backward_channel_first_kernel<T, A, kWidth>
            <<<grid_for(p.batch * p.channels * slices * 32), kThreads, 0, stream>>>(p, partials,
                                                                                    slices);
      }
      return cuda_status("vectorized backward kernel");
    }
  }
  constexpr int64_t DC = tile_channels<A>();
  slices = tile_count(p.length);
  const int64_t chunks = (p.channels + DC - 1) / DC;
  if (p.batch > 65535 || chunks > 65535) {
    return invalid("backward supports at most 65535 batch rows and 65535 * 32 channels");
  }
  const size_t shared_bytes = sizeof(A) * static_cast<size_t>((kTileLen + p.width - 1) * DC);
  const dim3 grid(static_cast<unsigned>(slices), static_cast<unsigned>(chunks),
                  static_cast<unsigned>(p.batch));
  backward_tile_kernel<T, A, kWidth><<<grid, kThreads, shared_bytes, stream>>>(p, partials, slices);
  return cuda_status("backward tile kernel");
}

template <typename T, typename A, int kWidth>
ffi::Error launch_backward(cudaStream_t stream, const ConvParams& p, A* dweight, A* dbias,
                           size_t workspace_elements, A* partials) {
  const int64_t per_slice = p.channels * (p.width + 1);
  // Every kernel above writes at most tile_count(L) slices per row.
  if (workspace_elements < static_cast<size_t>(p.batch * tile_count(p.length) * per_slice)) {
    return invalid("workspace is too small");
  }
  int64_t slices = 0;
  if (p.batch > 0 && p.channels > 0) {
    if (auto err = launch_backward_partials<T, A, kWidth>(stream, p, partials, slices);
        err.failure()) {
      return err;
    }
  }
  const int64_t reduce_blocks =
      std::min(kMaxGridBlocks, p.groups * ((per_slice + kReduceColumns - 1) / kReduceColumns));
  reduce_partials_kernel<A><<<std::max<int64_t>(reduce_blocks, 1), kThreads, 0, stream>>>(
      partials, p.groups, p.batch / p.groups, slices, p.channels, p.width, dweight, dbias);
  return cuda_status("reduce kernel");
}

ffi::Error forward_handler(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                           ffi::AnyBuffer bias, ffi::AnyBuffer initial_state,
                           ffi::Buffer<ffi::S32> seq_idx, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> final_state, bool silu, bool channel_last) {
  ConvParams p;
  if (auto err = fill_params(x, weight, bias, initial_state, seq_idx, silu, channel_last, p);
      err.failure()) {
    return err;
  }
  p.y = y->untyped_data();
  p.final_state = optional_data(final_state);
  return dispatch_dtype<__half, __nv_bfloat16>(
      x.element_type(), weight.element_type(), [&](auto types) {
        using Types = decltype(types);
        return dispatch_width(p.width, [&](auto width) {
          return launch_forward<typename Types::Storage, typename Types::Acc,
                                decltype(width)::value>(stream, p);
        });
      });
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
                                      dinitial_state, silu, channel_last, p);
      err.failure()) {
    return err;
  }
  return dispatch_dtype<__half, __nv_bfloat16>(
      x.element_type(), weight.element_type(), [&](auto types) {
        using Types = decltype(types);
        using A = typename Types::Acc;
        return dispatch_width(p.width, [&](auto width) {
          return launch_backward<typename Types::Storage, A, decltype(width)::value>(
              stream, p, static_cast<A*>(dweight->untyped_data()),
              static_cast<A*>(dbias->untyped_data()), workspace->element_count(),
              static_cast<A*>(workspace->untyped_data()));
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
    CausalConv1dForwardCuda, causal_conv::forward_handler,
    causal_conv::bind_forward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CausalConv1dBackwardCuda, causal_conv::backward_handler,
    causal_conv::bind_backward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
