// The causal depthwise conv math of DESIGN.md sections 1 and 2, written once for the CPU and the
// CUDA kernels. Every function works on one (batch row, time, channel) point with 64-bit indices,
// so kernels differ only in how they walk the points and where they keep delta.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define CAUSAL_CONV_HD __host__ __device__ __forceinline__
// Before a __host__ __device__ helper that calls a functor: the launch code passes it host lambdas,
// the kernels device lambdas, and without this nvcc warns at each host instantiation.
#define CAUSAL_CONV_EXEC_CHECK_DISABLE _Pragma("nv_exec_check_disable")
#elif defined(__GNUC__)
// Forced on the host as on the device: the CPU kernels are compiled once per instruction set
// (cpu_kernels.cc), and a call the compiler leaves out of line there runs scalar baseline code.
#define CAUSAL_CONV_HD inline __attribute__((always_inline))
#else
#define CAUSAL_CONV_HD inline
#endif
#ifndef CAUSAL_CONV_EXEC_CHECK_DISABLE
#define CAUSAL_CONV_EXEC_CHECK_DISABLE
#endif

namespace causal_conv {

// Element strides of a (batch, time, channel) tensor; the two layouts are two choices of strides.
struct Strides {
  int64_t batch, time, channel;
};

CAUSAL_CONV_HD Strides make_strides(int64_t length, int64_t channels, bool channel_last) {
  return channel_last ? Strides{length * channels, channels, 1}
                      : Strides{channels * length, 1, length};
}

CAUSAL_CONV_HD int64_t offset(const Strides& s, int64_t b, int64_t t, int64_t d) {
  return b * s.batch + t * s.time + d * s.channel;
}

// Everything a kernel needs, filled by the FFI handler. Optional tensors are null when absent.
// weight is (groups, channels, width) and bias (groups, channels), both in the accumulation type,
// or both in x's storage type when params_like_x (read through load_param); dweight and dbias are
// written in the same type. Batch row b uses group b / (batch / groups), which is how vmapped
// weights reach one launch.
struct ConvParams {
  int64_t batch = 0, length = 0, channels = 0, width = 0, groups = 1;
  bool silu = false;
  bool channel_last = true;
  bool params_like_x = false;
  Strides x_strides{}, state_strides{};  // x, y, dy, dx / initial, final, their gradients
  const void* x = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;
  const void* initial_state = nullptr;
  const int32_t* seq_idx = nullptr;  // (batch, length)
  void* y = nullptr;
  void* final_state = nullptr;
  const void* dy = nullptr;
  const void* dfinal_state = nullptr;
  void* dx = nullptr;
  void* dinitial_state = nullptr;
};

// The (b, t, d) of the i-th element, in memory order, of an x-like (length = L) or state-like
// (length = P) tensor, so that neighbouring threads touch neighbouring addresses in both layouts.
struct Point {
  int64_t b, t, d;
};
CAUSAL_CONV_HD Point point_at(int64_t i, int64_t length, int64_t channels, bool channel_last) {
  const int64_t row = length * channels;
  const int64_t b = i / row, r = i - b * row;
  return channel_last ? Point{b, r / channels, r % channels} : Point{b, r % length, r / length};
}

#if defined(__CUDACC__)
CAUSAL_CONV_HD float exp_acc(float v) { return expf(v); }
#else
// On the host, libm's expf is an opaque call that keeps every CPU loop around the activation
// scalar; this version inlines and vectorizes (without AVX-512, GCC needs -fno-trapping-math
// for that, which CMakeLists.txt gives the CPU module: the clamp becomes branches).
// exp(x) = 2^n e^r with n = round(x/ln 2) and |r| <= ln(2)/2, e^r by its Taylor series to r^7
// (truncation below 2e-9 relative, under a float ulp), ln 2 split in two so that r is exact. The
// input is clamped to where 2^n stays a normal float (sigmoid is then within 1e-38 of 0 or 1
// anyway); NaN passes through the clamp.
CAUSAL_CONV_HD float exp_acc(float v) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2High = 0.693359375f;               // 355/512, exact in a float
  constexpr float kLn2Low = -2.12194440054690583e-4f;    // ln 2 - 355/512
  constexpr float kRoundShift = 12582912.0f;             // 1.5 * 2^23: adding it rounds to int
  const float x = v < -87.0f ? -87.0f : (v > 88.0f ? 88.0f : v);
  const float shifted = x * kLog2e + kRoundShift;
  const float n = shifted - kRoundShift;
  const float r = (x - n * kLn2High) - n * kLn2Low;
  float e_r = 1.0f / 5040.0f;
  e_r = e_r * r + 1.0f / 720.0f;
  e_r = e_r * r + 1.0f / 120.0f;
  e_r = e_r * r + 1.0f / 24.0f;
  e_r = e_r * r + 1.0f / 6.0f;
  e_r = e_r * r + 0.5f;
  e_r = e_r * r + 1.0f;
  e_r = e_r * r + 1.0f;
  uint32_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  const uint32_t pow2_bits = (bits - 0x4B400000u + 127u) << 23;  // 2^n from the low bits of n
  float pow2;
  std::memcpy(&pow2, &pow2_bits, sizeof pow2);
  return e_r * pow2;
}
#endif
CAUSAL_CONV_HD double exp_acc(double v) { return exp(v); }
CAUSAL_CONV_HD double sigmoid(double z) { return 1.0 / (1.0 + exp_acc(-z)); }

// On the GPU the float sigmoid is two special-function instructions (ex2 and rcp, about 2 ulp),
// flushing subnormals: the IEEE expf and division, or even __expf's subnormal fix-ups, cost more
// issue slots than the memory traffic of the whole conv leaves. Large |z| saturates to 0 or 1.
CAUSAL_CONV_HD float sigmoid(float z) {
#if defined(__CUDA_ARCH__)
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r;
#else
  return 1.0f / (1.0f + exp_acc(-z));
#endif
}

// On the GPU both are branch-free (the sigmoid is computed, then selected): a branch per element,
// uniform as it is, costs more issue slots there than the two special-function instructions.
template <typename A>
CAUSAL_CONV_HD A activate(A z, bool silu) {
#if defined(__CUDA_ARCH__)
  const A s = sigmoid(z);
  return silu ? z * s : z;
#else
  return silu ? z * sigmoid(z) : z;
#endif
}

template <typename A>
CAUSAL_CONV_HD A activation_grad(A z, bool silu) {
#if defined(__CUDA_ARCH__)
  const A s = sigmoid(z);
  return silu ? s * (A(1) + z * (A(1) - s)) : A(1);
#else
  if (!silu) return A(1);
  const A s = sigmoid(z);
  return s * (A(1) + z * (A(1) - s));
#endif
}

// dy * activation_grad(z, kSilu) with the activation known at compile time. For silu,
// s (1 + z (1 - s)) = s (z - z s) + s: two FMAs, then the product with dy; no select on a run-time
// flag. (The channel-first backward's interior loop, SASS: 285 -> 263 instructions a segment of 8
// bf16 times a lane, eleventh session.) dy multiplies last so that an infinite dy meets the finite
// derivative only, as in the reference: folding dy in first (ds (z - z s) + ds, ds = dy s) gave
// inf - inf = NaN where the reference has +-inf.
template <bool kSilu, typename A>
CAUSAL_CONV_HD A activation_vjp(A dy, A z) {
  if constexpr (kSilu) {
    const A s = sigmoid(z);
    return dy * (s * (z - z * s) + s);
  } else {
    return dy;
  }
}

// dy * activation_grad(z, silu) with silu a run-time bool, or activation_vjp<kSilu> with silu a
// std::bool_constant<kSilu>: for a kernel that chooses the activation once for its hottest loop
// and reads the flag elsewhere.
template <typename A, typename Silu>
CAUSAL_CONV_HD A activation_vjp(A dy, A z, Silu silu) {
  if constexpr (std::is_same_v<Silu, bool>) {
    return dy * activation_grad(z, silu);
  } else {
    return activation_vjp<Silu::value>(dy, z);
  }
}

// Storage type <-> accumulation type. Half types convert through float; every storage type used
// here (float, double, the CUDA and CPU half types) has a float constructor and a float cast.
template <typename A, typename T>
CAUSAL_CONV_HD A to_acc(T v) {
  if constexpr (std::is_same_v<T, A>) {
    return v;
  } else {
    return static_cast<A>(static_cast<float>(v));
  }
}

template <typename T, typename A>
CAUSAL_CONV_HD T from_acc(A v) {
  if constexpr (std::is_same_v<T, A>) {
    return v;
  } else {
    return T(static_cast<float>(v));
  }
}

// Weight and bias (and their gradients) are stored in the accumulation type A, or in x's storage
// type T when like_x (a runtime flag: one kernel serves both). Values are A either way; a T
// weight widens exactly, and a gradient accumulated in A is rounded once, when it is stored.
template <typename T, typename A>
CAUSAL_CONV_HD A load_param(const void* base, int64_t i, bool like_x) {
  if constexpr (!std::is_same_v<T, A>) {
    if (like_x) return to_acc<A>(static_cast<const T*>(base)[i]);
  }
  return static_cast<const A*>(base)[i];
}

// fn(like_x) with like_x a compile-time std::bool_constant: the branch on the flag is taken once,
// around a run of load_param calls (a loop over the taps, the prologue that loads a thread's
// weights), which then compile to straight loads of one type. The hint only orders the code;
// with it ptxas allocates the vectorized kernels' registers closer to those of float weights only.
CAUSAL_CONV_EXEC_CHECK_DISABLE
template <typename T, typename A, typename Fn>
CAUSAL_CONV_HD auto with_param_type(bool like_x, const Fn& fn) {
  if constexpr (!std::is_same_v<T, A>) {
    if (__builtin_expect(like_x, 1)) return fn(std::true_type{});
  }
  return fn(std::false_type{});
}

// fn(flag) with flag a compile-time std::bool_constant: a flag tested per element inside a loop
// (the activation) costs a select each time; branching once around the loop compiles the loop
// once for each value instead.
CAUSAL_CONV_EXEC_CHECK_DISABLE
template <typename Fn>
CAUSAL_CONV_HD auto with_bool_constant(bool flag, const Fn& fn) {
  if (flag) return fn(std::true_type{});
  return fn(std::false_type{});
}

template <typename T, typename A>
CAUSAL_CONV_HD void store_param(void* base, int64_t i, A v, bool like_x) {
  if constexpr (!std::is_same_v<T, A>) {
    if (like_x) {
      static_cast<T*>(base)[i] = from_acc<T>(v);
      return;
    }
  }
  static_cast<A*>(base)[i] = v;
}

// Row (b, d)'s weights and bias, for Conv and Update: params p (ConvParams or UpdateParams) holds
// batch, groups, channels, weight, bias and params_like_x. param_row is the row's index in bias,
// and times the width its first weight's in weight; batch_per_group is p.batch / p.groups, or
// anything that divides b as it would (the CUDA kernels' FastDivisor).
template <typename Params, typename Divisor>
CAUSAL_CONV_HD int64_t param_row_of(const Params& p, int64_t b, int64_t d,
                                    const Divisor& batch_per_group) {
  return b / batch_per_group * p.channels + d;
}
template <typename Params>
CAUSAL_CONV_HD int64_t param_row_of(const Params& p, int64_t b, int64_t d) {
  return param_row_of(p, b, d, p.batch / p.groups);
}
template <typename T, typename A, typename Params>
CAUSAL_CONV_HD A weight_of(const Params& p, int64_t b, int64_t d, int64_t width, int64_t k) {
  return load_param<T, A>(p.weight, param_row_of(p, b, d) * width + k, p.params_like_x);
}
template <typename T, typename A, typename Params>
CAUSAL_CONV_HD A bias_of(const Params& p, int64_t b, int64_t d) {
  return p.bias ? load_param<T, A>(p.bias, param_row_of(p, b, d), p.params_like_x) : A(0);
}

// DESIGN.md section 2: output time t (segment seg_t) reads input time u (segment seg_u) only
// inside its own non-padding segment.
CAUSAL_CONV_HD bool same_segment(int32_t seg_t, int32_t seg_u) {
  return seg_t >= 0 && seg_u == seg_t;
}

// T: storage type of x and the states; A: accumulation type (float, or double for double x);
// kWidth: the kernel width when known at compile time, 0 when read from params.
template <typename T, typename A, int kWidth = 0>
struct Conv {
  ConvParams p;

  CAUSAL_CONV_HD int64_t width() const { return kWidth > 0 ? kWidth : p.width; }
  CAUSAL_CONV_HD int64_t state_len() const { return width() - 1; }

  CAUSAL_CONV_HD int64_t param_row(int64_t b, int64_t d) const { return param_row_of(p, b, d); }
  CAUSAL_CONV_HD A bias(int64_t b, int64_t d) const { return bias_of<T, A>(p, b, d); }
  // fn(w), w(k) being weight k of row (b, d): the weights' type is picked once, outside fn's loop.
  template <typename Fn>
  CAUSAL_CONV_HD A with_weights(int64_t b, int64_t d, const Fn& fn) const {
    const int64_t first = param_row(b, d) * width();
    return with_param_type<T, A>(p.params_like_x, [&](auto like_x) {
      return fn([&](int64_t k) { return load_param<T, A>(p.weight, first + k, like_x); });
    });
  }

  // seg(u) of DESIGN.md section 2: the initial state belongs to the row's first segment.
  CAUSAL_CONV_HD int32_t segment(int64_t b, int64_t u) const {
    return p.seq_idx[b * p.length + (u < 0 ? 0 : u)];
  }
  CAUSAL_CONV_HD bool is_padding(int64_t b, int64_t t) const {
    return p.seq_idx != nullptr && segment(b, t) < 0;
  }
  // Whether output time t reads input time u (u may be negative: the initial state).
  CAUSAL_CONV_HD bool tap_used(int64_t b, int64_t t, int64_t u) const {
    return p.seq_idx == nullptr || same_segment(segment(b, t), segment(b, u));
  }

  // The extended input x_u, u in [-P, L-1].
  CAUSAL_CONV_HD A input(int64_t b, int64_t u, int64_t d) const {
    if (u >= 0) return to_acc<A>(static_cast<const T*>(p.x)[offset(p.x_strides, b, u, d)]);
    if (p.initial_state == nullptr) return A(0);
    const int64_t j = u + state_len();
    return to_acc<A>(static_cast<const T*>(p.initial_state)[offset(p.state_strides, b, j, d)]);
  }

  CAUSAL_CONV_HD A pre_activation(int64_t b, int64_t t, int64_t d) const {
    const int64_t P = state_len();
    const A z0 = bias(b, d);
    return with_weights(b, d, [&](const auto& w) {
      A z = z0;
      for (int64_t k = 0; k < width(); ++k) {
        const int64_t u = t - P + k;
        if (tap_used(b, t, u)) z += w(k) * input(b, u, d);
      }
      return z;
    });
  }

  CAUSAL_CONV_HD A output(int64_t b, int64_t t, int64_t d) const {
    if (is_padding(b, t)) return A(0);
    return activate(pre_activation(b, t, d), p.silu);
  }

  // F[j] = x_{L-P+j} when it belongs to the row's last (non-padding) segment.
  CAUSAL_CONV_HD bool final_state_kept(int64_t b, int64_t j) const {
    return p.seq_idx == nullptr ||
           same_segment(segment(b, p.length - 1), segment(b, p.length - state_len() + j));
  }
  CAUSAL_CONV_HD A final_state(int64_t b, int64_t j, int64_t d) const {
    return final_state_kept(b, j) ? input(b, p.length - state_len() + j, d) : A(0);
  }

  // delta_t = dy_t * act'(z_t); zero at padding and outside [0, L).
  CAUSAL_CONV_HD A delta(int64_t b, int64_t t, int64_t d) const {
    if (t < 0 || t >= p.length || is_padding(b, t)) return A(0);
    const A g = to_acc<A>(static_cast<const T*>(p.dy)[offset(p.x_strides, b, t, d)]);
    return g * activation_grad(pre_activation(b, t, d), p.silu);
  }

  // The direct path of the final state: dF[j] lands on x_{L-P+j} as is, where dF is given and
  // x_{L-P+j} is in F. final_state_row(u) is the j of time u (negative before the state's times).
  CAUSAL_CONV_HD int64_t final_state_row(int64_t u) const { return u - (p.length - state_len()); }
  CAUSAL_CONV_HD bool final_state_grad_kept(int64_t b, int64_t j) const {
    return p.dfinal_state != nullptr && j >= 0 && final_state_kept(b, j);
  }
  CAUSAL_CONV_HD A final_state_grad(int64_t b, int64_t u, int64_t d) const {
    const int64_t j = final_state_row(u);
    if (!final_state_grad_kept(b, j)) return A(0);
    return to_acc<A>(static_cast<const T*>(p.dfinal_state)[offset(p.state_strides, b, j, d)]);
  }

  // dx_u for u in [-P, L-1]; delta_at(t) returns delta_t for t in [max(u, 0), min(u + P, L - 1)].
  template <typename DeltaAt>
  CAUSAL_CONV_HD A input_grad(int64_t b, int64_t u, int64_t d, const DeltaAt& delta_at) const {
    const int64_t P = state_len();
    const A acc = with_weights(b, d, [&](const auto& w) {
      A sum = A(0);
      for (int64_t k = 0; k < width(); ++k) {
        const int64_t t = u + P - k;
        if (t >= 0 && t < p.length && tap_used(b, t, u)) sum += w(k) * delta_at(t);
      }
      return sum;
    });
    return acc + final_state_grad(b, u, d);
  }

  // This point's share of dw[k] for output time t.
  CAUSAL_CONV_HD A weight_grad_term(int64_t b, int64_t t, int64_t k, int64_t d, A delta_t) const {
    const int64_t u = t - state_len() + k;
    return tap_used(b, t, u) ? delta_t * input(b, u, d) : A(0);
  }

  CAUSAL_CONV_HD void store_x_like(void* base, int64_t b, int64_t t, int64_t d, A v) const {
    static_cast<T*>(base)[offset(p.x_strides, b, t, d)] = from_acc<T>(v);
  }
  CAUSAL_CONV_HD void store_state_like(void* base, int64_t b, int64_t j, int64_t d, A v) const {
    static_cast<T*>(base)[offset(p.state_strides, b, j, d)] = from_acc<T>(v);
  }
};

}  // namespace causal_conv
