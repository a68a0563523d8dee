// How many clusters of the channel-first backward's clustered kernels (backward_vector.cuh,
// kClusterSums: the scalar kernel at bf16 K = 4 and 6 and float32 K = 4, the tensor-core kernel at
// bf16 K = 8) a device runs at once, by cluster size, against the blocks of their plain twins:
// a clustered grid of more clusters than that runs a second, partial wave. The launch rule in
// backward_cuda.cu takes clusters only for grids that fill the device at least once, because
// in one partial wave (B=8 L=2048 D=256 bf16: 128 clusters of 4 blocks) the clustered kernel
// took 10.4-10.5 us against the plain kernel's 8.6-8.9 on an H100 (fifty-second and fifty-third
// sessions); this asks the runtime whether that grid fits the clusters it can hold. It prints the
// device's peak DRAM bandwidth first, which a rule by device would read (benchmarks/trials,
// cf-clusters-by-bandwidth). On a GPU machine, from the repository root:
//
//   nvcc -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -O3 -Icuda -isystem <XLA FFI headers> \
//     scripts/cluster_occupancy.cu -o /tmp/cluster_occupancy && /tmp/cluster_occupancy
//
// (the FFI headers: `python3 scripts/ffi_headers.py DIR`, or jax.ffi.include_dir()).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "backward_vector.cuh"

namespace {

using causal_conv::backward_channel_first_kernel;
using causal_conv::backward_channel_first_mma_kernel;
using causal_conv::kChannelFirstThreads;

// kPlain and kClustered: a kernel and its kClusterSums twin, as launch_cluster_sums takes them.
template <auto kPlain, auto kClustered>
int report(const char* name) {
  int plain_blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&plain_blocks, kPlain, kChannelFirstThreads,
                                                    0) != cudaSuccess) {
    std::printf("%s: occupancy query failed: %s\n", name, cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  const int sms = causal_conv::device_attribute(0, cudaDevAttrMultiProcessorCount);
  std::printf("%s: plain kernel %d blocks an SM, %d at once on %d SMs\n", name, plain_blocks,
              plain_blocks * sms, sms);
  // No clusters of one block: launch_cluster_sums takes none (st.async needs a peer block).
  for (const unsigned cluster_blocks : {2u, 4u, 8u}) {
    cudaLaunchAttribute attribute = causal_conv::cluster_dimension(cluster_blocks);
    const cudaLaunchConfig_t config = causal_conv::launch_config(
        dim3(cluster_blocks * 128), dim3(kChannelFirstThreads), nullptr, &attribute);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kClustered, &config) != cudaSuccess) {
      std::printf("  clusters of %u: query failed: %s\n", cluster_blocks,
                  cudaGetErrorString(cudaGetLastError()));
      return 1;
    }
    std::printf("  clusters of %u blocks: %d at once (%d blocks)\n", cluster_blocks, clusters,
                clusters * static_cast<int>(cluster_blocks));
  }
  return 0;
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::printf("no CUDA device: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  // The peak DRAM bandwidth a launch rule by device would read (double data rate over the bus).
  const int memory_khz = causal_conv::device_attribute(0, cudaDevAttrMemoryClockRate);
  const int bus_bits = causal_conv::device_attribute(0, cudaDevAttrGlobalMemoryBusWidth);
  std::printf("%s: memory clock %d kHz, bus %d bits, peak %.2f TB/s\n", prop.name, memory_khz,
              bus_bits, 2e3 * memory_khz * (bus_bits / 8) / 1e12);
  return report<backward_channel_first_kernel<__nv_bfloat16, 4, false, false>,
                backward_channel_first_kernel<__nv_bfloat16, 4, false, true>>("bfloat16 K=4") |
         report<backward_channel_first_kernel<__nv_bfloat16, 6, false, false>,
                backward_channel_first_kernel<__nv_bfloat16, 6, false, true>>("bfloat16 K=6") |
         report<backward_channel_first_kernel<float, 4, false, false>,
                backward_channel_first_kernel<float, 4, false, true>>("float32 K=4") |
         report<backward_channel_first_mma_kernel<8, false>,
                backward_channel_first_mma_kernel<8, true>>("bfloat16 K=8 tensor cores");
}
