// Which local expert a row tile of the grouped expert GEMMs belongs to (every GEMM kernel with a
// grid row per possible tile: moe_weight_only_gemm.cuh, moe_weight_only_wgmma.cuh,
// bf16_moe_gemm.cuh).
#pragma once

#include <cstdint>

namespace mlaserve::moe_gemm {

// The largest e with tile_offsets[e] <= tile, for a tile below tile_offsets[num_experts]
// (InvokeMoeDispatch's row-tile offsets; experts without rows have tile_offsets[e] ==
// tile_offsets[e + 1] and are skipped by "largest"). Read through L2 (__ldcg): the offsets are
// written by this step's dispatch kernel, never from a stale L1 line.
__device__ __forceinline__ int ExpertOfTile(const int32_t* tile_offsets, int num_experts,
                                            int tile) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldcg(tile_offsets + mid) <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The same search over a block's shared-memory copy of the offsets (the few-expert kernel,
// moe_few_expert_gemm.cuh, which reads them once a block).
__device__ __forceinline__ int ExpertOfTileShared(const int* s_tile_offsets, int num_experts,
                                                  int tile) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (s_tile_offsets[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace mlaserve::moe_gemm
