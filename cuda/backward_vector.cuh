// Vectorized backward kernels for compile-time widths (see conv_vector.cuh). Each writes dx (and
// dS), and its dw/db sums per (batch row, slice of time, channel) to partials[b, slice, d, 0..K]
// (k = K is db), which reduce_partials_kernel then sums in a fixed order.
#pragma once

#include <cstdint>
#include <type_traits>

#include "conv_vector.cuh"

namespace causal_conv {

// Bytes of x (and as many of dy) in flight per thread in the channel-last backward: a RowRing of
// 8 rows of 8 bytes or 4 of 16 (twice that without a register cap, backward_ring_bytes).
constexpr int kBackwardRingBytes = 64;
// Threads per channel-last backward block, and weights per thread (K x C).
constexpr int kBackwardThreads = 128;
constexpr int kBackwardBudget = 16;
// Tiles per slice of dw/db partials where a block's warps take one run of 32 channel packs over
// consecutive tiles (a warp each) and sum their dw/db before writing them: the slices cost the
// backward's stores and the reduction's loads (about 0.33 us a slice on the H200's main workload,
// benchmarks/RESULTS.md, fifteenth session).
constexpr int kSliceTiles = kBackwardThreads / kLanes;

// How the channel-last backward's threads take their items (built on the host): tiles of len
// steps, count of them a row, cut into slices (of partials) a row; each slice into runs units, a
// unit being a block's kLanes packs over kSliceTiles tiles where grouped (slices < count), else a
// thread's one pack over one tile. The divisors take the index apart without a 64-bit division
// (whose calls left the masked 16-bit K = 2 kernel 8 bytes of spills at its cap).
struct ChannelLastTiles {
  int64_t len, count;
  FastDivisor runs, slices;
};

// Blocks per SM the register allocation must allow. Up to 16 weights a thread needs about 132
// registers, 3 blocks of 128 per SM; capped at 128 (4 blocks) the main workload's backward took
// 131.5 us against 135.7. Wider kernels keep what they need: the cap makes them spill, and a
// looser one lost too (the plain 16-bit K = 7-8 kernels held to 3 blocks, 168 registers, their
// rows cut into tiles that fill them: H100, K = 8 +11.5%, K = 7 +5%; ncu: 40% more warps, issue
// 62 -> 55%, each warp's scoreboard stalls doubled; forty-ninth session). With seq_idx the cap
// holds as well: the tap tests run in the checked copy only (see below). Up to 8 weights (float
// K = 2) the kernels took at most 93 registers, 5 blocks, before the grouped blocks' sums; bounded
// at 5 they keep them (unbounded, the masked one took 100).
template <typename T, int K>
constexpr int backward_min_blocks() {
  constexpr int kWeights = channels_per_thread<T, K, kBackwardBudget>() * K;
  return kWeights <= 8 ? 5 : kWeights <= 16 ? 4 : 1;
}

// Bytes of x (and as many of dy) in flight per thread: twice kBackwardRingBytes in the kernels
// without a register cap (16-bit K >= 5: 155-240 registers, 2-3 blocks an SM against K = 4's 4),
// so that an SM keeps about as many bytes in flight. H200 traces, BLD bwd bf16 B=8 L=2048 D=4096
// (thirty-fourth session, us): K = 5 with seq_idx and states 127.6 -> 123.1, K = 6 119.9 -> 118.4,
// K = 8 136.7-137.0 -> 135.2, K = 7 128.7 -> 128.4-128.7.
template <typename T, int K>
constexpr int backward_ring_bytes() {
  return backward_min_blocks<T, K>() == 1 ? 2 * kBackwardRingBytes : kBackwardRingBytes;
}

// Whether the channel-last backward reads a step's rows from its rings one step early and sums a
// dx's taps oldest delta first. A step is one dependency chain in issue order (ring wait, shared
// load, pre-activation, silu's two MUFU ops, delta, K multiply-adds of dx, store), and the main
// launch puts 2 blocks on an SM, 2 warps per scheduler: at K = 4 to 7 (16-bit) the backward took
// 0.91-0.98 us per SASS instruction of an interior step, about 0.6 instructions a cycle per
// scheduler (sixteenth session, benchmarks/RESULTS.md). The early read takes the shared load off
// the chain, the order all but one multiply-add of a dx. The next rows take registers (2 x C
// values): the 16-bit kernels read ahead where that does not spill, those without seq_idx and
// those without a register cap (K >= 5); at the cap of 128 the masked 16-bit K = 2 and 4 and
// float K = 4 spilled 4-124 bytes with it.
template <typename T, int K, bool kMasked>
constexpr bool backward_reads_ahead() {
  return sizeof(T) == 2 && (!kMasked || backward_min_blocks<T, K>() == 1);
}

// Whether the channel-last backward copies the P rows of the final state's cotangent (dF) that a
// thread's tile needs into shared memory with its first copy group, for the dx of times L - P ..
// L - 1 to read there. With seq_idx each of those last P steps of a channel loaded its dF values
// behind two id loads and a compare: a dependent chain at each of them, with a DRAM miss on a
// warp's first touch of a row, at the grid's very end (the twenty-first session's count of the
// masked bf16 K = 4 backward's gap: about 2 us, 24 dependent loads, 3 of them DRAM misses;
// benchmarks/RESULTS.md). Not at 16-bit K = 2 (8 channels a thread, at the cap of 128 registers):
// with the copies ptxas spilled 8 bytes of the float16 kernel (none of the bfloat16 one); one path
// serves both, as for kSpans below. Without seq_idx the load has no id loads before it.
template <typename T, int K, bool kMasked>
constexpr bool backward_stages_final_state() {
  return kMasked && !(sizeof(T) == 2 && K == 2);
}

// Whether the channel-last backward's checked steps (the tile edges' and, masked in the kernels
// with a register cap, every step at a segment boundary; see below) compute each channel's
// activation before selecting it and test the taps of a dx by the bits of one word. Tested tap by
// tap, and with the activation inside the select on `output`, ptxas made a checked step 20 branch
// regions run one after another: at masked bf16 K = 4 the chunk loop outside its step loops took
// 949 instructions with 101 branches, against 738 with 33 (sm_90 SASS; the step loops the same but
// for scheduling). A checked step costs far more than its count: the twenty-second session's
// traces took 15.1 us longer with 16 sequences a row than with 4, whose slowest tiles hold 7
// boundaries against 2, so about 3 us a boundary, P checked steps in place of uniform ones
// (benchmarks/RESULTS.md). H200 traces, packed BLD bwd bf16 K = 4: 124.5 -> 118.1 us, with 16
// sequences a row 138.4 -> 125.6 (twenty-seventh session). Without seq_idx every thread runs 2P
// of them a tile, each with one branch region a channel around its activation and one around its
// dx taps: the plain bf16 K = 4 silu edge step took 269 instructions in 11 branch regions (its
// final state's dF loads aside), against 229 in 3 (K = 8: 412 in 11, against 336 in 3); traces,
// plain BLD bwd: 109.6 -> 108.7, K = 8 141.1 -> 137.8, D = 256 13.5 -> 12.67 (twenty-seventh
// session, which read D = 256 at 15.98 once, a one-off: the same kernel runs D = 4096). Not at
// K = 2 with seq_idx: 16-bit K = 2 (8 channels a thread, at the cap of 128 registers) spilled
// 8-16 bytes with it, float K = 2 (at 5 blocks) 8 with the activation's; nor at 16-bit K = 2
// without (bf16 spilled 8 bytes; one path serves both 16-bit types) or 16-bit K = 6 without (no
// cap: bf16 took 172 registers against 166, 2 blocks an SM against 3; float16 168 against 174).
template <typename T, int K, bool kMasked>
constexpr bool backward_selects_checked_taps() {
  return kMasked ? K > 2 : !(sizeof(T) == 2 && (K == 2 || K == 6));
}

// Which copy of the channel-last backward's step runs. kChecked tests every edge. The others test
// none: kInterior, every step of [P, owned); without seq_idx, in a tile of at least P steps, kHead
// the first P steps where the tile emits no dS (every tile but a row's first when dS is asked
// for), which emit no dx (their x_u belong to the tile before), and kTail the last P steps where
// the P rows after the tile exist (every tile but a row's last), which add no dw/db (their times
// belong to the tile after). At 32-step tiles (B=8 L=2048 D=256) the checked copy's 2P steps were
// about a third of the plain bf16 K = 4 kernel's instructions (sm_90 SASS: 384 a checked step, 118
// an interior one, about 75 for these copies). H100 traces, BLD bwd kernel (forty-fourth session,
// us): with the L2 flushed before each call 15.15-15.17 -> 14.61, warm (inputs in the L2)
// 10.59-10.88 -> 10.59-10.61.
enum class StepCopy { kChecked, kInterior, kHead, kTail };
template <StepCopy kCopy>
using StepCopyConstant = std::integral_constant<StepCopy, kCopy>;

// Whether the plain channel-last backward runs kHead and kTail where a tile allows them. Not at
// 16-bit K = 2 (8 channels a thread, at the cap of 128 registers): with the copies ptxas spilled
// 8-16 bytes of the bfloat16 kernel, 16-32 of the float16 one. At 16-bit K = 8 the launch takes
// both kernels (kCheckedEdgesMinTile): the copies grow its code by half (bf16 138 KB against
// 94), and they won in short tiles and lost in long ones. H200 traces, BLD bf16 K = 8 bwd kernel
// (fiftieth session, us, copies against checked edges): B=8 L=2048 D=4096 (512-step tiles)
// 136.1-136.4 against 132.2-132.8, B=1 L=65536 481-483 against 472; 32-step tiles (B=8 L=1024
// D=512, B=8 L=2048 D=256) 18.8-19.0 against 20.8. At K = 7 the copies won at 512 steps too
// (trace spans 127.4-127.8 against 129.1-129.5).
template <typename T, int K>
constexpr bool backward_edge_copies() {
  return !(sizeof(T) == 2 && K == 2);
}
template <typename T, int K, bool kMasked>
constexpr bool backward_edge_copies_by_tile() {
  return sizeof(T) == 2 && K == 8 && !kMasked;
}
// Tiles from which backward_edge_copies_by_tile's kernels run the checked edges (a tile's edge
// steps are 2P of its steps: 44% of a 32-step tile at K = 8, 2.7% of a 512-step one; tiles of
// 64-255 steps not timed).
constexpr int64_t kCheckedEdgesMinTile = 256;

// (B, L, D), D a multiple of C. A thread owns C channels over one tile [t0, t1) and streams s from
// t0 to t1 + P - 1 with K-row register windows of x and delta. At step s it finishes delta_s, adds
// delta_s's dw/db terms when it owns s, and emits dx_{s-P}, whose deltas (s-P .. s) are all in the
// window by then. Its dw/db sums go to slice `tile` of partials; or, where the launch groups tiles
// (split.slices < split.count: a row's packs are whole runs of 32), a block's warps take one run
// over kSliceTiles consecutive tiles, warp w the w-th (a warp past the row's last tile adds
// zeros), and warp 0 writes their sum, in warp order, to slice tile / kSliceTiles. Either way a
// warp streams consecutive packs of one row, as SegmentSteps::masked_steps has it.
//
// Steps P .. owned - 1 are interior: the rows exist, the thread owns them and every tap of
// dx_{s-P} has its output in [0, L). They run a copy of the step with none of the edge tests,
// unrolled K times so that the window shifts are register renaming rather than moves; the first
// and last P steps run the checked copy. With seq_idx, so do the steps whose windows SegmentSteps
// finds across a segment boundary or at padding, with tap tests. Without seq_idx, the first and
// last P steps of a tile inside its row run copies without tests too (StepCopy).
template <typename T, int K, bool kMasked, bool kEdgeCopies = backward_edge_copies<T, K>()>
__global__ void __launch_bounds__(kBackwardThreads, backward_min_blocks<T, K>())
    backward_channel_last_kernel(ConvParams p, float* partials, ChannelLastTiles split) {
  constexpr int C = channels_per_thread<T, K, kBackwardBudget>();
  constexpr int P = K - 1;
  using Row = RawFor<T, C>;
  constexpr int kDepth = backward_ring_bytes<T, K>() / static_cast<int>(sizeof(Row));
  constexpr int kRingSlots = kDepth * kBackwardThreads;
  constexpr bool kAhead = backward_reads_ahead<T, K, kMasked>();
  static_assert(!kAhead || kDepth >= 2, "a read ahead leaves the ring a row in flight");
  constexpr bool kStagedFinal = backward_stages_final_state<T, K, kMasked>();
  constexpr bool kSelectedTaps = backward_selects_checked_taps<T, K, kMasked>();
  using FinalRows = RowSlots<P, Row, kBackwardThreads>;
  // The x ring, the dy ring, then (kStagedFinal) dF's rows; once a grouped block's steps are done,
  // its warps' dw/db sums.
  __shared__ Row slots[2 * kRingSlots + (kStagedFinal ? FinalRows::kSlots : 0)];
  const RowRing<kDepth, Row, kBackwardThreads> x_ring{slots}, dy_ring{slots + kRingSlots};
  const FinalRows final_rows{slots + 2 * kRingSlots};
  const Conv<T, float, K> conv{p};
  allow_dependent_grid();  // the reduction's blocks may wait on the SMs (see launch_dependent)
  const int64_t tile_len = split.len, tiles = split.count, slices = split.slices.d;
  const bool grouped = slices < tiles;
  const int64_t packs = p.channels / C;
  // Grouped, whole blocks: every thread of a block reaches the __syncthreads of each item.
  const int64_t total = p.batch * packs * (grouped ? slices * kSliceTiles : tiles);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    // Unit (b, slice, run), runs fastest: grouped, block item i / kBackwardThreads, whose lane l
    // of warp w takes pack run * kLanes + l over tile slice * kSliceTiles + w; else item i, pack
    // run over tile slice.
    const int64_t unit = grouped ? i / kBackwardThreads : i;
    const int64_t rest = unit / split.runs, run = unit - rest * split.runs.d;
    const int64_t b = rest / split.slices, slice = rest - b * split.slices.d;
    const int64_t d0 = (grouped ? run * kLanes + threadIdx.x % kLanes : run) * C;
    const int64_t tile = grouped ? slice * kSliceTiles + threadIdx.x / kLanes : slice;
    float dw[K][C] = {}, db[C] = {};
    if (tile < tiles) {  // a row's last slice may have fewer tiles: its other warps add zeros
      const int64_t t0 = tile * tile_len;
      const int owned = static_cast<int>(std::min(tile_len, p.length - t0));
      const int64_t first_u = (tile == 0 && p.dinitial_state != nullptr) ? -P : t0;
      // Step j streams time t0 + j: the tile and the P rows after it that exist.
      const int live_steps = static_cast<int>(std::min<int64_t>(owned + P, p.length - t0));
      // One element offset serves x, dy and dx (three pointers cost registers the cap above lacks):
      // the offset of the next fetch's row, kDepth rows after the current step's.
      int64_t next_row = (b * p.length + t0) * p.channels + d0;
      const auto fetch = [&](int step) {
        const bool live = step < live_steps;
        x_ring.fetch(step, static_cast<const T*>(p.x) + next_row, live);
        dy_ring.fetch(step, static_cast<const T*>(p.dy) + next_row, live);
        ring_commit();
        next_row += p.channels;
      };
      // Where the tile emits a dx of the final state's times (u >= L - P), all P rows of dF join
      // step 0's copy group.
      if constexpr (kStagedFinal) {
        if (p.dfinal_state != nullptr && t0 + owned > p.length - P) {
          for (int j = 0; j < P; ++j) {
            final_rows.fetch(
                j, static_cast<const T*>(p.dfinal_state) + offset(p.state_strides, b, j, d0));
          }
        }
      }
      for (int step = 0; step < kDepth; ++step) fetch(step);
      float w[K][C], bias[C], x[K][C], delta[K][C] = {};
      // The window's rows and the weights, loaded before the ring's first wait so that their
      // latencies overlap those of the ring's first rows: loaded after the read-ahead's first wait
      // (kAhead) and with load_window_before, the bf16 K = 4 prologue waited for the ring, then
      // for each of the three window rows in turn (sm_90 SASS). The window's loads go first: after
      // the weights', ptxas put the last row's load after the wait. 16-bit K = 2 (8 channels a
      // thread, at the cap of 128 registers) keeps them after the wait: before it, ptxas spilled
      // 24-32 bytes. H200 traces (twenty-sixth session), bf16 bwd us: B=8 L=2048 D=4096 K = 4
      // 110.1 -> 109.6, packed 125.3 -> 124.6, K = 8 unchanged, D = 256 14.07 -> 13.56 (1-2 us
      // predicted there).
      constexpr bool kLoadsBeforeWait = !(sizeof(T) == 2 && K == 2);
      const auto load_window_and_weights = [&] {
        load_window_at_once(conv, b, t0, d0, x);
        load_weights(conv, b, d0, w, bias);
      };
      if constexpr (kLoadsBeforeWait) load_window_and_weights();
      // With kAhead, the next step's rows. A row that was not fetched (past live_steps) holds an
      // older row's bytes or none: its step does not use it.
      Row x_next, dy_next;
      const auto read_rows = [&](int step) {
        x_next = x_ring.read(step);
        dy_next = dy_ring.read(step);
      };
      if constexpr (kAhead) {
        ring_wait<kDepth - 1>();
        read_rows(0);
      }
      if constexpr (!kLoadsBeforeWait) load_window_and_weights();
      using Segments = SegmentSteps<K, C>;
      const Segments segments{p, b, t0, d0, live_steps};
      // One step; copy a StepCopyConstant (see above), taps those of SegmentSteps: the constant
      // kAllTaps leaves no tap test. silu: std::true_type or std::false_type, chosen once around
      // the steps, or p.silu (with seq_idx, see below).
      const auto step_at = [&](int step, auto copy, uint32_t taps, auto silu) {
        constexpr StepCopy kCopy = decltype(copy)::value;
        constexpr bool kInterior = kCopy != StepCopy::kChecked;
        constexpr bool kEmits = kCopy != StepCopy::kHead, kAdds = kCopy != StepCopy::kTail;
        const int64_t s = t0 + step;
        const bool live = kInterior || step < live_steps;
        float dy[C];
        if constexpr (kAhead) {
          const Row x_row = x_next, dy_row = dy_next;
          ring_wait<kDepth - 2>();
          read_rows(step + 1);
          fetch(step + kDepth);  // into the slots read by the step before
          if (live) {
            widen(from_raw<T, C>(x_row), x[P]);
            widen(from_raw<T, C>(dy_row), dy);
          } else {
            for (int c = 0; c < C; ++c) x[P][c] = dy[c] = 0.0f;
          }
        } else {
          ring_wait<kDepth - 1>();
          if (live) {
            widen(x_ring.template read<T, C>(step), x[P]);
            widen(dy_ring.template read<T, C>(step), dy);
          } else {
            for (int c = 0; c < C; ++c) x[P][c] = dy[c] = 0.0f;
          }
          fetch(step + kDepth);  // into the slots just read
        }
        const bool output = live && Segments::has(taps, P);
        for (int c = 0; c < C; ++c) {
          float z = bias[c];
          for (int k = 0; k < K; ++k) {
            const float tap = fmaf(w[k][c], x[k][c], z);
            z = Segments::has(taps, k) ? tap : z;
          }
          if constexpr (kSelectedTaps) {
            const float vjp = activation_vjp(dy[c], z, silu);
            delta[P][c] = output ? vjp : 0.0f;
          } else {
            delta[P][c] = output ? activation_vjp(dy[c], z, silu) : 0.0f;
          }
        }
        if (kAdds && (kInterior || step < owned)) {
          for (int c = 0; c < C; ++c) {
            db[c] += delta[P][c];
            for (int k = 0; k < K; ++k) {
              const float term = fmaf(delta[P][c], x[k][c], dw[k][c]);
              dw[k][c] = Segments::has(taps, k) ? term : dw[k][c];
            }
          }
        }
        const int64_t u = s - P;  // tap k of output time s - k reads x_u; its delta is delta[P - k]
        if (kEmits && (kInterior || u >= first_u)) {
          // Taps of outputs outside [0, L) are skipped, not multiplied by a zero delta: a
          // non-finite weight must reach dx only through outputs that exist, as in the reference.
          const bool outputs_exist = kInterior || (u >= 0 && s < p.length);
          // kSelectedTaps: bit k whether tap k is used (output s - k in [0, L), and the taps of
          // SegmentSteps).
          uint32_t dx_taps = 0;
          if constexpr (kSelectedTaps && !kInterior) {
            for (int k = 0; k < K; ++k) {
              const bool exists = (s - k >= 0) & (s - k < p.length);
              dx_taps |= static_cast<uint32_t>(exists) << k;
            }
            dx_taps &= taps >> Segments::kInputTaps;
          }
          float g[C];
          for (int c = 0; c < C; ++c) {
            g[c] = 0.0f;
            for (int j = 0; j < K; ++j) {
              const int k = kAhead ? P - j : j;
              const bool used = kSelectedTaps && !kInterior
                                    ? Segments::has(dx_taps, k)
                                    : (outputs_exist || (s - k >= 0 && s - k < p.length)) &&
                                          Segments::has(taps, Segments::kInputTaps + k);
              g[c] = used ? fmaf(w[k][c], delta[P - k][c], g[c]) : g[c];
            }
          }
          if (!kInterior && u >= p.length - P) {
            if constexpr (kStagedFinal) {  // conv.final_state_grad with dF's row from its slots
              const int j = static_cast<int>(conv.final_state_row(u));
              if (conv.final_state_grad_kept(b, j)) {
                float final_grad[C];
                widen(final_rows.template read<T, C>(j), final_grad);
                for (int c = 0; c < C; ++c) g[c] += final_grad[c];
              }
            } else {
              for (int c = 0; c < C; ++c) g[c] += conv.final_state_grad(b, u, d0 + c);
            }
          }
          if (kInterior || u >= 0) {
            store_vec(static_cast<T*>(p.dx) + next_row - (kDepth + 1 + P) * p.channels,
                      narrow<T, C>(g));
          } else {
            store_vec(static_cast<T*>(p.dinitial_state) + offset(p.state_strides, b, u + P, d0),
                      narrow<T, C>(g));
          }
        }
        slide_windows<K, C>(x, delta);
      };
      // The interior steps [begin, end), silu as in step_at.
      const auto interior = [&](int begin, int end, auto silu) {
        return run_steps<K>(begin, end, [&](int step) {
          step_at(step, StepCopyConstant<StepCopy::kInterior>{}, Segments::kAllTaps, silu);
        });
      };
      if constexpr (kMasked) {
        // The steps that need tap tests are few: one checked copy serves them and the edges (in
        // the kernels with a register cap: a second one, or an interior copy with tap tests, cost
        // registers that the cap lacks), and it reads the activation's flag. 16-bit K = 2 (8
        // channels a thread, at the cap of 128 registers) reads it on its interior steps too:
        // with the activation chosen there ptxas spilled 20-32 bytes around the step loops (8-16
        // with this run_steps call written as interior(begin, end, p.silu)).
        const auto uniform = [&](int begin, int end) {
          if constexpr (sizeof(T) == 2 && K == 2) {
            return run_steps<K>(begin, end, [&](int step) {
              step_at(step, StepCopyConstant<StepCopy::kInterior>{}, Segments::kAllTaps, p.silu);
            });
          } else {
            return with_bool_constant(p.silu,
                                      [&](auto silu) { return interior(begin, end, silu); });
          }
        };
        // Spans (see SegmentSteps::run) cost 16-bit K = 2 (8 channels a thread, at the cap)
        // 4 bytes of spills with their loads in flight.
        constexpr bool kSpans = !(sizeof(T) == 2 && K == 2);
        // Kernels without a register cap (16-bit K >= 5) choose the activation once for these
        // steps too, and take a step of [P, owned) whose window crosses a segment boundary
        // (every such step is interior but for its taps) with an interior copy that has tap
        // tests: the checked copy's branches around the edge tests and each element's activation
        // made bf16 K = 8 such a step about 1200 SASS instructions (static), the copy with tap
        // tests about 320, an unrolled interior step 171.
        constexpr bool kTappedInterior = backward_min_blocks<T, K>() == 1;
        segments.template run<kSpans>(
            0, owned + P, P, owned, uniform, [&](int step, bool needs_seq_idx) {
              const uint32_t taps = needs_seq_idx ? segments.taps(step) : Segments::kAllTaps;
              if constexpr (kTappedInterior) {
                with_bool_constant(p.silu, [&](auto silu) {
                  if (needs_seq_idx && step >= P && step < owned) {
                    step_at(step, StepCopyConstant<StepCopy::kInterior>{}, taps, silu);
                  } else {
                    step_at(step, StepCopyConstant<StepCopy::kChecked>{}, taps, silu);
                  }
                });
              } else {
                step_at(step, StepCopyConstant<StepCopy::kChecked>{}, taps, p.silu);
              }
            });
      } else {
        const bool inner_head = kEdgeCopies && owned >= P && first_u == t0;
        const bool inner_tail = kEdgeCopies && owned >= P && live_steps == owned + P;
        with_bool_constant(p.silu, [&](auto silu) {
          const auto steps = [&](int begin, int end, bool inner, auto copy) {
            if (inner) {
#pragma unroll
              for (int j = 0; j < P; ++j) step_at(begin + j, copy, Segments::kAllTaps, silu);
            } else {
#pragma unroll 1
              for (int step = begin; step < end; ++step) {
                step_at(step, StepCopyConstant<StepCopy::kChecked>{}, Segments::kAllTaps, silu);
              }
            }
          };
          steps(0, P, inner_head, StepCopyConstant<StepCopy::kHead>{});
          const int tail = interior(P, owned, silu);  // owned, or P where owned < P
          steps(tail, owned + P, inner_tail, StepCopyConstant<StepCopy::kTail>{});
        });
      }
    }
    // The sums to pack (b * slices + slice) * packs + d0 / C of partials: unit * kLanes + lane
    // for warp 0 when grouped, else the unit. (From i, b and tile need not live across the steps.)
    const auto store = [&](int64_t pack) {
      float* out = partials + pack * C * (K + 1);
      for (int c = 0; c < C; ++c) {
        for (int k = 0; k < K; ++k) out[c * (K + 1) + k] = dw[k][c];
        out[c * (K + 1) + K] = db[c];
      }
    };
    if (!grouped) {
      store(i);
      continue;
    }
    // Warps 1 .. kSliceTiles - 1 leave their sums in the ring slots, value v of thread t at
    // v * kOthers + t - kLanes (a warp's lanes in consecutive banks), and warp 0 adds them to its
    // own in warp order. No copy is in flight by now (none is fetched past a thread's last step);
    // the wait makes it certain before the slots change hands.
    constexpr int kOthers = kBackwardThreads - kLanes;
    static_assert((K + 1) * C * kOthers * sizeof(float) <= sizeof(slots), "the sums fit the rings");
    float* const sums = reinterpret_cast<float*>(slots);
    const int other = static_cast<int>(threadIdx.x) - kLanes;
    ring_wait<0>();
    __syncthreads();
    if (other >= 0) {
      for (int c = 0; c < C; ++c) {
        for (int k = 0; k < K; ++k) sums[(c * (K + 1) + k) * kOthers + other] = dw[k][c];
        sums[(c * (K + 1) + K) * kOthers + other] = db[c];
      }
    }
    __syncthreads();
    if (other < 0) {
      for (int w = 0; w + 1 < kSliceTiles; ++w) {
        const int from = w * kLanes + static_cast<int>(threadIdx.x);
        for (int c = 0; c < C; ++c) {
          for (int k = 0; k < K; ++k) dw[k][c] += sums[(c * (K + 1) + k) * kOthers + from];
          db[c] += sums[(c * (K + 1) + K) * kOthers + from];
        }
      }
      store(i / kBackwardThreads * kLanes + threadIdx.x);
    }
    __syncthreads();  // the sums are read before the next item's fetches reuse the slots
  }
}

// delta of a channel-first lane's pack from xs = x_{t0-P} .. x_{t0+V-1} and dy (0 where the
// outputs do not exist, or with kSelect are padding), and where accumulate its terms of dw and db
// (dw[K]). With kSelect, seq_idx's masks, segments[j] being the entry of xs[j]; without, every tap.
// kBitMask (with kSelect): the taps of the pre-activation compare ids only and delta is zeroed
// where it is padding or does not exist by a mask of the bits, as in channel_first_outputs.
// silu: a bool, or a std::bool_constant where the kernel chose the activation once at its start.
template <bool kSelect, bool kBitMask = false, int K, int V, typename Silu>
__device__ __forceinline__ void channel_first_deltas(const float (&w)[K][1], float bias,
                                                     const float (&xs)[K - 1 + V],
                                                     const float (&dy)[V], const int32_t* segments,
                                                     bool exists, bool accumulate, Silu silu,
                                                     float (&delta)[V], float (&dw)[K + 1]) {
  constexpr int P = K - 1;
  for (int v = 0; v < V; ++v) {
    const float z = channel_first_pre_activation<kSelect, kBitMask>(w, bias, xs, segments, v);
    const float d = activation_vjp(dy[v], z, silu);  // before the select: no branch around it
    if constexpr (kBitMask) {
      delta[v] = zero_at_padding(d, exists ? segments[P + v] : -1);
    } else {
      const bool output = exists && !(kSelect && segments[P + v] < 0);
      delta[v] = output ? d : 0.0f;
    }
    if (accumulate) {
      dw[K] += delta[v];
      for (int k = 0; k < K; ++k) {
        const float term = fmaf(delta[v], xs[v + k], dw[k]);
        dw[k] = (!kSelect || same_segment(segments[P + v], segments[v + k])) ? term : dw[k];
      }
    }
  }
}

// delta of one channel-first segment, V times per lane.
template <int V>
struct SegmentDelta {
  float delta[V];
};

constexpr int power_of_two_from(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// Sums over the warp of each lane's values[0 .. N), padded with zeros to kPadded (a power of two):
// lane l returns the warp's sum of value l % kPadded (for l < N, value l's). A reduce-scatter: each
// of the first log2(kPadded) levels exchanges half of the values a lane still holds with lane
// l ^ half and keeps the half that bit `half` of l selects; the levels left sum the one value.
// N = 5 takes 4 + 2 + 1 + 1 + 1 = 9 shuffles against 25 for a tree per value. Each sum runs in one
// fixed order, so the backward stays deterministic. kWidth < 32: the sums of each group of kWidth
// lanes (lane: the lane's index in its group). N one more than a power of two from 8 up (K = 8's
// dw/db: 9) goes as a scatter of the first N - 1 and a tree of the last, whose sum lane N - 1
// returns: padded to 16, the values took a 64-byte stack frame in every K = 8 channel-first
// backward, and the split takes fewer shuffles (12 against 15 over 16 lanes; 5 values split
// would take 9 against 8 padded).
template <int kWidth = kLanes, int N>
__device__ __forceinline__ float warp_sum_scatter(const float (&values)[N], int lane) {
  constexpr int kPadded = power_of_two_from(N);
  static_assert(kPadded <= kWidth, "a value per lane at most");
  if constexpr (kPadded >= 16 && N == kPadded / 2 + 1) {
    float head[N - 1];
#pragma unroll
    for (int i = 0; i < N - 1; ++i) head[i] = values[i];
    const float head_sum = warp_sum_scatter<kWidth>(head, lane);
    float last = values[N - 1];
#pragma unroll
    for (int lanes = kWidth / 2; lanes > 0; lanes /= 2) {
      last += __shfl_xor_sync(kFullWarp, last, lanes);
    }
    return lane == N - 1 ? last : head_sum;
  } else {
    float v[kPadded];
#pragma unroll
    for (int i = 0; i < kPadded; ++i) v[i] = i < N ? values[i] : 0.0f;
#pragma unroll
    for (int half = kPadded / 2; half > 0; half /= 2) {
      const bool upper = lane & half;
#pragma unroll
      for (int j = 0; j < half; ++j) {
        const float keep = upper ? v[j + half] : v[j];
        v[j] = keep + __shfl_xor_sync(kFullWarp, upper ? v[j] : v[j + half], half);
      }
    }
#pragma unroll
    for (int lanes = kPadded; lanes < kWidth; lanes *= 2) {
      v[0] += __shfl_xor_sync(kFullWarp, v[0], lanes);
    }
    return v[0];
  }
}

// Blocks of kChannelFirstThreads per SM the channel-first backward's registers must allow (0: no
// bound). It is bound by issue slots at its occupancy: left free, the 16-bit kernels took 102-167
// registers (3-4 blocks of 128). Capped at 5 blocks (96 registers), bf16 K = 4 spills 28 bytes
// and still ran the main workload in 150.5 us, against 167.0 for 2 blocks of 256 (114
// registers); every unmasked kernel up to K = 6 gets that cap. bf16 K = 5 and 6 spill 48 and 96
// bytes there and still beat 4 blocks (no spills): 158.9 against 166.8 us and 169.7 against
// 175.0 with B=8 L=2048 D=4096; at K = 7 it gained nothing (185.4 against 186.7) and at K = 8
// it lost (204.4 against 194.7). At 4 blocks (128 registers) no unmasked kernel spills, nor do
// the masked ones up to K = 5 (at most 12 bytes); the masked ones above K = 5 would spill 24-144
// bytes there and get 3 blocks (168 registers; 16-bit K = 8 spills 24 bytes): left free, with the
// load ring and the activation chosen at the kernel's start, they took 230-244 (2 blocks).
// With those two, no kernel up to K = 7 spills at these caps.
template <typename T, int K, bool kMasked>
constexpr int channel_first_backward_min_blocks() {
  if constexpr (kMasked) return K <= 5 ? 4 : 3;
  return K <= 6 ? 5 : 4;
}

// Lanes per channel of the channel-first backward: a warp streams two rows (channels) at a time,
// a half-warp each, in segments of 16 packs, or (float32 without seq_idx) one row in segments of
// 32. A warp's segment of 16 costs what one of 32 did (SASS at bf16 K = 4: 243 instructions
// against 242), while a run's fixed cost (weights, carry, the first delta, the last dx, the dw/db
// sums: about 430) is paid once per two rows: at L = 2048 a 16-bit row issues 2162 instead of 2366
// at K = 4, 3194 instead of 3494 at K = 8. Not float32's: its K = 4 segment took 145 instead of
// 140, and at B=8 L=2048 D=4096 the launch cut rows in two, as many runs as with whole rows of
// one channel. With seq_idx, a segment that straddles a sequence boundary runs the masked
// arithmetic (about 1.6 times a uniform segment's instructions at bf16 K = 4); at four packed
// sequences a row of 2048, a third of the segments of 32 packs did, and about a sixth of those of
// 16 packs.
// With seq_idx, 16-bit K = 4 and 5 take a quarter-warp a row in segments of 8 packs, so that a
// boundary masks 64 elements instead of 128 and an item's 4 channels take one turn of the warp
// instead of two. On the H200 (packed BDL bwd B=8 L=2048 D=4096, four sequences, trace us; the
// thirty-seventh session) bf16 K = 4 took 126.8 -> 119.1, K = 5 135.3 -> 125.9, f16 K = 4 127.0 ->
// 119.6, f16 K = 5 137.8 -> 126.7; at K = 2, 3, 6 and 7 the same rows lost 1.2-1.9 us (thirty-sixth
// session), so those keep half-warp rows.
template <typename T, int K, bool kMasked>
constexpr int channel_first_backward_width() {
  if constexpr (kMasked && sizeof(T) < 4 && (K == 4 || K == 5)) return kLanes / 4;
  return kMasked || sizeof(T) < 4 ? kLanes / 2 : kLanes;
}

// Whether the masked channel-first backward's blocks share the seq_idx check of whole rows
// (for_each_channel_first_item's kShareCheck). On the H200 (thirty-second session, packed BDL bwd
// bf16 B=8 L=2048 D=4096, trace us) it took K = 4 121.4-122.0 -> 119.6 at one sequence a row,
// 128.0-128.7 -> 126.2-126.5 at four, K = 8 205.3 -> 196.4. Not where its second form of the check
// cost a block per SM (sm_90 ptxas): f32 K = 3 96 -> 104 registers, K = 6 125 -> 136.
template <typename T, int K>
constexpr bool channel_first_backward_shares_check() {
  return sizeof(T) < 4 || (K != 3 && K != 6);
}

// Whether the channel-first backward takes its interior segments two a loop pass (ring slots as
// immediates, current / next renamed instead of copied) only without seq_idx from K = 7: at bf16 K
// = 4 pairs cut a segment 242 -> 225 instructions and ran no faster (fourteenth and seventeenth
// sessions), that kernel not being issue-bound, while K = 8 issues about half as many instructions
// again an element and its forward bought about half its instruction cut (twenty-first session).
// bf16 segments: K = 7 331 -> 314.5 instructions, K = 8 359 -> 340. With taps also summed in
// arrival order, pairs took BDL K = 8 160.2 -> 157.0 us and K = 7 143.8 -> 145.5 (eighteenth
// session).
template <int K, bool kMasked>
constexpr bool channel_first_backward_interior_pairs() {
  return !kMasked && K >= 7;
}

// Segments whose x and dy packs a channel-first lane has in flight, through a cp.async ring (a
// register queue of them cost a move per word per segment: 34 of the loop's 285 instructions):
// 4, but 2 where the plain kernel's K = 7-8 interior pairs need it (a pair is a turn of the ring,
// its slots immediates) and where the masked kernel runs 3 blocks an SM
// (channel_first_backward_min_blocks: K >= 6), at which 4 lost.
// H200 traces, BDL bf16 B=8 L=2048 D=4096 (thirty-fourth session, 2 -> 4 ahead, us): plain K = 2
// 105.9 -> 101.2, K = 3 106.8 -> 101.8, K = 4 107.9-108.5 -> 102.7-103.2, K = 5 112.0 -> 109.6,
// K = 6 118.8 -> 115.7, f32 K = 4 194.6 -> 191.3, B=1 L=65536 397.8 -> 394.2, but D = 256 (the
// kernel alone, rows cut into short items) 8.5 -> 8.8; with seq_idx and states (four sequences a
// row) K = 2 113.6 -> 109.9, K = 3 117.4 -> 114.5, K = 4 126.3-126.9 -> 125.8-126.6, K = 5 136.7
// -> 135.4, f32 K = 4 220.4-221.1 -> 206.7, f16 K = 3 118.1 -> 116.1, one sequence a row K = 4
// 119.5-119.8 -> 115.3-116.0, B=1 L=65536 449.6-451.8 -> 422.3-423.3; but K = 6 165.8 -> 167.7
// and K = 8 197.2 -> 201.3. The registers of the kernels at 4 are the same or fewer (sm_90), but
// the masked f32 K = 2's 94 -> 99 (within its 4 blocks).
template <typename T, int K, bool kMasked>
constexpr int channel_first_backward_ahead() {
  const bool masked_at_3 = kMasked && channel_first_backward_min_blocks<T, K, kMasked>() < 4;
  return channel_first_backward_interior_pairs<K, kMasked>() || masked_at_3 ? 2 : 4;
}

// The most items of one weight group's channel group (its batch rows' chunks) for which the plain
// channel-first backward runs in clusters that sum dw/db themselves (backward_cuda.cu): a warp
// an item, in clusters of at most 8 blocks (the portable cluster size). The launch takes them
// only where the items fill whole blocks: idle warps would lengthen the waves (B=1 L=65536
// D=4096 bf16 cuts its rows into 9 chunks, whose clusters of 3 blocks would idle a quarter of
// their warps); and only where they fill the device (see the launch).
constexpr int kMaxClusterBlocks = 8;
constexpr int kMaxClusterItems = kMaxClusterBlocks * kChannelFirstThreads / kLanes;

// Sums of a channel-first backward launched in clusters that each take every item of a weight
// group's channel group (ClusterPlace), one item a warp: a row of kChannels * (K + 1) columns a
// warp, in ClusterSums.
template <int K, int kChannels>
using ChannelClusterSums = ClusterSums<kMaxClusterItems, kChannels * (K + 1)>;

// The clustered kernels' end: the thread's value `sum` (where has_value) goes to column `column`
// of its warp's row in the cluster's first block, which then sums each column over the rows and
// stores the cluster's channels' dweight and dbias (channel c of the channel group: columns
// c (K + 1) + k, k < K its taps', k = K its bias's).
template <typename T, int K, int kChannels>
__device__ __forceinline__ void store_cluster_sums(ChannelClusterSums<K, kChannels>& cluster_sums,
                                                   const ConvParams& p,
                                                   const ChannelFirstSplit& split, int column,
                                                   bool has_value, float sum, void* dweight,
                                                   void* dbias) {
  const ClusterPlace place(split);
  const int items = static_cast<int>(ClusterPlace::slots(split));
  cluster_sums.hand_over(static_cast<int>(place.slot), column, has_value, sum, items);
  if (cluster_sums.leader() && threadIdx.x < kChannels * (K + 1)) {
    const int64_t d = place.channel_group * kChannels + threadIdx.x / (K + 1);
    const int k = threadIdx.x % (K + 1);
    if (d < p.channels) {
      const float total = cluster_sums.total(threadIdx.x, items);
      const int64_t row = param_row_of(p, place.first_batch_row(split), d, split.batch_per_group);
      if (k == K) {
        store_param<T, float>(dbias, row, total, p.params_like_x);
      } else {
        store_param<T, float>(dweight, row * K + k, total, p.params_like_x);
      }
    }
  }
  cluster_sums.finish();
}

// (B, D, L), L a multiple of the pack V. A group of lanes (kWidth, see above) streams chunk_len
// times of one (b, d) row in segments of kWidth V times, lane l of the group owning V consecutive
// times of each. Per segment it computes delta (x halos from lower lanes by shuffle) and, once
// the next segment's delta is known, dx (delta halos from higher lanes or the next segment).
// dw/db stay in registers until the chunk ends, then warp_sum_scatter sums them into
// partials[b, chunk, d, 0..K]. A chunk that ends before the row does computes the first P deltas
// after it again (they belong to the next chunk). A warp item takes a channel per group; with
// seq_idx, kUniformChannels channels, whose uniform segments it finds once; those run the unmasked
// arithmetic, the others load their seq_idx entries.
template <typename T, int K, bool kMasked, bool kClusterSums = false>
__global__ void
__launch_bounds__(kChannelFirstThreads, channel_first_backward_min_blocks<T, K, kMasked>())
    backward_channel_first_kernel(ConvParams p, float* partials, void* dweight, void* dbias,
                                  ChannelFirstSplit split) {
  constexpr int V = kPack<T>;
  constexpr int P = K - 1;
  constexpr int kWidth = channel_first_backward_width<T, K, kMasked>();
  constexpr int kGroups = kLanes / kWidth;
  static_assert(!kClusterSums || !kMasked, "clusters take one channel a group of lanes");
  constexpr int64_t kSegment = kWidth * V;
  constexpr bool kInteriorPairs = channel_first_backward_interior_pairs<K, kMasked>();
  constexpr int kAhead = channel_first_backward_ahead<T, K, kMasked>();
  using Word = RawFor<T, V>;
  const Conv<T, float, K> conv{p};
  const int lane = threadIdx.x % kWidth;  // in the lane's group, which takes one channel
  __shared__ Word x_slots[kAhead * kChannelFirstThreads], dy_slots[kAhead * kChannelFirstThreads];
  const RowRing<kAhead, Word, kChannelFirstThreads> x_ring{x_slots}, dy_ring{dy_slots};
  allow_dependent_grid();  // the reduction's blocks may wait on the SMs (see launch_dependent)
  using Sums = std::conditional_t<kClusterSums, ChannelClusterSums<K, kGroups>, NoSums>;
  __shared__ Sums cluster_sums;
  if constexpr (kClusterSums) cluster_sums.start();
  float item_sum = 0.0f;  // with kClusterSums, the warp's item's sum (lane <= K of each group)
  // The item's channel `item` (times [c0, c1)). Bit 0 of uniform.before: whether the next segment
  // that segment_delta takes is uniform for its deltas; of uniform.after, whether the next segment
  // that segment_dx takes is for its dx. They take the segments below loaded_end and c1: the
  // launcher makes that at most kUniformSegments (the bits past those are 0, the segments masked).
  // silu: std::true_type or std::false_type.
  const auto run = [&](const ChannelFirstItem& item, UniformSegments uniform, auto silu) {
    // Times this item loads: its own, and the P after them that the dx of its last times needs.
    const int64_t loaded_end = std::min(item.c1 + P, p.length);
    // One element offset serves x, dy and dx: the lane's pack at time 0 of the row (their base
    // pointers stay in the constant bank); the lane's pack of segment s loads while s < lane_end.
    const int64_t lane_at = item.row * p.length + lane * V;
    const int64_t lane_end = loaded_end - lane * V;
    // The lane's x and dy packs of the next kAhead segments that segment_delta will take,
    // in the rings' slots (step: segment_delta's count). A pack past lane_end is not fetched: its
    // slot holds an older pack, which only lanes whose outputs do not exist read.
    int step = 0;
    const auto fetch = [&](int64_t s, int at) {
      const int64_t offset = lane_at + s;
      x_ring.fetch(at, static_cast<const T*>(p.x) + offset, s < lane_end);
      dy_ring.fetch(at, static_cast<const T*>(p.dy) + offset, s < lane_end);
      ring_commit();
    };
    // The first packs, then the carry's loads (widened after the weights'), then the params, the
    // bias by a predicated load beside the weights: so that an item's start waits for one memory
    // round, not several in series (the weights, then the bias behind a branch on p.bias, then
    // the first packs; the carry after the weights' widening until the forty-eighth session).
    // ncu per SASS line (thirty-eighth session, plain bf16 K = 4): the per-item code, 16% of the
    // instructions, held 39.5% of the stall samples, 16.8% on the weights' and bias's widening
    // and the first ring read alone.
    for (int a = 0; a < kAhead; ++a) fetch(item.c0 + a * kSegment, a);
    T carry_stored[P];
    ChannelFirstCarry<K>::template load_values<true>(
        static_cast<const T*>(p.x) + item.row * p.length,
        p.initial_state == nullptr ? nullptr
                                   : static_cast<const T*>(p.initial_state) + item.row * P,
        item.c0, carry_stored);
    float w[K][1], bias[1];
    load_param_row<T, true>(p, item.param_row, w, bias);
    // Held opaque: with a channel a half-warp, NVVM recomputed item.b * length for each masked
    // segment's entries (5 instructions each of its delta and dx at bf16 K = 4).
    const int32_t* segment_row = kMasked ? p.seq_idx + item.b * p.length : nullptr;
    asm("" : "+l"(segment_row));
    ChannelFirstCarry<K> carry;
    carry.widen(carry_stored);
    float dw[K + 1] = {};  // dw[K] is db

    // Called for segments c0, c0 + kSegment, ... in order, every one below loaded_end; interior
    // (std::true_type) when every time of the segment exists and is the item's own. slot: its
    // packs' ring slot, step or (in interior pairs) a std::integral_constant of it.
    const auto segment_delta = [&](int64_t s, SegmentDelta<V>& out, auto interior, auto slot) {
      constexpr bool kInterior = decltype(interior)::value;
      const bool masked = kMasked && !(uniform.before & 1u);
      uniform.before >>= 1;
      const int64_t t0 = s + lane * V;
      const bool exists = kInterior || t0 < loaded_end;
      float own[V], dy[V];
      ring_wait<kAhead - 1>();
      widen(x_ring.template read<T, V>(slot), own);
      widen(dy_ring.template read<T, V>(slot), dy);
      fetch(s + kAhead * kSegment, slot + kAhead);
      ++step;
      float xs[P + V];  // x_{t0-P} .. x_{t0+V-1}
      carry.template advance<V, kWidth>(own, lane, xs);
      const bool accumulate = kInterior || t0 < item.c1;
      if (!masked) {
        channel_first_deltas<false>(w, bias[0], xs, dy, nullptr, exists, accumulate, silu,
                                    out.delta, dw);
      } else {
        // A lane past the row's end does not exist: its window need not be in the row. Windows
        // without range tests, taps comparing ids only and delta (and segment_dx's dx) zeroed by
        // a bit mask: at bf16 K = 4 (silu) a masked segment of the interior loop took 521 -> 418
        // instructions (masked delta 282 -> 234, masked dx 132 -> 88), a uniform one 269 -> 258.
        int32_t segments[P + V];
        load_segment_window_before<V, P, kInterior>(segment_row, t0, p.length, segments);
        channel_first_deltas<true, true>(w, bias[0], xs, dy, segments, exists, accumulate, silu,
                                         out.delta, dw);
      }
    };

    SegmentDelta<V> current, next;
    segment_delta(item.c0, current, std::false_type{}, step);
    if (item.c0 == 0 && p.dinitial_state != nullptr) {
      // dS = dx on [-P, 0): taps of outputs 0 .. P-1, which lanes 0 and 1 hold. The rows here
      // are longer than 32 packs (shorter ones take backward_short_rows_kernel): those outputs
      // exist, and no time of dS is one of the final state's.
      float first[P];
      for (int t = 0; t < P; ++t) {
        first[t] = __shfl_sync(kFullWarp, current.delta[t % V], t / V, kWidth);
      }
      if (lane == 0) {
        // The entries of times 0 .. P-1 loaded before the first store: read in the taps' loop,
        // each was loaded again after every store of dS (which may alias seq_idx), 3 dependent
        // rounds of loads a run at bf16 K = 4 (SASS) while the warp waited on lane 0.
        int32_t first_segments[P];
        for (int t = 0; t < P; ++t) first_segments[t] = kMasked ? conv.segment(item.b, t) : 0;
        T* ds_row = static_cast<T*>(p.dinitial_state) + item.row * P;
        for (int i = 0; i < P; ++i) {
          float acc = 0.0f;
          for (int k = 0; k <= i; ++k) {
            const int t = i - k;
            const bool used = !kMasked || same_segment(first_segments[t], first_segments[0]);
            acc = used ? fmaf(w[k][0], first[t], acc) : acc;
          }
          ds_row[i] = from_acc<T>(acc);
        }
      }
    }
    // dx of segment s, after the delta of segment s + kSegment. Interior (std::true_type) when
    // both segments are the item's own: every tap's output then exists, no dx is a final-state
    // time (a segment is longer than P) and every lane stores. The per-element tests of the
    // checked copy compiled to a branch around each element's activation.
    const auto segment_dx = [&](int64_t s, auto interior, auto slot) {
      constexpr bool kInterior = decltype(interior)::value;
      if (kInterior || s + kSegment < loaded_end) {
        segment_delta(s + kSegment, next, interior, slot);
      } else {
        for (int v = 0; v < V; ++v) next.delta[v] = 0.0f;
      }
      const bool masked = kMasked && !(uniform.after & 1u);
      uniform.after >>= 1;
      const int64_t t0 = s + lane * V;
      float after[P];
      halo_after<P, V, kWidth>(current.delta, next.delta, lane, after);
      float g[V];
      // select: std::true_type for seq_idx's masks, segments[j] the entry of x_{t0+j}. Without
      // them the taps of outputs past the row are skipped, as the entries (-1) skip them.
      const auto input_grads = [&](auto select, const int32_t* segments) {
        constexpr bool kSelect = decltype(select)::value;
        bool exists[P];  // whether time t0 + V + m exists
        for (int m = 0; m < P; ++m) exists[m] = kInterior || t0 + V + m < p.length;
        for (int j = 0; j < V; ++j) {  // dx_{t0+j}: tap k of output t0 + j + P - k
          float acc = 0.0f;
          for (int k = 0; k < K; ++k) {
            const int at = j + P - k;
            if (at < V) {
              const float tap = fmaf(w[k][0], current.delta[at], acc);
              acc = (!kSelect || segments[at] == segments[j]) ? tap : acc;
            } else {
              const bool used = kSelect ? segments[at] == segments[j] : exists[at - V];
              acc = used ? fmaf(w[k][0], after[at - V], acc) : acc;
            }
          }
          // With kSelect the taps compare ids only, and dx is zeroed at padding: where x_{t0+j}
          // is not padding, equal ids are same_segment's test; where it is, no output reads it.
          g[j] = kSelect ? zero_at_padding(acc, segments[j]) : acc;
        }
      };
      if (!masked) {
        input_grads(std::false_type{}, nullptr);
      } else {
        int32_t segments[V + P];
        load_segment_window_after<V, P, kInterior>(segment_row, t0, p.length, segments);
        input_grads(std::true_type{}, segments);
      }
      if (!kInterior && p.dfinal_state != nullptr && t0 < item.c1 && t0 + V > p.length - P) {
        if constexpr (kMasked && P <= V) {
          // dF's P values, each loaded whether kept or not and zeroed after, so that they and
          // their seq_idx entries load in one round: conv.final_state_grad per time put each dF
          // load behind its entries' compare and the next time's loads behind that, 6 dependent
          // rounds a run at bf16 K = 4 (SASS) while the warp waited on one lane. Without seq_idx
          // its loads have no entries before them; with P > V (float32 K >= 6) the loads at once
          // took float32 K = 6 from 124 to 145 registers, 4 blocks per SM to 3.
          const int64_t first = t0 - (p.length - P);  // the dF row of time t0 (negative: none)
          for (int j = 0; j < P; ++j) {
            const float final_grad = to_acc<float>(static_cast<const T*>(
                p.dfinal_state)[offset(p.state_strides, item.b, j, item.d)]);
            const float kept = conv.final_state_kept(item.b, j) ? final_grad : 0.0f;
            for (int v = 0; v < V; ++v) g[v] = first + v == j ? g[v] + kept : g[v];
          }
        } else {
          for (int j = 0; j < V; ++j) g[j] += conv.final_state_grad(item.b, t0 + j, item.d);
        }
      }
      if (kInterior || t0 < item.c1) {
        store_streaming(static_cast<T*>(p.dx) + lane_at + s, narrow<T, V>(g));
      }
      current = next;
    };
    int64_t s = item.c0;
    if constexpr (kInteriorPairs) {
      // Segment c0 + n kSegment's packs are in slot n % 2: a pair starting at an even n takes the
      // next segments' deltas from slots 1 and 0.
      using Odd = std::integral_constant<int, 1>;
      using Even = std::integral_constant<int, 0>;
      static_assert(kAhead == 2, "a pair of segments is a turn of the ring");
      for (; s + 3 * kSegment <= item.c1; s += 2 * kSegment) {
        segment_dx(s, std::true_type{}, Odd{});
        segment_dx(s + kSegment, std::true_type{}, Even{});
      }
      if (s + 2 * kSegment <= item.c1) {
        segment_dx(s, std::true_type{}, Odd{});
        s += kSegment;
      }
    } else {
      for (; s + 2 * kSegment <= item.c1; s += kSegment) segment_dx(s, std::true_type{}, step);
    }
    for (; s < item.c1; s += kSegment) segment_dx(s, std::false_type{}, step);
    const float sum = warp_sum_scatter<kWidth>(dw, lane);
    ring_wait<0>();  // the fetches past the item land before the next item's reuse their slots
    if constexpr (kClusterSums) {
      item_sum = sum;
    } else if (lane <= K) {
      partials[((item.b * item.chunks + item.chunk) * p.channels + item.d) * (K + 1) + lane] = sum;
    }
  };
  with_bool_constant(p.silu, [&](auto silu) {
    for_each_channel_first_item<V, P, kMasked, ItemKept::kNothing, kWidth, kUniformChannels,
                                channel_first_backward_shares_check<T, K>(), kClusterSums>(
        p, split, P,
        [&](const ChannelFirstItem& item, UniformSegments uniform) { run(item, uniform, silu); });
  });
  if constexpr (kClusterSums) {
    const int group = (threadIdx.x % kLanes) / kWidth;
    store_cluster_sums<T, K, kGroups>(cluster_sums, p, split, group * (K + 1) + lane, lane <= K,
                                      item_sum, dweight, dbias);
  }
}

// ---- channel-first backward on tensor cores: bfloat16, K = 7 and 8, no seq_idx or states ----
//
// The scalar kernel above issues about 3K + 10 FP32 instructions an element (pre = conv(x, w),
// dx = the anti-causal conv of dpre with w, dw += x dpre, the activation's derivative): at K = 7
// and 8 it is issue-bound (H200, B=8 L=2048 D=4096 BDL: 131.9 and 143.0 us against 113.0 at
// K = 4, twenty-seventh session). Here pre and dx are products of x and dpre with Toeplitz
// matrices of the taps, and dw a product of x and dpre, each an m16n8k16 MMA per 128 times of
// one channel (PTX fragment layouts; g = lane / 4, q = lane % 4; word w of a block: its times
// 2w and 2w + 1, lane l loading words l and l + 32):
// - pre: A[m][k] = x[base + 8m + k - 8], B[k][n] = the tap of lag n + 8 - k, D[m][n] = pre at
//   base + 8m + n (K <= 9). A's fragment is words l - 4, l + 28, l, l + 32: two shuffles from
//   lane l - 4, lanes 0-3 taking the previous block's words 60-63 (the carry). D's is words l
//   and l + 32, the loads' own layout, so dy and dx use it as loaded.
// - dx[t] = sum_j tap_j dpre[t + j]: A'[m][k] = dpre[base + 8m + k] (words l, l + 32, l + 4,
//   l + 36: three shuffles from lane l + 4, lanes 28-31 taking the next block's words 0-3) and
//   B'[k][n] = the tap of lag k - n.
// - dw: the entry (k, n) of A^T (16 x 16, four movmatrix of A) times dpre's D fragment
//   transposed (two movmatrix: B[m][n] = dpre[base + 8m + n]) sums x[t - lag] dpre[t] over the
//   block's t = base + 8m + n, lag = n + 8 - k; the warp accumulates it over the item and sums
//   the diagonals at the end.
// x is exact in bfloat16; the float weights and dpre are split into bfloat16 high and low parts,
// so that the products keep about 16 bits more than bfloat16: two MMAs for pre (x w_hi, x w_lo),
// three for dx (dpre_hi w_hi, dpre_hi w_lo, dpre_lo w_hi), two for dw, all summed in float.
// scripts/mma_fragment_model.py simulates these fragments lane by lane against float64.
// Unlike the scalar kernels, a NaN or Inf in x, dy or the weights also reaches outputs whose taps
// do not read it: the zero entries of its MMA's Toeplitz matrix multiply it (Inf x 0 = NaN), and
// an infinite dpre's low part is Inf - Inf. (The tests of non-finite inputs use float32 and
// float64.)
constexpr int64_t kMmaBlock = 128;
// Words counted from a lane pointer in an int (those past it are neither loaded nor stored).
constexpr int64_t kMaxWordsLeft = int64_t{1} << 30;
// Blocks of x and dy words in a warp's cp.async ring (kMmaRing - 1 of them in flight, 512 bytes
// each). With the words loaded into registers two blocks ahead (at most 1 KB a warp, 24 KB per SM
// at 6 blocks of 128), the kernel ran slower than the scalar one at half its instructions (H200,
// B=8 L=2048 D=4096 BDL: K = 8 147.7 us against 141.9, K = 7 146.5 against 129.9, twenty-seventh
// session): bound by the loads' latency. Copies in flight hold no registers: 7 blocks, up to
// 3.5 KB a warp and 84 KB per SM (about 65 KB on average over an item of 16 blocks), in 16 KB of
// shared memory a block (96 KB per SM, still 6 blocks). Lane l copies 16 bytes of x (l < 16) or
// dy, so the warp waits on its lanes' copies with a __syncwarp; the waits, reads and copies cost
// a pair of blocks 193 -> 223 SASS instructions at K = 8 (predicted: memory-bound all the same).
constexpr int kMmaRing = 8;
// The fewest blocks in a tensor-core item: with fewer, filling and draining the ring costs more
// than the MMAs save. H200, B=8 BDL bf16 K = 8 bwd, tensor cores against the scalar kernel
// (twenty-eighth session; items of channel_first_chunk's blocks): L=2048 D=256 (6 blocks) 13.2
// -> 15.4 us, D=512 (8) 22.3 -> 24.1, L=512 D=4096 (4) 53.4 -> 54.6 and L=1024 D=4096 (8) 82.5
// -> 78.9; in items of 16 or more D=1024 39.4 -> 36.9, D=2048 72.9 -> 65.6, D=4096 142.0 ->
// 129.1, D=8192 272.8 -> 245.5, B=2 L=16384 D=1024 70.2 -> 60.6, B=1 L=65536 D=4096 509.3 ->
// 415.8 (K = 7: 8 blocks at L=512 49.1 -> 54.3, 16 at D=1024 36.5 -> 36.7, D=4096 129.8 -> 127.9).
constexpr int64_t kMmaMinItemBlocks = 16;
// Blocks of kChannelFirstThreads per SM the tensor-core backward's registers must allow. At 6 (80
// registers, 24 warps) it took B=8 L=2048 D=4096 K = 8 in about 121.5 us against 93.4 for a copy of
// its bytes (H200, thirtieth session), issuing in under 60% of the cycles at 1.98 GHz by its SASS
// (with silu about 2170 instructions a warp item of 16 blocks): its warps wait on each block's
// chain of shuffles, MMAs, MUFU and movmatrix, so more of them hide more of it. At 8 (64 registers)
// the silu pair loop takes 211 instructions instead of 210 and an item's code around the loops 471
// instead of 425 (values recomputed rather than held; K = 7 and 8 alike, no-op fillers aside), and
// one address spills (8 bytes, loaded once an item). The ring's shared memory allows 8: 8 x (16752
// + 1024 reserved) bytes, 112 KB of copies in flight per SM. At 32 warps an SM the launch's split
// keeps that shape's whole rows (16 blocks, 7.8 waves of items instead of 10.3); at 7 (72
// registers, no spills) it would cut B=8 L=2048 D=1024's rows to 8 blocks, below kMmaMinItemBlocks,
// where 6 keeps them whole. H200 traces, bf16 BDL backward (thirty-first session), 6 -> 8:
// B=8 L=2048 D=4096 K = 8 125.9 -> 122.9-123.1 us, K = 7 125.0-125.5 -> 122.4-122.5 (predicted
// 106-118: waiting was not the most of it); B=8 L=2048 D=512 and B=1 L=2048 D=4096 K = 8, one wave
// now on tensor cores, 22.2 -> 20.6; B=8 L=2048 D=1024 35.3 -> 34.9.
constexpr int kMmaBlocksPerSm = 8;

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4],
                                               const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// An 8 x 8 bfloat16 fragment (lane: row g, columns 2q and 2q + 1) of the transposed matrix.
__device__ __forceinline__ uint32_t transpose_8x8(uint32_t fragment) {
  uint32_t out;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(out) : "r"(fragment));
  return out;
}

__device__ __forceinline__ uint32_t bf16_pair(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  uint32_t word;
  memcpy(&word, &pair, sizeof word);
  return word;
}

// low + (high << 16) as bfloat16 pairs hi and lo with value ~ hi + lo (to about 2^-17).
__device__ __forceinline__ void split_pair(float low, float high, uint32_t& hi, uint32_t& lo) {
  hi = bf16_pair(low, high);
  lo = bf16_pair(low - __uint_as_float(hi << 16), high - __uint_as_float(hi & 0xffff0000u));
}

// Lags of the tap fragments' entries: -7 .. 15.
constexpr int kMinLag = -7, kLags = 23;

// The lane's B fragment of B[k][n] = the tap of lag lag_of(k, n), by_lag[lag - kMinLag] (the
// warp's table in shared memory: weight P - lag, zero outside the taps), row 0 row_0 where given,
// split into high and low parts. The lane's lags are known only at run time: with the weights in
// registers, selects for each lag took 64 compares and 64 selects an item at K = 8.
template <typename LagOf>
__device__ __forceinline__ void tap_fragment(const float* by_lag, int lane, const LagOf& lag_of,
                                             uint32_t (&hi)[2], uint32_t (&lo)[2],
                                             const float* row_0 = nullptr) {
  const int g = lane >> 2, q = lane & 3;
  for (int r = 0; r < 2; ++r) {
    float taps[2];
    for (int e = 0; e < 2; ++e) {
      const int k = 2 * q + 8 * r + e;
      taps[e] = row_0 != nullptr && k == 0 ? *row_0 : by_lag[lag_of(k, g) - kMinLag];
    }
    split_pair(taps[0], taps[1], hi[r], lo[r]);
  }
}

// A params row's entries of a warp's table of taps by lag (see tap_fragment): lane l < kLags's
// tap of lag l + kMinLag (weight P - lag, 0 outside the taps), and the row's bias (0 without
// one). Each lane loads one weight and the bias: one round of two loads where load_param_row had
// every lane load the row's K + 1 values. With the per-block math below moved out of the kernel's
// lambdas, H200 traces of the bf16 BDL backward, B=8 L=2048 D=4096: K = 8 127.3 -> 124.4-125.2
// us, K = 7 127.3-127.7 -> 124.1-124.5 (thirtieth session); through load_param, as here, rather
// than its own pick of the params' type, the same within 0.7 us (thirty-first).
struct MmaTapRow {
  float tap, bias;
};

template <int K>
__device__ __forceinline__ MmaTapRow mma_tap_row(const ConvParams& p, int64_t row, int lane) {
  constexpr int P = K - 1;
  const int lag = lane + kMinLag;
  const bool kept = lag >= 0 && lag <= P;
  return with_param_type<__nv_bfloat16, float>(p.params_like_x, [&](auto like_x) {
    const float tap =
        load_param<__nv_bfloat16, float>(p.weight, row * K + (kept ? P - lag : 0), like_x);
    const float bias = p.bias ? load_param<__nv_bfloat16, float>(p.bias, row, like_x) : 0.0f;
    return MmaTapRow{kept ? tap : 0.0f, bias};
  });
}

// One channel's taps as B fragments, split into high and low parts: the pre-activations' (lag
// n + 8 - k, row 0 the bias) and dx's (lag k - n).
struct MmaTaps {
  uint32_t pre_hi[2], pre_lo[2], dx_hi[2], dx_lo[2];
};

// A channel's MmaTaps from its table (mma_tap_row's taps, once every lane's write has landed).
__device__ __forceinline__ MmaTaps mma_taps(const float* by_lag, float bias, int lane) {
  MmaTaps taps;
  tap_fragment(by_lag, lane, [](int k, int n) { return n + 8 - k; }, taps.pre_hi, taps.pre_lo,
               &bias);
  tap_fragment(by_lag, lane, [](int k, int n) { return k - n; }, taps.dx_hi, taps.dx_lo);
  return taps;
}

// A block's x and dy of one channel as lane l holds them: words l and l + 32 (times 2l, 2l + 1
// and 64 + 2l, 65 + 2l of the block, bf16 pairs).
struct MmaWords {
  uint32_t x[2], dy[2];
};

// A block's dpre of one channel in D's layout (the times of MmaWords), as bf16 pairs split into
// high and low parts.
struct MmaDelta {
  uint32_t hi[2], lo[2];
};

// dpre of a block of one channel from its words, and a, its x fragment (for mma_accumulate).
// carry: in lanes 0-3, x words 60-63 of the block before (0 before the row), replaced by this
// block's. Every lane must call it (it shuffles).
template <typename Silu>
__device__ __forceinline__ void mma_deltas(const MmaWords& in, const MmaTaps& taps, int lane,
                                           Silu silu, uint32_t& carry, uint32_t (&a)[4],
                                           MmaDelta& out) {
  // Column 0 of A, the low halves of lanes 0, 4, .., 28's a0 and a1: bfloat16 1.0 (0x3f80).
  const uint32_t column_0 = lane % 4 == 0 ? 0xffffu : 0u;
  const int from = (lane + kLanes - 4) % kLanes;
  const uint32_t u0 = __shfl_sync(kFullWarp, in.x[0], from);
  const uint32_t u1 = __shfl_sync(kFullWarp, in.x[1], from);
  a[0] = ((lane >= 4 ? u0 : carry) & ~column_0) | (0x3f80u & column_0);
  a[1] = ((lane < 4 ? u0 : u1) & ~column_0) | (0x3f80u & column_0);
  a[2] = in.x[0];
  a[3] = in.x[1];
  carry = u1;
  float z[4] = {};
  mma_bf16_16816(z, a, taps.pre_hi);
  mma_bf16_16816(z, a, taps.pre_lo);
  for (int h = 0; h < 2; ++h) {
    const float low = activation_vjp(__uint_as_float(in.dy[h] << 16), z[2 * h], silu);
    const float high =
        activation_vjp(__uint_as_float(in.dy[h] & 0xffff0000u), z[2 * h + 1], silu);
    split_pair(low, high, out.hi[h], out.lo[h]);
  }
}

// Adds a block's terms of dw and db (from mma_deltas' a and dpre) to the lane's fragment of the
// accumulator: entry (k, n) of lag n + 8 - k; k = 0, of db.
__device__ __forceinline__ void mma_accumulate(const uint32_t (&a)[4], const MmaDelta& d,
                                               float (&dw)[4]) {
  const uint32_t at[4] = {transpose_8x8(a[0]), transpose_8x8(a[2]), transpose_8x8(a[1]),
                          transpose_8x8(a[3])};
  const uint32_t hi[2] = {transpose_8x8(d.hi[0]), transpose_8x8(d.hi[1])};
  const uint32_t lo[2] = {transpose_8x8(d.lo[0]), transpose_8x8(d.lo[1])};
  mma_bf16_16816(dw, at, hi);
  mma_bf16_16816(dw, at, lo);
}

// dx of a block of one channel, in D's layout (the times of MmaWords), from its dpre and the next
// block's. Every lane must call it (it shuffles).
__device__ __forceinline__ void mma_input_grads(const MmaDelta& current, const MmaDelta& next,
                                                const MmaTaps& taps, int lane, float (&g)[4]) {
  const int from = (lane + 4) % kLanes;
  const bool own = lane < kLanes - 4;
  const auto fragment = [&](const uint32_t (&words)[2], const uint32_t (&after)[2],
                            uint32_t (&out)[4]) {
    const uint32_t s0 = __shfl_sync(kFullWarp, words[0], from);
    const uint32_t s1 = __shfl_sync(kFullWarp, words[1], from);
    const uint32_t n0 = __shfl_sync(kFullWarp, after[0], from);
    out[0] = words[0];
    out[1] = words[1];
    out[2] = own ? s0 : s1;
    out[3] = own ? s1 : n0;
  };
  uint32_t hi[4], lo[4];
  fragment(current.hi, next.hi, hi);
  fragment(current.lo, next.lo, lo);
  for (int i = 0; i < 4; ++i) g[i] = 0.0f;
  mma_bf16_16816(g, hi, taps.dx_hi);
  mma_bf16_16816(g, hi, taps.dx_lo);
  mma_bf16_16816(g, lo, taps.dx_hi);
}

// The lane's accumulator fragment as entries[8 k + n] = entry (k, n): lane l's (g, 2q),
// (g, 2q + 1), (g + 8, 2q), (g + 8, 2q + 1).
__device__ __forceinline__ void mma_store_entries(const float (&dw)[4], uint32_t* entries,
                                                  int lane) {
  const int g = lane >> 2, q = lane & 3;
  for (int i = 0; i < 4; ++i) {
    entries[8 * (g + 8 * (i >> 1)) + 2 * q + (i & 1)] = __float_as_uint(dw[i]);
  }
}

// Sum k of an item's dw/db partials from its entries (mma_store_entries), in a fixed order: for
// k < K the 8 entries of lag P - k (row n + 8 - lag of column n), for k = K those of row 0 (db).
// (Selecting each entry for each tap and summing by warp_sum_scatter took about 170 instructions.)
template <int K>
__device__ __forceinline__ float mma_entry_sum(const uint32_t* entries, int k) {
  constexpr int P = K - 1;
  float sum = 0.0f;
  for (int n = 0; n < 8; ++n) {
    const int row = k == K ? 0 : n + 8 - (P - k);
    sum += __uint_as_float(entries[8 * row + n]);
  }
  return sum;
}

// (B, D, L) bfloat16 without seq_idx or states, L a multiple of 8 and longer than the short
// rows': a warp takes one channel's times [c0, c1) (c0 a multiple of kMmaBlock) in blocks of
// kMmaBlock, and the first block after them for the dx of its last times. dw/db sums go to
// partials[b, chunk, d, 0..K] as the scalar kernel's do, in a fixed order, or with kClusterSums
// (a launch in clusters, as the scalar kernel's) to the cluster's first block, which stores dw
// and db. Correct for items of any length; launched for those of kMmaMinItemBlocks blocks or more.
template <int K, bool kClusterSums = false>
__global__ void __launch_bounds__(kChannelFirstThreads, kMmaBlocksPerSm)
    backward_channel_first_mma_kernel(ConvParams p, float* partials, void* dweight, void* dbias,
                                      ChannelFirstSplit split) {
  using T = __nv_bfloat16;
  constexpr int P = K - 1;
  // Up to 9 taps a block's pre-activations are one product (lags up to 8). Up to 8, column 0 of
  // A (x at lag n + 8 for output n) is no tap's: it holds ones, so that row 0 of B adds the bias
  // (the accumulator starts at zero, no moves) and row 0 of A^T sums dpre for db.
  static_assert(K <= 8, "column 0 of A is free");
  const int lane = threadIdx.x % kLanes;
  allow_dependent_grid();  // the reduction's blocks may wait on the SMs (see launch_dependent)
  // The warp's ring: kMmaRing slots of a block's x words, then its dy words.
  constexpr int kWords = kMmaBlock / 2;  // a block's words of one row
  constexpr int kWarps = kChannelFirstThreads / kLanes;
  __shared__ uint32_t ring[kWarps][kMmaRing][2 * kWords];
  __shared__ float taps_by_lag[kWarps][kLags];
  const int warp = threadIdx.x / kLanes;
  uint32_t (*const slots)[2 * kWords] = ring[warp];
  // Lane l's 16 bytes of the warp's slot 0 (see fetch), as a shared-window address for cp.async.
  const uint32_t slots_shared =
      static_cast<uint32_t>(__cvta_generic_to_shared(&ring[warp][0][0])) + 16 * lane;
  using Sums = std::conditional_t<kClusterSums, ChannelClusterSums<K, 1>, NoSums>;
  __shared__ Sums cluster_sums;
  if constexpr (kClusterSums) cluster_sums.start();
  float item_sum = 0.0f;  // with kClusterSums, the warp's item's sum (lanes 0 .. K)
  const auto run = [&](const ChannelFirstItem& item, auto silu) {
    const int64_t row_words = p.length / 2;
    const int64_t row_at = item.row * row_words + lane;
    // Times this item loads: its own, and the block after them (of which dx needs P deltas).
    const int64_t loaded_end = std::min(item.c1 + kMmaBlock, p.length);
    const int64_t lane_loaded = loaded_end / 2 - lane, lane_words = row_words - lane;
    // Words from a lane's first word of the item on before `lane_end`, in an int (blocks are
    // counted in ints; those past kMaxWordsLeft are never reached).
    const auto words_left = [&](int64_t lane_end) {
      const int64_t left = lane_end - item.c0 / 2;
      return static_cast<int>(left < kMaxWordsLeft ? left : kMaxWordsLeft);
    };
    // The ring's copies first, so that the weights' loads wait behind them, not before them.
    // Lane l copies 16 bytes of block m: x words 4l .. 4l + 3 (l < 16) or dy words 4(l - 16) ..
    // 4(l - 16) + 3, whole or not at all (L and so loaded_end are multiples of 8 times).
    const int chunk_word = 4 * (lane % 16);
    const uint32_t* fetch_from = static_cast<const uint32_t*>(lane < 16 ? p.x : p.dy) +
                                 (item.row * row_words + item.c0 / 2 + chunk_word);
    // Held opaque: NVVM kept the base and the 64-bit offset apart, 6 instructions a copy's
    // address instead of one multiply-add.
    asm("" : "+l"(fetch_from));
    const int fetch_words = words_left(loaded_end / 2 - chunk_word);
    const auto fetch = [&](int m) {
      const uint32_t to = slots_shared + (m & (kMmaRing - 1)) * (2 * kWords * 4);
      if (m * kWords < fetch_words) copy_async<16>(to, fetch_from + m * kWords);
      ring_commit();
    };
    // The lanes' reads of the slots and the taps' table in the warp's last item precede these
    // copies and writes.
    __syncwarp();
    for (int m = 0; m < kMmaRing - 1; ++m) fetch(m);
    // Where the item's sums go, found before the blocks: the item's indices need not live
    // through them (with them, 80 registers spilled 8 bytes). Unused with kClusterSums.
    [[maybe_unused]] float* const sums_at =
        partials + ((item.b * item.chunks + item.chunk) * p.channels + item.d) * (K + 1);
    float* const by_lag = taps_by_lag[warp];
    const MmaTapRow tap_row = mma_tap_row<K>(p, item.param_row, lane);
    if (lane < kLags) by_lag[lane] = tap_row.tap;
    __syncwarp();
    const MmaTaps taps = mma_taps(by_lag, tap_row.bias, lane);
    // The lane's words of the row: of block `base`, words base / 2 + 32 h from these.
    const uint32_t* x = static_cast<const uint32_t*>(p.x) + row_at;
    uint32_t* dx = static_cast<uint32_t*>(p.dx) + row_at;
    // Block m's words, once all lanes' copies of it have landed (its group is kMmaRing - 2 from
    // the newest); then the copy of block m + kMmaRing - 1 into the slot that every lane read
    // at block m - 1, before this wait's __syncwarp. checked (std::true_type): words at or past
    // loads_left (past loaded_end: the slot holds older words) read as 0, so that a block past
    // the row has zero deltas.
    const int loads_left = words_left(lane_loaded);
    const auto take = [&](int m, MmaWords& out, auto checked) {
      ring_wait<kMmaRing - 2>();
      __syncwarp();
      const uint32_t* const slot = slots[m & (kMmaRing - 1)];
      for (int h = 0; h < 2; ++h) {
        const int word = lane + 32 * h;
        const bool live = !decltype(checked)::value || m * kWords + 32 * h < loads_left;
        out.x[h] = live ? slot[word] : 0u;
        out.dy[h] = live ? slot[kWords + word] : 0u;
      }
      fetch(m + kMmaRing - 1);
    };
    // Lanes 0-3: x word l - 4 of the next block (0 before the row: no initial state here).
    uint32_t carry = item.c0 > 0 && lane < 4 ? __ldg(x + item.c0 / 2 - 4) : 0u;
    float dw[4] = {};  // entry (k, n): of lag n + 8 - k; k = 0, of db
    uint32_t a[4];     // the block's x fragment, for its dw
    const auto deltas = [&](const MmaWords& in, MmaDelta& out) {
      mma_deltas(in, taps, lane, silu, carry, a, out);
    };
    const auto accumulate = [&](const MmaDelta& d) { mma_accumulate(a, d, dw); };
    // dx of a block from its dpre and the next block's: the lane's words from `to`, those from
    // offset `row_left` on past the row.
    const auto input_grads = [&](uint32_t* to, int row_left, const MmaDelta& current,
                                 const MmaDelta& next) {
      float g[4];
      mma_input_grads(current, next, taps, lane, g);
      for (int h = 0; h < 2; ++h) {
        if (32 * h < row_left) __stcs(to + 32 * h, bf16_pair(g[2 * h], g[2 * h + 1]));
      }
    };
    const int blocks = static_cast<int>((item.c1 - item.c0 + kMmaBlock - 1) / kMmaBlock);
    MmaWords in;
    MmaDelta delta_a, delta_b;  // block n's dpre in delta_a
    take(0, in, std::true_type{});
    deltas(in, delta_a);
    accumulate(delta_a);
    int n = 0;
    // Pairs of blocks whose deltas up to n + 2 are the item's own and whose words up to block
    // n + 2 are all loaded: no checks, the deltas renamed instead of moved (a block a pass took
    // 202 SASS instructions at K = 8, of which about 90 the checks, 64-bit offsets and moves).
    uint32_t* dx_at = dx + item.c0 / 2;
    const int full_blocks = static_cast<int>((loaded_end - item.c0) / kMmaBlock);
    const int pairs_end = std::min(blocks, full_blocks) - 2;
    // The lane's words from dx_at on before the row's end, counted down through the pairs (kept
    // from the start, the 64-bit ends cost 24 bytes of spills at 80 registers).
    int stores_left = words_left(lane_words);
    for (; n < pairs_end; n += 2) {
      take(n + 1, in, std::false_type{});
      deltas(in, delta_b);
      accumulate(delta_b);
      input_grads(dx_at, kWords, delta_a, delta_b);
      take(n + 2, in, std::false_type{});
      deltas(in, delta_a);
      accumulate(delta_a);
      input_grads(dx_at + kWords, kWords, delta_b, delta_a);
      dx_at += 2 * kWords;
      stores_left -= 2 * kWords;
    }
    // The last blocks (at most 4): stores checked against the row's end, in ints from the lane
    // pointer (with 64-bit offsets a block took 184 SASS instructions at K = 8).
    for (; n < blocks; ++n) {
      take(n + 1, in, std::true_type{});
      deltas(in, delta_b);
      if (n + 1 < blocks) accumulate(delta_b);  // a block past c1 is the next item's
      input_grads(dx_at, stores_left, delta_a, delta_b);
      delta_a = delta_b;
      dx_at += kWords;
      stores_left -= kWords;
    }
    // The sums through slot 0 (no copies in flight: the blocks past the last taken are past
    // loaded_end).
    __syncwarp();  // every lane's reads of slot 0 precede these writes
    uint32_t* const entries = slots[0];
    mma_store_entries(dw, entries, lane);
    __syncwarp();
    if (lane <= K) {
      const float sum = mma_entry_sum<K>(entries, lane);
      if constexpr (kClusterSums) {
        item_sum = sum;
      } else {
        sums_at[lane] = sum;
      }
    }
  };
  with_bool_constant(p.silu, [&](auto silu) {
    for_each_channel_first_item<kPack<T>, P, false, ItemKept::kNothing, kLanes, kUniformChannels,
                                false, kClusterSums>(
        p, split, P, [&](const ChannelFirstItem& item, UniformSegments) { run(item, silu); });
  });
  if constexpr (kClusterSums) {
    store_cluster_sums<T, K, 1>(cluster_sums, p, split, lane, lane <= K, item_sum, dweight, dbias);
  }
}

// Batch rows whose packs (x and dy) a short-row backward lane has in flight, through cp.async
// rings: 4 x 32 bytes, 4 KB a warp, 64 KB per SM at 2 blocks. A register queue of 3 (before) was
// one row in flight: its rotating moves waited on each row's loads an item after their issue.
constexpr int kShortBackwardDepth = 4;

// (B, D, L), L a multiple of the pack V and at most 32 V: group lanes per row (short_row_group),
// a warp unit (ShortRowUnits) at a time, one batch row of its channel block per step, the next
// kShortBackwardDepth steps' packs in flight. Per row it writes dx (and dS); per unit, its
// dw/db sums over the run, over the group by a fixed shuffle tree, to its slice of partials, or
// where dweight is given (one run a weight group), to dweight and dbias in the params' dtype.
// With one channel block a warp item per batch row, each row loaded its K + 1 weights (dependent
// loads at each item's start) and reduced and stored its own sums (bf16 K = 4: about 110 of the
// item loop's 500 SASS instructions), and the reduction read a slice per batch row. H200 trace,
// B=64 L=128 D=4096 bf16 K = 4, bwd span with the reduction: 111.5 -> 64.2 us (the copy's 47.0;
// twenty-sixth session).
template <typename T, int K>
__device__ __forceinline__ void backward_short_rows(const ConvParams& p, float* partials,
                                                    void* dweight, void* dbias, int group,
                                                    const ShortRowUnits& units) {
  constexpr int V = kPack<T>;
  constexpr int P = K - 1;
  using Pack = RawFor<T, V>;
  constexpr int kRingSlots = kShortBackwardDepth * kThreads;
  __shared__ Pack slots[2 * kRingSlots];
  const RowRing<kShortBackwardDepth, Pack, kThreads> x_ring{slots}, dy_ring{slots + kRingSlots};
  const Conv<T, float, K> conv{p};
  const ShortRowLane<V> at(p, group);
  const int g = at.g;
  const int64_t t0 = at.t0;
  // + row * L: the lane's pack of a row; for a lane past the row's end, the row's last pack, so
  // that its fetches of zeros name an address inside x and dy.
  const int64_t fetch_t = std::max<int64_t>(0, std::min<int64_t>(t0, p.length - V));
  const T* x = static_cast<const T*>(p.x) + fetch_t;
  const T* dy = static_cast<const T*>(p.dy) + fetch_t;
  const int64_t row_step = p.channels * p.length;  // from a batch row's pack to the next's
  for (int64_t unit = at.first_item; unit < units.count; unit += at.items_step) {
    const ShortRowUnit where(p, units, at, unit);
    const int64_t b0 = where.b0, d = where.d;
    const int steps = where.steps;
    const bool row_live = where.row_live, live = at.in_row && row_live;
    // The offset of the lane's pack in the next fetch's batch row.
    int64_t next_row = (b0 * p.channels + d) * p.length;
    const auto fetch = [&](int step) {
      x_ring.fetch_or_zeros(step, x + next_row, step < steps, live);
      dy_ring.fetch_or_zeros(step, dy + next_row, step < steps, live);
      ring_commit();
      next_row += row_step;
    };
    for (int step = 0; step < kShortBackwardDepth; ++step) fetch(step);
    float w[K][1], bias[1];
    load_param_row<T>(p, where.weight_group * p.channels + d, w, bias);
    float dw[K + 1] = {};  // dw[K] is db
    for (int step = 0; step < steps; ++step) {
      // The rows' packs: a lane outside them (past the row's end or the channels) reads zeros.
      const int64_t b = b0 + step;
      float xs[P + V], dys[V];  // x_{t0-P} .. x_{t0+V-1}, dy_{t0} .. dy_{t0+V-1}
      ring_wait<kShortBackwardDepth - 1>();
      widen(x_ring.template read<T, V>(step), reinterpret_cast<float(&)[V]>(xs[P]));
      widen(dy_ring.template read<T, V>(step), dys);
      fetch(step + kShortBackwardDepth);  // into the slots just read
      short_row_halo<T, K>(p, at, b, d, x, xs);
      // With seq_idx, whether some row of the step has more than one id or padding: its deltas
      // and dx take seq_idx's masks, segments[j] the entry of time t0 - P + j (j < P + V + P).
      int32_t segments[P + V + P];
      const bool masked = p.seq_idx != nullptr &&
                          short_row_segments<V, P>(p.seq_idx + b * p.length, at, live, segments);
      if (masked) {
        for (int m = 0; m < P; ++m) {  // the times after the lane's: -1 past the row
          const int32_t later = __shfl_down_sync(kFullWarp, segments[P + m % V], 1 + m / V, group);
          segments[P + V + m] = t0 + V + m < p.length ? later : -1;
        }
      }
      // delta, and the row's dw/db terms (the lane's own times). A lane outside the rows takes
      // deltas of zero, so that its terms (products with its zeros and halo) add nothing: the
      // terms accumulated only where live cost a predicated move each, V (K + 1) a step (sm_90
      // SASS, bf16 K = 4 without features: 318 -> 287 a step). No dS or dx reads a time that does
      // not exist.
      float delta[V];
      if (masked) {
        channel_first_deltas<true>(w, bias[0], xs, dys, segments, live, true, p.silu, delta, dw);
      } else {
        channel_first_deltas<false>(w, bias[0], xs, dys, segments, live, true, p.silu, delta, dw);
      }
      if (p.dinitial_state != nullptr) {
        // dS = dx on [-P, 0): taps of outputs 0 .. P-1, the group's first lanes' (t < L).
        float first[P];
        for (int t = 0; t < P; ++t) first[t] = __shfl_sync(kFullWarp, delta[t % V], t / V, group);
        if (g == 0 && row_live) {
          // Output t's seq_idx entry where it matters (0 otherwise), -1 where it does not exist.
          int32_t first_segment[P];
          for (int t = 0; t < P; ++t) {
            first_segment[t] = t >= p.length ? -1 : masked ? conv.segment(b, t) : 0;
          }
          const int32_t segment_u = masked ? conv.segment(b, 0) : 0;
          for (int i = 0; i < P; ++i) {
            float acc = 0.0f;
            for (int k = 0; k <= i; ++k) {
              const int t = i - k;
              const bool used =
                  masked ? same_segment(first_segment[t], segment_u) : first_segment[t] >= 0;
              acc = used ? fmaf(w[k][0], first[t], acc) : acc;
            }
            acc += conv.final_state_grad(b, i - P, d);
            conv.store_state_like(p.dinitial_state, b, i, d, acc);
          }
        }
      }
      // dx_{t0+j}: tap k of output t0 + j + P - k, from this lane's deltas or the next lanes'.
      float after[P];
      for (int m = 0; m < P; ++m) {
        after[m] = __shfl_down_sync(kFullWarp, delta[m % V], 1 + m / V, group);
      }
      float gx[V];
      const auto input_grads = [&](auto select) {
        constexpr bool kSelect = decltype(select)::value;
        for (int j = 0; j < V; ++j) {
          float acc = 0.0f;
          for (int k = 0; k < K; ++k) {
            const int at = j + P - k;
            const float delta_at = at < V ? delta[at] : after[at - V];
            // Without seq_idx's masks, taps of outputs past the row are skipped.
            const bool used = kSelect ? same_segment(segments[P + at], segments[P + j])
                                      : at < V || t0 + at < p.length;
            acc = used ? fmaf(w[k][0], delta_at, acc) : acc;
          }
          gx[j] = acc;
        }
      };
      if (masked) {
        input_grads(std::true_type{});
      } else {
        input_grads(std::false_type{});
      }
      if (live) {
        if (p.dfinal_state != nullptr && t0 + V > p.length - P) {
          for (int j = 0; j < V; ++j) gx[j] += conv.final_state_grad(b, t0 + j, d);
        }
        const int64_t row = next_row - (kShortBackwardDepth + 1) * row_step;  // b's, as fetched
        store_vec(static_cast<T*>(p.dx) + t0 + row, narrow<T, V>(gx));
      }
    }
    // The same tree for every group: unrolled over the five levels a warp has, those below the
    // group's width taken (a loop over the width ran 9 instructions per level and sum).
#pragma unroll
    for (int lanes = kLanes / 2; lanes > 0; lanes /= 2) {
      if (lanes < group) {
        for (int k = 0; k <= K; ++k) dw[k] += __shfl_xor_sync(kFullWarp, dw[k], lanes, group);
      }
    }
    if (g == 0 && row_live) {
      if (dweight != nullptr) {  // one run a weight group: the sums are dw and db
        const int64_t row = where.weight_group * p.channels + d;
        for (int k = 0; k < K; ++k) {
          store_param<T, float>(dweight, row * K + k, dw[k], p.params_like_x);
        }
        store_param<T, float>(dbias, row, dw[K], p.params_like_x);
      } else {
        float* out = partials + (where.rest * p.channels + d) * (K + 1);  // (group, run, d)
        for (int k = 0; k <= K; ++k) out[k] = dw[k];
      }
    }
  }
}

template <typename T, int K, bool kFeatures>
__global__ void __launch_bounds__(kThreads, 2)
    backward_short_rows_kernel(ConvParams p, float* partials, void* dweight, void* dbias,
                               int group, ShortRowUnits units) {
  backward_short_rows<T, K>(with_features<kFeatures>(p), partials, dweight, dbias, group, units);
}

}  // namespace causal_conv
