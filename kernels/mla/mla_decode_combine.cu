// Schedule and combine kernels of the split-KV MLA decode (see mla_decode.h).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/mla/mla_decode_params.h"

namespace mlaserve::mla {
namespace {

constexpr int kScheduleThreads = 1024;

__device__ __forceinline__ int SequenceCost(int len) {
  return (len + kTileTokens - 1) / kTileTokens + kSeqFixedCost;
}

// One block: prefix[b] = sum of costs of sequences < b, prefix[batch] = total,
// prefix[batch + 1] = share of one worker (tiles, >= kMinTilesPerWorker). Worker w takes the
// cost range [w * share, (w + 1) * share); sequence b is split over the workers
// prefix[b] / share .. (prefix[b + 1] - 1) / share.
__global__ void __launch_bounds__(kScheduleThreads) MlaDecodeScheduleKernel(
    const MlaDecodeKernelParams p) {
  __shared__ int sums[kScheduleThreads];
  const int tid = threadIdx.x;
  const int per = (p.batch + kScheduleThreads - 1) / kScheduleThreads;
  const int begin = min(tid * per, p.batch), end = min(begin + per, p.batch);
  int local = 0;
  for (int b = begin; b < end; ++b) local += SequenceCost(p.seq_lens[b]);
  sums[tid] = local;
  __syncthreads();
  for (int off = 1; off < kScheduleThreads; off <<= 1) {  // Inclusive scan (Hillis-Steele).
    const int v = tid >= off ? sums[tid - off] : 0;
    __syncthreads();
    sums[tid] += v;
    __syncthreads();
  }
  int run = sums[tid] - local;
  for (int b = begin; b < end; ++b) {
    p.schedule[b] = run;
    run += SequenceCost(p.seq_lens[b]);
  }
  if (tid == kScheduleThreads - 1) {
    const int total = sums[tid];
    p.schedule[p.batch] = total;
    p.schedule[p.batch + 1] = max((total + p.num_workers - 1) / p.num_workers, kMinTilesPerWorker);
  }
}

constexpr int kCombineWarps = 4;

// One warp per (sequence, query row) whose sequence was split: merges the partials by their
// log-sum-exp. Rows of unsplit sequences were written by the split kernel directly.
__global__ void __launch_bounds__(kCombineWarps * 32) MlaDecodeCombineKernel(
    const MlaDecodeKernelParams p) {
  const int lane = threadIdx.x & 31;
  const int idx = blockIdx.x * kCombineWarps + (threadIdx.x >> 5);
  if (idx >= p.batch * p.rows) return;
  const int b = idx / p.rows, row = idx % p.rows;
  const int share = p.schedule[p.batch + 1];
  const int first = p.schedule[b] / share, last = (p.schedule[b + 1] - 1) / share;
  if (first == last) return;
  const int n = last - first + 1;
  const size_t slot0 = static_cast<size_t>(first) + b;
  float mx = -INFINITY;
  for (int s = lane; s < n; s += 32) mx = fmaxf(mx, p.lse_part[(slot0 + s) * p.rows + row]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  float4 acc[4] = {};
  float wsum = 0.0f;
  for (int s = 0; s < n; ++s) {
    const float l = p.lse_part[(slot0 + s) * p.rows + row];
    const float w = mx == -INFINITY ? 0.0f : exp2f(l - mx);
    if (w == 0.0f) continue;  // Uniform across the warp.
    wsum += w;
    const float4* part =
        reinterpret_cast<const float4*>(p.o_part + ((slot0 + s) * p.rows + row) * kMlaLatentDim);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float4 v = part[k * 32 + lane];
      acc[k].x += w * v.x; acc[k].y += w * v.y; acc[k].z += w * v.z; acc[k].w += w * v.w;
    }
  }
  const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
  uint16_t* out = p.out + (static_cast<size_t>(b) * p.rows + row) * kMlaLatentDim;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(acc[k].x * inv, acc[k].y * inv);
    __nv_bfloat162 hi = __floats2bfloat162_rn(acc[k].z * inv, acc[k].w * inv);
    uint2 packed = {*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi)};
    *reinterpret_cast<uint2*>(out + (k * 32 + lane) * 4) = packed;
  }
  if (p.lse != nullptr && lane == 0) {
    p.lse[static_cast<size_t>(b) * p.rows + row] =
        wsum > 0.0f ? (mx + log2f(wsum)) * 0.693147180559945309f : -INFINITY;
  }
}

}  // namespace

cudaError_t LaunchMlaDecodeSchedule(const MlaDecodeKernelParams& p, cudaStream_t stream) {
  MlaDecodeScheduleKernel<<<1, kScheduleThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchMlaDecodeCombine(const MlaDecodeKernelParams& p, cudaStream_t stream) {
  const int warps = p.batch * p.rows;
  MlaDecodeCombineKernel<<<(warps + kCombineWarps - 1) / kCombineWarps, kCombineWarps * 32, 0,
                           stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlaserve::mla
