// Schedule and combine kernels of the split-KV MLA decode (see mla_decode.h).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/mla/mla_decode_params.h"
#include "kernels/mla/mla_decode_timeline.cuh"
#include "kernels/programmatic_launch.cuh"

namespace mlaserve::mla {
namespace {

constexpr int kScheduleThreads = 1024;

// One block: prefix[b] = sum of costs of sequences < b, prefix[batch] = total,
// prefix[batch + 1] = share of one worker (cost units, MlaBalancedShare). Worker w takes the
// cost range [w * share, (w + 1) * share); sequence b is split over the workers
// prefix[b] / share .. (prefix[b + 1] - 1) / share.
__global__ void __launch_bounds__(kScheduleThreads)
    MlaDecodeScheduleKernel(const MlaDecodeKernelParams p) {
  __shared__ int sums[kScheduleThreads];
  const int tid = threadIdx.x;
  const int per = (p.batch + kScheduleThreads - 1) / kScheduleThreads;
  const int begin = min(tid * per, p.batch), end = min(begin + per, p.batch);
  int local = 0;
  for (int b = begin; b < end; ++b) local += MlaScheduledCost(p.seq_lens[b], p.fixed_share);
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
    run += MlaScheduledCost(p.seq_lens[b], p.fixed_share);
  }
  if (tid == kScheduleThreads - 1) {
    const int total = sums[tid];
    p.schedule[p.batch] = total;
    p.schedule[p.batch + 1] =
        p.fixed_share > 0 ? p.fixed_share
                          : MlaBalancedShare(total, p.num_workers, p.min_share);
  }
}

// Up to this many (sequence, row) pairs the combine runs 16 warps x 8 loads in flight per block
// instead of 8 x 4: then the grid (batch * rows * 4 blocks) is below one block per SM and each
// row has hundreds of partials (batch 1 x 32k x 16 heads: 64 blocks, 264 partials each), so the
// time is rounds of load latency. Measured on the H200 (bench/RESULTS.md, session 3): batch 1,
// 16 heads, 32k: bf16 27.5 -> 25.6 us, fp8 25.8 -> 23.8 us; at 128 rows (batch 8 x 16 heads,
// batch 1 x 128 heads, 512 blocks) the wide form was 1-5% slower, hence the limit.
constexpr int kWideCombineRows = 16;

// A sequence's partial outputs: workspace slots slot0 .. slot0 + n - 1 (worker w's piece of
// sequence b lies in slot w + b). n == 1: the sequence was not split and the split kernel wrote
// its rows itself.
struct RowPartials {
  size_t slot0;
  int n;
};
__device__ __forceinline__ RowPartials PartialsOf(const MlaDecodeKernelParams& p, int b) {
  const int share = p.schedule[p.batch + 1];
  const int first = p.schedule[b] / share, last = (p.schedule[b + 1] - 1) / share;
  return {static_cast<size_t>(first) + b, last - first + 1};
}
// A row's lse (natural log) from its partials' largest log2-sum-exp and their weight sum.
__device__ __forceinline__ float RowLse(float mx, float wsum) {
  return wsum > 0.0f ? (mx + log2f(wsum)) * 0.693147180559945309f : -INFINITY;
}

// A lane's 4 consecutive fp32 columns (128 columns a warp).
struct Cols {
  float v[4];
  __device__ __forceinline__ static Cols Zero() { return {{0.0f, 0.0f, 0.0f, 0.0f}}; }
  __device__ __forceinline__ static Cols Load(const float* p) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    return {{x.x, x.y, x.z, x.w}};
  }
  __device__ __forceinline__ void Fma(float w, const Cols& x) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] += w * x.v[i];
  }
  __device__ __forceinline__ void Add(const Cols& x) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] += x.v[i];
  }
  // The columns times inv, as bf16, at out.
  __device__ __forceinline__ void StoreBf16(uint16_t* out, float inv) const {
    __nv_bfloat162 lo = __floats2bfloat162_rn(v[0] * inv, v[1] * inv);
    __nv_bfloat162 hi = __floats2bfloat162_rn(v[2] * inv, v[3] * inv);
    *reinterpret_cast<uint2*>(out) =
        make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
  }
};

// One block per (sequence, query row, column chunk of 128 columns); rows of unsplit
// sequences were written by the split kernel and exit at once. The warps of a block stride over
// the sequence's partials (kUnroll loads in flight each, 4 floats per lane), weight them by
// 2^(lse - max), and reduce through shared memory. Splitting columns over 4 blocks keeps batch 1
// (hundreds of partials per row) from resting on batch * rows blocks (16 blocks of 32 columns for
// calls of at most 16 rows measured no faster: bench/RESULTS.md, session 33).
template <int kCombineWarps, int kCombineUnroll>
__global__ void __launch_bounds__(kCombineWarps * 32)
    MlaDecodeCombineKernel(const MlaDecodeKernelParams p) {
  constexpr int kChunks = kMlaLatentDim / 128;
  // Launched plainly or programmatically (MlaDecodeParams::programmatic_combine): nothing is
  // read before the split kernel has finished (its schedule, partials and outputs).
  pdl::WaitForPrerequisiteGrid();
  pdl::AllowDependentLaunch();  // a programmatic successor (the v expand) may set up
  MlaTimelineStamp(p, kMlaTimelineBlocks + blockIdx.x, kMlaCombineEntry);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunk = blockIdx.x % kChunks;
  const int b = blockIdx.x / kChunks / p.rows, row = blockIdx.x / kChunks % p.rows;
  const RowPartials parts = PartialsOf(p, b);
  if (parts.n == 1) return;
  const int n = parts.n;
  const size_t slot0 = parts.slot0;
  __shared__ Cols acc_smem[kCombineWarps][32];
  __shared__ float wsum_smem[kCombineWarps];
  __shared__ float mx_smem[kCombineWarps];
  float mx = -INFINITY;
  for (int s = threadIdx.x; s < n; s += kCombineWarps * 32) {
    mx = fmaxf(mx, p.lse_part[(slot0 + s) * p.rows + row]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) mx_smem[warp] = mx;
  __syncthreads();
  mx = mx_smem[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) mx = fmaxf(mx, mx_smem[w]);

  Cols acc = Cols::Zero();
  float wsum = 0.0f;
  const int col = chunk * 128 + lane * 4;
  for (int s0 = warp; s0 < n; s0 += kCombineWarps * kCombineUnroll) {
    float w[kCombineUnroll];
    Cols v[kCombineUnroll];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int s = s0 + u * kCombineWarps;
      w[u] = 0.0f;
      if (s < n) {
        const float l = p.lse_part[(slot0 + s) * p.rows + row];
        w[u] = mx == -INFINITY ? 0.0f : exp2f(l - mx);  // Empty pieces (lse -inf) weigh 0.
        v[u] = Cols::Load(p.o_part + ((slot0 + s) * p.rows + row) * kMlaLatentDim + col);
      }
    }
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      if (w[u] == 0.0f) continue;  // Also skips never-written rows of empty pieces.
      wsum += w[u];
      acc.Fma(w[u], v[u]);
    }
  }
  acc_smem[warp][lane] = acc;
  if (lane == 0) wsum_smem[warp] = wsum;
  __syncthreads();
  if (warp != 0) return;
  wsum = 0.0f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) wsum += wsum_smem[w];
  acc = acc_smem[0][lane];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) acc.Add(acc_smem[w][lane]);
  const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
  acc.StoreBf16(p.out + (static_cast<size_t>(b) * p.rows + row) * kMlaLatentDim + col, inv);
  if (p.lse != nullptr && chunk == 0 && lane == 0) {
    p.lse[static_cast<size_t>(b) * p.rows + row] = RowLse(mx, wsum);
  }
  MlaTimelineStamp(p, kMlaTimelineBlocks + blockIdx.x, kMlaCombineExit);
}

// One warp per (sequence, query row), kRowWarps a block (MlaDecodeParams::combine_row_warps): the
// warp weighs the row's partials one after another, each lane holding 16 of the 512 columns (four
// float4, 512 B a warp a load). For calls with many rows and few partials a row (128 heads x batch
// 64: 8,192 rows of two or three partials), where one block per (row, 128 columns) spends most of
// its warps idle.
template <int kRowWarps, int kRowUnroll>
__global__ void __launch_bounds__(kRowWarps * 32)
    MlaDecodeCombineRowsKernel(const MlaDecodeKernelParams p) {
  pdl::WaitForPrerequisiteGrid();
  pdl::AllowDependentLaunch();
  MlaTimelineStamp(p, kMlaTimelineBlocks + blockIdx.x, kMlaCombineEntry);
  const int lane = threadIdx.x & 31;
  const int pair = blockIdx.x * kRowWarps + (threadIdx.x >> 5);
  if (pair >= p.batch * p.rows) return;
  const int b = pair / p.rows, row = pair % p.rows;
  const RowPartials parts = PartialsOf(p, b);
  if (parts.n == 1) return;  // unsplit: the split kernel wrote the row
  const int n = parts.n;
  const size_t slot0 = parts.slot0;
  float mx = -INFINITY;
  for (int s = lane; s < n; s += 32) mx = fmaxf(mx, p.lse_part[(slot0 + s) * p.rows + row]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  float4 acc[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float wsum = 0.0f;
  // kRowUnroll partials' loads in flight (rows of batch 1 have hundreds of partials); the sums
  // still run in partial order, so the bits do not depend on the unroll.
  for (int s0 = 0; s0 < n; s0 += kRowUnroll) {
    float w[kRowUnroll];
    float4 x[kRowUnroll][4];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int s = s0 + u;
      w[u] = 0.0f;
      if (s < n) {
        const float l = p.lse_part[(slot0 + s) * p.rows + row];
        w[u] = mx == -INFINITY ? 0.0f : exp2f(l - mx);  // Empty pieces (lse -inf) weigh 0.
      }
      if (w[u] != 0.0f) {  // Never-written rows of empty pieces are not read.
        const float4* v = reinterpret_cast<const float4*>(p.o_part + ((slot0 + s) * p.rows + row) *
                                                                         kMlaLatentDim);
#pragma unroll
        for (int k = 0; k < 4; ++k) x[u][k] = v[32 * k + lane];
      }
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      if (w[u] == 0.0f) continue;
      wsum += w[u];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        acc[k].x += w[u] * x[u][k].x;
        acc[k].y += w[u] * x[u][k].y;
        acc[k].z += w[u] * x[u][k].z;
        acc[k].w += w[u] * x[u][k].w;
      }
    }
  }
  const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
  uint16_t* out = p.out + (static_cast<size_t>(b) * p.rows + row) * kMlaLatentDim;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(acc[k].x * inv, acc[k].y * inv);
    __nv_bfloat162 hi = __floats2bfloat162_rn(acc[k].z * inv, acc[k].w * inv);
    *reinterpret_cast<uint2*>(out + 4 * (32 * k + lane)) =
        make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
  }
  if (p.lse != nullptr && lane == 0) {
    p.lse[static_cast<size_t>(b) * p.rows + row] = RowLse(mx, wsum);
  }
  MlaTimelineStamp(p, kMlaTimelineBlocks + blockIdx.x, kMlaCombineExit);
}
constexpr int kCombineRowWarps = 8;

}  // namespace

cudaError_t LaunchMlaDecodeSchedule(const MlaDecodeKernelParams& p, cudaStream_t stream) {
  MlaDecodeScheduleKernel<<<1, kScheduleThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchMlaDecodeCombine(const MlaDecodeKernelParams& p, cudaStream_t stream) {
  // Batch-invariant schedules always take the narrow form: the wide one sums a row's partials
  // in another order, and which one runs would depend on the batch.
  const bool programmatic = p.programmatic_combine != 0;
  const int pairs = p.batch * p.rows;
  if (p.fixed_share == 0 && p.combine_row_warps != 0 && pairs > kWideCombineRows) {
    const int row_blocks = (pairs + kCombineRowWarps - 1) / kCombineRowWarps;
    return pdl::LaunchKernel(MlaDecodeCombineRowsKernel<kCombineRowWarps, 4>, dim3(row_blocks),
                             dim3(kCombineRowWarps * 32), 0, stream, programmatic, p);
  }
  if (p.fixed_share == 0 && pairs <= kWideCombineRows) {
    return pdl::LaunchKernel(MlaDecodeCombineKernel<16, 8>, dim3(pairs * 4), dim3(16 * 32), 0,
                             stream, programmatic, p);
  }
  return pdl::LaunchKernel(MlaDecodeCombineKernel<8, 4>, dim3(pairs * 4), dim3(8 * 32), 0, stream,
                           programmatic, p);
}

}  // namespace mlaserve::mla
