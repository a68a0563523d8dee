// Host-side glue shared by the CPU and CUDA FFI handlers: the argument bindings, buffers and
// attributes into one ConvParams, and the one dtype and width dispatch table.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "conv_math.h"
#include "update_math.h"
#include "xla/ffi/api/ffi.h"

namespace causal_conv {

namespace ffi = xla::ffi;

// Absent optional tensors travel as empty buffers.
inline const void* optional_data(const ffi::AnyBuffer& buffer) {
  return buffer.element_count() == 0 ? nullptr : buffer.untyped_data();
}
inline void* optional_data(ffi::Result<ffi::AnyBuffer>& buffer) {
  return buffer->element_count() == 0 ? nullptr : buffer->untyped_data();
}

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_causal_conv: " + what);
}

inline ffi::DataType accumulation_type(ffi::DataType x_dtype) {
  return x_dtype == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

// Weight and bias share one dtype: x's accumulation type, or x's own (then like_x is set, and the
// kernels widen them as they load them).
inline ffi::Error check_param_dtypes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                                     const ffi::AnyBuffer& bias, bool& like_x) {
  // x's own dtype is dispatch_dtype's to check: every handler goes through it.
  const ffi::DataType x_dtype = x.element_type(), w_dtype = weight.element_type();
  if (w_dtype != x_dtype && w_dtype != accumulation_type(x_dtype)) {
    return invalid("weight must have x's dtype or x's accumulation dtype (float32; float64 for "
                   "float64 x)");
  }
  if (bias.element_type() != w_dtype) return invalid("bias must have weight's dtype");
  like_x = w_dtype == x_dtype;
  return ffi::Error::Success();
}

// Whether buffer holds count elements of dtype. The handlers check every buffer's dtype with its
// size: a kernel writing x's dtype into a narrower buffer of the same count would write past it.
inline bool holds(const ffi::AnyBuffer& buffer, ffi::DataType dtype, size_t count) {
  return buffer.element_type() == dtype && buffer.element_count() == count;
}
inline bool same_dtype_and_size(const ffi::AnyBuffer& buffer, const ffi::AnyBuffer& like) {
  return holds(buffer, like.element_type(), like.element_count());
}

// Whether an optional state buffer (initial or final state, or a gradient of one) fits p: absent
// (empty) or the (batch, width - 1, channels) conv state in x's dtype.
inline bool optional_state_fits(const ffi::AnyBuffer& buffer, ffi::DataType x_dtype,
                                const ConvParams& p) {
  return buffer.element_count() == 0 ||
         holds(buffer, x_dtype, static_cast<size_t>(p.batch * (p.width - 1) * p.channels));
}

// x is (batch, length, channels) for channel_last, else (batch, channels, length);
// weight is (groups, channels, width), bias (groups, channels).
inline ffi::Error fill_params(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                              const ffi::AnyBuffer& bias, const ffi::AnyBuffer& initial_state,
                              const ffi::Buffer<ffi::S32>& seq_idx, bool silu, bool channel_last,
                              ConvParams& p) {
  const auto xd = x.dimensions();
  const auto wd = weight.dimensions();
  if (xd.size() != 3 || wd.size() != 3) return invalid("x and weight must have rank 3");
  p.batch = xd[0];
  p.length = channel_last ? xd[1] : xd[2];
  p.channels = channel_last ? xd[2] : xd[1];
  p.groups = wd[0];
  p.width = wd[2];
  if (wd[1] != p.channels) return invalid("weight channels do not match x");
  if (p.groups < 1 || p.batch % p.groups != 0) return invalid("batch is not a multiple of groups");
  if (p.width < 1) return invalid("width must be at least 1");
  if (bias.element_count() != static_cast<size_t>(p.groups * p.channels)) {
    return invalid("bias must be (groups, channels)");
  }
  if (!optional_state_fits(initial_state, x.element_type(), p)) {
    return invalid("initial_state has the wrong size or dtype");
  }
  if (seq_idx.element_count() != 0 &&
      seq_idx.element_count() != static_cast<size_t>(p.batch * p.length)) {
    return invalid("seq_idx must be (batch, length)");
  }
  if (auto err = check_param_dtypes(x, weight, bias, p.params_like_x); err.failure()) return err;
  p.silu = silu;
  p.channel_last = channel_last;
  p.x_strides = make_strides(p.length, p.channels, channel_last);
  p.state_strides = make_strides(p.width - 1, p.channels, channel_last);
  p.x = x.untyped_data();
  p.weight = weight.untyped_data();
  p.bias = bias.untyped_data();
  p.initial_state = optional_data(initial_state);
  p.seq_idx = seq_idx.element_count() == 0 ? nullptr : seq_idx.typed_data();
  return ffi::Error::Success();
}

// fill_params plus the forward's outputs: y shaped like x, final_state like the state (or empty).
inline ffi::Error fill_forward_params(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                                      const ffi::AnyBuffer& bias,
                                      const ffi::AnyBuffer& initial_state,
                                      const ffi::Buffer<ffi::S32>& seq_idx,
                                      ffi::Result<ffi::AnyBuffer>& y,
                                      ffi::Result<ffi::AnyBuffer>& final_state, bool silu,
                                      bool channel_last, ConvParams& p) {
  if (auto err = fill_params(x, weight, bias, initial_state, seq_idx, silu, channel_last, p);
      err.failure()) {
    return err;
  }
  if (!same_dtype_and_size(*y, x)) return invalid("y must have x's dtype and size");
  if (!optional_state_fits(*final_state, x.element_type(), p)) {
    return invalid("final_state has the wrong size or dtype");
  }
  p.y = y->untyped_data();
  p.final_state = optional_data(final_state);
  return ffi::Error::Success();
}

// fill_params plus the backward's buffers: dy and dx shaped like x, dweight and dbias like weight
// and bias (same dtype), dfinal_state and dinitial_state like the state (or empty).
inline ffi::Error fill_backward_params(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                                       const ffi::AnyBuffer& bias,
                                       const ffi::AnyBuffer& initial_state,
                                       const ffi::Buffer<ffi::S32>& seq_idx,
                                       const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dfinal_state,
                                       ffi::Result<ffi::AnyBuffer>& dx,
                                       ffi::Result<ffi::AnyBuffer>& dweight,
                                       ffi::Result<ffi::AnyBuffer>& dbias,
                                       ffi::Result<ffi::AnyBuffer>& dinitial_state, bool silu,
                                       bool channel_last, ConvParams& p) {
  if (auto err = fill_params(x, weight, bias, initial_state, seq_idx, silu, channel_last, p);
      err.failure()) {
    return err;
  }
  if (!same_dtype_and_size(dy, x) || !same_dtype_and_size(*dx, x)) {
    return invalid("dy and dx must have x's dtype and size");
  }
  // bias has weight's dtype (check_param_dtypes).
  if (!same_dtype_and_size(*dweight, weight) || !same_dtype_and_size(*dbias, bias)) {
    return invalid("dweight and dbias must have the dtypes and sizes of weight and bias");
  }
  if (!optional_state_fits(dfinal_state, x.element_type(), p) ||
      !optional_state_fits(*dinitial_state, x.element_type(), p)) {
    return invalid("state gradients have the wrong size or dtype");
  }
  p.dy = dy.untyped_data();
  p.dfinal_state = optional_data(dfinal_state);
  p.dx = dx->untyped_data();
  p.dinitial_state = optional_data(dinitial_state);
  return ffi::Error::Success();
}

template <typename B>
auto bind_forward(B binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()            // weight
      .template Arg<ffi::AnyBuffer>()            // bias
      .template Arg<ffi::AnyBuffer>()            // initial_state (empty when absent)
      .template Arg<ffi::Buffer<ffi::S32>>()     // seq_idx (empty when absent)
      .template Ret<ffi::AnyBuffer>()            // y
      .template Ret<ffi::AnyBuffer>()            // final_state (empty when not asked for)
      .template Attr<bool>("silu")
      .template Attr<bool>("channel_last");
}

template <typename B>
auto bind_backward(B binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()            // weight
      .template Arg<ffi::AnyBuffer>()            // bias
      .template Arg<ffi::AnyBuffer>()            // initial_state (empty when absent)
      .template Arg<ffi::Buffer<ffi::S32>>()     // seq_idx (empty when absent)
      .template Arg<ffi::AnyBuffer>()            // dy
      .template Arg<ffi::AnyBuffer>()            // dfinal_state (empty when absent)
      .template Ret<ffi::AnyBuffer>()            // dx
      .template Ret<ffi::AnyBuffer>()            // dweight (groups, channels, width), as weight
      .template Ret<ffi::AnyBuffer>()            // dbias (groups, channels), as weight
      .template Ret<ffi::AnyBuffer>()            // dinitial_state (empty when absent)
      .template Ret<ffi::AnyBuffer>()            // workspace (backward_workspace_elements)
      .template Attr<bool>("silu")
      .template Attr<bool>("channel_last");
}

template <typename T, typename A>
struct TypePair {
  using Storage = T;
  using Acc = A;
};

// The dtype table: x's dtype picks the storage type T and the accumulation type A; weight and bias
// arrive in A or in T (the params' params_like_x, checked by check_param_dtypes). Each platform
// names its own half types.
template <typename Half, typename BFloat16, typename Fn>
ffi::Error dispatch_dtype(ffi::DataType x_dtype, Fn&& fn) {
  switch (x_dtype) {
    case ffi::DataType::F32: return fn(TypePair<float, float>{});
    case ffi::DataType::F64: return fn(TypePair<double, double>{});
    case ffi::DataType::F16: return fn(TypePair<Half, float>{});
    case ffi::DataType::BF16: return fn(TypePair<BFloat16, float>{});
    default: return invalid("x must be float16, bfloat16, float32 or float64");
  }
}

// Widths 2 .. kMaxWidth get compile-time kernels; every other width runs the generic loop
// (kWidth = 0). The CPU compiles K <= 4 (each width is one more copy per instruction set); the GPU
// K <= 8, the widths its performance targets cover.
constexpr int kCpuMaxWidth = 4;
constexpr int kCudaMaxWidth = 8;

template <int kWidth, int kMaxWidth, typename Fn>
auto dispatch_width_from(int64_t width, Fn&& fn) {
  if constexpr (kWidth > kMaxWidth) {
    return fn(std::integral_constant<int, 0>{});
  } else {
    if (width == kWidth) return fn(std::integral_constant<int, kWidth>{});
    return dispatch_width_from<kWidth + 1, kMaxWidth>(width, std::forward<Fn>(fn));
  }
}

template <int kMaxWidth, typename Fn>
auto dispatch_width(int64_t width, Fn&& fn) {
  return dispatch_width_from<2, kMaxWidth>(width, std::forward<Fn>(fn));
}

// causal_conv1d_update: x is (batch, tokens, channels) for channel_last, else (batch, channels,
// tokens); the state is (pool, state_len, channels) in the same layout; y is shaped like x and
// new_state like state. p.state is new_state's buffer: see unaliased_state.
inline ffi::Error fill_update_params(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                                     const ffi::AnyBuffer& bias, const ffi::AnyBuffer& state,
                                     const ffi::Buffer<ffi::S32>& cache_seqlens,
                                     const ffi::Buffer<ffi::S32>& state_indices,
                                     ffi::Result<ffi::AnyBuffer>& y,
                                     ffi::Result<ffi::AnyBuffer>& new_state, bool silu,
                                     bool channel_last, UpdateParams& p) {
  const auto xd = x.dimensions();
  const auto wd = weight.dimensions();
  const auto sd = state.dimensions();
  if (xd.size() != 3 || wd.size() != 3 || sd.size() != 3) {
    return invalid("x, weight and conv_state must have rank 3");
  }
  p.batch = xd[0];
  p.tokens = channel_last ? xd[1] : xd[2];
  p.channels = channel_last ? xd[2] : xd[1];
  p.groups = wd[0];
  p.width = wd[2];
  p.pool = sd[0];
  p.state_len = channel_last ? sd[1] : sd[2];
  if (wd[1] != p.channels) return invalid("weight channels do not match x");
  if ((channel_last ? sd[2] : sd[1]) != p.channels) {
    return invalid("conv_state channels do not match x");
  }
  if (p.groups < 1 || p.batch % p.groups != 0) return invalid("batch is not a multiple of groups");
  if (p.width < 1) return invalid("width must be at least 1");
  if (p.state_len < p.width - 1) return invalid("conv_state must hold at least width - 1 steps");
  if (state.element_type() != x.element_type()) return invalid("conv_state must have x's dtype");
  if (bias.element_count() != static_cast<size_t>(p.groups * p.channels)) {
    return invalid("bias must be (groups, channels)");
  }
  if (auto err = check_param_dtypes(x, weight, bias, p.params_like_x); err.failure()) return err;
  const size_t batch = static_cast<size_t>(p.batch);
  if (cache_seqlens.element_count() != 0 && cache_seqlens.element_count() != batch) {
    return invalid("cache_seqlens must be (batch,)");
  }
  if (state_indices.element_count() != 0 && state_indices.element_count() != batch) {
    return invalid("state_indices must be (batch,)");
  }
  if (state_indices.element_count() == 0 && p.batch != 0 && p.pool != p.batch) {
    return invalid("without state_indices the conv_state pool must have batch rows");
  }
  if (!same_dtype_and_size(*y, x)) return invalid("y must have x's dtype and size");
  if (!same_dtype_and_size(*new_state, state)) {
    return invalid("new_conv_state must have conv_state's dtype and size");
  }
  p.silu = silu;
  p.channel_last = channel_last;
  p.x_strides = make_strides(p.tokens, p.channels, channel_last);
  p.state_strides = make_strides(p.state_len, p.channels, channel_last);
  p.x = x.untyped_data();
  p.weight = weight.untyped_data();
  p.bias = bias.untyped_data();
  p.cache_seqlens = cache_seqlens.element_count() == 0 ? nullptr : cache_seqlens.typed_data();
  p.state_indices = state_indices.element_count() == 0 ? nullptr : state_indices.typed_data();
  p.y = y->untyped_data();
  p.state = new_state->untyped_data();
  return ffi::Error::Success();
}

// The lowering aliases conv_state to new_conv_state, so the two are normally one buffer and the
// update runs in place. Should XLA ever hand over two, the handler copies conv_state into p.state
// first: the bytes to copy, or nullptr when there is nothing to copy.
inline const void* unaliased_state(const ffi::AnyBuffer& conv_state, const UpdateParams& p) {
  const void* from = conv_state.untyped_data();
  return from == p.state || conv_state.size_bytes() == 0 ? nullptr : from;
}

template <typename B>
auto bind_update(B binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()            // weight
      .template Arg<ffi::AnyBuffer>()            // bias
      .template Arg<ffi::AnyBuffer>()            // conv_state (aliased to new_conv_state)
      .template Arg<ffi::Buffer<ffi::S32>>()     // cache_seqlens (empty when absent)
      .template Arg<ffi::Buffer<ffi::S32>>()     // state_indices (empty when absent)
      .template Ret<ffi::AnyBuffer>()            // y
      .template Ret<ffi::AnyBuffer>()            // new_conv_state
      .template Attr<bool>("silu")
      .template Attr<bool>("channel_last");
}

}  // namespace causal_conv
