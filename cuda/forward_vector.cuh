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

// Segments whose packs a channel-first lane has in flight: with one, a warp waited for every load.
constexpr int kForwardAhead = 3;

// (B, D, L), L a multiple of the pack V: a warp streams chunk_len times of one (b, d) row, lane l
// owning V consecutive times of each 32 V-time segment; the K-1 inputs before a lane's pack come
// from its lower neighbours by shuffle. The next kForwardAhead segments' packs are in flight.
template <typename T, int K, bool kMasked>
__global__ void __launch_bounds__(kThreads)
    forward_channel_first_kernel(ConvParams p, int64_t chunk_len) {
  constexpr int V = kPack<T>;
  constexpr int P = K - 1;
  constexpr int64_t kSegment = kLanes * V;
  const Conv<T, float, K> conv{p};
  const int lane = threadIdx.x % kLanes;
  const int64_t chunks = (p.length + chunk_len - 1) / chunk_len;
  const int64_t items = p.batch * p.channels * chunks;
  const int64_t warps_per_grid = int64_t{gridDim.x} * (blockDim.x / kLanes);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x / kLanes} + threadIdx.x / kLanes;
       i < items; i += warps_per_grid) {
    const ChannelFirstItem item(i, chunks, chunk_len, p);
    const T* x_row = static_cast<const T*>(p.x) + item.row * p.length;
    T* y_row = static_cast<T*>(p.y) + item.row * p.length;
    float w[K][1], bias[1];
    load_weights(conv, item.b, item.d, w, bias);
    const int32_t* segment_row = kMasked ? p.seq_idx + item.b * p.length : nullptr;
    ChannelFirstCarry<K, kMasked> carry(conv, item);
    // The lane's packs of the next kAhead segments, loaded before they are needed.
    RawFor<T, V> ahead[kForwardAhead];
    for (int a = 0; a < kForwardAhead; ++a) {
      const int64_t t = item.c0 + a * kSegment + lane * V;
      ahead[a] = load_readonly_or_zero<T, V>(x_row + t, t < item.c1);
    }
    for (int64_t s = item.c0; s < item.c1; s += kSegment) {
      const int64_t t0 = s + lane * V;
      const bool live = t0 < item.c1;
      float own[V];
      to_floats(from_raw<T, V>(ahead[0]), own);
      for (int a = 0; a + 1 < kForwardAhead; ++a) ahead[a] = ahead[a + 1];
      const int64_t t_ahead = t0 + kForwardAhead * kSegment;
      ahead[kForwardAhead - 1] = load_readonly_or_zero<T, V>(x_row + t_ahead, t_ahead < item.c1);
      float xs[P + V];  // x_{t0-P} .. x_{t0+V-1}
      int32_t segments[P + V];
      carry.advance(own, segment_row, t0, live, lane, xs, segments);
      float out[V];
      for (int v = 0; v < V; ++v) {
        float z = bias[0];
        for (int k = 0; k < K; ++k) {
          const float tap = fmaf(w[k][0], xs[v + k], z);
          z = (!kMasked || same_segment(segments[P + v], segments[v + k])) ? tap : z;
        }
        out[v] = (kMasked && segments[P + v] < 0) ? 0.0f : activate(z, p.silu);
      }
      if (live) store_vec(y_row + t0, from_floats<T, V>(out));
    }
  }
}

}  // namespace causal_conv
