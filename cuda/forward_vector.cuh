// Vectorized forward kernels for compile-time widths (see conv_vector.cuh).
#pragma once

#include <cstdint>

#include "conv_vector.cuh"

namespace causal_conv {

// Rows in flight per thread (RowRing depth) and threads per block: 16 x 8 bytes x 128 threads =
// 16 KB of shared memory per block.
constexpr int kForwardDepth = 16;
constexpr int kForwardThreads = 128;
// Channels per channel-last forward thread: kForwardBudget / K taps, 8-byte accesses for 16-bit x
// at K = 4. With 16-byte ones (twice the weights and window in registers) ncu saw 124 registers,
// 23% of warps active and DRAM at 54% of peak: 104 us against 85 us on the main workload.
constexpr int kForwardBudget = 16;

// (B, L, D), D a multiple of C: a thread owns C channels over time_chunk steps and slides a
// K-row register window down them; its next rows arrive through a RowRing. The step loop is
// unrolled K times, so that the window shifts are register renaming. With seq_idx, the steps whose
// windows SegmentSteps finds across a segment boundary or at padding run one by one, with tap
// tests.
template <typename T, int K, bool kMasked>
__global__ void __launch_bounds__(kForwardThreads)
    forward_channel_last_kernel(ConvParams p, int64_t time_chunk) {
  constexpr int C = channels_per_thread<T, K, kForwardBudget>();
  constexpr int P = K - 1;
  using Row = RawFor<T, C>;
  __shared__ Row x_slots[kForwardDepth * kForwardThreads];
  const RowRing<kForwardDepth, Row, kForwardThreads> x_ring{x_slots};
  const Conv<T, float, K> conv{p};
  const int64_t packs = p.channels / C;
  const int64_t chunks = (p.length + time_chunk - 1) / time_chunk;
  const int64_t total = p.batch * chunks * packs;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d0 = (i % packs) * C;
    const int64_t chunk = (i / packs) % chunks, b = i / (packs * chunks);
    const int64_t t0 = chunk * time_chunk;
    const int steps = static_cast<int>(std::min(time_chunk, p.length - t0));
    const int64_t first = (b * p.length + t0) * p.channels + d0;
    const T* x_next = static_cast<const T*>(p.x) + first;  // the row of the next fetch
    T* y_row = static_cast<T*>(p.y) + first;
    const auto fetch = [&](int step) {
      x_ring.fetch(step, x_next, step < steps);
      ring_commit();
      x_next += p.channels;
    };
    for (int step = 0; step < kForwardDepth; ++step) fetch(step);
    float w[K][C], bias[C];
    load_weights(conv, b, d0, w, bias);
    float window[K][C];  // window[k] holds x_{t-P+k}
    load_window_before(conv, b, t0, d0, window);
    using Segments = SegmentSteps<K, C>;
    const Segments segments{p, b, t0, d0, steps};
    // One step, with the taps of SegmentSteps: the constant kAllTaps leaves no tap test.
    const auto step_at = [&](int step, uint32_t taps) {
      ring_wait<kForwardDepth - 1>();
      to_floats(x_ring.template read<T, C>(step), window[P]);
      fetch(step + kForwardDepth);  // into the slots just read
      float out[C];
      for (int c = 0; c < C; ++c) {
        float z = bias[c];
        for (int k = 0; k < K; ++k) {
          const float tap = fmaf(w[k][c], window[k][c], z);
          z = Segments::has(taps, k) ? tap : z;
        }
        out[c] = Segments::has(taps, P) ? activate(z, p.silu) : 0.0f;
      }
      store_vec(y_row, from_floats<T, C>(out));
      y_row += p.channels;
      slide_windows<K, C>(window);
    };
    const auto uniform = [&](int begin, int end) {
      run_steps<K>(begin, end, [&](int step) { step_at(step, Segments::kAllTaps); });
    };
    if constexpr (kMasked) {
      // The forward has no edge steps: every other step is one that needs the tap tests.
      segments.run(0, steps, 0, steps, uniform,
                   [&](int step, bool) { step_at(step, segments.taps(step)); });
    } else {
      uniform(0, steps);
    }
  }
}

// xs[j] = x_{t0-P+j}, j < P + V, for the lane whose pack starts at t0 (a multiple of V; live:
// whether the pack exists), from the row's own pointers (x_row: its L inputs; state_row: its P
// initial-state values, or nullptr for zeros): the lane's pack and the packs before it by aligned
// loads, no shuffle.
template <typename T, int V, int P>
__device__ __forceinline__ void load_x_window(const T* x_row, const T* state_row, int64_t t0,
                                              bool live, float (&xs)[P + V]) {
  constexpr int kPacks = (P + V - 1) / V;  // the packs before t0 that hold the P times
  float before[kPacks * V];
  for (int i = 0; i < kPacks; ++i) {
    const int64_t u = t0 - (kPacks - i) * V;
    to_floats(from_raw<T, V>(load_readonly_or_zero<T, V>(x_row + u, u >= 0)),
              reinterpret_cast<float(&)[V]>(before[i * V]));
  }
  for (int j = 0; j < P; ++j) xs[j] = before[kPacks * V - P + j];  // zeros before the row
  if (t0 < P && state_row != nullptr) {  // the row's first lanes, with an initial state
    for (int j = 0; j < P; ++j) {
      if (t0 - P + j < 0) xs[j] = static_cast<float>(state_row[t0 + j]);
    }
  }
  to_floats(from_raw<T, V>(load_readonly_or_zero<T, V>(x_row + t0, live)),
            reinterpret_cast<float(&)[V]>(xs[P]));
}

// y of a channel-first lane's pack from xs = x_{t0-P} .. x_{t0+V-1}. With kSelect, seq_idx's
// masks, segments[j] being the entry of xs[j]; without, every tap.
template <bool kSelect, int K, int V>
__device__ __forceinline__ void channel_first_outputs(const float (&w)[K][1], float bias,
                                                      const float (&xs)[K - 1 + V],
                                                      const int32_t* segments, bool silu,
                                                      float (&out)[V]) {
  constexpr int P = K - 1;
  for (int v = 0; v < V; ++v) {
    const float z = channel_first_pre_activation<kSelect>(w, bias, xs, segments, v);
    out[v] = (kSelect && segments[P + v] < 0) ? 0.0f : activate(z, silu);
  }
}

// Segments whose packs a channel-first lane has in flight: with one, a warp waited for every load.
constexpr int kForwardAhead = 3;

// Blocks of kChannelFirstThreads per SM the channel-first forward's registers must allow (0: no
// bound). Left free, ptxas gave the masked kernel 72-80 registers (6 blocks of 128): the few
// values it holds beyond the unmasked kernel's (the item's flags and row, for the masked segments
// after the loop) tip it over. Capped at 8 blocks, it spills only around uniform_segments and in
// the masked segments (a few words per item), and its loop over the uniform segments keeps the
// unmasked kernel's occupancy.
//
// Unmasked 16-bit kernels up to K = 4 ask for 9 blocks (56 registers, no spills): on the main
// workload that took 81.5 us against 85.3 with 4 blocks of 256 (63 registers). The other unmasked
// kernels are left free (56-72 registers: 7-9 blocks); with 9 blocks float32 K = 4 spilled 36
// bytes and every K >= 6 spilled 12-64. Any bound changes the code ptxas picks, so none is set
// where it would not raise the occupancy.
template <typename T, int K, bool kMasked>
constexpr int channel_first_forward_min_blocks() {
  if constexpr (kMasked) return K <= 6 ? 8 : 0;
  return sizeof(T) == 2 && K <= 4 ? 9 : 0;
}

// (B, D, L), L a multiple of the pack V: a warp streams chunk_len times of one (b, d) row, lane l
// owning V consecutive times of each 32 V-time segment; the K-1 inputs before a lane's pack come
// from its lower neighbours by shuffle. The next kForwardAhead segments' packs are in flight.
//
// With seq_idx (items of at most kUniformSegments segments and of kUniformChannels channels, whose
// uniform segments the warp finds once), the uniform segments run in that loop with the unmasked
// arithmetic; the others only pass their inputs on to the carry there, and run after it with
// seq_idx's masks, their packs and halos loaded again. Kept out of the loop, the masked arithmetic
// (the entries, their compares and the selects) adds nothing to the registers the loop holds:
// inside it (bf16, K = 4), the kernel took 80 registers against the unmasked kernel's 63, and
// ptxas recomputed addresses in the loop to make room (162 instructions per uniform segment
// against 138; now 150).
template <typename T, int K, bool kMasked>
__global__ void
__launch_bounds__(kChannelFirstThreads, channel_first_forward_min_blocks<T, K, kMasked>())
    forward_channel_first_kernel(ConvParams p, ChannelFirstSplit split) {
  constexpr int V = kPack<T>;
  constexpr int P = K - 1;
  constexpr int64_t kSegment = kLanes * V;
  const Conv<T, float, K> conv{p};
  const int lane = threadIdx.x % kLanes;
  // The item's channel `item` (times [c0, c1)); bit j of masks.before (then of uniform): whether
  // the item's segment j is uniform (none past the first kUniformSegments).
  const auto run = [&](const ChannelFirstItem& item, UniformSegments masks) {
    uint32_t uniform = masks.before;
    const T* x_row = static_cast<const T*>(p.x) + item.row * p.length;
    T* y_row = static_cast<T*>(p.y) + item.row * p.length;
    const int32_t* segment_row = kMasked ? p.seq_idx + item.b * p.length : nullptr;
    float w[K][1], bias[1];
    load_param_rows<T>(p, [&](int) { return item.param_row; }, w, bias);
    ChannelFirstCarry<K> carry;
    carry.load(conv, item.b, item.c0, item.d);
    // The lane's packs of the next kAhead segments, loaded before they are needed.
    RawFor<T, V> ahead[kForwardAhead];
    for (int a = 0; a < kForwardAhead; ++a) {
      const int64_t t = item.c0 + a * kSegment + lane * V;
      ahead[a] = load_readonly_or_zero<T, V>(x_row + t, t < item.c1);
    }
    uint32_t next_uniform = uniform;  // bit 0: the next segment's
    for (int64_t s = item.c0; s < item.c1; s += kSegment) {
      const bool masked = kMasked && !(next_uniform & 1u);
      next_uniform >>= 1;
      const int64_t t0 = s + lane * V;
      const bool live = t0 < item.c1;
      float own[V];
      to_floats(from_raw<T, V>(ahead[0]), own);
      for (int a = 0; a + 1 < kForwardAhead; ++a) ahead[a] = ahead[a + 1];
      const int64_t t_ahead = t0 + kForwardAhead * kSegment;
      ahead[kForwardAhead - 1] = load_readonly_or_zero<T, V>(x_row + t_ahead, t_ahead < item.c1);
      float xs[P + V];  // x_{t0-P} .. x_{t0+V-1}
      carry.advance(own, lane, xs);
      if (!masked) {
        float out[V];
        channel_first_outputs<false>(w, bias[0], xs, nullptr, p.silu, out);
        if (live) store_vec(y_row + t0, from_floats<T, V>(out));
      }
    }
    if (kMasked) {
      // The segments the loop left: each lane loads its window of x and of entries.
      const T* state_row = p.initial_state == nullptr
                               ? nullptr
                               : static_cast<const T*>(p.initial_state) + item.row * P;
      for (int64_t s = item.c0; s < item.c1; s += kSegment, uniform >>= 1) {
        if (uniform & 1u) continue;
        const int64_t t0 = s + lane * V;
        const bool live = t0 < item.c1;
        float xs[P + V], out[V];
        load_x_window<T, V, P>(x_row, state_row, t0, live, xs);
        int32_t segments[P + V];
        load_segment_window<V, P, 0>(segment_row, t0, p.length, segments);
        channel_first_outputs<true>(w, bias[0], xs, segments, p.silu, out);
        if (live) store_vec(y_row + t0, from_floats<T, V>(out));
      }
    }
  };
  for_each_channel_first_item<V, P, kMasked>(p, split, 0, run);
}

// Warp items whose rows a short-row lane has in flight: 4 x 16 bytes, 2 KB per warp; 24 warps per
// SM (the kernel takes 64-80 registers up to K = 7) then have 48 KB in flight.
constexpr int kShortForwardAhead = 4;

// (B, D, L), L a multiple of the pack V and at most 32 V: group lanes per row (short_row_group),
// 32 / group rows per warp item, the rows of the next kShortForwardAhead items in flight (see
// ShortRowCursor). With seq_idx, an item whose rows each have one id >= 0 throughout (the P times
// before a row have its first id) runs the unmasked arithmetic, the others seq_idx's masks.
template <typename T, int K>
__global__ void __launch_bounds__(kThreads) forward_short_rows_kernel(ConvParams p, int group) {
  constexpr int V = kPack<T>;
  constexpr int P = K - 1;
  const Conv<T, float, K> conv{p};
  const ShortRowLane<V> at(p, group);
  ShortRowCursor cursor = at.cursor(group, p.channels);
  const T* x = static_cast<const T*>(p.x) + at.t0;  // + row * L: the lane's pack of a row
  const auto fetch = [&](int64_t row) {
    return load_readonly_or_zero<T, V>(x + row * p.length, at.in_row && row < at.rows);
  };
  RawFor<T, V> ahead[kShortForwardAhead];  // the lane's packs of its next rows
  for (int a = 0; a < kShortForwardAhead; ++a) ahead[a] = fetch(cursor.row + a * cursor.stride);
  for (int64_t item = at.first_item; item * at.rows_per_item < at.rows; item += at.items_step) {
    const bool row_live = cursor.row < at.rows, live = at.in_row && row_live;
    const int64_t b = row_live ? cursor.b : 0, d = row_live ? cursor.d : 0;  // loads stay in range
    float xs[P + V];  // x_{t0-P} .. x_{t0+V-1}
    to_floats(from_raw<T, V>(ahead[0]), reinterpret_cast<float(&)[V]>(xs[P]));
    for (int a = 0; a + 1 < kShortForwardAhead; ++a) ahead[a] = ahead[a + 1];
    ahead[kShortForwardAhead - 1] = fetch(cursor.row + kShortForwardAhead * cursor.stride);
    float w[K][1], bias[1];
    short_row_window(conv, at, group, b, d, x, xs, w, bias);
    float out[V];
    int32_t segments[P + V];  // with seq_idx: the entry of xs[j]
    const bool masked =
        p.seq_idx != nullptr && short_row_segments<V, P>(p.seq_idx + b * p.length, at, group, live,
                                                         segments);
    if (masked) {
      channel_first_outputs<true>(w, bias[0], xs, segments, p.silu, out);
    } else {
      channel_first_outputs<false>(w, bias[0], xs, nullptr, p.silu, out);
    }
    if (live) {
      store_vec(static_cast<T*>(p.y) + cursor.row * p.length + at.t0, from_floats<T, V>(out));
    }
    cursor.advance(p.channels);
  }
}

}  // namespace causal_conv
