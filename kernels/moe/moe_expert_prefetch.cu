#include "kernels/moe/moe_expert_prefetch.h"

#include "kernels/prefetch/l2_prefetch.cuh"
#include "kernels/programmatic_launch.cuh"

namespace mlaserve {
namespace {

using P = MoeExpertPrefetchParams;

// Grid (blocks_per_expert, max_experts), one warp a block: block (x, y) prefetches share x of the
// y-th distinct local expert.
__global__ void __launch_bounds__(32) MoeExpertPrefetchKernel(P p) {
  __shared__ int32_t ids[P::kMaxAssignments];
  pdl::WaitForPrerequisiteGrid();  // the router wrote topk_ids
  const int lane = threadIdx.x;
  for (int j = lane; j < P::kMaxAssignments; j += 32) ids[j] = j < p.assignments ? p.topk_ids[j] : -1;
  __syncwarp();
  // Assignments j and j + 32 of this lane: first occurrences of a local expert.
  bool first[2];
  for (int h = 0; h < 2; ++h) {
    const int j = lane + 32 * h;
    const int e = ids[j] - p.first_expert;
    bool f = j < p.assignments && e >= 0 && e < p.num_local_experts;
    for (int k = 0; f && k < j; ++k) f = ids[k] != ids[j];
    first[h] = f;
  }
  unsigned long long mask = static_cast<unsigned long long>(__ballot_sync(~0u, first[0])) |
                            (static_cast<unsigned long long>(__ballot_sync(~0u, first[1])) << 32);
  for (unsigned y = 0; y < blockIdx.y && mask != 0; ++y) mask &= mask - 1;
  const int expert = mask == 0 ? -1 : ids[__ffsll(static_cast<long long>(mask)) - 1] - p.first_expert;
  if (p.selected != nullptr && blockIdx.x == 0 && lane == 0) p.selected[blockIdx.y] = expert;
  if (expert < 0) return;
  const auto mode = static_cast<prefetch::L2PrefetchMode>(p.mode);
  for (int a = 0; a < p.arrays; ++a) {
    const auto* base = static_cast<const uint8_t*>(p.base[a]) + expert * p.expert_bytes[a];
    prefetch::PrefetchL2Share(base, p.expert_bytes[a], blockIdx.x, gridDim.x, mode);
  }
}

}  // namespace

cudaError_t InvokeMoeExpertPrefetch(const MoeExpertPrefetchParams& p, cudaStream_t stream) {
  if (p.assignments <= 0 || p.max_experts <= 0) return cudaSuccess;
  if (p.assignments > P::kMaxAssignments || p.arrays < 0 || p.arrays > P::kMaxArrays ||
      p.topk_ids == nullptr || p.max_experts > 65535) {
    return cudaErrorInvalidValue;
  }
  int blocks = p.blocks_per_expert;
  if (blocks <= 0) {
    int dev = 0, sms = 0;
    if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
    if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        e != cudaSuccess) {
      return e;
    }
    blocks = sms / p.max_experts > 1 ? sms / p.max_experts : 1;
  }
  return pdl::LaunchKernel(MoeExpertPrefetchKernel, dim3(blocks, p.max_experts), dim3(32), 0,
                           stream, p.programmatic, p);
}

}  // namespace mlaserve
