// CPU kernels and their XLA FFI handlers. They run the same conv_math.h functions as the CUDA
// kernels, one batch row and channel at a time, in a fixed order (so results are deterministic).
#include <algorithm>
#include <vector>

#include "conv_math.h"
#include "cpu_half.h"
#include "ffi_common.h"

namespace causal_conv {
namespace {

template <typename T, typename A, int kWidth>
void forward(const ConvParams& p) {
  const Conv<T, A, kWidth> conv{p};
  const int64_t points = p.batch * p.length * p.channels;
  for (int64_t i = 0; i < points; ++i) {
    const Point q = point_at(i, p.length, p.channels, p.channel_last);
    conv.store_x_like(p.y, q.b, q.t, q.d, conv.output(q.b, q.t, q.d));
  }
  if (p.final_state == nullptr) return;
  const int64_t state_points = p.batch * conv.state_len() * p.channels;
  for (int64_t i = 0; i < state_points; ++i) {
    const Point q = point_at(i, conv.state_len(), p.channels, p.channel_last);
    conv.store_state_like(p.final_state, q.b, q.t, q.d, conv.final_state(q.b, q.t, q.d));
  }
}

// One (row, channel) at a time: delta for the whole row, then dx (and dS), then dw and db.
template <typename T, typename A, int kWidth>
void backward(const ConvParams& p, A* dweight, A* dbias) {
  const Conv<T, A, kWidth> conv{p};
  const int64_t K = conv.width(), P = conv.state_len(), L = p.length;
  std::fill(dweight, dweight + p.groups * p.channels * K, A(0));
  std::fill(dbias, dbias + p.groups * p.channels, A(0));
  std::vector<A> delta(static_cast<size_t>(L));
  const auto delta_at = [&](int64_t t) { return delta[static_cast<size_t>(t)]; };
  const int64_t first_u = p.dinitial_state != nullptr ? -P : 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t d = 0; d < p.channels; ++d) {
      for (int64_t t = 0; t < L; ++t) delta[static_cast<size_t>(t)] = conv.delta(b, t, d);
      for (int64_t u = first_u; u < L; ++u) {
        const A g = conv.input_grad(b, u, d, delta_at);
        if (u >= 0) {
          conv.store_x_like(p.dx, b, u, d, g);
        } else {
          conv.store_state_like(p.dinitial_state, b, u + P, d, g);
        }
      }
      const int64_t row = conv.group(b) * p.channels + d;
      A* dw = dweight + row * K;
      for (int64_t t = 0; t < L; ++t) {
        const A delta_t = delta[static_cast<size_t>(t)];
        dbias[row] += delta_t;
        for (int64_t k = 0; k < K; ++k) dw[k] += conv.weight_grad_term(b, t, k, d, delta_t);
      }
    }
  }
}

ffi::Error forward_handler(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                           ffi::AnyBuffer initial_state, ffi::Buffer<ffi::S32> seq_idx,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> final_state,
                           bool silu, bool channel_last) {
  ConvParams p;
  if (auto err = fill_params(x, weight, bias, initial_state, seq_idx, silu, channel_last, p);
      err.failure()) {
    return err;
  }
  p.y = y->untyped_data();
  p.final_state = optional_data(final_state);
  return dispatch_dtype<Float16, BFloat16>(x.element_type(), weight.element_type(), [&](auto types) {
    using Types = decltype(types);
    dispatch_width(p.width, [&](auto width) {
      forward<typename Types::Storage, typename Types::Acc, decltype(width)::value>(p);
    });
    return ffi::Error::Success();
  });
}

ffi::Error backward_handler(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                            ffi::AnyBuffer initial_state, ffi::Buffer<ffi::S32> seq_idx,
                            ffi::AnyBuffer dy, ffi::AnyBuffer dfinal_state,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                            ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::AnyBuffer> dinitial_state,
                            ffi::Result<ffi::AnyBuffer> /*workspace: empty on CPU*/, bool silu,
                            bool channel_last) {
  ConvParams p;
  if (auto err = fill_params(x, weight, bias, initial_state, seq_idx, silu, channel_last, p);
      err.failure()) {
    return err;
  }
  p.dy = dy.untyped_data();
  p.dfinal_state = optional_data(dfinal_state);
  p.dx = dx->untyped_data();
  p.dinitial_state = optional_data(dinitial_state);
  return dispatch_dtype<Float16, BFloat16>(x.element_type(), weight.element_type(), [&](auto types) {
    using Types = decltype(types);
    using A = typename Types::Acc;
    dispatch_width(p.width, [&](auto width) {
      backward<typename Types::Storage, A, decltype(width)::value>(
          p, static_cast<A*>(dweight->untyped_data()), static_cast<A*>(dbias->untyped_data()));
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace causal_conv

XLA_FFI_DEFINE_HANDLER_SYMBOL(CausalConv1dForwardCpu, causal_conv::forward_handler,
                              causal_conv::bind_forward(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CausalConv1dBackwardCpu, causal_conv::backward_handler,
                              causal_conv::bind_backward(xla::ffi::Ffi::Bind()));
