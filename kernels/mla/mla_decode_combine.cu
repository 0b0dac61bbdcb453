// Schedule and combine kernels of the split-KV MLA decode (see mla_decode.h).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/mla/mla_decode_params.h"

namespace mlaserve::mla {
namespace {

constexpr int kScheduleThreads = 1024;

__device__ __forceinline__ int SequenceCost(int len) {
  return (len + kCostTokens - 1) / kCostTokens + kSeqFixedCost;
}

// One block: prefix[b] = sum of costs of sequences < b, prefix[batch] = total,
// prefix[batch + 1] = share of one worker (tiles, >= kMinTilesPerWorker). Worker w takes the
// cost range [w * share, (w + 1) * share); sequence b is split over the workers
// prefix[b] / share .. (prefix[b + 1] - 1) / share.
__global__ void __launch_bounds__(kScheduleThreads)
    MlaDecodeScheduleKernel(const MlaDecodeKernelParams p) {
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

constexpr int kCombineWarps = 8;
constexpr int kCombineUnroll = 4;

// One block per (sequence, query row); rows of unsplit sequences were written by the split
// kernel and exit at once. The warps of a block stride over the sequence's partials (4 loads in
// flight each), weight them by 2^(lse - max), and reduce through shared memory.
__global__ void __launch_bounds__(kCombineWarps * 32)
    MlaDecodeCombineKernel(const MlaDecodeKernelParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int b = blockIdx.x / p.rows, row = blockIdx.x % p.rows;
  const int share = p.schedule[p.batch + 1];
  const int first = p.schedule[b] / share, last = (p.schedule[b + 1] - 1) / share;
  if (first == last) return;
  const int n = last - first + 1;
  const size_t slot0 = static_cast<size_t>(first) + b;
  __shared__ float4 acc_smem[kCombineWarps][4][32];
  __shared__ float wsum_smem[kCombineWarps];
  float mx = -INFINITY;
  for (int s = threadIdx.x; s < n; s += kCombineWarps * 32) {
    mx = fmaxf(mx, p.lse_part[(slot0 + s) * p.rows + row]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  __shared__ float mx_smem[kCombineWarps];
  if (lane == 0) mx_smem[warp] = mx;
  __syncthreads();
  mx = mx_smem[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) mx = fmaxf(mx, mx_smem[w]);

  float4 acc[4] = {};
  float wsum = 0.0f;
  for (int s0 = warp; s0 < n; s0 += kCombineWarps * kCombineUnroll) {
    float w[kCombineUnroll];
    float4 v[kCombineUnroll][4];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int s = s0 + u * kCombineWarps;
      w[u] = 0.0f;
      if (s < n) {
        const float l = p.lse_part[(slot0 + s) * p.rows + row];
        w[u] = mx == -INFINITY ? 0.0f : exp2f(l - mx);  // Empty pieces (lse -inf) weigh 0.
        const float4* part = reinterpret_cast<const float4*>(
            p.o_part + ((slot0 + s) * p.rows + row) * kMlaLatentDim);
#pragma unroll
        for (int k = 0; k < 4; ++k) v[u][k] = part[k * 32 + lane];
      }
    }
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      if (w[u] == 0.0f) continue;  // Also skips never-written rows of empty pieces.
      wsum += w[u];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        acc[k].x += w[u] * v[u][k].x;
        acc[k].y += w[u] * v[u][k].y;
        acc[k].z += w[u] * v[u][k].z;
        acc[k].w += w[u] * v[u][k].w;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) acc_smem[warp][k][lane] = acc[k];
  if (lane == 0) wsum_smem[warp] = wsum;
  __syncthreads();
  if (warp != 0) return;
  wsum = 0.0f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) wsum += wsum_smem[w];
  for (int k = 0; k < 4; ++k) {
    acc[k] = acc_smem[0][k][lane];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) {
      const float4 x = acc_smem[w][k][lane];
      acc[k].x += x.x;
      acc[k].y += x.y;
      acc[k].z += x.z;
      acc[k].w += x.w;
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
  MlaDecodeCombineKernel<<<p.batch * p.rows, kCombineWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlaserve::mla
