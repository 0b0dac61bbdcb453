#include "kernels/prefetch/l2_prefetch.h"

#include "kernels/prefetch/l2_prefetch.cuh"
#include "kernels/programmatic_launch.cuh"

namespace mlaserve {
namespace {

__global__ void __launch_bounds__(32) L2PrefetchKernel(L2PrefetchRanges r) {
  // The weights are written before the step; nothing a predecessor writes is read, so the
  // requests go out first and the wait (programmatic_launch.cuh's rule) comes after.
  const auto mode = static_cast<prefetch::L2PrefetchMode>(r.mode);
  for (int i = 0; i < r.count; ++i) {
    prefetch::PrefetchL2Share(r.base[i], r.bytes[i], blockIdx.x, gridDim.x, mode);
  }
  pdl::WaitForPrerequisiteGrid();
}

}  // namespace

cudaError_t InvokeL2Prefetch(const L2PrefetchRanges& ranges, cudaStream_t stream) {
  if (ranges.count < 0 || ranges.count > L2PrefetchRanges::kMaxRanges) {
    return cudaErrorInvalidValue;
  }
  size_t total = 0;
  for (int i = 0; i < ranges.count; ++i) total += ranges.bytes[i];
  if (total == 0) return cudaSuccess;
  int blocks = ranges.blocks;
  if (blocks <= 0) {
    int dev = 0;
    if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
    if (cudaError_t e = cudaDeviceGetAttribute(&blocks, cudaDevAttrMultiProcessorCount, dev);
        e != cudaSuccess) {
      return e;
    }
  }
  return pdl::LaunchKernel(L2PrefetchKernel, dim3(blocks), dim3(32), 0, stream,
                           ranges.programmatic, ranges);
}

}  // namespace mlaserve
