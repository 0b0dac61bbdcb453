#include <cub/block/block_scan.cuh>

#include "kernels/moe/moe_dispatch.h"
#include "kernels/programmatic_launch.cuh"
#include "kernels/resident_blocks.h"

namespace mlaserve {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxLocalExperts = 1024;
constexpr int kChunk = 8192;  // assignments staged in shared memory per placement round

constexpr int kWarps = kThreads / 32;
// Batches of more assignments than this use the block-parallel placement (kParallel). Was 2048
// until session 10: at 2,048 assignments (256 tokens x top-8) warp 0's walk took 15 us of a
// 400 us Kimi-K2.5 EP8 decode layer (H200, moe_bench --decode).
#ifndef MLASERVE_MOE_DISPATCH_PARALLEL_MIN
#define MLASERVE_MOE_DISPATCH_PARALLEL_MIN 256
#endif
constexpr int kParallelMinAssignments = MLASERVE_MOE_DISPATCH_PARALLEL_MIN;
constexpr int kParallelChunk = 4096;  // assignments per round: 128 a warp, 4 lane strides

// Dynamic shared memory of the parallel placement: a uint16 count per warp and local expert.
size_t ParallelSmemBytes(int num_local_experts) {
  return static_cast<size_t>(kWarps) * ((num_local_experts + 1) / 2 * 2) * sizeof(uint16_t);
}

// kParallel false: warp 0 places every assignment (32 a step). kParallel true: the 32 warps
// place a chunk's 32 consecutive slices at once; the same rows (a stable counting sort), in
// chunk / 32 / 32 steps a warp instead of chunk / 32 (262,144 assignments: 256 steps a warp
// against 8,192).
template <bool kParallel>
__global__ void __launch_bounds__(kThreads) MoeDispatchKernel(const MoeDispatchParams p) {
  using Scan = cub::BlockScan<int, kThreads>;
  constexpr int kStage = kParallel ? kParallelChunk : kChunk;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int s_count[kMaxLocalExperts];
  __shared__ int s_cursor[kMaxLocalExperts];
  __shared__ int s_local[kStage];
  // Launched plainly, or programmatically (then nothing is read or written before the wait: the
  // router's ids, and earlier layers' reads of the offsets, are done once it returns). Lets a
  // programmatically launched gate_up become resident now and wait for this grid in its prologue.
  pdl::WaitForPrerequisiteGrid();
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
  // Stable placement: assignments in order, lanes with the same expert get consecutive rows by
  // their lane order (match + popc).
  const int lane = tid & 31, warp = tid >> 5;
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int base = 0; base < A; base += kStage) {
    const int n = min(kStage, A - base);
    for (int i = tid; i < n; i += kThreads) {
      const int local = p.topk_ids[base + i] - p.first_expert;
      s_local[i] = (local >= 0 && local < E) ? local : -1;
    }
    __syncthreads();
    if constexpr (!kParallel) {
      // Warp 0 walks the chunk, 32 at a time.
      if (warp == 0) {
        for (int i0 = 0; i0 < n; i0 += 32) {
          const int i = i0 + lane;
          const int local = i < n ? s_local[i] : -2;
          const unsigned peers = __match_any_sync(0xffffffffu, local);
          const int rank = __popc(peers & lanes_below);
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
    } else {
      // Warp w owns slice [w * len, (w + 1) * len) of the chunk. (1) Its per-expert counts;
      // (2) per expert, the counts turned into each slice's first row relative to the chunk's
      // (in warp order, so slice w's rows follow slice w - 1's), the chunk's total kept in
      // s_count; (3) each warp walks its slice as warp 0 does above, from its own bases.
      extern __shared__ uint16_t s_warp_rows[];  // [kWarps][E rounded up to even]
      const int stride = (E + 1) / 2 * 2;
      uint16_t* mine = s_warp_rows + warp * stride;
      const int len = (n + kWarps - 1) / kWarps;
      const int lo = min(n, warp * len), hi = min(n, lo + len);
      for (int e = lane; e < E; e += 32) mine[e] = 0;
      __syncwarp();
      for (int i0 = lo; i0 < hi; i0 += 32) {
        const int i = i0 + lane;
        const int local = i < hi ? s_local[i] : -2;
        const unsigned peers = __match_any_sync(0xffffffffu, local);
        if (local >= 0 && (peers & lanes_below) == 0) {
          mine[local] = static_cast<uint16_t>(mine[local] + __popc(peers));
        }
        __syncwarp();
      }
      __syncthreads();
      for (int e = tid; e < E; e += kThreads) {
        int run = 0;  // <= kParallelChunk: fits the uint16 slots
        for (int w = 0; w < kWarps; ++w) {
          const int c = s_warp_rows[w * stride + e];
          s_warp_rows[w * stride + e] = static_cast<uint16_t>(run);
          run += c;
        }
        s_count[e] = run;
      }
      __syncthreads();
      for (int i0 = lo; i0 < hi; i0 += 32) {
        const int i = i0 + lane;
        const int local = i < hi ? s_local[i] : -2;
        const unsigned peers = __match_any_sync(0xffffffffu, local);
        const int rank = __popc(peers & lanes_below);
        if (local >= 0) {
          const int row = s_cursor[local] + mine[local] + rank;
          p.sorted_assignment[row] = base + i;
          p.assignment_row[base + i] = row;
        } else if (local == -1) {
          p.assignment_row[base + i] = -1;
        }
        __syncwarp();
        if (local >= 0 && rank == 0) mine[local] = static_cast<uint16_t>(mine[local] + __popc(peers));
        __syncwarp();
      }
      __syncthreads();
      for (int e = tid; e < E; e += kThreads) s_cursor[e] += s_count[e];
    }
    __syncthreads();
  }
}

}  // namespace

cudaError_t InvokeMoeDispatch(const MoeDispatchParams& p, cudaStream_t stream) {
  if (p.num_local_experts < 1 || p.num_local_experts > kMaxLocalExperts || p.tile_tokens < 1) {
    return cudaErrorInvalidValue;
  }
  if (p.tokens * p.top_k <= kParallelMinAssignments) {
    return pdl::LaunchKernel(MoeDispatchKernel<false>, dim3(1), dim3(kThreads), 0, stream,
                             p.programmatic, p);
  }
  const size_t smem = ParallelSmemBytes(p.num_local_experts);
  if (cudaError_t e = OptInDynamicSmem(MoeDispatchKernel<true>, static_cast<int>(smem));
      e != cudaSuccess) {
    return e;
  }
  return pdl::LaunchKernel(MoeDispatchKernel<true>, dim3(1), dim3(kThreads), smem, stream,
                           p.programmatic, p);
}

}  // namespace mlaserve
