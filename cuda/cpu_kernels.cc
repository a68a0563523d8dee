// CPU kernels and their XLA FFI handlers.
//
// The work is cut into tiles fixed by the shape alone: (batch row, block of channels, block of
// time). A tile walks its points in memory order, so that the inner loops run over contiguous
// memory and vectorize: for "BLD" one time step of the channel block at a time, for "BDL" one
// channel row at a time. Interior times (every tap reads x of the output's own segment) take a
// fast path with no per-tap check. The other times (the first P steps, the initial state, segment
// boundaries, padding, the final-state gradient) take the edge path of Channels, which follows
// Conv::pre_activation and Conv::input_grad tap by tap for all channels of the tile at once. Both
// paths use conv_math.h's activation math in the same order of operations.
//
// Tiles run on XLA's intra-op thread pool above a size threshold. A tile owns dx on its time
// block (it recomputes delta on the P-step right halo) and the dw/db terms of the times it owns,
// which it writes to its own slot of a partial-sum buffer; the slots are reduced afterwards in a
// fixed order. As the tiling does not depend on the thread count, the results are bitwise the
// same for any number of threads and any schedule. They may differ in the last bits between
// machines with and without FMA (the x86-64-v3/v4 versions, cpu_target.h, contract a * b + c).
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "conv_math.h"
#include "cpu_half.h"
#include "cpu_params.h"
#include "cpu_target.h"
#include "cpu_tiles.h"
#include "ffi_common.h"

namespace causal_conv {
namespace {

// Points per tile (about): enough to amortize a tile's fixed work (the P-step halo, the segment
// checks, the edge path's per-time setup), few enough to balance threads.
constexpr int64_t kTilePoints = int64_t{1} << 16;
// "BLD" tiles take runs of a time step's channels whose K weights and K taps fit in this many
// bytes (about an L1), and at least 512 channels. A tile of part of a row reads and writes only
// its run of each time step's row: with 512-channel runs (2 KB of float32) the hardware
// prefetcher, which stops at 4 KB pages, starts again on every step, and each page of y is
// finished by another tile much later. B=8 L=2048 D=2048 float32 on an AVX2 EPYC (sixtieth
// session): whole rows at K = 2 and 1024-channel runs at K = 4 took the forward from 1.13 to
// 1.01 of the reference under XLA and the backward 10-20% faster; 1024-channel runs at K = 8
// (64 KB a step) made the forward slower.
constexpr int64_t kStepBytes = int64_t{32} << 10;
// The shortest time tiles that a forward cuts to give each thread a tile. On 16 cores of a Xeon,
// B=2 L=512 D=256 forwards in four tiles left 12 threads idle: bf16 K = 2 took up to 1.24x the
// reference's time; cut into 16 tiles, at most 1.02x, and the other forwards of that size held or
// gained (sixty-second session, ratios to the same run's reference; RESULTS.md, section CPU).
constexpr int64_t kMinSplitSteps = 32;
// Lanes of the dw/db partial sums along time in "BDL" (a fixed count, so results do not depend
// on the vector width of the CPU).
constexpr int64_t kLanes = 16;

struct Tile {
  int64_t b, d0, d1, t0, t1;
};

// Tile sizes depend on the shape and the layout, and a forward's also on the pool's threads.
struct Tiling {
  int64_t channel_block, time_block, channel_tiles, time_tiles, count;

  // tap_bytes: a channel's bytes a tap, its weight's and its x's (sizeof(A) + sizeof(T)).
  // min_tiles: a call of several tiles has its time cut finer (down to kMinSplitSteps) until there
  // are this many. A one-tile call (about kParallelPoints) stays whole: on a 2-core machine handing
  // half of it to a second thread cost more than it saved (B=1 L=256 D=256 bf16: 92 -> 150 us).
  // The forward passes its threads for a threaded call: its outputs do not depend on the tiles.
  // The backward passes 1, since it sums dw/db per tile and its results must not depend on the
  // machine's thread count.
  Tiling(const ConvParams& p, int64_t tap_bytes, int64_t min_tiles) {
    // "BLD": runs of 512 channels per time step, doubled while kStepBytes allows;
    // "BDL": channel rows of up to 8192 steps.
    if (p.channel_last) {
      const int64_t step_bytes = std::max<int64_t>(p.width, 1) * tap_bytes;
      int64_t run = 512;
      while (run < p.channels && 2 * run * step_bytes <= kStepBytes) run *= 2;
      channel_block = std::max<int64_t>(1, std::min(p.channels, run));
      time_block = std::min<int64_t>(p.length, std::max<int64_t>(128, kTilePoints / channel_block));
    } else {
      time_block = std::min<int64_t>(p.length, 8192);
      const int64_t rows = std::max<int64_t>(8, kTilePoints / std::max<int64_t>(time_block, 1));
      channel_block = std::max<int64_t>(1, std::min(p.channels, rows));
    }
    time_block = std::max<int64_t>(1, time_block);
    channel_tiles = (p.channels + channel_block - 1) / channel_block;
    // At least one time tile, so that dS is written even for an empty sequence.
    const auto count_for = [&](int64_t block) {
      time_tiles = std::max<int64_t>(1, (p.length + block - 1) / block);
      return p.batch * channel_tiles * time_tiles;
    };
    count = count_for(time_block);
    while (count > 1 && count < min_tiles && time_block > kMinSplitSteps) {
      time_block = std::max(kMinSplitSteps, (time_block + 1) / 2);
      count = count_for(time_block);
    }
  }
  int64_t index(int64_t b, int64_t c, int64_t tt) const {
    return (b * channel_tiles + c) * time_tiles + tt;
  }
  Tile tile(const ConvParams& p, int64_t i) const {
    const int64_t tt = i % time_tiles, c = (i / time_tiles) % channel_tiles;
    const int64_t b = i / (time_tiles * channel_tiles);
    return Tile{b, c * channel_block, std::min(p.channels, (c + 1) * channel_block),
                tt * time_block, std::min(p.length, (tt + 1) * time_block)};
  }
};

// interior[t - lo], t in [lo, hi): whether output time t reads all K taps from x in its own
// segment, so that it needs no per-tap check (t >= P, not padding, no segment boundary).
template <typename C>
void find_interior(const C& conv, int64_t b, int64_t lo, int64_t hi,
                   std::vector<uint8_t>& interior) {
  const int64_t P = conv.state_len();
  interior.assign(static_cast<size_t>(hi - lo), 0);
  for (int64_t t = std::max(lo, P); t < hi; ++t) {
    bool all = true;
    if (conv.p.seq_idx != nullptr) {
      for (int64_t u = t; u >= t - P && all; --u) all = conv.tap_used(b, t, u);
    }
    interior[static_cast<size_t>(t - lo)] = all;
  }
}

// The maximal intervals [a, e) of interior times in [lo, hi), in order; interior[t - base] flags
// time t.
using Intervals = std::vector<std::pair<int64_t, int64_t>>;
inline Intervals interior_intervals(const std::vector<uint8_t>& interior, int64_t base,
                                    int64_t lo, int64_t hi) {
  Intervals out;
  int64_t t = lo;
  while (t < hi) {
    if (!interior[static_cast<size_t>(t - base)]) {
      ++t;
      continue;
    }
    const int64_t a = t;
    while (t < hi && interior[static_cast<size_t>(t - base)]) ++t;
    out.emplace_back(a, t);
  }
  return out;
}

// z for n channels at one interior time of "BLD": taps[k * stride + dd] is x_{t-P+k} of channel dd.
template <typename T, typename A, int kWidth>
CAUSAL_CONV_HD void pre_activation_bld(int64_t K, int64_t n, const A* w, const A* bias,
                                       const T* taps, int64_t stride, A* z) {
  if constexpr (kWidth > 0) {
    for (int64_t dd = 0; dd < n; ++dd) {
      A acc = bias[dd];
      for (int k = 0; k < kWidth; ++k) acc += w[k * n + dd] * to_acc<A>(taps[k * stride + dd]);
      z[dd] = acc;
    }
  } else {
    for (int64_t dd = 0; dd < n; ++dd) z[dd] = bias[dd];
    for (int64_t k = 0; k < K; ++k) {
      const A* wk = w + k * n;
      const T* xk = taps + k * stride;
      for (int64_t dd = 0; dd < n; ++dd) z[dd] += wk[dd] * to_acc<A>(xk[dd]);
    }
  }
}

// z on an interior interval of one "BDL" row: z[i] for time a + i, i < n; x points at x_a.
template <typename T, typename A, int kWidth>
CAUSAL_CONV_HD void pre_activation_bdl(int64_t K, int64_t n, const A* w, A bias, const T* x,
                                       A* z) {
  const int64_t P = K - 1;
  if constexpr (kWidth > 0) {
    for (int64_t i = 0; i < n; ++i) {
      A acc = bias;
      for (int k = 0; k < kWidth; ++k) acc += w[k] * to_acc<A>(x[i - P + k]);
      z[i] = acc;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) z[i] = bias;
    for (int64_t k = 0; k < K; ++k) {
      const A wk = w[k];
      const T* xk = x - P + k;
      for (int64_t i = 0; i < n; ++i) z[i] += wk * to_acc<A>(xk[i]);
    }
  }
}

// A tile's channels d0 + dd, dd < n, with their weights transposed to w[k * n + dd] (in A, whatever
// type they are stored in), and the edge path: the non-interior times, one time step for all n
// channels at once. It follows Conv::pre_activation, Conv::weight_grad_term and Conv::input_grad
// tap by tap (same taps, same order of additions), but asks conv.tap_used once per tap and time
// instead of once per point.
// Element (t, dd) of an x-like tensor is at [t * ts + dd * cs] from the tile's (b, 0, d0).
template <typename T, typename A, int kWidth>
struct Channels {
  Conv<T, A, kWidth> conv;
  int64_t b, d0, n, K, P, ts, cs, origin;
  std::vector<A> w, bias, row;
  std::vector<uint8_t> used;
  std::vector<A> z;

  Channels(const ConvParams& p, const Tile& tile)
      : conv{p}, b(tile.b), d0(tile.d0), n(tile.d1 - tile.d0), K(conv.width()),
        P(conv.state_len()), ts(p.x_strides.time), cs(p.x_strides.channel),
        origin(offset(p.x_strides, tile.b, 0, tile.d0)), w(static_cast<size_t>(K * n)),
        bias(static_cast<size_t>(n)), row(static_cast<size_t>(K)), used(static_cast<size_t>(K)),
        z(static_cast<size_t>(n)) {
    param_table<T, A>(p, b, d0, n, K, w.data(), bias.data());
  }

  // The K weights of channel d0 + dd, contiguous (valid until the next call).
  const A* weight_row(int64_t dd) {
    for (int64_t k = 0; k < K; ++k) {
      row[static_cast<size_t>(k)] = w[static_cast<size_t>(k * n + dd)];
    }
    return row.data();
  }

  template <typename U>
  CAUSAL_CONV_HD U* at(const void* base, int64_t t) const {
    return const_cast<U*>(static_cast<const U*>(base)) + origin + t * ts;
  }

  // z of every channel at output time t (not padding); leaves used[k] = whether tap k is read.
  CAUSAL_CONV_HD void edge_pre_activation(int64_t t) {
    for (int64_t dd = 0; dd < n; ++dd) z[dd] = bias[dd];
    for (int64_t k = 0; k < K; ++k) {
      const int64_t u = t - P + k;
      used[k] = conv.tap_used(b, t, u);
      if (!used[k]) continue;
      const A* wk = w.data() + k * n;
      if (u >= 0) {
        const T* xu = at<const T>(conv.p.x, u);
        for (int64_t dd = 0; dd < n; ++dd) z[dd] += wk[dd] * to_acc<A>(xu[dd * cs]);
      } else {
        for (int64_t dd = 0; dd < n; ++dd) z[dd] += wk[dd] * conv.input(b, u, d0 + dd);
      }
    }
  }

  // The taps edge_pre_activation found used, times delta: dw terms of output time t.
  CAUSAL_CONV_CPU_KERNEL void edge_weight_grad(int64_t t, const A* delta, int64_t delta_stride,
                                               A* dw) const {
    for (int64_t k = 0; k < K; ++k) {
      if (!used[k]) continue;
      const int64_t u = t - P + k;
      A* dwk = dw + k * n;
      if (u >= 0) {
        const T* xu = at<const T>(conv.p.x, u);
        for (int64_t dd = 0; dd < n; ++dd) {
          dwk[dd] += delta[dd * delta_stride] * to_acc<A>(xu[dd * cs]);
        }
      } else {
        for (int64_t dd = 0; dd < n; ++dd) {
          dwk[dd] += delta[dd * delta_stride] * conv.input(b, u, d0 + dd);
        }
      }
    }
  }

  // dx_u of every channel, stored. delta_t of channel dd is at
  // delta[((t - origin) % period) * row_stride + dd * delta_stride]: a ring of rows or a buffer.
  CAUSAL_CONV_CPU_KERNEL void edge_input_grad(int64_t u, const A* delta, int64_t origin,
                                              int64_t period, int64_t row_stride,
                                              int64_t delta_stride) {
    const ConvParams& p = conv.p;
    for (int64_t dd = 0; dd < n; ++dd) z[dd] = A(0);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t t = u + P - k;
      if (t < 0 || t >= p.length || !conv.tap_used(b, t, u)) continue;
      const A* wk = w.data() + k * n;
      const A* dr = delta + ((t - origin) % period) * row_stride;
      for (int64_t dd = 0; dd < n; ++dd) z[dd] += wk[dd] * dr[dd * delta_stride];
    }
    if (p.dfinal_state != nullptr && u >= p.length - P) {
      for (int64_t dd = 0; dd < n; ++dd) z[dd] += conv.final_state_grad(b, u, d0 + dd);
    }
    if (u >= 0) {
      T* dxu = at<T>(p.dx, u);
      for (int64_t dd = 0; dd < n; ++dd) dxu[dd * cs] = from_acc<T>(z[dd]);
    } else {
      for (int64_t dd = 0; dd < n; ++dd) {
        conv.store_state_like(p.dinitial_state, b, u + P, d0 + dd, z[dd]);
      }
    }
  }

  // y at a non-interior time t.
  template <bool kSilu>
  CAUSAL_CONV_CPU_KERNEL void edge_output(int64_t t) {
    T* yt = at<T>(conv.p.y, t);
    if (conv.is_padding(b, t)) {
      for (int64_t dd = 0; dd < n; ++dd) yt[dd * cs] = from_acc<T>(A(0));
      return;
    }
    edge_pre_activation(t);
    for (int64_t dd = 0; dd < n; ++dd) yt[dd * cs] = from_acc<T>(activate(z[dd], kSilu));
  }

  // delta at a non-interior time t < L into delta[dd * delta_stride]; false at padding (delta = 0,
  // no dw terms), else used[] holds the taps for edge_weight_grad.
  template <bool kSilu>
  CAUSAL_CONV_CPU_KERNEL bool edge_delta(int64_t t, A* delta, int64_t delta_stride) {
    if (conv.is_padding(b, t)) {
      for (int64_t dd = 0; dd < n; ++dd) delta[dd * delta_stride] = A(0);
      return false;
    }
    edge_pre_activation(t);
    const T* g = at<const T>(conv.p.dy, t);
    for (int64_t dd = 0; dd < n; ++dd) {
      delta[dd * delta_stride] = to_acc<A>(g[dd * cs]) * activation_grad(z[dd], kSilu);
    }
    return true;
  }
};

template <typename T, typename A, int kWidth, bool kSilu>
CAUSAL_CONV_CPU_KERNEL void forward_tile(const ConvParams& p, const Tile& tile) {
  Channels<T, A, kWidth> ch(p, tile);
  const int64_t K = ch.K, P = ch.P, L = p.length, D = p.channels, n = ch.n, b = tile.b;
  std::vector<uint8_t> interior;
  find_interior(ch.conv, b, tile.t0, tile.t1, interior);
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  if (p.channel_last) {
    const int64_t row = b * L * D + tile.d0;
    for (int64_t t = tile.t0; t < tile.t1; ++t) {
      if (!interior[static_cast<size_t>(t - tile.t0)]) {
        ch.template edge_output<kSilu>(t);
        continue;
      }
      pre_activation_bld<T, A, kWidth>(K, n, ch.w.data(), ch.bias.data(), x + row + (t - P) * D,
                                       D, ch.z.data());
      T* yt = y + row + t * D;
      for (int64_t dd = 0; dd < n; ++dd) yt[dd] = from_acc<T>(activate(ch.z[dd], kSilu));
    }
    return;
  }
  std::vector<A> z(static_cast<size_t>(tile.t1 - tile.t0));
  const Intervals runs = interior_intervals(interior, tile.t0, tile.t0, tile.t1);
  for (int64_t d = tile.d0; d < tile.d1; ++d) {
    const A* w = ch.weight_row(d - tile.d0);
    const A bias = ch.bias[static_cast<size_t>(d - tile.d0)];
    const T* xr = x + (b * D + d) * L;
    T* yr = y + (b * D + d) * L;
    for (const auto& [a, e] : runs) {
      pre_activation_bdl<T, A, kWidth>(K, e - a, w, bias, xr + a, z.data());
      for (int64_t t = a; t < e; ++t) yr[t] = from_acc<T>(activate(z[t - a], kSilu));
    }
  }
  for (int64_t t = tile.t0; t < tile.t1; ++t) {
    if (!interior[static_cast<size_t>(t - tile.t0)]) ch.template edge_output<kSilu>(t);
  }
}

// A tile of the backward; dw_part (n * K, channel-major like dweight) and db_part (n) receive the
// tile's dw/db terms.
template <typename T, typename A, int kWidth, bool kSilu>
CAUSAL_CONV_CPU_KERNEL void backward_tile(const ConvParams& p, const Tile& tile, A* dw_part,
                                          A* db_part) {
  Channels<T, A, kWidth> ch(p, tile);
  const int64_t K = ch.K, P = ch.P, L = p.length, D = p.channels, n = ch.n, b = tile.b;
  const int64_t t0 = tile.t0, t1 = tile.t1;
  // dx is owned on [t0, t1), and on [-P, 0) (dS) by the first time tile; delta is needed on
  // [t0, hi).
  const int64_t u_first = (t0 == 0 && p.dinitial_state != nullptr) ? -P : t0;
  const int64_t hi = std::min(t1 + P, L);
  std::vector<uint8_t> interior;
  find_interior(ch.conv, b, t0, hi, interior);
  const auto is_interior = [&](int64_t t) { return interior[static_cast<size_t>(t - t0)] != 0; };
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy);
  T* dx = static_cast<T*>(p.dx);
  const A* w = ch.w.data();
  std::vector<A> dw(static_cast<size_t>(K * n), A(0));
  std::fill(db_part, db_part + n, A(0));

  if (p.channel_last) {
    // delta of the last K times, time t in slot t % K: all that dx at t - P reads.
    std::vector<A> ring(static_cast<size_t>(K * n));
    const auto slot = [&](int64_t t) { return ring.data() + (t % K) * n; };
    const int64_t row = b * L * D + tile.d0;
    A* z = ch.z.data();
    for (int64_t t = t0; t < t1 + P; ++t) {
      A* delta = slot(t);
      const bool fast = t < L && is_interior(t);
      if (fast) {
        const T* taps = x + row + (t - P) * D;
        pre_activation_bld<T, A, kWidth>(K, n, w, ch.bias.data(), taps, D, z);
        const T* g = dy + row + t * D;
        for (int64_t dd = 0; dd < n; ++dd) {
          delta[dd] = to_acc<A>(g[dd]) * activation_grad(z[dd], kSilu);
        }
        if (t < t1) {
          for (int64_t k = 0; k < K; ++k) {
            A* dwk = dw.data() + k * n;
            const T* xk = taps + k * D;
            for (int64_t dd = 0; dd < n; ++dd) dwk[dd] += delta[dd] * to_acc<A>(xk[dd]);
          }
          for (int64_t dd = 0; dd < n; ++dd) db_part[dd] += delta[dd];
        }
      } else if (t < L) {
        if (ch.template edge_delta<kSilu>(t, delta, 1) && t < t1) {
          ch.edge_weight_grad(t, delta, 1, dw.data());
          for (int64_t dd = 0; dd < n; ++dd) db_part[dd] += delta[dd];
        }
      }
      const int64_t u = t - P;
      if (u < u_first) continue;
      if (!fast) {
        ch.edge_input_grad(u, ring.data(), 0, K, n, 1);
        continue;
      }
      // every tap of dx_u is used and u < L - P: no final-state gradient
      T* dxu = dx + row + u * D;
      if constexpr (kWidth > 0) {
        const A* d_k[kWidth];
        for (int k = 0; k < kWidth; ++k) d_k[k] = slot(t - k);
        for (int64_t dd = 0; dd < n; ++dd) {
          A acc = A(0);
          for (int k = 0; k < kWidth; ++k) acc += w[k * n + dd] * d_k[k][dd];
          dxu[dd] = from_acc<T>(acc);
        }
      } else {
        std::fill(z, z + n, A(0));
        for (int64_t k = 0; k < K; ++k) {
          const A* wk = w + k * n;
          const A* dk = slot(t - k);
          for (int64_t dd = 0; dd < n; ++dd) z[dd] += wk[dd] * dk[dd];
        }
        for (int64_t dd = 0; dd < n; ++dd) dxu[dd] = from_acc<T>(z[dd]);
      }
    }
  } else {
    // "BDL": delta of channel dd at time t in delta[dd * S + t - t0], t in [t0, hi).
    const int64_t S = hi - t0;
    std::vector<A> delta(static_cast<size_t>(n * S)), z(static_cast<size_t>(S));
    std::vector<A> lanes(static_cast<size_t>((K + 1) * kLanes));
    // Interior times, one channel row at a time: delta, then the dw/db terms in kLanes lanes
    // (lane j takes times a + j, a + j + kLanes, ... of an interval [a, e)), then dx.
    const Intervals runs = interior_intervals(interior, t0, t0, hi);
    for (int64_t dd = 0; dd < n; ++dd) {
      const int64_t d = tile.d0 + dd;
      const A* wr = ch.weight_row(dd);
      const T* xr = x + (b * D + d) * L;
      const T* gr = dy + (b * D + d) * L;
      A* dr = delta.data() + dd * S;
      for (const auto& [a, e] : runs) {
        pre_activation_bdl<T, A, kWidth>(K, e - a, wr, ch.bias[dd], xr + a, z.data());
        for (int64_t t = a; t < e; ++t) {
          dr[t - t0] = to_acc<A>(gr[t]) * activation_grad(z[t - a], kSilu);
        }
      }
      std::fill(lanes.begin(), lanes.end(), A(0));
      A* lane_b = lanes.data() + K * kLanes;
      for (const auto& run : runs) {
        const int64_t a = run.first, e = std::min(run.second, t1);
        for (int64_t s = a; s < e; s += kLanes) {
          const int64_t m = std::min(kLanes, e - s);
          const A* ds = dr + (s - t0);
          for (int64_t j = 0; j < m; ++j) lane_b[j] += ds[j];
          for (int64_t k = 0; k < K; ++k) {
            A* lane_w = lanes.data() + k * kLanes;
            const T* xk = xr + s - P + k;
            for (int64_t j = 0; j < m; ++j) lane_w[j] += ds[j] * to_acc<A>(xk[j]);
          }
        }
      }
      for (int64_t j = 0; j < kLanes; ++j) {
        for (int64_t k = 0; k < K; ++k) dw[k * n + dd] += lanes[k * kLanes + j];
        db_part[dd] += lane_b[j];
      }
    }
    // Edge times for all channels at once: delta, then dw/db terms.
    for (int64_t t = t0; t < hi; ++t) {
      if (is_interior(t)) continue;
      A* dt = delta.data() + (t - t0);
      if (ch.template edge_delta<kSilu>(t, dt, S) && t < t1) {
        ch.edge_weight_grad(t, dt, S, dw.data());
        for (int64_t dd = 0; dd < n; ++dd) db_part[dd] += dt[dd * S];
      }
    }
    // dx where the window [u, u + P] of dx_u is interior at u + P, per channel row.
    const auto fast_dx = [&](int64_t u) { return u >= 0 && u + P < hi && is_interior(u + P); };
    for (int64_t dd = 0; dd < n; ++dd) {
      const A* wr = ch.weight_row(dd);
      T* dxr = dx + (b * D + tile.d0 + dd) * L;
      const A* dr = delta.data() + dd * S;
      for (const auto& run : runs) {
        const int64_t a = std::max(run.first - P, t0), e = std::min(run.second - P, t1);
        if (a >= e) continue;
        const int64_t m = e - a;
        const A* base = dr + (a + P - t0);
        if constexpr (kWidth > 0) {
          for (int64_t i = 0; i < m; ++i) {
            A acc = A(0);
            for (int k = 0; k < kWidth; ++k) acc += wr[k] * base[i - k];
            dxr[a + i] = from_acc<T>(acc);
          }
        } else {
          std::fill(z.begin(), z.begin() + m, A(0));
          for (int64_t k = 0; k < K; ++k) {
            const A wk = wr[k];
            const A* dk = base - k;
            for (int64_t i = 0; i < m; ++i) z[i] += wk * dk[i];
          }
          for (int64_t i = 0; i < m; ++i) dxr[a + i] = from_acc<T>(z[i]);
        }
      }
    }
    for (int64_t u = u_first; u < t1; ++u) {
      if (fast_dx(u)) continue;
      ch.edge_input_grad(u, delta.data(), t0, S, 1, S);
    }
  }
  for (int64_t dd = 0; dd < n; ++dd) {
    for (int64_t k = 0; k < K; ++k) dw_part[dd * K + k] = dw[static_cast<size_t>(k * n + dd)];
  }
}

template <typename T, typename A, int kWidth>
void forward(ffi::ThreadPool& pool, const ConvParams& p) {
  const int64_t points = p.batch * p.length * p.channels;
  const Tiling tiling(p, sizeof(T) + sizeof(A), threads_for(pool, points));
  run_tiles(pool, tiling.count, points, [&](int64_t i) {
    const Tile tile = tiling.tile(p, i);
    if (p.silu) {
      forward_tile<T, A, kWidth, true>(p, tile);
    } else {
      forward_tile<T, A, kWidth, false>(p, tile);
    }
  });
  if (p.final_state == nullptr) return;
  const Conv<T, A, kWidth> conv{p};
  const int64_t state_points = p.batch * conv.state_len() * p.channels;
  for (int64_t i = 0; i < state_points; ++i) {
    const Point q = point_at(i, conv.state_len(), p.channels, p.channel_last);
    conv.store_state_like(p.final_state, q.b, q.t, q.d, conv.final_state(q.b, q.t, q.d));
  }
}

// dweight and dbias are stored in the params' type (A, or T when params_like_x).
template <typename T, typename A, int kWidth>
void backward(ffi::ThreadPool& pool, const ConvParams& p, void* dweight, void* dbias) {
  const Tiling tiling(p, sizeof(T) + sizeof(A), 1);
  const int64_t K = p.width, cb = tiling.channel_block;
  std::vector<A> dw_parts(static_cast<size_t>(tiling.count * cb * K));
  std::vector<A> db_parts(static_cast<size_t>(tiling.count * cb));
  run_tiles(pool, tiling.count, p.batch * p.length * p.channels, [&](int64_t i) {
    const Tile tile = tiling.tile(p, i);
    A* dw = dw_parts.data() + i * cb * K;
    A* db = db_parts.data() + i * cb;
    if (p.silu) {
      backward_tile<T, A, kWidth, true>(p, tile, dw, db);
    } else {
      backward_tile<T, A, kWidth, false>(p, tile, dw, db);
    }
  });
  // Fixed order: batch rows of the group, then time tiles; summed in A, then stored.
  std::vector<A> dw_sum(static_cast<size_t>(p.groups * p.channels * K), A(0));
  std::vector<A> db_sum(static_cast<size_t>(p.groups * p.channels), A(0));
  const int64_t rows_per_group = p.batch / p.groups;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t g = b / rows_per_group;
    for (int64_t c = 0; c < tiling.channel_tiles; ++c) {
      const int64_t d0 = c * cb, n = std::min(p.channels, d0 + cb) - d0;
      for (int64_t tt = 0; tt < tiling.time_tiles; ++tt) {
        const int64_t i = tiling.index(b, c, tt);
        const A* dw = dw_parts.data() + i * cb * K;
        const A* db = db_parts.data() + i * cb;
        A* dw_out = dw_sum.data() + (g * p.channels + d0) * K;
        A* db_out = db_sum.data() + g * p.channels + d0;
        for (int64_t j = 0; j < n * K; ++j) dw_out[j] += dw[j];
        for (int64_t j = 0; j < n; ++j) db_out[j] += db[j];
      }
    }
  }
  for (size_t i = 0; i < dw_sum.size(); ++i) {
    store_param<T, A>(dweight, static_cast<int64_t>(i), dw_sum[i], p.params_like_x);
  }
  for (size_t i = 0; i < db_sum.size(); ++i) {
    store_param<T, A>(dbias, static_cast<int64_t>(i), db_sum[i], p.params_like_x);
  }
}

ffi::Error forward_handler(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                           ffi::AnyBuffer bias, ffi::AnyBuffer initial_state,
                           ffi::Buffer<ffi::S32> seq_idx, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> final_state, bool silu, bool channel_last) {
  ConvParams p;
  if (auto err = fill_forward_params(x, weight, bias, initial_state, seq_idx, y, final_state, silu,
                                     channel_last, p);
      err.failure()) {
    return err;
  }
  return dispatch_dtype<Float16, BFloat16>(x.element_type(), [&](auto types) {
    using Types = decltype(types);
    dispatch_width<kCpuMaxWidth>(p.width, [&](auto width) {
      forward<typename Types::Storage, typename Types::Acc, decltype(width)::value>(pool, p);
    });
    return ffi::Error::Success();
  });
}

ffi::Error backward_handler(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                            ffi::AnyBuffer bias, ffi::AnyBuffer initial_state,
                            ffi::Buffer<ffi::S32> seq_idx, ffi::AnyBuffer dy,
                            ffi::AnyBuffer dfinal_state, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::AnyBuffer> dinitial_state,
                            ffi::Result<ffi::AnyBuffer> /*workspace: empty on CPU*/, bool silu,
                            bool channel_last) {
  ConvParams p;
  if (auto err = fill_backward_params(x, weight, bias, initial_state, seq_idx, dy, dfinal_state, dx,
                                      dweight, dbias, dinitial_state, silu, channel_last, p);
      err.failure()) {
    return err;
  }
  return dispatch_dtype<Float16, BFloat16>(x.element_type(), [&](auto types) {
    using Types = decltype(types);
    dispatch_width<kCpuMaxWidth>(p.width, [&](auto width) {
      backward<typename Types::Storage, typename Types::Acc, decltype(width)::value>(
          pool, p, dweight->untyped_data(), dbias->untyped_data());
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace causal_conv

XLA_FFI_DEFINE_HANDLER_SYMBOL(CausalConv1dForwardCpu, causal_conv::forward_handler,
                              causal_conv::bind_forward(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CausalConv1dBackwardCpu, causal_conv::backward_handler,
                              causal_conv::bind_backward(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
