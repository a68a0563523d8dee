// The causal_conv1d_update CPU kernel and its XLA FFI handler, on the state buffer that XLA
// aliases to the result. Update (update_math.h) says which pool row, ring slot or token each tap
// reads and which slots the state's rewrite moves; here a batch row's channels go at a time, the
// per-token sum of Update::output and each of the rewrite's moves written as loops over the
// channels, which vectorize where the channels are contiguous ("BLD"). The generic CUDA kernel
// runs Update::run itself.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_half.h"
#include "cpu_params.h"
#include "cpu_target.h"
#include "cpu_tiles.h"
#include "ffi_common.h"
#include "update_math.h"

namespace causal_conv {
namespace {

// Update::run for every channel of batch row b: the outputs from the old state first (z
// accumulates over the taps, each tap a loop over the channels), then the state's rewrite. w holds
// the row's group's weights tap-major (width x channels), bias its biases. kContiguous: channels
// adjacent in x and the state ("BLD"), so that the loops run over contiguous memory and vectorize.
template <typename T, typename A, int kWidth, bool kSilu, bool kContiguous>
CAUSAL_CONV_CPU_KERNEL void update_row(const Update<T, A, kWidth>& op, int64_t b, int64_t d0,
                                       int64_t d1, const A* w, const A* bias, A* z) {
  const UpdateParams& p = op.p;
  const int64_t D = d1 - d0, K = op.width(), P = op.history(), row = op.pool_row(b);
  const int64_t xs = kContiguous ? 1 : p.x_strides.channel;
  const int64_t ss = kContiguous ? 1 : p.state_strides.channel;
  T* y = static_cast<T*>(p.y);
  for (int64_t t = 0; t < p.tokens; ++t) {
    T* yt = &y[offset(p.x_strides, b, t, d0)];
    if (row < 0) {
      for (int64_t d = 0; d < D; ++d) yt[d * xs] = from_acc<T>(A(0));
      continue;
    }
    for (int64_t d = 0; d < D; ++d) z[d] = bias[d0 + d];
    for (int64_t k = 0; k < K; ++k) {
      const int64_t u = t - P + k;
      const T* tap = op.input_at(b, row, u, d0);
      if (tap == nullptr) continue;
      const int64_t stride = u >= 0 ? xs : ss;
      const A* wk = w + k * p.channels + d0;
      for (int64_t d = 0; d < D; ++d) z[d] += wk[d] * to_acc<A>(tap[d * stride]);
    }
    for (int64_t d = 0; d < D; ++d) yt[d * xs] = from_acc<T>(activate(z[d], kSilu));
  }
  if (row < 0) return;
  // Update::rewrite_state's order. A shift's rows overlap their sources within one state row:
  // memmove where contiguous, which GCC's loop would do one element at a time for want of knowing
  // they do not.
  op.rewrite_state(b, row, d0, [&](T* to, const T* from, bool from_x) {
    if constexpr (kContiguous) {
      std::memmove(to, from, sizeof(T) * static_cast<size_t>(D));
    } else {
      const int64_t from_stride = from_x ? xs : ss;
      for (int64_t d = 0; d < D; ++d) to[d * ss] = from[d * from_stride];
    }
  });
}

// Channels a tile. A tile runs every batch row of its channels in order, so that batch rows sharing
// a pool row (state_indices) update it in the same order whatever the threads.
constexpr int64_t kUpdateTileChannels = 1024;

template <typename T, typename A, int kWidth>
void update(ffi::ThreadPool& pool, const UpdateParams& p) {
  // Nothing to write (with no batch rows the weights may have no group either).
  if (p.batch == 0 || p.channels == 0) return;
  const Update<T, A, kWidth> op{p};
  // The weights and biases in A, tap-major, read once a call instead of once a token and channel.
  const int64_t D = p.channels, K = op.width(), rows_per_group = p.batch / p.groups;
  std::vector<A> w(static_cast<size_t>(p.groups * K * D)), bias(static_cast<size_t>(p.groups * D));
  for (int64_t g = 0; g < p.groups; ++g) {
    param_table<T, A>(p, g * rows_per_group, 0, D, K, w.data() + g * K * D, bias.data() + g * D);
  }
  const bool contiguous = p.x_strides.channel == 1 && p.state_strides.channel == 1;
  const int64_t tiles = (D + kUpdateTileChannels - 1) / kUpdateTileChannels;
  with_bool_constant(p.silu, [&](auto silu) {
    with_bool_constant(contiguous, [&](auto adjacent) {
      run_tiles(pool, tiles, p.batch * p.tokens * D, [&](int64_t i) {
        const int64_t d0 = i * kUpdateTileChannels, d1 = std::min(D, d0 + kUpdateTileChannels);
        std::vector<A> z(static_cast<size_t>(d1 - d0));
        for (int64_t b = 0; b < p.batch; ++b) {
          const int64_t g = b / rows_per_group;
          update_row<T, A, kWidth, decltype(silu)::value, decltype(adjacent)::value>(
              op, b, d0, d1, w.data() + g * K * D, bias.data() + g * D, z.data());
        }
      });
    });
  });
}

ffi::Error update_handler(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                          ffi::AnyBuffer bias, ffi::AnyBuffer conv_state,
                          ffi::Buffer<ffi::S32> cache_seqlens, ffi::Buffer<ffi::S32> state_indices,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> new_conv_state,
                          bool silu, bool channel_last) {
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
          update<typename Types::Storage, typename Types::Acc, decltype(width)::value>(pool, p);
        });
        return ffi::Error::Success();
      });
}

}  // namespace
}  // namespace causal_conv

XLA_FFI_DEFINE_HANDLER_SYMBOL(CausalConv1dUpdateCpu, causal_conv::update_handler,
                              causal_conv::bind_update(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
