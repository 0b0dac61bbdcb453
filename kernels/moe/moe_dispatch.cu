#include <cub/block/block_scan.cuh>

#include "kernels/moe/moe_dispatch.h"
#include "kernels/programmatic_launch.cuh"

namespace mlaserve {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxLocalExperts = 1024;
constexpr int kChunk = 8192;  // assignments staged in shared memory per placement round

__global__ void __launch_bounds__(kThreads) MoeDispatchKernel(const MoeDispatchParams p) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int s_count[kMaxLocalExperts];
  __shared__ int s_cursor[kMaxLocalExperts];
  __shared__ int s_local[kChunk];
  // Launched plainly (everything before it has finished); lets a programmatically launched
  // gate_up become resident now and wait for this grid in its prologue.
  pdl::AllowDependentLaunch();
  const int tid = threadIdx.x;
  const int E = p.num_local_experts;
  const int A = p.tokens * p.top_k;
  for (int e = tid; e < E; e += kThreads) s_count[e] = 0;
  __syncthreads();
  for (int a = tid; a < A; a += kThreads) {
    const int local = p.topk_ids[a] - p.first_expert;
    if (local >= 0 && local < E) atomicAdd(&s_count[local], 1);
  }
  __syncthreads();
  const int count = tid < E ? s_count[tid] : 0;
  int offset, tile_offset, total, total_tiles;
  Scan(scan_storage).ExclusiveSum(count, offset, total);
  __syncthreads();
  const int tiles = (count + p.tile_tokens - 1) / p.tile_tokens;
  Scan(scan_storage).ExclusiveSum(tiles, tile_offset, total_tiles);
  if (tid < E) {
    p.expert_counts[tid] = count;
    p.expert_offsets[tid] = offset;
    p.tile_offsets[tid] = tile_offset;
    s_cursor[tid] = offset;
  }
  if (tid == 0) {
    p.expert_offsets[E] = total;
    p.tile_offsets[E] = total_tiles;
  }
  __syncthreads();
  // Stable placement: warp 0 walks the assignments in order, 32 at a time; lanes with the same
  // expert get consecutive rows by their lane order (match + popc).
  const int lane = tid & 31;
  for (int base = 0; base < A; base += kChunk) {
    const int n = min(kChunk, A - base);
    for (int i = tid; i < n; i += kThreads) {
      const int local = p.topk_ids[base + i] - p.first_expert;
      s_local[i] = (local >= 0 && local < E) ? local : -1;
    }
    __syncthreads();
    if (tid < 32) {
      for (int i0 = 0; i0 < n; i0 += 32) {
        const int i = i0 + lane;
        const int local = i < n ? s_local[i] : -2;
        const unsigned peers = __match_any_sync(0xffffffffu, local);
        const int rank = __popc(peers & ((1u << lane) - 1u));
        if (local >= 0) {
          const int row = s_cursor[local] + rank;
          p.sorted_assignment[row] = base + i;
          p.assignment_row[base + i] = row;
        } else if (local == -1) {
          p.assignment_row[base + i] = -1;
        }
        __syncwarp();
        if (local >= 0 && rank == 0) s_cursor[local] += __popc(peers);
        __syncwarp();
      }
    }
    __syncthreads();
  }
}

}  // namespace

cudaError_t InvokeMoeDispatch(const MoeDispatchParams& p, cudaStream_t stream) {
  if (p.num_local_experts < 1 || p.num_local_experts > kMaxLocalExperts || p.tile_tokens < 1) {
    return cudaErrorInvalidValue;
  }
  MoeDispatchKernel<<<1, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlaserve
