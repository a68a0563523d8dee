// The causal_conv1d_update CUDA kernel and its XLA FFI handler. One thread owns one (batch row,
// channel) and runs update_math.h on it: a decode step has batch * channels independent pieces
// of work, and neighbouring threads take neighbouring channels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "ffi_common.h"
#include "update_math.h"

namespace causal_conv {
namespace {

constexpr int kUpdateThreads = 256;
constexpr int64_t kUpdateMaxBlocks = int64_t{1} << 20;

ffi::Error update_cuda_error(const char* where) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_causal_conv: ") + where + ": " +
                              cudaGetErrorString(err));
}

template <typename T, typename A, int kWidth>
__global__ void update_kernel(UpdateParams p) {
  const Update<T, A, kWidth> op{p};
  const int64_t work = p.batch * p.channels;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < work;
       i += int64_t{gridDim.x} * blockDim.x) {
    op.run(i / p.channels, i % p.channels);
  }
}

template <typename T, typename A, int kWidth>
ffi::Error launch_update(cudaStream_t stream, const UpdateParams& p) {
  const int64_t work = p.batch * p.channels;
  if (work == 0) return ffi::Error::Success();
  const int64_t blocks = std::max<int64_t>(
      1, std::min(kUpdateMaxBlocks, (work + kUpdateThreads - 1) / kUpdateThreads));
  update_kernel<T, A, kWidth><<<blocks, kUpdateThreads, 0, stream>>>(p);
  return update_cuda_error("update kernel");
}

ffi::Error update_handler(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                          ffi::AnyBuffer bias, ffi::AnyBuffer conv_state,
                          ffi::Buffer<ffi::S32> cache_seqlens, ffi::Buffer<ffi::S32> state_indices,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> new_conv_state,
                          bool silu, bool channel_last) {
  UpdateParams p;
  if (auto err = fill_update_params(x, weight, bias, conv_state, cache_seqlens, state_indices,
                                    silu, channel_last, p);
      err.failure()) {
    return err;
  }
  // The lowering aliases conv_state to new_conv_state, so the buffers are normally one; copy
  // only if XLA ever hands over two.
  void* state = new_conv_state->untyped_data();
  if (state != conv_state.untyped_data() && conv_state.size_bytes() > 0) {
    const cudaError_t err = cudaMemcpyAsync(state, conv_state.untyped_data(), conv_state.size_bytes(),
                                            cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) {
      return ffi::Error::Internal(std::string("jax_causal_conv: state copy: ") +
                                 cudaGetErrorString(err));
    }
  }
  p.state = state;
  p.y = y->untyped_data();
  return dispatch_dtype<__half, __nv_bfloat16>(
      x.element_type(), weight.element_type(), [&](auto types) {
        using Types = decltype(types);
        return dispatch_width(p.width, [&](auto width) {
          return launch_update<typename Types::Storage, typename Types::Acc,
                               decltype(width)::value>(stream, p);
        });
      });
}

}  // namespace
}  // namespace causal_conv

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CausalConv1dUpdateCuda, causal_conv::update_handler,
    causal_conv::bind_update(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()));
