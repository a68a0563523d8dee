// The per-token math of causal_conv1d_update (DESIGN.md section 3), written once for the CPU and
// the CUDA kernels. One call of run() owns one (batch row, channel): it computes every output
// from the old state first and only then rewrites that row's state, so the state may be updated
// in place (the FFI call aliases the input state to the output state).
#pragma once

#include <cstdint>

#include "conv_math.h"

namespace causal_conv {

// Filled by the FFI handler. x and y are (batch, tokens, channels) and the state
// (pool, state_len, channels), both in x's layout; weight (groups, channels, width) and bias
// (groups, channels) in the accumulation type, or in x's type when params_like_x (as in
// ConvParams). Optional tensors are null when absent.
struct UpdateParams {
  int64_t batch = 0, tokens = 0, channels = 0, width = 0, groups = 1;
  int64_t pool = 0, state_len = 0;
  bool silu = false;
  bool channel_last = true;
  bool params_like_x = false;
  Strides x_strides{}, state_strides{};
  const void* x = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;
  const int32_t* cache_seqlens = nullptr;  // (batch,): ring-buffer mode when present
  const int32_t* state_indices = nullptr;  // (batch,): pool row of each batch row
  void* y = nullptr;
  void* state = nullptr;  // read, then updated in place
};

// T: storage type of x and the state; A: accumulation type; kWidth: compile-time width or 0.
template <typename T, typename A, int kWidth = 0>
struct Update {
  UpdateParams p;

  CAUSAL_CONV_HD int64_t width() const { return kWidth > 0 ? kWidth : p.width; }
  CAUSAL_CONV_HD int64_t history() const { return width() - 1; }

  CAUSAL_CONV_HD A weight(int64_t b, int64_t d, int64_t k) const {
    return weight_of<T, A>(p, b, d, width(), k);
  }
  CAUSAL_CONV_HD A bias(int64_t b, int64_t d) const { return bias_of<T, A>(p, b, d); }

  // The pool row that batch row b reads and writes, or -1 when b is padding.
  CAUSAL_CONV_HD int64_t pool_row(int64_t b) const {
    const int64_t row = p.state_indices ? p.state_indices[b] : b;
    return row >= 0 && row < p.pool ? row : -1;
  }

  // Ring slot of an absolute position (floor modulo, so it matches the reference for any sign).
  CAUSAL_CONV_HD int64_t ring_slot(int64_t position) const {
    const int64_t r = position % p.state_len;
    return r < 0 ? r + p.state_len : r;
  }

  CAUSAL_CONV_HD const T& x_at(int64_t b, int64_t t, int64_t d) const {
    return static_cast<const T*>(p.x)[offset(p.x_strides, b, t, d)];
  }
  CAUSAL_CONV_HD T& state_at(int64_t row, int64_t j, int64_t d) const {
    return static_cast<T*>(p.state)[offset(p.state_strides, row, j, d)];
  }

  // Where x_u of batch row b, channel d lives (u counted from the first new token: u >= 0 is new
  // input, u in [-P, 0) history), or null where it reads as zero (a ring position before 0). The
  // CPU kernel takes it at a run's first channel and steps by the layout's channel stride.
  CAUSAL_CONV_HD const T* input_at(int64_t b, int64_t row, int64_t u, int64_t d) const {
    if (u >= 0) return &x_at(b, u, d);
    if (p.cache_seqlens == nullptr) return &state_at(row, p.state_len + u, d);
    const int64_t position = int64_t{p.cache_seqlens[b]} + u;
    return position < 0 ? nullptr : &state_at(row, ring_slot(position), d);
  }

  CAUSAL_CONV_HD A input(int64_t b, int64_t row, int64_t u, int64_t d) const {
    const T* from = input_at(b, row, u, d);
    return from == nullptr ? A(0) : to_acc<A>(*from);
  }

  CAUSAL_CONV_HD A output(int64_t b, int64_t row, int64_t t, int64_t d) const {
    const int64_t P = history();
    A z = bias(b, d);
    for (int64_t k = 0; k < width(); ++k) z += weight(b, d, k) * input(b, row, t - P + k, d);
    return activate(z, p.silu);
  }

  // The state's rewrite once the outputs are computed: move(to, from, from_x) for each slot that
  // changes, to and from at channel d, from_x telling whether from is a token of x or a slot of
  // the same state row. Shift mode keeps the last state_len inputs: slot j takes slot j + tokens
  // or a new token, always from a higher index, so an ascending in-place pass never reads a new
  // value. Ring mode: token t goes to position cache_seqlens[b] + t; only the last state_len
  // survive.
  template <typename Move>
  CAUSAL_CONV_HD void rewrite_state(int64_t b, int64_t row, int64_t d, const Move& move) const {
    if (p.cache_seqlens == nullptr) {
      for (int64_t j = 0; j < p.state_len; ++j) {
        const int64_t source = j + p.tokens;
        if (source < p.state_len) {
          move(&state_at(row, j, d), &state_at(row, source, d), false);
        } else {
          move(&state_at(row, j, d), &x_at(b, source - p.state_len, d), true);
        }
      }
      return;
    }
    if (p.state_len == 0) return;
    const int64_t start = int64_t{p.cache_seqlens[b]};
    const int64_t first = p.tokens > p.state_len ? p.tokens - p.state_len : 0;
    for (int64_t t = first; t < p.tokens; ++t) {
      move(&state_at(row, ring_slot(start + t), d), &x_at(b, t, d), true);
    }
  }

  CAUSAL_CONV_HD void run(int64_t b, int64_t d) const {
    const int64_t row = pool_row(b);
    T* y = static_cast<T*>(p.y);
    for (int64_t t = 0; t < p.tokens; ++t) {
      y[offset(p.x_strides, b, t, d)] = from_acc<T>(row < 0 ? A(0) : output(b, row, t, d));
    }
    if (row < 0) return;
    rewrite_state(b, row, d, [](T* to, const T* from, bool) { *to = *from; });
  }
};

}  // namespace causal_conv
