// Does compute-sanitizer's racecheck see races on distributed shared memory? The channel-first
// backward's cluster sums (cuda_vector.cuh, ClusterSums) hand each warp's row to the leader
// block's shared memory by st.async; racecheck found no hazard there (fifty-seventh session), which
// clears the hand-over only if racecheck tracks another block's stores into the leader's shared
// memory. NVIDIA's documentation does not say, so this asks it: one kernel per mode, each run under
// racecheck by scripts/racecheck_cluster_probe.sh, which reads each run's hazard count.
//
//   same-block   control: warp 1 stores into its block's shared memory while warp 0 reads it, no
//                barrier between (racecheck's classic hazard; it must be reported)
//   remote-store a block stores (st.shared::cluster) into the leader's shared memory while the
//                leader reads it, no barrier between
//   no-wait      ClusterSums' hand-over by st.async, but the leader reads the rows before it waits
//                on the mbarrier that counts their bytes
//   protocol     ClusterSums as the backward uses it (start, hand_over, total, finish): no hazard
//                expected
//
// Every mode keeps each cluster resident until the leader's reads are done (a last cluster
// barrier, and in no-wait the mbarrier's wait after the early read), so that the races are the
// only faults. Built by the .sh beside it, from the repository root:
//
//   nvcc -std=c++17 -arch=sm_90 -O3 -Icuda -I<XLA FFI headers> scripts/racecheck_cluster_probe.cu
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "cuda_vector.cuh"

namespace {

using causal_conv::ClusterSums;
using causal_conv::cluster_rank;

constexpr int kClusterBlocks = 2;
constexpr int kThreads = 64;
constexpr int kColumns = kThreads;
using Sums = ClusterSums<kClusterBlocks, kColumns>;

enum class Mode { kSameBlock, kRemoteStore, kNoWait, kProtocol };

__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release;\n barrier.cluster.wait.acquire;" ::: "memory");
}

// out[cluster * kColumns + column]: what the leader read of row 1 (or, for same-block, warp 0's
// read of warp 1's values), so that no read is optimized away.
template <Mode kMode>
__global__ void probe(float* out) {
  __shared__ Sums sums;
  const int column = threadIdx.x;
  const uint32_t rank = cluster_rank();
  float seen = 0.0f;
  if constexpr (kMode == Mode::kSameBlock) {
    volatile float* row = sums.rows[0];
    if (threadIdx.x >= 32) row[threadIdx.x - 32] = 1.0f + threadIdx.x;
    if (threadIdx.x < 32) seen = row[threadIdx.x];
    __syncthreads();
  } else if constexpr (kMode == Mode::kRemoteStore) {
    cluster_barrier();  // every block started, so the leader's shared memory exists
    if (rank == 1) {
      const uint32_t at = Sums::leader_address(&sums.rows[1][column]);
      asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(at), "f"(2.0f + column) : "memory");
    } else {
      seen = static_cast<volatile float*>(sums.rows[1])[column];
    }
    cluster_barrier();
  } else if constexpr (kMode == Mode::kNoWait) {
    sums.start();
    asm volatile("barrier.cluster.wait;" ::: "memory");
    if (rank == 0 && threadIdx.x == 0) sums.announce(1);
    if (rank == 1) {
      sums.store_to_leader(1, column, 3.0f + column);
    } else {
      seen = static_cast<volatile float*>(sums.rows[1])[column];
      sums.wait_for_rows();
    }
    cluster_barrier();
  } else {
    sums.start();
    sums.hand_over(static_cast<int>(rank), column, true, 4.0f + rank + column, kClusterBlocks);
    if (Sums::leader()) seen = sums.total(column, kClusterBlocks);
    sums.finish();
  }
  if (rank == 0) out[(blockIdx.x / kClusterBlocks) * kColumns + column] = seen;
}

template <Mode kMode>
int run(const char* name) {
  constexpr int kClusters = 4;
  float* out = nullptr;
  if (cudaMalloc(&out, kClusters * kColumns * sizeof(float)) != cudaSuccess) {
    std::printf("%s: cudaMalloc failed\n", name);
    return 1;
  }
  if constexpr (kMode == Mode::kSameBlock) {
    probe<kMode><<<kClusters, kThreads>>>(out);
  } else {
    causal_conv::launch_clustered(probe<kMode>, dim3(kClusters * kClusterBlocks), dim3(kThreads),
                                  kClusterBlocks, nullptr, out);
  }
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t finished = cudaDeviceSynchronize();
  float first = 0.0f;
  cudaMemcpy(&first, out + 1, sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(out);
  std::printf("%s: launch %s, run %s, leader's column 1 read %g\n", name,
              cudaGetErrorString(launched), cudaGetErrorString(finished), first);
  return launched != cudaSuccess || finished != cudaSuccess;
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "same-block") == 0) return run<Mode::kSameBlock>(mode);
  if (std::strcmp(mode, "remote-store") == 0) return run<Mode::kRemoteStore>(mode);
  if (std::strcmp(mode, "no-wait") == 0) return run<Mode::kNoWait>(mode);
  if (std::strcmp(mode, "protocol") == 0) return run<Mode::kProtocol>(mode);
  std::printf("usage: %s same-block|remote-store|no-wait|protocol\n", argv[0]);
  return 2;
}
