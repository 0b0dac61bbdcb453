// The split decode kernels' in-kernel schedule (MlaDecodeScheduleKernel's arithmetic, for batches
// up to kInlineScheduleMaxBatch): the cost prefix over sequences and the per-worker share, computed
// by every block of the split kernel into shared memory (block 0 also stores it for the combine
// kernel), the search for a worker's first sequence and a sequence's piece of a worker's range.
// Shared by mla_decode_sliced.cuh and mla_decode_wgmma.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mla/mla_decode_params.h"

namespace mlaserve::mla {

// sched: >= kMaxBatch + 2 int32 of shared memory, p.batch <= kMaxBatch. Returns sched (the
// prefix P[0..batch], then total at [batch] and the share at [batch + 1]). Call from every thread.
template <int kThreads, int kMaxBatch = kInlineScheduleMaxBatch>
__device__ __forceinline__ const int32_t* InlineSchedule(const MlaDecodeKernelParams& p,
                                                         int32_t* sched) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kPer = (kMaxBatch + kThreads - 1) / kThreads;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  int cost[kPer], local = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int bb = tid * kPer + i;
    cost[i] = bb < p.batch ? MlaScheduledCost(p.seq_lens[bb], p.fixed_share) : 0;
    local += cost[i];
  }
  int incl = local;  // inclusive scan over the warp, then over the warp totals
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += v;
  }
  int* warp_tot = sched;  // scratch for the warp totals, overwritten after the next barrier
  if (lane == 31) warp_tot[w] = incl;
  __syncthreads();
  int base = 0, total = 0;
#pragma unroll
  for (int ww = 0; ww < kWarps; ++ww) {
    const int t = warp_tot[ww];
    base += ww < w ? t : 0;
    total += t;
  }
  __syncthreads();  // warp_tot read before sched is written
  int run = base + incl - local;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int bb = tid * kPer + i;
    if (bb < p.batch) sched[bb] = run;
    run += cost[i];
  }
  if (tid == 0) {
    sched[p.batch] = total;
    sched[p.batch + 1] = p.fixed_share > 0
                             ? p.fixed_share
                             : MlaBalancedShare(total, p.num_workers, p.min_share);
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int i = tid; i < p.batch + 2; i += kThreads) p.schedule[i] = sched[i];
  }
  return sched;
}

// The last sequence whose cost range starts at or before cost_begin.
__device__ __forceinline__ int FirstSequence(const int32_t* prefix, int batch, int cost_begin) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (prefix[mid] <= cost_begin)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Sequence b's piece of a worker's cost range [cost_begin, cost_end): its tokens [tok_begin,
// tok_end) (the range's 16-token units after the sequence's fixed cost) and whether the worker
// holds the whole sequence (it then writes the output itself, else a partial for the combine).
struct SeqPiece {
  int len, tok_begin, tok_end;
  bool whole;
};
__device__ __forceinline__ SeqPiece PieceOfSequence(const MlaDecodeKernelParams& p,
                                                    const int32_t* prefix, int b, int cost_begin,
                                                    int cost_end) {
  const int seq_cost_begin = prefix[b], seq_cost_end = prefix[b + 1];
  SeqPiece s;
  s.len = p.seq_lens[b];
  const int ncost = (s.len + kCostTokens - 1) / kCostTokens;
  const int local_begin = max(cost_begin, seq_cost_begin) - seq_cost_begin;
  const int local_end = min(cost_end, seq_cost_end) - seq_cost_begin;
  s.tok_begin = min(max(local_begin - kSeqFixedCost, 0), ncost) * kCostTokens;
  s.tok_end = min(min(max(local_end - kSeqFixedCost, 0), ncost) * kCostTokens, s.len);
  s.whole = seq_cost_begin >= cost_begin && seq_cost_end <= cost_end;
  return s;
}

}  // namespace mlaserve::mla
