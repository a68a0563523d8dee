// Building blocks of the vectorized conv kernels (forward_vector.cuh, backward_vector.cuh): how
// many channels a channel-last thread owns, weights in registers, and the lane-to-lane halos of a
// warp streaming a channel-first row.
//
// The vectorized kernels take a compile-time width K and a compile-time kMasked (seq_idx given):
// without it the tap loop is K fused multiply-adds per element, with no selects (and with it, the
// channel-last kernels run that loop too wherever a step's window lies inside one segment). They
// accumulate in float (double x takes the generic kernels) and move 8 or 16 bytes per access.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "conv_math.h"
#include "cuda_vector.cuh"

namespace causal_conv {

constexpr int kThreads = 256;
// Threads per block of the channel-first kernels (a warp per item, so only the grid's granularity
// and the register cap change with it). Blocks of 128 with the bounds below measured faster than
// blocks of 256 on the main workload (bf16 B=8 L=2048 D=4096 K=4): forward 81.5 against 85.3 us,
// backward 150.5 against 163.4 (benchmarks/RESULTS.md, seventh session).
constexpr int kChannelFirstThreads = 128;

// Channels per thread in the channel-last kernels: one 16-byte access, halved (down to 8-byte
// accesses) while the thread's K x C weights would pass kBudget registers.
template <typename T, int K, int kBudget>
constexpr int channels_per_thread() {
  int c = kPack<T>;
  while (c * K > kBudget && c * static_cast<int>(sizeof(T)) > 8) c /= 2;
  return c;
}

// The K weights and the bias of params row row_of(c) (a Conv::param_row) into column c, as floats
// (stored in float or in T: with_param_type picks which once, around all the loads).
// kPredicatedBias: the biases by predicated loads (load_runs' live), not in a branch on p.bias:
// ptxas put the branch after the weights' conversions, so that a bias load was issued only once
// the weights had come (sm_90 SASS, channel-last forward: bf16 K = 4 the last of its 4 biases,
// bf16 K = 8 the bias run of load_weight_runs).
template <typename T, bool kPredicatedBias = false, int K, int C, typename RowOf>
__device__ __forceinline__ void load_param_rows(const ConvParams& p, const RowOf& row_of,
                                                float (&w)[K][C], float (&bias)[C]) {
  with_param_type<T, float>(p.params_like_x, [&](auto like_x) {
    using Param = std::conditional_t<decltype(like_x)::value, T, float>;
    for (int c = 0; c < C; ++c) {
      const int64_t row = row_of(c);
      for (int k = 0; k < K; ++k) w[k][c] = load_param<T, float>(p.weight, row * K + k, like_x);
      if constexpr (kPredicatedBias) {
        const Param* src = p.bias ? static_cast<const Param*>(p.bias) + row : nullptr;
        float value[1];
        load_runs(src, value, src != nullptr);
        bias[c] = value[0];
      } else {
        bias[c] = p.bias ? load_param<T, float>(p.bias, row, like_x) : 0.0f;
      }
    }
  });
}

// The K weights and the bias of one params row (a channel-first item's or lane's) as column 0.
// kPredicatedBias as in load_param_rows.
template <typename T, bool kPredicatedBias = false, int K>
__device__ __forceinline__ void load_param_row(const ConvParams& p, int64_t row,
                                               float (&w)[K][1], float (&bias)[1]) {
  load_param_rows<T, kPredicatedBias>(p, [&](int) { return row; }, w, bias);
}

// The K weights and the bias of channels d0 .. d0 + C - 1 for batch row b.
template <typename T, bool kPredicatedBias = false, int K, int C>
__device__ __forceinline__ void load_weights(const Conv<T, float, K>& conv, int64_t b, int64_t d0,
                                             float (&w)[K][C], float (&bias)[C]) {
  load_param_rows<T, kPredicatedBias>(conv.p, [&](int c) { return conv.param_row(b, d0 + c); }, w,
                                      bias);
}

// load_weights in runs of up to 16 bytes (load_runs): channels d0 .. d0 + C - 1 are C consecutive
// params rows (d0 and the channel count multiples of C), so the thread's K x C weights and C biases
// are two runs of the (16-byte aligned) buffers, each aligned to its own size. At bf16 K = 8 a
// thread's weights and biases took 36 scalar loads (520 L1 line lookups a warp), in runs 5 (66).
// kPredicatedBias as in load_param_rows.
template <typename T, bool kPredicatedBias = false, int K, int C>
__device__ __forceinline__ void load_weight_runs(const Conv<T, float, K>& conv, int64_t b,
                                                 int64_t d0, float (&w)[K][C],
                                                 float (&bias)[C]) {
  const ConvParams& p = conv.p;
  const int64_t row = conv.param_row(b, d0);
  with_param_type<T, float>(p.params_like_x, [&](auto like_x) {
    using Param = std::conditional_t<decltype(like_x)::value, T, float>;
    float taps[C * K];  // the rows' weights in memory order, [c][k]
    load_runs(static_cast<const Param*>(p.weight) + row * K, taps);
    for (int c = 0; c < C; ++c) {
      for (int k = 0; k < K; ++k) w[k][c] = taps[c * K + k];
    }
    if constexpr (kPredicatedBias) {
      const Param* bias_row = p.bias ? static_cast<const Param*>(p.bias) + row : nullptr;
      load_runs(bias_row, bias, bias_row != nullptr);
    } else if (p.bias != nullptr) {
      load_runs(static_cast<const Param*>(p.bias) + row, bias);
    } else {
      for (int c = 0; c < C; ++c) bias[c] = 0.0f;
    }
  });
}

// Where the C consecutive values of a channel-last row at time u start, for the halo rows before
// a tile: in the initial state for u < 0, or nullptr (zeros) without one.
template <typename T, int K>
__device__ __forceinline__ const T* halo_row(const Conv<T, float, K>& conv, int64_t b, int64_t u,
                                             int64_t d0) {
  const ConvParams& p = conv.p;
  if (u >= 0) return static_cast<const T*>(p.x) + offset(p.x_strides, b, u, d0);
  if (p.initial_state != nullptr) {
    return static_cast<const T*>(p.initial_state) + offset(p.state_strides, b, u + K - 1, d0);
  }
  return nullptr;
}

// The halo row at time u as floats.
template <typename T, int K, int C>
__device__ __forceinline__ void load_row(const Conv<T, float, K>& conv, int64_t b, int64_t u,
                                         int64_t d0, float (&out)[C]) {
  const T* src = halo_row(conv, b, u, d0);
  widen(src == nullptr ? zero_vec<T, C>() : load_readonly<T, C>(src), out);
}

// ---- channel-last columns: a thread streams C channels of a batch row over a piece of time ----

// The K-row window of x a thread slides down its piece: rows 0 .. K-2 get the K-1 times before t0
// (the initial state or zeros before time 0), row K-1 is each step's new row.
template <typename T, int K, int C>
__device__ __forceinline__ void load_window_before(const Conv<T, float, K>& conv, int64_t b,
                                                   int64_t t0, int64_t d0, float (&x)[K][C]) {
  for (int k = 0; k < K - 1; ++k) load_row(conv, b, t0 - (K - 1) + k, d0, x[k]);
}

// The K - 1 halo rows before t0 of load_window_before as raw words, zero where there is no row,
// their loads all issued before any is waited for. In load_window_before each row's Vec of 16-bit
// values, selected against zero_vec, compiled to PRMTs inside the branch around its load, which
// waited for the load there: at bf16 K = 4 the rows came one memory latency after another (sm_90
// SASS). Raw words leave the loads' registers alone until the caller widens them (widen_window).
template <typename T, int K, int C>
__device__ __forceinline__ void load_halo_words(const Conv<T, float, K>& conv, int64_t b,
                                                int64_t t0, int64_t d0,
                                                RawFor<T, C> (&rows)[K - 1]) {
  for (int k = 0; k < K - 1; ++k) {
    const T* src = halo_row(conv, b, t0 - (K - 1) + k, d0);
    rows[k] = load_readonly_or_zero<T, C>(src, src != nullptr);
  }
}

// Rows 0 .. K-2 of the window from load_halo_words' words.
template <typename T, int K, int C>
__device__ __forceinline__ void widen_window(const RawFor<T, C> (&rows)[K - 1], float (&x)[K][C]) {
  for (int k = 0; k < K - 1; ++k) widen(from_raw<T, C>(rows[k]), x[k]);
}

// load_window_before with all K - 1 loads issued before any row is widened, for callers with
// nothing else to load in between (the channel-last backward).
template <typename T, int K, int C>
__device__ __forceinline__ void load_window_at_once(const Conv<T, float, K>& conv, int64_t b,
                                                    int64_t t0, int64_t d0, float (&x)[K][C]) {
  RawFor<T, C> rows[K - 1];
  load_halo_words<T, K, C>(conv, b, t0, d0, rows);
  widen_window<T, K, C>(rows, x);
}

// One step down K-row windows: row k of each takes row k + 1, freeing the last row for the next
// step.
template <int K, int C, typename... Rows>
__device__ __forceinline__ void slide_windows(Rows&... rows) {
  for (int k = 0; k + 1 < K; ++k) {
    for (int c = 0; c < C; ++c) ((rows[k][c] = rows[k + 1][c]), ...);
  }
}

// step(s) for s in [begin, end) in order: K steps per iteration, unrolled, so that sliding K-row
// windows is register renaming rather than moves; the last few one by one. Returns the step after
// the last, max(begin, end).
template <int K, typename Step>
__device__ __forceinline__ int run_steps(int begin, int end, Step&& step) {
  int s = begin;
#pragma unroll 1
  for (; s + K <= end; s += K) {
#pragma unroll
    for (int j = 0; j < K; ++j) step(s + j);
  }
#pragma unroll 1
  for (; s < end; ++s) step(s);
  return s;
}

// With seq_idx, a channel-last step whose window lies inside one segment (the ids of its K times
// are one id >= 0) computes with the step code without seq_idx exactly what the masked code would:
// every tap is used and its output is no padding. In packed rows nearly every step is such a step,
// so a thread finds, 32 steps at a time, the few that are not (the P steps after each segment
// boundary, whose windows reach across it, and padding), and takes the code with tap tests only
// there, without the id loads and tap selects of every step. (A ring of ids in shared memory, as
// for x, cost every step registers and issue slots, and the backward its occupancy.)
constexpr int kSegmentChunk = 32;  // steps a 32-bit mask covers, one a lane
// Steps whose windows a warp streaming one piece of a row checks at once before it takes them
// chunk by chunk (SegmentSteps::run). In the masked bf16 K = 4 channel-last backward (interior
// steps 124.5 SASS instructions each) a chunk's check took 89 instructions with two id loads
// one after the other, a vote, and the step loop's exit and entry, every 32 steps; a span's
// check takes its loads in flight together, for 128 steps, and leaves each chunk's bits with a
// lane, so that the chunks of a span turned down (at a segment boundary) need no loads of
// their own.
constexpr int kSpanChunks = 4;
constexpr int kSegmentSpan = kSpanChunks * kSegmentChunk;

// The seq_idx side of a channel-last thread whose step j has time t0 + j of batch row b, for
// steps j >= -P (the P before step 0 fill its first window), channels d0 .. d0 + C - 1. It refers
// to the kernel's values and keeps no pointer or bound of its own: in the backward, held across
// the step loops, two more registers made its cap of 128 spill.
template <int K, int C>
struct SegmentSteps {
  static constexpr int P = K - 1;
  // Bits of taps(j): bit k (k < K) whether output j reads x of step j - P + k (so bit P whether
  // step j has an output), bit kInputTaps + k whether output j - k reads x of step j - P.
  static constexpr int kInputTaps = 8;
  static_assert(K <= kInputTaps, "a tap bit per k");
  static constexpr uint32_t kOutputTaps = (1u << K) - 1;
  static constexpr uint32_t kAllTaps = ~0u;  // every tap used: a window inside one segment

  const ConvParams& p;
  const int64_t &b, &t0, &d0;
  const int& live;  // the steps the thread streams: their times are before L

  // Steps [begin, end) in order: uniform(begin', end') for the stretches of steps in [open, close)
  // whose windows lie inside one segment, other(j, needs) for every other step j, needs telling
  // whether its window is not inside one segment (a step outside [open, close) may be one whose
  // window is). The lanes of the thread's group (see masked_steps) must call it alike; begin >= 0
  // and close <= live. kSpans: whether a warp checks spans first (below).
  template <bool kSpans, typename Uniform, typename Other>
  __device__ __forceinline__ void run(int begin, int end, int open, int close, Uniform&& uniform,
                                      Other&& other) const {
    // Spans start at the first chunk from open on, then every kSegmentSpan steps: the stretch of
    // a span inside [open, close) whose windows all lie inside one segment is one call of
    // uniform. The chunks before, and those from close on where close cut a span short, go one
    // by one; so do the chunks of a span turned down, with the bits span_steps left them. (Chunks
    // cut at open, so that the spans start there, spilled 4 bytes of the float K = 2 backward.)
    // From P on: span_steps reads no id before time 0.
    const int first_span = begin + (std::max(open - begin, int{P}) + kSegmentChunk - 1) /
                                       kSegmentChunk * kSegmentChunk;
    const bool whole = kSpans && whole_warp();
    // span_steps of the last span's start where the chunk is spanned (below), else the chunk's
    // masked_steps: one register across the step loops.
    uint32_t bits = 0;
#pragma unroll 1
    for (int chunk = begin; chunk < end;) {
      // Whether the bits of the span's start hold this chunk's (in lane `index`).
      const bool spanned =
          whole && chunk >= first_span && (chunk - first_span) % kSegmentChunk == 0;
      const int index = (chunk - first_span) / kSegmentChunk % kSpanChunks;
      if (spanned && index == 0) bits = span_steps(chunk, end);
      const int span_end = std::min(chunk + kSegmentSpan, close);
      const int lane = static_cast<int>(threadIdx.x % kLanes);
      const bool span =
          spanned && index == 0 && span_end > chunk &&
          __all_sync(kFullWarp, (bits & low_bits(span_end - chunk - lane * kLanes)) == 0);
      const int chunk_end = span ? span_end : std::min(chunk + kSegmentChunk, end);
      if (!spanned) bits = masked_steps(chunk, chunk_end);
      const auto needs = [&] { return spanned ? __shfl_sync(kFullWarp, bits, index) : bits; };
      // Bit i: step chunk + i goes to other(). (A span's steps need none, and close cuts it.)
      uint32_t pending = needs() | low_bits(open - chunk) | ~low_bits(close - chunk);
      int step = chunk;
#pragma unroll 1
      while (true) {
        const int next =
            pending == 0 ? chunk_end
                         : std::min(chunk + __ffs(static_cast<int>(pending)) - 1, chunk_end);
        uniform(step, next);
        if (next == chunk_end) break;
        other(next, (needs() >> (next - chunk)) & 1);
        pending &= pending - 1;
        step = next + 1;
      }
      chunk = kSpans ? chunk_end : chunk + kSegmentChunk;  // (without spans, the same)
    }
  }

  // The taps of step j (see kInputTaps): all of them just when its window lies inside one
  // segment.
  __device__ __forceinline__ uint32_t taps(int j) const {
    const int32_t* ids = this->ids();
    int32_t window[K];
    for (int k = 0; k < K; ++k) window[k] = id(ids, j - P + k);
    return taps(window);
  }

  // The taps of a step whose window has the ids window[0 .. P] (window[P] its own).
  static __device__ __forceinline__ uint32_t taps(const int32_t (&window)[K]) {
    uint32_t bits = 0;
    for (int k = 0; k < K; ++k) {
      bits |= static_cast<uint32_t>(same_segment(window[P], window[k])) << k;
      bits |= static_cast<uint32_t>(same_segment(window[P - k], window[0])) << (kInputTaps + k);
    }
    return bits;
  }

  static __device__ __forceinline__ bool has(uint32_t taps, int bit) { return (taps >> bit) & 1u; }

  // Bit i: whether step begin + i (i < end - begin <= 32) needs the tap tests, its window not
  // inside one segment. A step at or past live is counted as one that does (its id is -1).
  //
  // The lanes of the thread's group work it out together. A warp's lanes take consecutive
  // channel packs in lane order, those of one piece of a row, then from the first pack of the
  // next piece (the channel-last kernels' consecutive items; a grouped backward block's warp
  // takes 32 packs of one piece), so the lanes that stream this piece are lanes first .. first +
  // size - 1 (all 32 when a row's packs are a multiple of 32). Mostly the ids of steps
  // begin - P .. begin + 31 are all one id >= 0 and no step needs the tap tests: the lanes read
  // them a few each and vote. Else each looks at every size-th step, whose window's ids its
  // neighbours have just read. (Shuffles instead of these loads compiled to calls for a diverged
  // warp, which cost the callers registers.)
  __device__ __forceinline__ uint32_t masked_steps(int begin, int end) const {
    static_assert(kSegmentChunk == kLanes, "a step a lane");
    const int lane = static_cast<int>(threadIdx.x % kLanes);
    const int first = std::max(lane - pack(), 0);
    const int size = std::min(lane - pack() + packs(), int{kLanes}) - first, rank = lane - first;
    const unsigned group = (size == kLanes ? kFullWarp : (1u << size) - 1) << first;
    const int32_t* ids = this->ids();
    const int32_t first_id = id(ids, begin - P);
    bool same = first_id >= 0;
#pragma unroll 1
    for (int at = rank; at < kLanes + P; at += size) same &= id(ids, begin - P + at) == first_id;
    if (__all_sync(group, same)) return 0;
    uint32_t bits = 0;
#pragma unroll 1
    for (int at = 0; at < kLanes; at += size) {
      const int j = begin + at + rank;
      const bool needs = at + rank < kLanes && j < end && (taps(j) & kOutputTaps) != kOutputTaps;
      bits |= __ballot_sync(group, needs) >> first << at;
    }
    return bits;
  }

  // Whether this thread's warp streams one piece with all 32 lanes (see masked_steps): only
  // such a warp checks spans.
  __device__ __forceinline__ bool whole_warp() const {
    const int lane = static_cast<int>(threadIdx.x % kLanes);
    return lane <= pack() && pack() - lane + kLanes <= packs();
  }

  // masked_steps' bits of the kSpanChunks chunks from step begin >= P (so that no id read is
  // before time 0), chunk m's in lane m and none in the others; those of steps from end on mean
  // nothing. Every lane of a whole warp (whole_warp) must call it. A step needs the tap tests
  // where its window holds a change, an id that differs from the one before it or padding (a
  // window of one id >= 0 holds none, from live on the ids are -1). Lane l reads the ids of
  // steps begin - P + m * kLanes + l, all in flight together, a ballot per m gives their
  // changes, and step begin + m * kLanes + i looks at those of bits i + 1 .. i + P from m on.
  __device__ __forceinline__ uint32_t span_steps(int begin, int end) const {
    const int lane = static_cast<int>(threadIdx.x % kLanes);
    const int32_t* const ids = this->ids();
    const int with_id = std::min(end, live) - (begin - P);  // the steps with an id, from begin - P
    constexpr int kReads = (kSegmentSpan + P + kLanes - 1) / kLanes;
    static_assert(kReads > kSpanChunks, "a chunk's windows end in the next read's ids");
    const int32_t* const row = ids + (begin - P + lane);
    int32_t at[kReads];
#pragma unroll
    for (int m = 0; m < kReads; ++m) at[m] = m * kLanes + lane < with_id ? row[m * kLanes] : -1;
    uint32_t changes[kReads];  // bit l of m: step begin - P + m * kLanes + l's id changes
#pragma unroll
    for (int m = 0; m < kReads; ++m) {
      // Lane l takes lane l - 1's id; lane 0, lane 31's of the read before (for m = 0 unused:
      // no window starts before begin - P).
      const int32_t sent = lane == kLanes - 1 && m > 0 ? at[m - 1] : at[m];
      const int32_t before = __shfl_sync(kFullWarp, sent, (lane + kLanes - 1) % kLanes);
      changes[m] = __ballot_sync(kFullWarp, at[m] != before || at[m] < 0);
    }
    uint32_t bits = 0;
#pragma unroll
    for (int m = 0; m < kSpanChunks; ++m) {
      uint32_t chunk = 0;
      for (int s = 1; s <= P; ++s) chunk |= __funnelshift_r(changes[m], changes[m + 1], s);
      bits = lane == m ? chunk : bits;
    }
    return bits;
  }

  // seg() of step j's time, ids = ids(): as Conv::segment has it, times before 0 (the initial
  // state) have time 0's id; steps from live on have none (-1).
  __device__ __forceinline__ int32_t id(const int32_t* ids, int j) const {
    return j < live ? ids[std::max(j, first_step())] : -1;
  }

  // The n lowest bits (none for n <= 0, all for n >= 32).
  static __device__ __forceinline__ uint32_t low_bits(int n) {
    return n <= 0 ? 0 : n >= 32 ? ~0u : (1u << n) - 1;
  }

  // seq_idx[b, t0], step 0's id, and the first step whose time is not before 0.
  __device__ __forceinline__ const int32_t* ids() const { return p.seq_idx + b * p.length + t0; }
  __device__ __forceinline__ int first_step() const {
    return -static_cast<int>(std::min<int64_t>(t0, P));
  }
  // The thread's channel pack, and the row's packs.
  __device__ __forceinline__ int pack() const { return static_cast<int>(d0 / C); }
  __device__ __forceinline__ int packs() const { return static_cast<int>(p.channels / C); }
};

// N consecutive seq_idx entries (N a multiple of 4, 16-byte aligned), or -1 (no segment) where
// live is false.
template <int N>
__device__ __forceinline__ void load_segments(const int32_t* src, bool live, int32_t (&out)[N]) {
  static_assert(N % 4 == 0, "segments load in fours");
  for (int i = 0; i < N; i += 4) {
    const Vec<int32_t, 4> four =
        live ? load_readonly<int32_t, 4>(src + i) : Vec<int32_t, 4>{{-1, -1, -1, -1}};
    for (int j = 0; j < 4; ++j) out[i + j] = four.v[j];
  }
}

// ---- channel-first rows: a warp streams a row in segments of 32 packs of V times ----

// n / d for 0 <= n < 2^63 (d >= 1) by a multiply-high and a shift instead of a 64-bit division
// (a 32-bit shortcut and a call to a division routine on sm_90). With s = ceil(log2 d) and
// m = ceil(2^(63+s) / d) = (2^(63+s) + r) / d, 0 <= r < d:
//   umulhi(2n, m) >> s = floor(n m / 2^(63+s)) = floor(n / d + e),
//   e = n r / (d 2^(63+s)) < 2^63 d / (d 2^(63+s)) = 2^-s <= 1 / d,
// and n / d = q + t / d with t <= d - 1, so the floor is q. It fits: 2n < 2^64, and m < 2^64 (for
// d = 2^s, m = 2^63; else d >= 2^(s-1) + 1 and 2^(63+s) / d <= 2^64 - 2^64 / (2^(s-1) + 1), at
// least 1 below 2^64).
struct FastDivisor {
  int64_t d;
  uint64_t m;
  int s;

  explicit FastDivisor(int64_t divisor) : d(divisor), m(0), s(0) {
    while ((uint64_t{1} << s) < static_cast<uint64_t>(d)) ++s;
    const unsigned __int128 scaled = static_cast<unsigned __int128>(1) << (63 + s);
    m = static_cast<uint64_t>((scaled + static_cast<uint64_t>(d) - 1) / static_cast<uint64_t>(d));
  }

  friend __device__ __forceinline__ int64_t operator/(int64_t n, const FastDivisor& by) {
    return static_cast<int64_t>(__umul64hi(static_cast<uint64_t>(n) << 1, by.m) >> by.s);
  }
};

// How a channel-first launch cuts its rows into warp items (built on the host): items of G
// consecutive channels (channels_per_item) of one batch row, times [c, c + chunk_len) of it, in the
// order (b, channel group, chunk); the divisors that take an item's index apart, and the param
// row's batch / groups (param_row_of).
struct ChannelFirstSplit {
  int64_t chunk_len;
  FastDivisor chunks;          // chunks per row
  FastDivisor channel_groups;  // items of G channels per batch row and chunk: D / G rounded up
  FastDivisor batch_per_group;

  ChannelFirstSplit(const ConvParams& p, int64_t chunk_len, int channels_per_item)
      : chunk_len(chunk_len),
        chunks((p.length + chunk_len - 1) / chunk_len),
        channel_groups((p.channels + channels_per_item - 1) / channels_per_item),
        batch_per_group(p.batch / p.groups) {}
};

// A channel-first warp item: times [c0, c1) of row `row` = (b, d) of the (B, D, L) tensor, its
// chunk-th chunk of chunks; param_row its weights' and bias's row (Conv::param_row).
struct ChannelFirstItem {
  int64_t chunks, chunk, row, b, d, c0, c1, param_row;

  // The first channel of item `item` of a kernel whose items take `channels` consecutive channels
  // of one (b, chunk) each (the last item of a batch row fewer, when D is not a multiple), its
  // rows cut as split says (built for `channels`).
  __device__ __forceinline__ ChannelFirstItem(int64_t item, const ChannelFirstSplit& split,
                                              const ConvParams& p, int channels)
      : chunks(split.chunks.d) {
    const int64_t group_row = item / split.chunks;
    chunk = item - group_row * chunks;
    b = group_row / split.channel_groups;
    d = (group_row - b * split.channel_groups.d) * channels;
    row = b * p.channels + d;
    c0 = chunk * split.chunk_len;
    c1 = std::min(c0 + split.chunk_len, p.length);
    param_row = param_row_of(p, b, d, split.batch_per_group);
  }

  // The same times of channel d + offset.
  __device__ __forceinline__ ChannelFirstItem channel(int offset) const {
    ChannelFirstItem other = *this;
    other.d += offset;
    other.row += offset;
    other.param_row += offset;
    return other;
  }
};

// Lane l holds times [s + l V, s + (l + 1) V) of segment s in own[]. Every lane must call these
// (they shuffle), with the same s.

// out[j] = the value at time s + l V - P + j: from lower lanes, or for the first lanes from carry,
// which holds the P values before the segment. With width < 32, the same within each group of
// width lanes (lane: the lane's index in its group).
template <int P, int V, typename U>
__device__ __forceinline__ void halo_before(const U (&own)[V], const U (&carry)[P], int lane,
                                            U (&out)[P], int width = kLanes) {
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const int back = P - j;  // times before the lane's first
    const int lanes_back = (back + V - 1) / V;
    U value = __shfl_up_sync(kFullWarp, own[lanes_back * V - back], lanes_back, width);
#pragma unroll
    for (int l = 0; l < (P + V - 1) / V; ++l) {
      // Only lanes l < lanes_back read the carry, at j + l V < P; the min keeps the (dead)
      // others' indices in range at compile time.
      if (l < lanes_back && lane == l) value = carry[j + l * V < P ? j + l * V : P - 1];
    }
    out[j] = value;
  }
}

// The segment's last P values, which the next segment's halo_before needs as its carry. With
// kWidth < 32, the same within each group of kWidth lanes (a segment of kWidth packs).
template <int P, int V, int kWidth = kLanes, typename U>
__device__ __forceinline__ void segment_tail(const U (&own)[V], U (&carry)[P]) {
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const int at = kWidth * V - P + j;
    carry[j] = __shfl_sync(kFullWarp, own[at % V], at / V, kWidth);
  }
}

// What a channel-first lane passes from one segment of its item to the next: the P inputs before
// the segment, the halo of its first lanes. (seq_idx entries do not travel with it: the segments
// that need them load their own, see uniform_segments.)
template <int K>
struct ChannelFirstCarry {
  static constexpr int P = K - 1;
  float x[P];

  // The P inputs before time t of a row (x_row: its L inputs, L >= P; state_row: its P
  // initial-state values, or nullptr for zeros): the carry into the segment that starts at t.
  // One value at a time, ptxas put each load and its widening in a branch of its own: P dependent
  // rounds before the item's first segment (the masked bf16 K = 4 backward with an initial state,
  // SASS). kAtOnce: the P loads in one round where items start, at a row's first time (the
  // state's, or none) and at P or more into it (x_row's), each case a branch of its own on values
  // that an item shares. A select per value with x_row[0] standing in for a missing state (the
  // twenty-seventh session's form, whose packed BDL bwd went 132.8 -> 128.6 us on the H200 with
  // dS's and dF's loads in one round) still widened each load into one register before the next
  // load: P rounds (sm_90 SASS, fortieth session).
  template <bool kAtOnce = false, typename T>
  __device__ __forceinline__ void load(const T* x_row, const T* state_row, int64_t t) {
    load_values<kAtOnce>(x_row, state_row, t, x);
  }

  // load's values into out, as floats (load) or stored as they are (Out = T), for an item that
  // loads its weights after them and then widens both (widen): so that the two wait as one memory
  // round. With load<true> after load_param_row, ptxas widened the weights before the carry's
  // branches, and the carry's loads waited a second round (ncu per SASS line, forty-eighth
  // session, H100: the packed bf16 K = 4 backward with an initial state, 672 stall samples on the
  // carry's widening after 1102 on the weights').
  template <bool kAtOnce, typename T, typename Out>
  __device__ __forceinline__ static void load_values(const T* x_row, const T* state_row, int64_t t,
                                                     Out (&out)[P]) {
    if constexpr (kAtOnce) {
      if (t >= P) {
        for (int j = 0; j < P; ++j) out[j] = static_cast<Out>(x_row[t - P + j]);
        return;
      }
      if (t == 0 && state_row == nullptr) {
        for (int j = 0; j < P; ++j) out[j] = Out(0.0f);
        return;
      }
      if (t == 0) {
        for (int j = 0; j < P; ++j) out[j] = static_cast<Out>(state_row[j]);
        return;
      }
    }
    for (int j = 0; j < P; ++j) {
      const int64_t u = t - P + j;
      out[j] = u >= 0 ? static_cast<Out>(x_row[u])
                      : (state_row == nullptr ? Out(0.0f) : static_cast<Out>(state_row[u + P]));
    }
  }

  template <typename T>
  __device__ __forceinline__ void widen(const T (&stored)[P]) {
    for (int j = 0; j < P; ++j) x[j] = static_cast<float>(stored[j]);
  }

  // For the segment of which own is the lane's pack: xs[j] = x_{t0-P+j}, t0 the lane's first time,
  // and the carry for the next segment. Every lane must call it (it shuffles), for the item's
  // segments in order. With P <= V the halo costs one shuffle per value: the P values before a
  // lane's pack are lane l - 1's, lane 0 taking the carry's and replacing them with lane 31's
  // (x then holds the carry in lane 0 only); halo_before and segment_tail (any P) took two
  // shuffles per value and a select. kWidth < 32: segments of kWidth packs, a row per group of
  // kWidth lanes (lane: the lane's index in its group).
  template <int V, int kWidth = kLanes>
  __device__ __forceinline__ void advance(const float (&own)[V], int lane, float (&xs)[P + V]) {
    if constexpr (P <= V) {
      for (int j = 0; j < P; ++j) {
        const float rotated =
            __shfl_sync(kFullWarp, own[V - P + j], (lane + kWidth - 1) % kWidth, kWidth);
        xs[j] = lane == 0 ? x[j] : rotated;
        x[j] = rotated;
      }
    } else {
      halo_before<P, V>(own, x, lane, reinterpret_cast<float(&)[P]>(xs[0]), kWidth);
      segment_tail<P, V, kWidth>(own, x);
    }
    for (int v = 0; v < V; ++v) xs[P + v] = own[v];
  }
};

// The pre-activation of output t0 + v of a channel-first lane from xs = x_{t0-P} .. x_{t0+V-1}
// (N = P + V, or more): with kSelect only the taps seq_idx's masks keep, segments[j] being the
// entry of xs[j]; without, every tap. kNoPadding: the caller drops the output where it is padding,
// so a tap need only match the output's id (one compare a tap, none for tap P).
template <bool kSelect, bool kNoPadding = false, int K, int N>
__device__ __forceinline__ float channel_first_pre_activation(const float (&w)[K][1], float bias,
                                                              const float (&xs)[N],
                                                              const int32_t* segments, int v) {
  constexpr int P = K - 1;
  float z = bias;
  for (int k = 0; k < K; ++k) {
    const float tap = fmaf(w[k][0], xs[v + k], z);
    const bool used = !kSelect || (kNoPadding ? segments[v + k] == segments[P + v]
                                              : same_segment(segments[P + v], segments[v + k]));
    z = used ? tap : z;
  }
  return z;
}

// value, or 0.0f where id (a seq_idx entry) is negative, i.e. padding. A mask of the bits rather
// than a select: ptxas turned the select into a branch around each value's arithmetic (about 5
// instructions an output in the masked bf16 K = 4 channel-first forward, the activation's test
// repeated in each).
__device__ __forceinline__ float zero_at_padding(float value, int32_t id) {
  return __int_as_float(__float_as_int(value) & ~(id >> 31));  // all ones unless id < 0
}

// A raw word of V elements of T (to_raw of narrow's pack) with those at padding (ids[v] < 0)
// zeroed, as zero_at_padding zeroes a float: a mask of the bits. For 16-bit T one PRMT replicates
// the sign bits of two ids over their elements' halves of a 4-byte word, so two outputs take a
// PRMT and a LOP3 where the floats took a shift and a LOP3 each.
template <typename T, int V>
__device__ __forceinline__ RawFor<T, V> zero_padding(const RawFor<T, V>& raw, const int32_t* ids) {
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));
  static_assert(V % kPerWord == 0, "whole words");
  uint32_t words[V / kPerWord];
  memcpy(words, &raw, sizeof words);
  for (int i = 0; i < V / kPerWord; ++i) {
    uint32_t padding;  // all ones over each element at padding
    if constexpr (kPerWord == 2) {
      // Selector nibbles 0xb and 0xf: byte 3 of ids[2i] and of ids[2i + 1], sign replicated.
      asm("prmt.b32 %0, %1, %2, 0xffbb;" : "=r"(padding) : "r"(ids[2 * i]), "r"(ids[2 * i + 1]));
    } else {
      padding = static_cast<uint32_t>(ids[i] >> 31);
    }
    words[i] &= ~padding;
  }
  RawFor<T, V> out;
  memcpy(&out, words, sizeof words);
  return out;
}

// ---- seq_idx in channel-first rows ----
//
// In packed sequences nearly every segment of 32 V times lies inside one sequence, where every
// mask of seq_idx holds: the kernels run those segments with the unmasked arithmetic (no per-tap
// selects, no padding tests, no seq_idx entries in registers or shuffles), and load the entries,
// lane by lane, only for the segments that straddle a boundary or hold padding. Which segments
// are which, uniform_segments finds for a whole item (the launchers cut rows into items of at
// most kUniformSegments segments) before its first segment runs: its loads then wait behind the
// item's x loads in flight rather than stall each segment.
constexpr int kUniformSegments = 32;  // the bits of uniform_segments' masks

// With seq_idx, a warp item takes kUniformChannels consecutive channels of one batch row and
// chunk: uniform_segments' masks depend on the row's entries and the times only, so the warp finds
// them once for all its channels. The check costs about 100 instructions per segment against about
// 150 for a uniform segment's outputs (SASS, bf16 K = 4), and it reads the row's entries (twice
// the bytes of bf16 x) once per item; without the sharing, every channel paid both.
constexpr int kUniformChannels = 4;
// Channels per warp item: with seq_idx, kMaskedChannels (a multiple of the groups of kWidth
// lanes); without, one per group (see for_each_channel_first_item).
template <bool kMasked, int kWidth = kLanes, int kMaskedChannels = kUniformChannels>
constexpr int channels_per_item() {
  return kMasked ? kMaskedChannels : kLanes / kWidth;
}

// The warp items of a channel-first kernel with rows cut into `chunks` chunks.
template <bool kMasked, int kWidth = kLanes, int kMaskedChannels = kUniformChannels>
__host__ __device__ __forceinline__ int64_t channel_first_items(const ConvParams& p,
                                                                int64_t chunks) {
  constexpr int G = channels_per_item<kMasked, kWidth, kMaskedChannels>();
  return p.batch * ((p.channels + G - 1) / G) * chunks;
}

// The seq_idx entries of a channel-first lane's window as the masks read them (DESIGN.md section
// 2): seg(u) = the row's first entry for u < 0 (the initial state belongs to the row's first
// segment), -1 (no time: no tap reads it, no output is kept) for u >= length. t0 (the lane's first
// time) and length are multiples of V, and V of 4, so each aligned four lies wholly before 0, in
// the row or past it. Both windows serve lanes whose results are kept only where t0 < length: a
// lane past the row's end reads the last pack's entries instead, so that no load needs a range
// test. kInRow: the caller knows the window's times before the row's end.
//
// Times [t0 - P, t0 + V), for outputs t0 .. t0 + V - 1 (forward outputs, backward deltas): only
// the fours before the row need a select. At bf16 K = 4 the general window's range tests,
// defaults and selects were about 55 of a masked forward segment's 272 instructions; with this
// one it took 263 and the kernel 72 registers instead of 79 (7 blocks per SM instead of 6). Every
// load is at an immediate offset from the lane's pack or, before the row, from a pointer that
// depends on the row only (kept out of the segment loop): selecting the offset for each load took
// 30 instructions of 64-bit address arithmetic and selects at bf16 K = 4, this 25.
template <int V, int P, bool kInRow = false>
__device__ __forceinline__ void load_segment_window_before(const int32_t* row, int64_t t0,
                                                           int64_t length,
                                                           int32_t (&out)[P + V]) {
  constexpr int kBefore = (P + 3) / 4 * 4;
  const int64_t at = kInRow || t0 < length ? t0 : length - V;  // the pack read, a multiple of 4
  const int32_t* const pack = row + at;
  int32_t all[kBefore + V];
  for (int i = 0; i < kBefore + V; i += 4) {
    const bool before_row = i < kBefore && at + i < kBefore;  // the four's times are before 0
    // row + (kBefore - i) + (i - kBefore): the row's first four, whose first entry is seg(u < 0).
    const int32_t* const base = before_row ? row + (kBefore - i) : pack;
    const Vec<int32_t, 4> four = load_readonly<int32_t, 4>(base + (i - kBefore));
    for (int j = 0; j < 4; ++j) all[i + j] = before_row ? four.v[0] : four.v[j];
  }
  for (int j = 0; j < P + V; ++j) out[j] = all[kBefore - P + j];
}

// Times [t0, t0 + V + A), for the backward's dx of inputs t0 .. t0 + V - 1: only the fours after
// the pack need a range test (-1 past the row), none with kInRow (t0 + V + A <= length).
template <int V, int A, bool kInRow = false>
__device__ __forceinline__ void load_segment_window_after(const int32_t* row, int64_t t0,
                                                          int64_t length, int32_t (&out)[V + A]) {
  constexpr int kAfter = (A + 3) / 4 * 4;
  const int64_t at = kInRow || t0 < length ? t0 : length - V;  // the pack read, a multiple of 4
  const int32_t* const pack = row + at;
  int32_t all[V + kAfter];
  for (int i = 0; i < V + kAfter; i += 4) {
    const bool in_row = kInRow || i < V || at + i < length;
    const Vec<int32_t, 4> four =
        in_row ? load_readonly<int32_t, 4>(pack + i) : Vec<int32_t, 4>{{-1, -1, -1, -1}};
    for (int j = 0; j < 4; ++j) all[i + j] = four.v[j];
  }
  for (int j = 0; j < V + A; ++j) out[j] = all[j];
}

// Segments of W V times s_j = s + j W V of a row (W packs: 32, or uniform_segments' kWidth), j <
// count, that are uniform: every time u of a window around s_j that is before the row's end has one
// and the same seq_idx entry >= 0 (u < 0: the row's first entry, as in load_segment_window_before).
// Then every mask of the outputs that read only the window's times holds (none is padding, every
// tap is used), and the unmasked arithmetic gives their bits; times past the row are no output's
// and no tap's.
struct UniformSegments {
  uint32_t before;  // bit j: over [s_j - P, s_j + W V), the taps of segment j's outputs
  uint32_t after;   // bit j: over [s_j, s_j + W V + P), the outputs whose taps are its times
};

// Whether a lane's pack of seq_idx entries is one id >= 0 throughout (the callers also compare it
// with the entry of the time before the pack).
template <int V>
__device__ __forceinline__ bool pack_is_uniform(const int32_t (&own)[V]) {
  int32_t differ = 0;  // a bit set where an entry differs from own[0]: three-input LOP3s
  for (int v = 1; v < V; ++v) differ |= own[v] ^ own[0];
  return own[0] >= 0 && differ == 0;
}

// uniform_segments' ballots, ballot j over the kLanes packs from s_j = s + j kLanes V (j <
// ballots, s_j < length): lane l checks its pack and that it continues the time before it (lane
// l - 1's last; for lane 0 the time before s_j, whose entry is -1, no match, at j = 0 where the P
// times before s do not share it); lane j gets ballot j, for j = first, first + kStride, ... (0
// for the other lanes). With kStride 1 each ballot's lane 0 takes the entry before s_j from the
// ballot before it; else it loads it.
template <int V, int P, int kStride = 1>
__device__ __forceinline__ uint32_t uniform_ballots(const int32_t* row, int64_t s, int ballots,
                                                    int first, int64_t length, int lane) {
  constexpr int kEdge = (P + 3) / 4 * 4;  // entries loaded before the first segment
  const auto entry_before = [&](int j) -> int32_t {
    if (j > 0) return __ldg(row + s + int64_t{j} * kLanes * V - 1);
    if (s == 0) return __ldg(row);  // before the row: the row's first entry
    int32_t before[kEdge];
    load_segments(row + s - kEdge, true, before);
    int32_t previous = before[kEdge - 1];
    for (int m = kEdge - P; m < kEdge - 1; ++m) previous = before[m] == previous ? previous : -1;
    return previous;
  };
  // A warp of the block's shared check may have no ballot (first >= ballots): its entry before
  // would lie past the row.
  int32_t previous = kStride == 1 || first < ballots ? entry_before(first) : -1;
  // Only the last ballot's packs may end past the row: its times before the row's end.
  const int64_t last_in_row = length - (s + int64_t{ballots - 1} * kLanes * V);
  const int32_t* pack = row + s + (int64_t{first} * kLanes + lane) * V;
  uint32_t packs = 0;
  for (int j = first; j < ballots; j += kStride, pack += kStride * kLanes * V) {
    const bool exists = j + 1 < ballots || lane * V < last_in_row;
    if constexpr (kStride > 1) {
      if (j > first) previous = entry_before(j);
    }
    int32_t own[V];  // a pack past the row's end loads the row's first instead: it is not checked
    load_segments(exists ? pack : row, true, own);
    bool ok = pack_is_uniform(own);
    // Lane l gets lane l - 1's last entry; lane 0 gets lane 31's, the time before the next segment.
    const int32_t rotated = __shfl_sync(kFullWarp, own[V - 1], (lane + kLanes - 1) % kLanes);
    ok = ok && own[0] == (lane == 0 ? previous : rotated);
    if constexpr (kStride == 1) previous = rotated;
    const uint32_t ballot = __ballot_sync(kFullWarp, ok || !exists);
    packs = lane == j ? ballot : packs;
  }
  return packs;
}

// UniformSegments for count <= kUniformSegments segments from s (s_j < length for j < count). Per
// segment, a ballot of its lanes' packs (uniform_ballots); lane j keeps segment j's ballot. The P
// times before (after) a segment are in the last (first) packs of its neighbour, which must check
// out too: a boundary in those packs but outside the P times makes the segment masked, not wrong.
// Every lane must call it, with the same arguments. kWidth < 32: segments of kWidth packs (s_j = s
// + j kWidth V); each ballot then takes 32 / kWidth of them, and lane j takes segment j's bits of
// its ballot. kWarps > 1: every warp of the block calls it (all of its threads, each warp with
// the same arguments, warp its index), and each loads and checks every kWarps-th ballot, which
// they share through shared memory.
template <int V, int P, int kWidth = kLanes, int kWarps = 1>
__device__ UniformSegments uniform_segments(const int32_t* row, int64_t s, int count,
                                            int64_t length, int lane, int warp = 0) {
  constexpr int kSegment = kWidth * V;
  constexpr int kPerBallot = kLanes / kWidth;
  constexpr uint32_t kSegmentLanes = kWidth == kLanes ? kFullWarp : (1u << kWidth) - 1;
  constexpr int kEdgeLanes = (P + V - 1) / V;  // lanes whose packs hold the first or last P times
  constexpr uint32_t kFirstLanes = (1u << kEdgeLanes) - 1;
  constexpr uint32_t kLastLanes = kSegmentLanes & (~0u << (kWidth - kEdgeLanes));
  const int ballots = (count + kPerBallot - 1) / kPerBallot;
  uint32_t packs;  // lane j: ballot j, then segment j's bits of its ballot
  if constexpr (kWarps == 1) {
    packs = uniform_ballots<V, P>(row, s, ballots, 0, length, lane);
  } else {
    __shared__ uint32_t shared_ballots[kUniformSegments];
    const uint32_t own = uniform_ballots<V, P, kWarps>(row, s, ballots, warp, length, lane);
    __syncthreads();  // the block's reads of the previous item's ballots are done
    if (lane < ballots && lane % kWarps == warp) shared_ballots[lane] = own;
    __syncthreads();
    packs = lane < ballots ? shared_ballots[lane] : 0;
  }
  if constexpr (kPerBallot > 1) {
    packs = __shfl_sync(kFullWarp, packs, lane / kPerBallot) >> (lane % kPerBallot * kWidth) &
            kSegmentLanes;
  }
  const uint32_t earlier = __shfl_up_sync(kFullWarp, packs, 1);
  const uint32_t later = __shfl_down_sync(kFullWarp, packs, 1);
  const bool whole = lane < count && packs == kSegmentLanes;
  // Segment 0's first lane matched the P times before s already.
  const bool before = lane == 0 || (earlier & kLastLanes) == kLastLanes;
  const bool after = s + int64_t{lane + 1} * kSegment >= length ||
                     (lane + 1 < count && (later & kFirstLanes) == kFirstLanes);
  return {__ballot_sync(kFullWarp, whole && before), __ballot_sync(kFullWarp, whole && after)};
}

// out[m] = the value at time s + (l + 1) V + m: from higher lanes of this segment (own) or, past
// lane 31, from the first lanes of the next one (next). Every lane must call it. With P <= V (as
// ChannelFirstCarry::advance before a pack) one shuffle per value: lane l + 1's, lane 0 sending
// the next segment's first values to lane 31; the general form takes two and a select. kWidth
// < 32: the same within each group of kWidth lanes, as in ChannelFirstCarry::advance.
template <int P, int V, int kWidth = kLanes, typename U>
__device__ __forceinline__ void halo_after(const U (&own)[V], const U (&next)[V], int lane,
                                           U (&out)[P]) {
  if constexpr (P <= V) {
    for (int m = 0; m < P; ++m) {
      out[m] = __shfl_sync(kFullWarp, lane == 0 ? next[m] : own[m], (lane + 1) % kWidth, kWidth);
    }
  } else {
#pragma unroll
    for (int m = 0; m < P; ++m) {
      const int ahead = 1 + m / V;
      const int source = (lane + ahead) % kWidth;
      const U from_own = __shfl_sync(kFullWarp, own[m % V], source, kWidth);
      const U from_next = __shfl_sync(kFullWarp, next[m % V], source, kWidth);
      out[m] = lane + ahead < kWidth ? from_own : from_next;
    }
  }
}

// A warp's place in a launch in clusters (launch_clustered) where each cluster takes every item of
// one weight group's channel group, a warp each: cluster g * channel_groups + c holds the items of
// channel group c in the batch rows of weight group g, its warps' slots in the order (batch row,
// chunk), so that one block can sum the channels' dw/db (ClusterSums).
struct ClusterPlace {
  int64_t slot, weight_group, channel_group;

  __device__ __forceinline__ explicit ClusterPlace(const ChannelFirstSplit& split)
      : slot(int64_t{cluster_rank()} * (blockDim.x / kLanes) + threadIdx.x / kLanes) {
    const int64_t cluster = cluster_index();
    weight_group = cluster / split.channel_groups;
    channel_group = cluster - weight_group * split.channel_groups.d;
  }

  // The slots of a cluster: the items of its weight group's batch rows (also the launch's
  // cluster size, in warps).
  __host__ __device__ __forceinline__ static int64_t slots(const ChannelFirstSplit& split) {
    return split.batch_per_group.d * split.chunks.d;
  }

  // The first batch row of the weight group.
  __device__ __forceinline__ int64_t first_batch_row(const ChannelFirstSplit& split) const {
    return weight_group * split.batch_per_group.d;
  }

  // The warp's item, its index in ChannelFirstItem's order.
  __device__ __forceinline__ int64_t item(const ChannelFirstSplit& split) const {
    const int64_t row_in_group = slot / split.chunks;
    const int64_t chunk = slot - row_in_group * split.chunks.d;
    const int64_t b = first_batch_row(split) + row_in_group;
    return (b * split.channel_groups.d + channel_group) * split.chunks.d + chunk;
  }
};

// What for_each_channel_first_item holds opaque to the compiler through an item's channels, so
// that NVVM keeps it in registers where it otherwise computed it again for each channel from the
// item's index (by the three divisions of ChannelFirstItem): nothing; the channel count (the
// loop's test: about 35 instructions a channel in the masked forward, no more registers); or the
// count and the item's row and param_row (the channels' are theirs plus g: about 85 instructions
// more a channel, and 4 registers more across the kernel's loops).
enum class ItemKept { kNothing, kChannels, kRows };

// Runs run(item, uniform, next) for this warp's channel-first items (a grid-stride loop over
// warps; the launchers give each warp one item where the grid allows, see grid_for_warps) of rows
// cut as split says (channels_per_item<kMasked, kWidth, kMaskedChannels>() channels per item).
// With seq_idx the channels of an item share one UniformSegments, found over its segments from c0
// to min(c1 + extra, L): the times it loads (the backward's dx also needs the P after its own).
// Without seq_idx, all zero. next: whether the group's next run is the item's next channel of
// the group (row + kGroups, the same times), so that the run may start that channel's loads.
// start(item) comes first for each item, with the group's first channel, before the uniform
// check, whose loads then wait behind what start issued. kKept: see ItemKept (where the groups
// take the item in one turn, nothing is held through it). kWidth < 32: segments of kWidth packs
// (see uniform_segments), and each group of kWidth lanes takes its own channel of the item at a
// time, the groups consecutive ones; where the item has fewer left, the last again (the groups
// then store the same values to the same places). kShareCheck: where a block's warps all take
// whole rows of one batch row (a choice of the whole block), they share the uniform check
// (uniform_segments' kWarps); the launch must then be of kChannelFirstThreads, so a caller opts in.
template <int V, int P, bool kMasked, ItemKept kKept = ItemKept::kNothing, int kWidth = kLanes,
          int kMaskedChannels = kUniformChannels, bool kShareCheck = false,
          bool kClustered = false, typename Start, typename Run>
__device__ __forceinline__ void for_each_channel_first_item(const ConvParams& p,
                                                            const ChannelFirstSplit& split,
                                                            int64_t extra, const Start& start,
                                                            const Run& run) {
  constexpr int64_t kSegment = kWidth * V;
  constexpr int kGroups = kLanes / kWidth;
  constexpr int G = channels_per_item<kMasked, kWidth, kMaskedChannels>();
  static_assert(kGroups == 1 || G > 1, "groups of lanes share an item's segments");
  static_assert(kMasked || G == kGroups, "without seq_idx an item is one channel a group");
  const int lane = threadIdx.x % kLanes;
  const int64_t items = channel_first_items<kMasked, kWidth, kMaskedChannels>(p, split.chunks.d);
  const int64_t warps_per_grid = int64_t{gridDim.x} * (blockDim.x / kLanes);
  const int64_t first_item =
      kClustered ? ClusterPlace(split).item(split)
                 : blockIdx.x * int64_t{blockDim.x / kLanes} + threadIdx.x / kLanes;
  for (int64_t i = first_item; i < items; i += kClustered ? items : warps_per_grid) {
    const ChannelFirstItem first(i, split, p, G);
    if constexpr (G == 1) {
      start(first);
      run(first, UniformSegments{0, 0}, false);
    } else {
      const int group = lane / kWidth;
      start(kGroups == 1 ? first
                         : first.channel(static_cast<int>(
                               std::min<int64_t>(group, p.channels - first.d - 1))));
      UniformSegments uniform{0, 0};
      if constexpr (kMasked) {
        const int64_t end = std::min(first.c1 + extra, p.length);
        const int count = static_cast<int>(
            std::min<int64_t>(kUniformSegments, (end - first.c0 + kSegment - 1) / kSegment));
        constexpr int kWarps = kChannelFirstThreads / kLanes;
        const int warp = static_cast<int>(threadIdx.x / kLanes);
        const int64_t block_first = i - warp, block_last = block_first + kWarps - 1;
        const int32_t* const row = p.seq_idx + first.b * p.length;
        // Two forms of the check rather than one loop with a run-time stride: that took other
        // masked kernels 8-15 registers more or spilled (sm_90, thirty-second session).
        if (kShareCheck && split.chunks.d == 1 && block_last < items &&
            block_first / split.channel_groups == block_last / split.channel_groups) {
          uniform = uniform_segments<V, P, kWidth, kWarps>(row, first.c0, count, p.length, lane,
                                                           warp);
        } else {
          uniform = uniform_segments<V, P, kWidth>(row, first.c0, count, p.length, lane);
        }
      }
      int channels = static_cast<int>(std::min<int64_t>(G, p.channels - first.d));
      ChannelFirstItem item = first;
      constexpr bool kOneTurn = G == kGroups;  // each group of lanes one channel of the item
      if constexpr (kKept == ItemKept::kRows && !kOneTurn) {
        asm("" : "+r"(channels), "+l"(item.row), "+l"(item.param_row));
      } else if constexpr (kKept == ItemKept::kChannels && !kOneTurn) {
        asm("" : "+r"(channels));
      }
      if constexpr (kGroups == 1) {
        for (int g = 0; g < channels; ++g) run(item.channel(g), uniform, g + 1 < channels);
      } else {
        // One turn where kOneTurn, bounded so that the compiler sees it: to the channel count
        // the loop cost the unmasked bf16 K = 5 and 6 backward 12 bytes of spills.
        const int loop_channels = kOneTurn ? 1 : channels;
        for (int g = 0; g < loop_channels; g += kGroups) {
          run(item.channel(std::min(g + group, channels - 1)), uniform,
              g + group + kGroups < channels);
        }
      }
    }
  }
}

// The same without start, for run(item, uniform).
template <int V, int P, bool kMasked, ItemKept kKept = ItemKept::kNothing, int kWidth = kLanes,
          int kMaskedChannels = kUniformChannels, bool kShareCheck = false,
          bool kClustered = false, typename Run>
__device__ __forceinline__ void for_each_channel_first_item(const ConvParams& p,
                                                            const ChannelFirstSplit& split,
                                                            int64_t extra, const Run& run) {
  for_each_channel_first_item<V, P, kMasked, kKept, kWidth, kMaskedChannels, kShareCheck,
                              kClustered>(
      p, split, extra, [](const ChannelFirstItem&) {},
      [&](const ChannelFirstItem& item, UniformSegments uniform, bool) { run(item, uniform); });
}

// ---- channel-first short rows: several rows per warp ----
//
// A row of at most 32 packs takes a group of lanes (a power of two, at least its packs), lane g of
// the group owning times [g V, (g + 1) V); a warp takes 32 / group consecutive channels of one
// batch row at a time, so that its lanes' 16-byte accesses are one contiguous block, and walks
// them down a run of batch rows (ShortRowUnits), the next rows' packs in flight while it computes
// these. Halos are shuffles within the group (width group): a row has no neighbour segments. With
// one row per warp, rows of 16 packs left half the lanes idle, and a warp's loads were only its
// one row's: 256 bytes in flight per warp where the bytes from DRAM need about 40 KB per SM.

// Whether a call has an initial or final state or their gradients.
CAUSAL_CONV_HD bool has_states(const ConvParams& p) {
  return p.initial_state != nullptr || p.final_state != nullptr || p.dinitial_state != nullptr ||
         p.dfinal_state != nullptr;
}

// The short-row kernels are instantiated with kFeatures false for calls without seq_idx or states
// (has_states): p with those pointers null at compile time, so that their per-row tests and
// branches compile away. sm_90 SASS, bf16 K = 4 with silu, instructions a row step without
// features: forward 167 -> 127, backward 331 -> 318 (registers 62 -> 40 and 106 -> 80).
// With kFeatures, p itself: a copy of the kernel's parameters cost the features kernels registers
// (sm_90, float32 K = 4 forward 48 -> 52, a block less per SM).
template <bool kFeatures>
__device__ __forceinline__ decltype(auto) with_features(const ConvParams& p) {
  if constexpr (kFeatures) {
    return (p);
  } else {
    ConvParams plain = p;
    plain.seq_idx = nullptr;
    plain.initial_state = nullptr;
    plain.final_state = nullptr;
    plain.dinitial_state = nullptr;
    plain.dfinal_state = nullptr;
    return plain;
  }
}

// Lanes per row for the short-row kernels: the packs of a row rounded up to a power of two; 0 for
// rows of more than 32 packs (the segment kernels').
inline int short_row_group(int64_t length, int pack) {
  const int64_t packs = length / pack;
  if (packs > kLanes) return 0;
  int group = 1;
  while (group < packs) group *= 2;
  return group;
}

// Where a short-row lane stands: lane g of its group of `group` lanes (short_row_group) holds
// times [t0, t0 + V) of each row it takes; its warp takes units (ShortRowUnits) first_item,
// first_item + items_step, ..., channel lane / group of each unit's block of rows_per_item.
template <int V>
struct ShortRowLane {
  int group, lane, g, rows_per_item;
  int64_t t0;
  bool in_row;  // whether the lane's times are in the rows (L may be less than group packs)
  int64_t first_item, items_step;

  __device__ __forceinline__ ShortRowLane(const ConvParams& p, int group)
      : group(group),
        lane(threadIdx.x % kLanes),
        g(lane % group),
        rows_per_item(kLanes / group),
        t0(int64_t{g} * V),
        in_row(t0 < p.length),
        first_item(blockIdx.x * int64_t{blockDim.x / kLanes} + threadIdx.x / kLanes),
        items_step(int64_t{gridDim.x} * (blockDim.x / kLanes)) {}
};

// How the short-row kernels cut their rows into warp units (built on the host, short_row_units):
// a unit is a block of rows_per_item consecutive channels (the last block of a row fewer) over a
// run of up to `chunk` consecutive batch rows of one weight group, in the order (group, run,
// block), blocks fastest. Its lanes load their weights once; the backward sums its dw/db over the
// run, one slice of partials per run: partials[group, run, d, 0..K].
struct ShortRowUnits {
  int64_t chunk;             // batch rows per run (the group's last run fewer)
  FastDivisor runs;          // runs per weight group
  FastDivisor blocks;        // channel blocks: D / rows_per_item rounded up
  int64_t batch_per_group;
  int64_t count;             // units: groups x runs x blocks
};

// Where a short-row lane's unit lies: its first batch row b0, its rows (steps), its channel d
// (0 where the lane is past the channels, row_live false, so that its loads stay in range) and
// the (group, run) index `rest` of its slice of partials.
struct ShortRowUnit {
  int64_t rest, weight_group, b0, d;
  int steps;
  bool row_live;

  template <int V>
  __device__ __forceinline__ ShortRowUnit(const ConvParams& p, const ShortRowUnits& units,
                                          const ShortRowLane<V>& at, int64_t unit) {
    rest = unit / units.blocks;
    const int64_t block = unit - rest * units.blocks.d;
    weight_group = rest / units.runs;
    const int64_t run = rest - weight_group * units.runs.d;
    b0 = weight_group * units.batch_per_group + run * units.chunk;
    steps = static_cast<int>(std::min(units.chunk, units.batch_per_group - run * units.chunk));
    const int64_t channel = block * at.rows_per_item + at.lane / at.group;
    row_live = channel < p.channels;
    d = row_live ? channel : 0;
  }
};

// The P inputs before a short-row lane's times in row (b, d) (xs[0 .. P), its own pack being in
// xs[P..]), from lower lanes of the group or, for the group's first lanes, the initial state
// (zeros without one). x: the lane's pack of row 0.
template <typename T, int K, int V>
__device__ __forceinline__ void short_row_halo(const ConvParams& p, const ShortRowLane<V>& at,
                                               int64_t b, int64_t d, const T* x,
                                               float (&xs)[K - 1 + V]) {
  constexpr int P = K - 1;
  constexpr int kCarryLanes = (P + V - 1) / V;  // lanes of a group whose halo reaches before t = 0
  ChannelFirstCarry<K> before;  // the initial state (or zeros), for the lanes that reach it
  const T* state_row = p.initial_state == nullptr || at.g >= kCarryLanes
                           ? nullptr
                           : static_cast<const T*>(p.initial_state) + (b * p.channels + d) * P;
  before.load(x, state_row, 0);
  halo_before<P, V>(reinterpret_cast<const float(&)[V]>(xs[P]), before.x, at.g,
                    reinterpret_cast<float(&)[P]>(xs[0]), at.group);
}

// With seq_idx (row: the row's entries): the lane's entries into segments[P .. P + V), and whether
// some row of the warp item has more than one id or padding (then seq_idx's masks apply to the
// whole item), in which case segments[0 .. P) receives the entries of the P times before the
// lane's (the row's first entry before t = 0). Every lane of the warp must call it.
template <int V, int P, int N>
__device__ __forceinline__ bool short_row_segments(const int32_t* row, const ShortRowLane<V>& at,
                                                   bool live, int32_t (&segments)[N]) {
  static_assert(N >= P + V, "segments holds the P times before and the lane's V");
  int32_t(&own)[V] = reinterpret_cast<int32_t(&)[V]>(segments[P]);
  load_segments(row + at.t0, live, own);
  const bool one_id = pack_is_uniform(own);
  const int32_t earlier = __shfl_up_sync(kFullWarp, own[V - 1], 1, at.group);
  const bool uniform = !live || (one_id && (at.g == 0 || own[0] == earlier));
  const bool masked = !__all_sync(kFullWarp, uniform);
  if (masked) {
    int32_t first[P];  // seg(u) for u < 0: the row's first entry
    const int32_t row_first = __shfl_sync(kFullWarp, own[0], 0, at.group);
    for (int j = 0; j < P; ++j) first[j] = row_first;
    halo_before<P, V>(own, first, at.g, reinterpret_cast<int32_t(&)[P]>(segments[0]), at.group);
  }
  return masked;
}

// The time of `work` threads (or warps) of `length` steps each when the device holds `resident`
// at once: whole waves x (length + overhead), a partial last wave costing a whole one. The launch
// rules below and in forward_cuda.cu compare cuts of the time axis by it.
inline int64_t waves_cost(int64_t work, int64_t resident, int64_t length, int64_t overhead) {
  return (work + resident - 1) / resident * (length + overhead);
}

// A channel-first warp item's fixed cost in segments: its weights, halo and first loads' latency
// before its stream flows. Fitted to B=8 L=2048 bf16 (tenth session's trial-items): each further
// wave of items at D = 256 cost about 1.8 us forward and 3 us backward, some two segments' time.
constexpr int64_t kItemOverheadSegments = 2;
// Cuts past this many waves of items only add overheads.
constexpr int64_t kMaxItemWaves = 16;

// Times per warp item for channel-first kernels, a multiple of segment (32 V times, or the kernel's
// width of packs). Rows (each row_items warp items) are cut into the number of pieces, of at most
// max_segments segments each, whose waves of resident_warps x (piece segments +
// kItemOverheadSegments) cost least; whole rows where the runtime cannot say how many warps fit
// (resident_warps 0). For each count of waves the cheapest cut is the one with the most pieces that
// still fit in it, so only those are compared. Aiming at a fixed 32768 (forward) and 16384
// (backward) items cut B=8 L=2048 D=256's rows into one-segment pieces: 11.6 and 30.7 us against
// 6.3 and 13.1 for this choice's 2 pieces and whole rows.
inline int64_t channel_first_chunk(int64_t row_items, int64_t length, int64_t segment,
                                   int64_t resident_warps, int64_t max_segments) {
  const int64_t segments = (length + segment - 1) / segment;
  const auto piece_segments = [&](int64_t pieces) { return (segments + pieces - 1) / pieces; };
  const int64_t fewest = (segments + max_segments - 1) / max_segments;
  int64_t best = piece_segments(fewest);
  if (resident_warps <= 0) return best * segment;
  const int64_t rows = std::max<int64_t>(row_items, 1);
  int64_t best_cost = -1;
  for (int64_t waves = 0; waves <= kMaxItemWaves; ++waves) {
    const int64_t pieces = std::clamp(waves * resident_warps / rows, fewest, segments);
    const int64_t chunk = piece_segments(pieces);
    const int64_t items = rows * ((segments + chunk - 1) / chunk);
    const int64_t cost = waves_cost(items, resident_warps, chunk, kItemOverheadSegments);
    if (best_cost < 0 || cost < best_cost) {
      best_cost = cost;
      best = chunk;
    }
  }
  return best * segment;
}

// The most segments per channel-first item (channel_first_chunk's max_segments). With seq_idx,
// uniform_segments' masks cover an item's segments: the forward's, and the backward's with the one
// after them whose first deltas its dx needs, which an item that ends the row does not have (a row
// of kUniformSegments segments or fewer is one item).
constexpr int64_t kUnlimitedSegments = int64_t{1} << 40;
template <bool kMasked>
constexpr int64_t forward_item_segments() {
  return kMasked ? kUniformSegments : kUnlimitedSegments;
}
template <bool kMasked>
constexpr int64_t backward_item_segments(int64_t length, int64_t segment) {
  if (!kMasked) return kUnlimitedSegments;
  return length <= kUniformSegments * segment ? kUniformSegments : kUniformSegments - 1;
}

}  // namespace causal_conv
