// The causal_conv1d_update CUDA kernels and their XLA FFI handler. A decode step has batch *
// channels independent pieces of work; neighbouring threads take neighbouring channels.
//
// The common step (one token, a K-1 slot state, compile-time K) has its own kernel: a thread owns
// a vector of channels, loads the token, its history and the weights before it writes anything,
// then writes y and the state. The generic kernel runs update_math.h one channel at a time, whose
// in-place state shift alternates loads and stores, so each state slot costs a memory round trip.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "cuda_vector.cuh"
#include "ffi_common.h"
#include "update_math.h"

namespace causal_conv {
namespace {

constexpr int kUpdateThreads = 256;
constexpr int64_t kUpdateMaxBlocks = int64_t{1} << 20;

template <typename T, typename A, int kWidth>
__global__ void update_kernel(UpdateParams p) {
  const Update<T, A, kWidth> op{p};
  const int64_t work = p.batch * p.channels;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < work;
       i += int64_t{gridDim.x} * blockDim.x) {
    op.run(i / p.channels, i % p.channels);
  }
}

// The K taps of one channel. With V channels per thread, scalar tap loads would be 32-line
// gathers per warp (lanes K * V accumulators apart); whole rows as one 8- or 16-byte load where
// K taps make one.
template <typename A, int K>
struct Taps {
  A v[K];
};

template <typename A, int K>
__device__ __forceinline__ Taps<A, K> load_taps(const A* row) {
  Taps<A, K> taps;
  if constexpr (sizeof(A) * K == 8 || sizeof(A) * K == 16) {
    if (reinterpret_cast<uintptr_t>(row) % sizeof(Vec<A, K>) == 0) {
      const Vec<A, K> packed = *reinterpret_cast<const Vec<A, K>*>(row);
      for (int k = 0; k < K; ++k) taps.v[k] = packed.v[k];
      return taps;
    }
  }
  for (int k = 0; k < K; ++k) taps.v[k] = row[k];
  return taps;
}

// One token per row, state_len == K - 1 (shift or ring mode): V channels per thread.
template <typename T, typename A, int K, int V>
__global__ void __launch_bounds__(kUpdateThreads) update_token_kernel(UpdateParams p) {
  constexpr int P = K - 1;
  const Update<T, A, K> op{p};
  const int64_t vectors = p.channels / V;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < p.batch * vectors;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d0 = (i % vectors) * V, b = i / vectors;
    const int64_t row = op.pool_row(b);
    T* y = &static_cast<T*>(p.y)[offset(p.x_strides, b, 0, d0)];
    if (row < 0) {
      store_vec(y, zero_vec<T, V>());
      continue;
    }
    // Plain loads, not read-only ones: this kernel writes the state it reads.
    const Vec<T, V> token = *reinterpret_cast<const Vec<T, V>*>(&op.x_at(b, 0, d0));
    const int64_t next = p.cache_seqlens ? int64_t{p.cache_seqlens[b]} : P;
    Vec<T, V> history[P];  // x_{-P} .. x_{-1}
    for (int j = 0; j < P; ++j) {
      const int64_t position = next - P + j;
      const int64_t slot = p.cache_seqlens ? op.ring_slot(position) : j;
      history[j] = position < 0 ? zero_vec<T, V>()
                                : *reinterpret_cast<const Vec<T, V>*>(&op.state_at(row, slot, d0));
    }
    Vec<T, V> out;
    for (int v = 0; v < V; ++v) {
      const Taps<A, K> w = load_taps<A, K>(op.weight_row(b, d0 + v));
      A z = op.bias(b, d0 + v) + w.v[P] * to_acc<A>(token.v[v]);
      for (int k = 0; k < P; ++k) z += w.v[k] * to_acc<A>(history[k].v[v]);
      out.v[v] = from_acc<T>(activate(z, p.silu));
    }
    store_vec(y, out);
    if (p.cache_seqlens) {
      store_vec(&op.state_at(row, op.ring_slot(next), d0), token);
    } else {
      for (int j = 0; j + 1 < P; ++j) store_vec(&op.state_at(row, j, d0), history[j + 1]);
      if (P > 0) store_vec(&op.state_at(row, P - 1, d0), token);
    }
  }
}

int64_t update_blocks(int64_t threads) {
  return std::max<int64_t>(
      1, std::min(kUpdateMaxBlocks, (threads + kUpdateThreads - 1) / kUpdateThreads));
}

template <typename T, typename A, int kWidth>
ffi::Error launch_update(cudaStream_t stream, const UpdateParams& p) {
  const int64_t work = p.batch * p.channels;
  if (work == 0) return ffi::Error::Success();
  if constexpr (kWidth > 0) {
    if (p.tokens == 1 && p.state_len == kWidth - 1) {
      constexpr int V = kPack<T>;
      // Channel vectors need contiguous channels (channel-last) that the vectors tile.
      if (p.channel_last && p.channels % V == 0 && aligned16(p.x) && aligned16(p.y) &&
          aligned16(p.state)) {
        update_token_kernel<T, A, kWidth, V>
            <<<update_blocks(work / V), kUpdateThreads, 0, stream>>>(p);
      } else {
        update_token_kernel<T, A, kWidth, 1><<<update_blocks(work), kUpdateThreads, 0, stream>>>(p);
      }
      return cuda_status("update token kernel");
    }
  }
  update_kernel<T, A, kWidth><<<update_blocks(work), kUpdateThreads, 0, stream>>>(p);
  return cuda_status("update kernel");
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
        return dispatch_width<kCudaMaxWidth>(p.width, [&](auto width) {
          return launch_update<typename Types::Storage, typename Types::Acc,
                               decltype(width)::value>(stream, p);
        });
      });
}

}  // namespace
}  // namespace causal_conv

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CausalConv1dUpdateCuda, causal_conv::update_handler,
    causal_conv::bind_update(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
