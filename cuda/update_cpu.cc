// The causal_conv1d_update CPU kernel and its XLA FFI handler: the update_math.h math, one
// (batch row, channel) at a time, on the state buffer that XLA aliases to the result.
#include <cstring>

#include "cpu_half.h"
#include "ffi_common.h"
#include "update_math.h"

namespace causal_conv {
namespace {

template <typename T, typename A, int kWidth>
void update(const UpdateParams& p) {
  const Update<T, A, kWidth> op{p};
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t d = 0; d < p.channels; ++d) op.run(b, d);
  }
}

ffi::Error update_handler(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                          ffi::AnyBuffer conv_state, ffi::Buffer<ffi::S32> cache_seqlens,
                          ffi::Buffer<ffi::S32> state_indices, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> new_conv_state, bool silu,
                          bool channel_last) {
  UpdateParams p;
  if (auto err = fill_update_params(x, weight, bias, conv_state, cache_seqlens, state_indices, y,
                                    new_conv_state, silu, channel_last, p);
      err.failure()) {
    return err;
  }
  if (const void* from = unaliased_state(conv_state, p)) {
    std::memcpy(p.state, from, conv_state.size_bytes());
  }
  return dispatch_dtype<Float16, BFloat16>(
      x.element_type(), [&](auto types) {
        using Types = decltype(types);
        dispatch_width<kCpuMaxWidth>(p.width, [&](auto width) {
          update<typename Types::Storage, typename Types::Acc, decltype(width)::value>(p);
        });
        return ffi::Error::Success();
      });
}

}  // namespace
}  // namespace causal_conv

XLA_FFI_DEFINE_HANDLER_SYMBOL(CausalConv1dUpdateCpu, causal_conv::update_handler,
                              causal_conv::bind_update(xla::ffi::Ffi::Bind()));
