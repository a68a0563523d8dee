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

// Blocks of kForwardThreads per SM the channel-last forward's registers must allow (0: no bound).
// With the activation chosen once (two copies of the step loop) ptxas took more registers than
// before at K = 4 (bf16 80 -> 96, float 80 -> 94, f16 80) and float K = 7 (80 -> 96), a block
// per SM fewer; capped at 6 blocks they took 70-72 and 61 registers (7 and 8 blocks, no spills).
// With the downward pieces (two more copies, see forward_channel_last_kernel) that cap left them
// 75 and 66 (6 and 7 blocks); capped at the 7 and 8 blocks they had, they take 72 and 64, no
// spills, their step loops as long as before (bf16 K = 4: 253 and 173 instructions for 16
// outputs with and without silu, 256 and 173 before). With its weights in runs (load_weight_runs)
// bf16 K = 7 left free took 96 registers and spilled 12 bytes (115 before, 4 blocks); capped at
// the 4 blocks it had, it takes 111, no spills, its step loop with silu 552 -> 523 instructions.
template <typename T, int K, bool kMasked>
constexpr int forward_channel_last_min_blocks() {
  if constexpr (kMasked) return 0;
  if constexpr (K == 7) return sizeof(T) == 4 ? 8 : (std::is_same_v<T, __nv_bfloat16> ? 4 : 0);
  return K == 4 ? 7 : 0;
}

// Widths from which the unmasked channel-last forward loads its weights in runs (load_weight_runs):
// one scalar load a weight cost a warp-piece 296, 400 and 520 L1 line lookups at bf16 K = 6, 7, 8
// (weights in bf16; 38, 100 and 66 in runs). H200 traces, BLD fwd bf16 B=8 L=2048 D=4096
// (twenty-third session): K = 8 88.85 / 88.30 -> 78.14 / 78.19 us, K = 7 75.46 / 75.58 -> 72.70 /
// 72.66, K = 6 73.42 -> 72.72; f16 K = 8 90.26 -> 77.68. Bounding the 16-bit K = 7-8 kernels at 5
// blocks per SM on top (95-96 registers instead of 111-120) lost at bf16 (K = 8 81.5, K = 7 73.9)
// and gained 1.2 at f16 K = 8: not taken. The narrower and the masked kernels keep the scalar
// loads, untimed with runs.
constexpr int kWeightRunsWidth = 6;

// Whether an upward channel-last forward piece issues the loads it makes before the ring's first
// wait all before it waits for any: the halo rows' words (load_halo_words) before the weights,
// widened after them, and the biases by predicated loads (kPredicatedBias). Else each 16-bit halo
// row waited for its load before the next was issued (see load_halo_words) and a bias for the
// weights. Memory latencies in a row before a piece's first step (sm_90 SASS, bf16 and f16 alike,
// params like x): unmasked K + 1 (K = 4: 5, K = 8: 9; downward pieces 2, unchanged) -> 1; with
// seq_idx K + 4 -> 4, 3 of them the first chunk's seq_idx loads (SegmentSteps::run), which come
// after the weights in both orders. H200 traces, bf16 B=8 L=2048 D=4096 fwd us (twenty-sixth
// session): K = 8 75.8 -> 73.7, packed K = 4 75.5 -> 73.7, K = 4 69.8 unchanged; at D = 256,
// where a piece is all a thread runs and the most was predicted (1-2 us), only 7.25 -> 6.94. The
// 16-bit K = 3 kernels but masked bf16 keep the order (with it 64 -> 66-70 registers, 8 -> 7
// blocks per SM), and the float ones too: their halo rows were in flight together already (1
// latency unmasked), and with seq_idx this took them 3 -> 4.
template <typename T, int K, bool kMasked>
constexpr bool forward_loads_at_once() {
  if constexpr (sizeof(T) != 2) return false;
  return K != 3 || (kMasked && std::is_same_v<T, __nv_bfloat16>);
}

// Whether the channel-last forward reads a step's row from its ring one step early, as the
// backward does (backward_reads_ahead): a step is one dependency chain (ring wait, shared load,
// widen, K multiply-adds, the activation's two MUFU ops, store), and where a launch leaves about
// two warps a scheduler (B=8 L=2048 D=256: 256 blocks) no other warp fills its latencies; the
// early read takes the shared load off it. The 16-bit kernels without seq_idx, where that keeps
// their blocks per SM (sm_90 ptxas: bf16 K = 4 72 registers at its cap, K = 5 86 -> 90, K = 8
// 120 -> 121) but float16 K = 3 (64 -> 68, 8 -> 7 blocks). The float kernels spilled 8 bytes at
// K = 4 or lost a block at K = 2; the masked ones took 4-13 registers more (16 bytes spilled at
// K = 6). H100 traces, BLD bf16 fwd kernel (forty-fifth session, us): B=8 L=2048 D=256 7.01 ->
// 6.59 (L2 flushed before each call 9.31-9.34 -> 9.25-9.30), main shape K = 8 95.9-96.2 ->
// 94.9-95.0, K = 4 93.7 -> 93.6.
template <typename T, int K, bool kMasked>
constexpr bool forward_reads_ahead() {
  return sizeof(T) == 2 && !kMasked && !(std::is_same_v<T, __half> && K == 3);
}

// (B, L, D), D a multiple of C: a thread owns C channels over time_chunk steps and slides a
// K-row register window down them; its next rows arrive through a RowRing. The step loop is
// unrolled K times, so that the window shifts are register renaming. With seq_idx, the steps whose
// windows SegmentSteps finds across a segment boundary or at padding run one by one, with tap
// tests.
//
// The K-1 halo rows before a piece are the last rows of the piece before it in time, which a
// thread started alongside streams about a piece's time later (some 18 us on the main workload,
// about 70 MB of DRAM traffic through a 50 MB L2): so each halo row is read from DRAM twice
// where the L2 has not kept it, 3 of every 39 rows a thread reads at 36-step pieces. With
// `alternate` (set by the launch where a warp's threads share one piece of time and x and y pass
// the L2, see launch_vector_forward) the odd pieces of time run down instead, from their last
// row to the first of their halo: an odd piece then reads its halo at the end of its stream, when
// the even piece below reads the same rows at the end of its own, and an even piece reads its
// halo at its start, when the odd piece below starts on those rows, so that the second read of
// each halo row finds it in the L2. A downward piece streams its halo through its ring and fills
// its first window from its own first rows; it takes the taps in the upward order, so that its
// outputs are bit for bit the upward ones. Odd pieces start at time_chunk >= K - 1, so their
// halos never reach before time 0 (the initial state).
template <typename T, int K, bool kMasked>
__global__ void __launch_bounds__(kForwardThreads, forward_channel_last_min_blocks<T, K, kMasked>())
    forward_channel_last_kernel(ConvParams p, int64_t time_chunk, bool alternate) {
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
    // down: std::true_type for a piece streamed from its last row down (see above).
    const auto piece = [&](auto down) {
      constexpr bool kDown = decltype(down)::value;
      // Rows streamed: up, the piece's; down, the piece's from the last and then its halo.
      const int rows = kDown ? steps + P : steps;
      const int64_t first = (b * p.length + (kDown ? t0 + steps - 1 : t0)) * p.channels + d0;
      const T* x_next = static_cast<const T*>(p.x) + first;  // the row of the next fetch
      T* y_row = static_cast<T*>(p.y) + first;
      const auto advance = [&](auto*& row) { row = kDown ? row - p.channels : row + p.channels; };
      const auto fetch = [&](int step) {
        x_ring.fetch(step, x_next, step < rows);
        ring_commit();
        advance(x_next);
      };
      if constexpr (kMasked) {
        // The piece that ends the row writes its final state (the launch then needs no
        // final-state kernel, whose launch and grid of 64-bit divisions the packed call paid).
        // Here, before the ring's first fetches, it costs no masked kernel a block per SM; after
        // them bf16 K = 7 took 96 -> 114 registers (5 -> 4 blocks), and after the step loops
        // (from the window, or loaded again) every masked kernel took 8 more (bf16 K = 4 72 -> 80).
        if (p.final_state != nullptr && t0 + steps == p.length) {
          for (int j = 0; j < P; ++j) {
            float row[C];  // x_{L-P+j}, as Conv::input
            load_row(conv, b, p.length - P + j, d0, row);
            const bool kept = conv.final_state_kept(b, j);
            for (int c = 0; c < C; ++c) {
              conv.store_state_like(p.final_state, b, j, d0 + c, kept ? row[c] : 0.0f);
            }
          }
        }
      }
      for (int step = 0; step < kForwardDepth; ++step) fetch(step);
      // Up, with kLoadsAtOnce, the halo rows' words before the weights, widened after them (see
      // forward_loads_at_once). Down, the biases stay in their branch: the piece then waits for
      // its weights and then its biases (params every piece reads, mostly in the L2) while its
      // first row comes from DRAM; with predicated biases there too, the bf16 K = 4 downward step
      // loop took 253 -> 259 instructions per K steps (sm_90 SASS).
      constexpr bool kLoadsAtOnce = !kDown && forward_loads_at_once<T, K, kMasked>();
      Row halo[P];
      if constexpr (kLoadsAtOnce) load_halo_words<T, K, C>(conv, b, t0, d0, halo);
      float w[K][C], bias[C];
      if constexpr (!kMasked && K >= kWeightRunsWidth) {
        load_weight_runs<T, kLoadsAtOnce>(conv, b, d0, w, bias);
      } else {
        load_weights<T, kLoadsAtOnce>(conv, b, d0, w, bias);
      }
      // Up, window[k] holds x_{t-P+k} at the output of time t; down, x_{t-k}: tap k reads
      // window[tap(k)] either way.
      float window[K][C];
      const auto tap = [](int k) { return kDown ? P - k : k; };
      // Step's row from the ring into `row`, its slot refilled. With kAhead, row_ahead holds it,
      // read by the step before (or by read_first, after the piece's other loads are issued), and
      // the step reads the next one (after the piece's last row, a slot not fetched: unused).
      constexpr bool kAhead = forward_reads_ahead<T, K, kMasked>();
      [[maybe_unused]] Row row_ahead;  // read only with kAhead
      const auto read_first = [&] {
        if constexpr (kAhead) {
          ring_wait<kForwardDepth - 1>();
          row_ahead = x_ring.read(0);
        }
      };
      const auto take = [&](int step, float(&row)[C]) {
        if constexpr (kAhead) {
          const Row x_row = row_ahead;
          ring_wait<kForwardDepth - 2>();
          row_ahead = x_ring.read(step + 1);
          fetch(step + kForwardDepth);  // into the slot read by the step before
          widen(from_raw<T, C>(x_row), row);
        } else {
          ring_wait<kForwardDepth - 1>();
          widen(x_ring.template read<T, C>(step), row);
          fetch(step + kForwardDepth);
        }
      };
      if constexpr (kDown) {
        read_first();
        for (int step = 0; step < P; ++step) take(step, window[step]);
      } else {
        if constexpr (kLoadsAtOnce) {
          widen_window<T, K, C>(halo, window);
        } else {
          load_window_before(conv, b, t0, d0, window);
        }
        read_first();
      }
      using Segments = SegmentSteps<K, C>;
      const Segments segments{p, b, t0, d0, steps};
      // One step, with the taps of SegmentSteps: the constant kAllTaps leaves no tap test. silu:
      // p.silu, or on the uniform steps std::true_type or std::false_type, chosen once around
      // them.
      const auto step_at = [&](int step, uint32_t taps, auto silu) {
        take(step, window[P]);
        float out[C];
        for (int c = 0; c < C; ++c) {
          float z = bias[c];
          for (int k = 0; k < K; ++k) {
            const float product = fmaf(w[k][c], window[tap(k)][c], z);
            z = Segments::has(taps, k) ? product : z;
          }
          out[c] = Segments::has(taps, P) ? activate(z, silu) : 0.0f;
        }
        store_vec(y_row, narrow<T, C>(out));
        advance(y_row);
        slide_windows<K, C>(window);
      };
      const auto uniform = [&](int begin, int end) {
        if constexpr (kMasked && sizeof(T) == 2 && K == 7) {
          // Chosen here, the activation took this kernel from 96 registers to 115-120 (a block
          // per SM fewer), and capped at 96 it spilled 40 bytes.
          run_steps<K>(begin, end, [&](int step) { step_at(step, Segments::kAllTaps, p.silu); });
        } else {
          with_bool_constant(p.silu, [&](auto silu) {
            run_steps<K>(begin, end, [&](int step) { step_at(step, Segments::kAllTaps, silu); });
          });
        }
      };
      if constexpr (kMasked) {
        // The forward has no edge steps: every other step is one that needs the tap tests. Its
        // pieces (56-63 steps on the main workload) take two checks, and its masked kernels have
        // no register bound: with spans, bf16 K = 5 / 7 and f16 K = 3 to 5 took 8-21 registers
        // more (bf16 K = 7 96 -> 117, a block per SM fewer).
        segments.template run<false>(
            0, steps, 0, steps, uniform,
            [&](int step, bool) { step_at(step, segments.taps(step), p.silu); });
      } else {
        uniform(kDown ? P : 0, rows);
      }
    };
    if constexpr (kMasked) {
      piece(std::false_type{});
    } else {
      with_bool_constant(alternate && chunk % 2 == 1, piece);
    }
  }
}

// y of a channel-first lane's pack from xs = x_{t0-P} .. x_{t0+V-1}. With kSelect, seq_idx's
// masks, segments[j] being the entry of xs[j]; without, every tap. kZeroPadding: the outputs at
// padding are zeroed here (else the caller zeroes them, see zero_padding).
// silu: a bool, or a std::bool_constant where the kernel chose the activation once.
template <bool kSelect, bool kZeroPadding = kSelect, int K, int V, typename Silu>
__device__ __forceinline__ void channel_first_outputs(const float (&w)[K][1], float bias,
                                                      const float (&xs)[K - 1 + V],
                                                      const int32_t* segments, Silu silu,
                                                      float (&out)[V]) {
  constexpr int P = K - 1;
  for (int v = 0; v < V; ++v) {
    const float y = activate(channel_first_pre_activation<kSelect, true>(w, bias, xs, segments, v),
                            silu);
    out[v] = kZeroPadding ? zero_at_padding(y, segments[P + v]) : y;
  }
}

// The final state of a channel-first row from the lane whose pack ends it (xs as in
// channel_first_outputs, xs[V + j] = x_{L-P+j}): with kSelect only the values in the segment of
// the row's last time (segments: the entries of xs), as Conv::final_state. state_row: the row's P.
template <bool kSelect, int K, int V, typename T>
__device__ __forceinline__ void store_final_state(T* state_row, const float (&xs)[K - 1 + V],
                                                  const int32_t* segments) {
  constexpr int P = K - 1;
  for (int j = 0; j < P; ++j) {
    const bool kept = !kSelect || same_segment(segments[P + V - 1], segments[V + j]);
    state_row[j] = from_acc<T>(kept ? xs[V + j] : 0.0f);
  }
}

// Segments whose packs a channel-first lane has in flight: with one, a warp waited for every load.
constexpr int kForwardAhead = 3;

// Slots of the channel-first forward's cp.async ring of x packs (a RowRing, whose depth is a power
// of two): the kForwardAhead packs in flight and the one the segment reads. Until the
// twenty-fourth session the packs in flight were registers: ptxas issued each segment's load
// ahead into registers other than its slot's and copied them into the slot under the load's
// predicate a few instructions later, waiting there for the load, and with every x load on one
// scoreboard a wait for one was a wait for all (sm_90 SASS, bf16 K = 4: the masked loop waited at
// each turn's end for the three loads of that turn, the plain loop for two of its three about 20
// instructions after issue; benchmarks/RESULTS.md, twenty-third session). A ring of four register
// slots with turns of four segments kept the copies in the plain loop, put the masked loop's wait
// for its four loads two instructions after the last, and spilled at the bounds below.
// cp.async.wait_group waits for the oldest groups only, and the copies hold no registers. On the
// H200 (bf16 B=8 L=2048 D=4096, benchmarks/RESULTS.md, twenty-fourth session) the plain forward
// went 68.7 -> 67.8 us at K = 4 and 79.1 -> 70.7 at K = 8, the packed one 83.6 -> 81.9 at K = 4,
// 89.9 -> 80.5 at K = 6 and 94.7 -> 89.8 at K = 8.
constexpr int kForwardRing = 4;

// Blocks of kChannelFirstThreads per SM the channel-first forward's registers must allow (0: no
// bound). The masked kernel computes its masked segments in its loop (the seq_idx window, its
// compares and selects held there). On the packed workload (bf16 K = 4, B=8 L=2048 D=4096, 4
// sequences a row, with states) it ran in 96.8 us at 6 blocks (80 registers, no spills) and 97.5
// at 8 (spilling 84 B), where the loop over the uniform segments with a second pass for the masked
// ones took 104.2 at 8 blocks; 9 blocks lost 6 us. Each masked kernel takes the most blocks at
// which its unrolled turn (channel_first_forward_turn, worth a block at bf16 K = 4) spills nothing
// (ptxas -v; the slots in registers, no local memory in the SASS): registers (blocks)
//   f32:  K = 2-3 64 (8), K = 4-5 72 (7), K = 6 80 (6), K = 7 94 and K = 8 96 (5, left free);
//   f16:  K = 2 72 (7), K = 3-5 79-80 (6), K = 6-7 96 (5, left free), K = 8 96 (5; left free it
//         spilled 4 bytes);
//   bf16: K = 2-3 72 (7), K = 4-5 80 (6), K = 6-7 96 (5, left free), K = 8 96 (5; left free, with
//         the outputs at padding zeroed on the narrowed words, it took 112-121 registers).
// One block fewer than with one segment a turn for f16 K = 3 (7 blocks spilled 16 bytes) and f32
// K = 7 (6 blocks spilled 16 bytes). Where 5 blocks is all that fits, ptxas left free took 96
// registers or fewer without spilling and a loop 1-6% shorter than at a bound of 5. With the ring
// (kForwardRing) the masked kernels left free take fewer: 16-bit K = 6 72-79 (7 and 6 blocks),
// K = 7 80 (6), K = 8 90 (5), f32 K = 7 83 (5); with an item's first packs fetched before its
// uniform_segments (channel_first_forward_primes) f32 K = 7 88 (5) and 16-bit K = 8 95-96 (5),
// which a bound of 6 blocks takes to 80 without spilling (H200 trace, packed BDL fwd bf16 K = 8,
// twenty-fifth session: 88.0 / 88.4 -> 87.9 / 87.7 us). Bounds of 7 at 16-bit K = 4 and f16 K = 6
// (72 registers, no spills without the priming) spilled 16-20 bytes with it.
//
// Unmasked 16-bit kernels up to K = 4 asked for 9 blocks (56 registers, no spills): on the main
// workload that took 81.5 us against 85.3 with 4 blocks of 256 (63 registers). With the loop's
// turns (channel_first_forward_turn) and the activation chosen once, the bounds keep the blocks
// the kernels had before (K = 2: 10, 16-bit K <= 6 and f32 K = 5: 9; left free, K = 5-6 took
// 63-64 registers, and K = 2 at 9 blocks 56), except bf16 K = 7 (56 registers before; now 64 left
// free, 8 blocks, as every form of the loop spilled 8-48 bytes at 9); the others take 48-64
// registers left free. Any bound changes the code ptxas picks, so none is set where it would not
// keep the occupancy.
template <typename T, int K, bool kMasked>
constexpr int channel_first_forward_min_blocks() {
  if constexpr (kMasked) {
    if constexpr (sizeof(T) == 4) return K <= 3 ? 8 : (K <= 5 ? 7 : (K == 6 ? 6 : 0));
    if constexpr (K == 8) return 6;
    if constexpr (std::is_same_v<T, __half>) return K == 2 ? 7 : (K <= 5 ? 6 : 0);
    return K <= 3 ? 7 : (K <= 5 ? 6 : 0);
  }
  if constexpr (sizeof(T) == 2) {
    return K == 2 ? 10 : (K <= 6 ? 9 : 0);
  }
  return K == 5 ? 9 : 0;
}

// Whether the masked channel-first forward's ring has 2 kForwardRing slots, kForwardRing segments
// ahead: it runs fewer warps an SM than the plain kernel (bf16 K = 4: 24, 6 blocks, against 36), so
// fewer loads are in flight. Its turns stay kForwardRing segments, the ring's steps then counted at
// run time. H200 traces, packed BDL fwd bf16 B=8 L=2048 D=4096 (thirty-fourth session, us): K = 4
// 77.1-77.5 -> 76.8-77.1 at four sequences a row, 76.8-77.3 -> 74.5-74.7 at one; K = 2 79.8-80.6 ->
// 78.0-78.2, K = 3 80.6 -> 79.6, K = 7 80.6 -> 79.6; f16 K = 3 82.7 -> 81.1, K = 4 77.8 -> 76.7,
// but K = 5 84.0 -> 84.4; f32 K = 4 141.0 -> 140.1, K = 8 145.4 -> 143.3. Not where ptxas then
// spills (sm_90: bf16 K = 5 and 8, f16 K = 2 and 7, f32 K = 2 and 6, 4-20 bytes) or takes a block
// fewer (bf16 K = 6, 72 -> 80 registers).
template <typename T, int K, bool kMasked>
constexpr bool channel_first_forward_deep_ring() {
  if constexpr (!kMasked) return false;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return K <= 4 || K == 7;
  if constexpr (sizeof(T) == 4) return K >= 3 && K != 6;
  return K >= 3 && K != 7;
}

// Segments a turn of the channel-first forward's loop takes: kForwardRing, so that the ring's slots
// are immediates (until the twenty-fourth session kForwardAhead, the packs in flight in registers
// kept in place: a queue shifted each segment cost a move per word, about 1.75 instructions per
// element at bf16 K = 4), where the unrolled turn fits the blocks of
// channel_first_forward_min_blocks without spilling; else 1: unrolled, the unmasked 16-bit K = 6
// and 8 and f32 K >= 5 spilled 12-32 bytes there or took a block fewer (with the packs in
// registers), and with the ring and a tail of a whole turn f16 K = 2, 16-bit K = 5 and bf16 K = 7
// spilled 8-24 bytes (at one segment a turn: 40-55 registers, no spills). With the tail below,
// turns of four fit them (sm_90, untimed): f16 K = 2 48, 16-bit and f32 K = 5 56 registers, their
// blocks the same; 16-bit K = 7 64 and f32 K = 7 59 (8 blocks, against 9-10). After the turns,
// the whole segments left go one at a time (ring steps computed at run time) and only the last
// takes the partial-segment path: with all of the last turn's segments on that path, the masked
// forward at bf16 K = 4 lost 1.6 us to the registers' 3-segment turns, and the masked 16-bit K = 7
// kept 91-93 registers (80 now). The counts and times below are of turns of kForwardAhead, before
// the ring.
//
// The masked kernels all unroll (with the masked segments' outputs free of branches, at the bounds
// above). Instructions a segment, uniform / masked, one segment a turn -> kForwardAhead:
//   f32:  K = 2 82 / 118 -> 60 / 95,   K = 3 89 / 131 -> 67 / 109,  K = 4 96 / 143 -> 74 / 121,
//         K = 5 103 / 154 -> 81 / 131, K = 6 116 / 183 -> 95 / 161, K = 7 125 / 197 -> 97 / 165,
//         K = 8 134 / 211 -> 107 / 182;
//   f16:  K = 2 122 / 176 -> 97 / 150,  K = 3 133 / 196 -> 105 / 167, K = 4 144 / 216 -> 118 / 188,
//         K = 5 155 / 235 -> 126 / 205, K = 6 166 / 266 -> 135 / 232, K = 7 180 / 283 -> 144 / 250,
//         K = 8 185 / 297 -> 158 / 275;
//   bf16: K = 2 122 / 176 -> 104 / 156, K = 3 133 / 196 -> 114 / 176, K = 4 144 / 216 -> 124 / 195,
//         K = 5 155 / 235 -> 134 / 213, K = 6 166 / 266 -> 141 / 238, K = 7 175 / 278 -> 151 / 257,
//         K = 8 185 / 297 -> 162 / 279
// (the loop scripts/sass_census.py finds, counted along its uniform and its masked branches;
// zero_padding then took 7-8 more off each masked 16-bit segment: bf16 K = 4 195 -> 187). On
// the H200 the packed BDL forward's kernel at bf16 K = 4 (bench.py's features case) went 93.2 ->
// 86.1 us at 6 blocks against 7 blocks of one segment a turn (eighteenth session).
template <typename T, int K, bool kMasked>
constexpr int channel_first_forward_turn() {
  if constexpr (kMasked) return kForwardRing;
  if constexpr (std::is_same_v<T, __half>) return K == 3 || K == 4 ? kForwardRing : 1;
  return K <= 4 ? kForwardRing : 1;
}

// Whether the channel-first forward writes the final state itself, from its last segment (the
// launch then needs no final-state kernel): with seq_idx, but for f16 and f32 K = 3 and 5, where
// that code cost a block per SM (with the range-tested seq_idx window of then: f16 72 -> 77 and
// 80 -> 92 registers, f32 64 -> 67 and 72 -> 74; the others took 0-4 registers more within their
// blocks). In the unmasked kernels (with their last turn's segments in the tail) it spilled
// 12-180 bytes at bf16 K = 2, 16-bit K = 5-6 and f32 K = 5, or took up to 16 registers more. On
// the H200 the packed channel-first forward (bf16 B=8 L=2048 D=4096 K=4) went 107.2 -> 101.5 us
// with this and load_segment_window_before (benchmarks/RESULTS.md, fourteenth session).
template <typename T, int K, bool kMasked>
constexpr bool channel_first_forward_final_state() {
  return kMasked && ((K != 3 && K != 5) || std::is_same_v<T, __nv_bfloat16>);
}

// What the masked channel-first forward keeps through an item's channels (ItemKept): the rows
// where that fits the registers of channel_first_forward_min_blocks without spilling, else the
// channel count. Keeping the rows, f32 K = 3-6 and bf16 K = 3 spilled 16-28 bytes; the others kept
// their registers (f16 K = 3 and f32 K = 7 one or two more, their blocks the same). At bf16 K = 4,
// before its halves, the item's channel loop outside its segment loop went from 1169 static
// instructions (the channel count computed again) to 1085, its division chains gone. The 16-bit
// kernels at K >= 4 take an item in one turn of their halves (channel_first_forward_halves), so
// they keep nothing through it.
template <typename T, int K>
constexpr ItemKept channel_first_forward_kept() {
  if constexpr (sizeof(T) == 4) return K == 2 || K >= 7 ? ItemKept::kRows : ItemKept::kChannels;
  if constexpr (std::is_same_v<T, __half>) return ItemKept::kRows;
  return K == 2 ? ItemKept::kRows : ItemKept::kChannels;
}

// Whether the channel-first forward's warps take two rows at once, one in each half of 16 lanes, in
// segments of 16 V times: with seq_idx, for 16-bit T. A sequence boundary then makes the segments
// of 16 V times around it masked instead of those of 32 V, at the same instructions a warp's
// segment (bf16 K = 4: 124 uniform, 187 masked): at four sequences a row of 2048 at three random
// cuts (bench.py's features case) 2.7 of a row's 8 segments of 256 times were masked, in halves 2.9
// of its 16 of 128, which the warp takes two rows at a time (1.45 a row's 8 warp segments).
// uniform_segments then checks twice the segments, two a ballot, once per item (see
// channel_first_forward_item_channels). On the H200 (twentieth session, packed BDL fwd, us) the
// halves took K = 6 100.7 -> 94.6 and K = 8 110.0 -> 100.8, but K = 2 83.8 -> 84.9 and K = 4 83.8
// -> 86.7 (f16 83.2 -> 86.3; 16-bit K = 4 also lost its kept rows, which spilled): where a uniform
// segment is cheap, a run's fixed cost and the masked share weigh less than the halves' extra
// shuffles and twice the uniform_segments checks. So K >= 6 only, until the thirty-eighth
// session: by then a warp segment of the halves cost what a full one does (sm_90 bf16 K = 4, a
// turn of 4: 479 uniform, 717 masked, against 478 and 716), so at K = 4-5 the halves only halve the
// masked share (no spill: bf16 K = 4 77 registers, f16 78, K = 5 79; primed, see below). H200
// traces, packed BDL fwd bf16 B=8 L=2048 D=4096 (thirty-eighth session, us): K = 4 77.1 -> 74.4,
// one sequence a row 75.0 -> 73.3, 16 sequences 87.3 -> 77.9, K = 5 79.8 -> 75.8, f16 K = 4 77.4
// -> 74.3, f16 K = 5 84.0 -> 79.5, B=1 L=65536 291.4 -> 278.8, D = 256 9.5 -> 7.7. The halves are
// for_each_channel_first_item's kWidth 16, as in the backward; until the twenty-second session the
// kernel paired an item's channels itself, at width 32 with uniform_segments on packs of V / 2
// entries (so not f32, whose fours load_segments cannot halve; f32 halves have not been tried
// since), which took about 120 instructions more an item of four rows of 16 segments at K = 6 and
// 8, 80 at K = 7 (SASS, bf16 and f16: a ballot a segment, and turns for the odd channels).
template <typename T, int K, bool kMasked>
constexpr bool channel_first_forward_halves() {
  return kMasked && sizeof(T) == 2 && K >= 4;
}

// Lanes a row's segment takes in the channel-first forward: 16 with the halves above and in the
// unmasked 16-bit kernels at K >= 7, whose items are two channels, one per half, of the same
// times (the last item's two the same channel where D is odd: both halves then store the same
// values), as in the unmasked 16-bit backward (channel_first_backward_width). A warp's segment of
// 16 packs costs what one of 32 did (SASS, bf16 K = 8: 178 instructions), while a run's start
// (weights, carry, first loads: about 300 at K = 8) is paid once per two rows where the launch
// keeps rows whole: at B=8 L=2048 D=4096 it does from K = 7 (8 blocks per SM, 3.9 waves of
// items; bf16 K = 8: about 1570 instructions a row instead of 1710). At K <= 6 (9-10 blocks) it
// would cut the rows in halves there (6.9 waves of half-row pairs against 3.45 of whole-row ones),
// as many runs as with one channel a warp, and the segment took up to 2% more instructions (bf16
// K = 4: 345 a turn of three against 338). H200, kernel us: bf16 K = 8 80.8 -> 78.9, K = 7 74.4 ->
// 72.3, f16 K = 8 81.9 -> 79.6; at every K with whole rows kept at K = 4 by the launch, bf16 K = 4
// lost (68.6 -> 71.4), and B=1 L=65536 too (269 -> 300).
template <typename T, int K, bool kMasked>
constexpr int channel_first_forward_width() {
  const bool plain_halves = !kMasked && sizeof(T) == 2 && K >= 7;
  return channel_first_forward_halves<T, K, kMasked>() || plain_halves ? kLanes / 2 : kLanes;
}

// Channels per masked channel-first forward item: kUniformChannels, whose rows share one
// uniform_segments check; with the halves, one per half (an item in one turn, as without seq_idx).
// Items of four channels in halves took two turns, and the launch's model then kept B=8 L=2048
// D=4096's rows whole in 3.1 waves; in pairs it keeps them whole in 6.2 waves. H200 trace, packed
// BDL fwd (twenty-third session, trial-cf-fwd-rows): bf16 K = 8 98.5 / 97.8 -> 94.4 / 95.0 us. One
// channel an item at full width there (the plain kernel's grid: 7 blocks per SM at bf16 K = 4
// instead of 6, 8.9 waves instead of 2.6) lost: bf16 K = 4 83.8 -> 92.1 us, B = 7 76.5 -> 81.2, B =
// 9 90.3 -> 102.9, f32 K = 7 unchanged: each row's own uniform_segments check cost more than the
// finer grid saved.
template <typename T, int K>
constexpr int channel_first_forward_item_channels() {
  constexpr int kWidth = channel_first_forward_width<T, K, true>();
  return channel_first_forward_halves<T, K, true>() ? kLanes / kWidth : kUniformChannels;
}

// Whether the masked channel-first forward fetches an item's first packs before its
// uniform_segments (whose seq_idx loads then wait behind them). H200, packed BDL bf16 B=8 L=2048
// D=4096, fwd kernel us, main -> primed (and chained where kChains): K = 2 82.9 -> 80.4, K = 3 82.5
// -> 80.6, K = 4 82.3 -> 79.5, K = 5 83.9 -> 81.4, K = 8 90.1 -> 88.0, f16 K = 4 82.5 -> 79.5; but
// the halves at K = 6 80.8 -> 82.7 and K = 7 82.6 -> 85.3, whose registers did not change. There
// the priming cost uniform_segments' loop over its ballots (4 ballots a turn, 2 seq_idx loads each)
// a round of loads in series: ptxas issued a turn's loads in 2 rounds (2, then 6) without it and
// in 3 with it (bf16 K = 6 2-4-2, K = 7 2-2-4), two more L2 latencies an item of 8 ballots. The
// loads wait behind registers: bounds tighter by a block took K = 6-7 to 4 rounds, spilling
// (sm_90 SASS, twenty-fifth session's trial-prime67). Where the priming gained the loop kept its
// 2 rounds: at width 32, and at K = 8 left free (96 registers, 5 blocks); at its bound of 6
// blocks (80 registers) the primed K = 8 takes 3 (2-2-4), and 2 without the priming: 87.1 ->
// 86.5-87.0 us in the twenty-sixth session's traces (87.7-88.2 primed the session before). The
// halves at K = 4-5 keep the loop's 2 rounds primed (sm_90 bf16 K = 4: 2, then 6; 79-80
// registers, no spill), and gained by it: packed BDL fwd bf16 K = 4 unprimed 75.9, primed 74.4
// us; K = 5 78.0 against 75.8; f16 K = 4 76.0 against 74.3 (H200, thirty-eighth session).
template <typename T, int K, bool kMasked>
constexpr bool channel_first_forward_primes() {
  return kMasked && (K <= 5 || !channel_first_forward_halves<T, K, kMasked>());
}

// Whether the channel-first forward fetches an item's first packs before loading its params, the
// bias by a predicated load beside the weights and the carry in one round, as the backward does
// (backward_channel_first_kernel), so that an item's start waits for one memory round, not three
// in series (ncu per SASS line, thirty-eighth session: the plain forward's two waits on its
// params held 15% of its stall samples). Not with seq_idx, where the same order spilled 4-28
// bytes in six kernels, nor at float32 K = 3 and 7 and bf16 K = 7, where it took 48 -> 54, 48 -> 50
// and 48 -> 53 registers, 10 blocks per SM to 9 (sm_90 ptxas).
template <typename T, int K, bool kMasked>
constexpr bool channel_first_forward_fetches_first() {
  if constexpr (kMasked) return false;
  if constexpr (sizeof(T) == 4) return K != 3 && K != 7;
  return !std::is_same_v<T, __nv_bfloat16> || K != 7;
}

// Whether the masked channel-first forward's blocks share the seq_idx check of whole rows
// (for_each_channel_first_item's kShareCheck). On the H200 (thirty-second session, packed BDL fwd
// bf16 B=8 L=2048 D=4096, trace us) it took K = 4 79.2-79.8 -> 77.2-77.4 at one and four
// sequences a row, K = 8 86.8 -> 83.7. Only where its second form of the check costs neither
// blocks nor spills (sm_90 ptxas): with it bf16 K = 6 took 72 -> 80 registers and f16 K = 6 79
// -> 91 (a block per SM fewer), and at their bounds bf16 K = 3, f16 K = 2, 7 and 8 and f32 K = 3-5
// and 7 spilled 4-24 bytes.
template <typename T, int K>
constexpr bool channel_first_forward_shares_check() {
  if constexpr (sizeof(T) == 4) return K == 2 || K == 6 || K == 8;
  if constexpr (std::is_same_v<T, __half>) return K >= 3 && K <= 5;
  return K != 3 && K != 6;
}

// (B, D, L), L a multiple of the pack V: a warp streams chunk_len times of one (b, d) row, lane l
// owning V consecutive times of each 32 V-time segment (with channel_first_forward_width 16, of two
// rows, each half of the warp one row's segments of 16 V times); the K-1 inputs before a lane's
// pack come from its lower neighbours by shuffle. The next kForwardAhead segments' packs are in
// flight, through a cp.async ring in shared memory (kForwardRing; with seq_idx, where
// channel_first_forward_deep_ring, kForwardRing segments in a ring of twice the slots).
//
// With seq_idx (items of at most kUniformSegments segments and of
// channel_first_forward_item_channels channels, whose uniform segments the warp finds once), the
// uniform segments run the unmasked arithmetic; the others load their lanes' seq_idx windows and
// apply the masks, on the inputs the carry gave them like any segment. A second pass over those
// segments after the loop, loading their packs and halos again, kept the masked arithmetic's
// registers out of the loop but cost more than it saved (see channel_first_forward_min_blocks):
// 104.2 us against 96.8 on the packed workload.
template <typename T, int K, bool kMasked>
__global__ void
__launch_bounds__(kChannelFirstThreads, channel_first_forward_min_blocks<T, K, kMasked>())
    forward_channel_first_kernel(ConvParams p, ChannelFirstSplit split) {
  constexpr int V = kPack<T>;
  constexpr int P = K - 1;
  constexpr int kWidth = channel_first_forward_width<T, K, kMasked>();
  constexpr int64_t kSegment = kWidth * V;
  constexpr int kTurn = channel_first_forward_turn<T, K, kMasked>();
  using Word = RawFor<T, V>;
  constexpr bool kFinalState = channel_first_forward_final_state<T, K, kMasked>();
  constexpr bool kDeepRing = channel_first_forward_deep_ring<T, K, kMasked>();
  constexpr int kRing = kDeepRing ? 2 * kForwardRing : kForwardRing;
  constexpr int kAhead = kDeepRing ? kForwardRing : kForwardAhead;
  // Whether turn_step counts the item's segments through its turns (else the turns fill the ring
  // and take its slots as immediates, turn_step 0).
  constexpr bool kCountedSteps = kTurn < kRing;
  const int lane = threadIdx.x % kWidth;
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  __shared__ Word x_slots[kRing * kChannelFirstThreads];
  const RowRing<kRing, Word, kChannelFirstThreads> x_ring{x_slots};
  // The lane's pack at time 0 of the item's row as one element offset for x and y (their base
  // pointers stay in the constant bank), and the end of the times whose packs are the lane's: its
  // pack of segment s is the item's while s < lane_end.
  const auto lane_at_of = [&](const ChannelFirstItem& item) {
    return item.row * p.length + lane * V;
  };
  const auto lane_end_of = [&](const ChannelFirstItem& item) { return item.c1 - lane * V; };
  // The lane's packs of the first kAhead segments from c0, in ring steps 0 .. kAhead - 1, each in
  // a commit group of its own (a pack past lane_end is not fetched).
  const auto fetch_first = [&](int64_t lane_at, int64_t lane_end, int64_t c0) {
    for (int a = 0; a < kAhead; ++a) {
      const int64_t s = c0 + a * kSegment;
      x_ring.fetch(a, x + lane_at + s, s < lane_end);
      ring_commit();
    }
  };
  // Whether the ring holds the lane's packs of the next run's first kAhead segments (in ring steps
  // 0 .. kAhead - 1), each in its own commit group. Each warp of the launch runs
  // one item (grid_for_warps): without seq_idx a single channel, whose first packs it can only
  // fetch at its start. With seq_idx the item's first packs are fetched before its uniform_segments
  // (for_each_channel_first_item's start, where channel_first_forward_primes), so that the check's
  // seq_idx loads wait behind them; and where an item's channels run one after another in the warp
  // (kChains) the last segments of each fetch the next channel's first packs instead of nothing,
  // so that no channel but the first starts on an empty ring.
  constexpr bool kChains =
      kMasked && channel_first_forward_item_channels<T, K>() > kLanes / kWidth;
  static_assert(!kChains || kAhead <= kTurn,
                "a chained item's turns fetch none of the next channel's packs");
  bool primed = false;
  // The item's channel `item` (times [c0, c1)), at width 16 the half's own (see
  // for_each_channel_first_item: past the item's channels the upper half repeats the lower half's
  // row, storing the same values at the same addresses; a test of each store instead spilled 8
  // bytes at bf16 K = 4, when that had halves). Bit j of masks.before (then of uniform): whether
  // the item's segment j of kWidth packs is uniform (none past the first kUniformSegments).
  // silu: p.silu, or without seq_idx std::true_type or std::false_type. next: whether the warp's
  // next run is the item's next channel (row + 1, the same times).
  const auto run = [&](const ChannelFirstItem& item, UniformSegments masks, auto silu, bool next) {
    const int64_t lane_at = lane_at_of(item), lane_end = lane_end_of(item);
    const int32_t* segment_row = kMasked ? p.seq_idx + item.b * p.length : nullptr;
    // See channel_first_forward_fetches_first.
    constexpr bool kFirst = channel_first_forward_fetches_first<T, K, kMasked>();
    if (kFirst) fetch_first(lane_at, lane_end, item.c0);
    float w[K][1], bias[1];
    load_param_row<T, kFirst>(p, item.param_row, w, bias);
    ChannelFirstCarry<K> carry;
    carry.template load<kFirst>(x + item.row * p.length,
                                p.initial_state == nullptr
                                    ? nullptr
                                    : static_cast<const T*>(p.initial_state) + item.row * P,
                                item.c0);
    // The lane's packs of the next kAhead segments, in the ring's slots. turn_step is the ring step
    // of the next turn's first segment: with turns of kTurn = kRing it stays 0 through them (the
    // item's segment j in slot j), so that their slots are immediates, and the single segments
    // after the turns advance it one at a time; in the deep ring it counts the item's segments. A
    // pack past lane_end is not fetched: its slot holds an older pack, which only lanes whose
    // outputs are not stored read. So an item ends with no copy in flight, and the next item's
    // fetches may take any slot (the backward's fetches past its items are live, hence its
    // ring_wait<0> between items).
    int turn_step = 0;
    const auto fetch = [&](int64_t s, int step) {
      x_ring.fetch(step, x + lane_at + s, s < lane_end);
      ring_commit();
    };
    if (!kFirst && !primed) fetch_first(lane_at, lane_end, item.c0);
    // With chain, the item's last kAhead segments fetch the next channel's first ones (all whole:
    // the item has kRing segments or more) into the ring steps from end_step on, after this
    // channel's last, which are the slots of the next channel's first segments where the item's
    // segments fill whole turns of the ring (else the next channel fetches its own). The turns then
    // end before the item's last kTurn segments (steady_end), the single segments after them, which
    // fetch across.
    const int64_t segments = (item.c1 - item.c0 + kSegment - 1) / kSegment;
    const bool chain = kChains && next && segments % kRing == 0;
    const int end_step = kCountedSteps ? static_cast<int>(segments) : kRing;
    primed = chain;
    const auto fetch_across = [&](int64_t s, int step) {
      const int next_segment = step - end_step;  // the next channel's, at s past the item's
      const bool next_row = chain && next_segment >= 0;
      const int64_t at = next_row ? lane_at + p.length + item.c0 + next_segment * kSegment
                                  : lane_at + s;
      x_ring.fetch(step, x + at, next_row || s < lane_end);
      ring_commit();
    };
    uint32_t uniform = masks.before;  // bit 0: the next segment's
    // Segment s from its ring step's slot, then the fetch of segment s + kAhead kSegment
    // into the slot the segment before it read. whole (std::true_type): every lane's pack of s is
    // the item's. With kFinalState the others (then the item's last segment) also write the final
    // state, in the lane whose pack ends the row. across (std::true_type): after the turns, where
    // the fetch may be the next channel's.
    const auto segment = [&](int64_t s, int step, auto whole, auto across) {
      constexpr bool kWhole = decltype(whole)::value;
      const bool ends_row =
          kFinalState && !kWhole && p.final_state != nullptr && s + (lane + 1) * V == p.length;
      const bool masked = kMasked && !(uniform & 1u);
      uniform >>= 1;
      float own[V];
      ring_wait<kAhead - 1>();
      widen(x_ring.template read<T, V>(step), own);
      if constexpr (kChains && decltype(across)::value) {
        fetch_across(s + kAhead * kSegment, step + kAhead);
      } else {
        fetch(s + kAhead * kSegment, step + kAhead);
      }
      float xs[P + V];  // x_{t0-P} .. x_{t0+V-1}, t0 = s + lane V
      carry.template advance<V, kWidth>(own, lane, xs);
      float out[V];
      // With seq_idx, out narrowed, its padding zeroed: a raw word (a Vec of 16-bit values took
      // PRMTs to cross the branches).
      RawFor<T, V> ys;
      // The final state before the outputs, whose registers are not live yet.
      T* const state_row = static_cast<T*>(p.final_state) + item.row * P;
      if (!masked) {
        if (ends_row) store_final_state<false, K, V>(state_row, xs, nullptr);
        channel_first_outputs<false>(w, bias[0], xs, nullptr, silu, out);
        if constexpr (kMasked) ys = to_raw(narrow<T, V>(out));
      } else {
        int32_t segments[P + V];
        load_segment_window_before<V, P, kWhole>(segment_row, s + lane * V, p.length, segments);
        if (ends_row) store_final_state<true, K, V>(state_row, xs, segments);
        channel_first_outputs<true, false>(w, bias[0], xs, segments, silu, out);
        ys = zero_padding<T, V>(to_raw(narrow<T, V>(out)), segments + P);
      }
      if (kWhole || s < lane_end) {
        store_vec(y + lane_at + s, kMasked ? from_raw<T, V>(ys) : narrow<T, V>(out));
      }
    };
    int64_t s = item.c0;
    // The last segment is the tail's where it may end the row (kFinalState) and where the
    // segments before it must leave their turns to the single segments (kChains, see chain).
    const int64_t steady_end = kFinalState || kChains ? item.c1 - 1 : item.c1;
    for (; s + kTurn * kSegment <= steady_end; s += kTurn * kSegment) {
#pragma unroll
      for (int a = 0; a < kTurn; ++a) {
        segment(s + a * kSegment, turn_step + a, std::true_type{}, std::false_type{});
      }
      if constexpr (kCountedSteps) turn_step += kTurn;
    }
    // The whole segments left one at a time, the item's last segment (partial, or with kFinalState
    // the one that may end the row) after them.
    if constexpr (kTurn > 1) {
#pragma unroll 1
      for (; s + kSegment <= steady_end; s += kSegment) {
        segment(s, turn_step++, std::true_type{}, std::true_type{});
      }
    }
    if (s < item.c1) segment(s, turn_step, std::false_type{}, std::true_type{});
  };
  constexpr ItemKept kKept = kMasked ? channel_first_forward_kept<T, K>() : ItemKept::kNothing;
  const auto run_items = [&](auto silu) {
    for_each_channel_first_item<V, P, kMasked, kKept, kWidth,
                                channel_first_forward_item_channels<T, K>(),
                                channel_first_forward_shares_check<T, K>()>(
        p, split, 0,
        [&](const ChannelFirstItem& item) {
          if constexpr (channel_first_forward_primes<T, K, kMasked>()) {
            // Opaque, so that NVVM does not keep the item's lane_end through uniform_segments for
            // the run: without it bf16 K = 6, primed then, took 72 -> 80 registers (a block per SM
            // fewer).
            const int64_t lane_at = lane_at_of(item);
            int64_t lane_end = lane_end_of(item);
            asm("" : "+l"(lane_end));
            fetch_first(lane_at, lane_end, item.c0);
            primed = true;
          }
        },
        [&](const ChannelFirstItem& item, UniformSegments masks, bool next) {
          run(item, masks, silu, next);
        });
  };
  if constexpr (kMasked) {
    // Chosen once, the activation saved one instruction of a uniform segment's 146 at bf16 K = 4
    // and took f16 and f32 K = 4 a block per SM fewer.
    run_items(p.silu);
  } else {
    with_bool_constant(p.silu, run_items);
  }
}

// Batch rows whose x packs a short-row forward lane has in flight, through a cp.async ring: 4 x 16
// bytes, 2 KB a warp, 16 KB of shared memory a block. A register queue of 4 warp items (before)
// was one item in flight: its rotating moves waited on each item's loads an item after their issue
// (sm_90 SASS, bf16 K = 4), so that 24 warps per SM had about 12 KB in flight.
constexpr int kShortForwardDepth = 4;

// (B, D, L), L a multiple of the pack V and at most 32 V: group lanes per row (short_row_group),
// a warp unit (ShortRowUnits) at a time, one batch row of its channel block per step, the next
// kShortForwardDepth steps' packs in flight; weights and bias loaded once a unit. With seq_idx, a
// step whose rows each have one id >= 0 throughout (the P times before a row have its first id)
// runs the unmasked arithmetic, the others seq_idx's masks. With one channel block a warp item
// per batch row, each item loaded its K + 1 weights (dependent loads at its start that its first
// outputs waited on), rotated its queue and stepped a (b, d) cursor in 64-bit arithmetic: sm_90
// SASS, bf16 K = 4 with silu and neither seq_idx nor states, 232 instructions an item, 167 a step
// then (127 since compiled without features, with_features). H200 traces, B=64 L=128 D=4096 fwd:
// bf16 K = 4 49.7 -> 37.2 us (the copy's 32.1), K = 8 66.8 -> 42.8, float32 78.7 -> 75.1
// (twenty-seventh session).
template <typename T, int K>
__device__ __forceinline__ void forward_short_rows(const ConvParams& p, int group,
                                                   const ShortRowUnits& units) {
  constexpr int V = kPack<T>;
  constexpr int P = K - 1;
  using Pack = RawFor<T, V>;
  __shared__ Pack slots[kShortForwardDepth * kThreads];
  const RowRing<kShortForwardDepth, Pack, kThreads> x_ring{slots};
  const ShortRowLane<V> at(p, group);
  const T* x = static_cast<const T*>(p.x) + at.t0;  // + row * L: the lane's pack of a row
  T* y = static_cast<T*>(p.y) + at.t0;
  const int64_t row_step = p.channels * p.length;  // from a batch row's pack to the next's
  for (int64_t unit = at.first_item; unit < units.count; unit += at.items_step) {
    const ShortRowUnit where(p, units, at, unit);
    const int64_t d = where.d;
    const int steps = where.steps;
    const bool live = at.in_row && where.row_live;
    // The offset of the lane's pack in the next fetch's batch row.
    int64_t next_row = (where.b0 * p.channels + d) * p.length;
    const auto fetch = [&](int step) {
      x_ring.fetch(step, x + next_row, live && step < steps);
      ring_commit();
      next_row += row_step;
    };
    for (int step = 0; step < kShortForwardDepth; ++step) fetch(step);
    float w[K][1], bias[1];
    load_param_row<T>(p, where.weight_group * p.channels + d, w, bias);
    for (int step = 0; step < steps; ++step) {
      // The row's pack: a lane outside the rows (past the row's end or the channels) reads a slot
      // it did not fill, whose outputs are not stored and whose halo reaches only such lanes.
      const int64_t b = where.b0 + step;
      float xs[P + V];  // x_{t0-P} .. x_{t0+V-1}
      ring_wait<kShortForwardDepth - 1>();
      widen(x_ring.template read<T, V>(step), reinterpret_cast<float(&)[V]>(xs[P]));
      fetch(step + kShortForwardDepth);  // into the slot just read
      short_row_halo<T, K>(p, at, b, d, x, xs);
      float out[V];
      int32_t segments[P + V];  // with seq_idx: the entry of xs[j]
      const bool masked = p.seq_idx != nullptr &&
                          short_row_segments<V, P>(p.seq_idx + b * p.length, at, live, segments);
      if (masked) {
        channel_first_outputs<true>(w, bias[0], xs, segments, p.silu, out);
      } else {
        channel_first_outputs<false>(w, bias[0], xs, nullptr, p.silu, out);
      }
      if (live) {
        const int64_t row = next_row - (kShortForwardDepth + 1) * row_step;  // b's, as fetched
        store_vec(y + row, narrow<T, V>(out));
      }
    }
  }
}

template <typename T, int K, bool kFeatures>
__global__ void __launch_bounds__(kThreads)
    forward_short_rows_kernel(ConvParams p, int group, ShortRowUnits units) {
  forward_short_rows<T, K>(with_features<kFeatures>(p), group, units);
}

}  // namespace causal_conv
