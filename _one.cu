#include "cuda/forward_vector.cuh"
#include "cuda/backward_vector.cuh"
namespace causal_conv {
template __global__ void backward_channel_first_kernel<__nv_bfloat16, 4, false>(ConvParams, float*, int64_t);
template __global__ void backward_channel_first_kernel<__nv_bfloat16, 5, false>(ConvParams, float*, int64_t);
template __global__ void backward_channel_first_kernel<float, 4, false>(ConvParams, float*, int64_t);
}
