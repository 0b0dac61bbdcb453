// Skinny projections (skinny_gemm.h): one warp streams a few weight rows with 16-byte loads, the
// activation rows (at most kSkinnyMaxRows, L1-resident) are read beside them.
#include "kernels/linear/skinny_gemm.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <limits>

#include "kernels/programmatic_launch.cuh"
#include "kernels/warp_ptx.cuh"

namespace mlaserve {
namespace {

constexpr int kTnWarps = 4;       // W [n, k]: warps per block
constexpr int kTnRowsPerWarp = 2;  // weight rows a warp streams side by side
constexpr int kTnUnroll = 4;       // 16-byte chunks per row in flight per lane

// A read-once weight vector: not kept in L1.
__device__ __forceinline__ uint4 LdgStream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float Lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float Hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

// acc + the 8 products of a weight chunk and an activation chunk, in element order.
__device__ __forceinline__ float Dot8(const uint4& w, const float (&x)[8], float acc) {
  acc = fmaf(Lo(w.x), x[0], acc);
  acc = fmaf(Hi(w.x), x[1], acc);
  acc = fmaf(Lo(w.y), x[2], acc);
  acc = fmaf(Hi(w.y), x[3], acc);
  acc = fmaf(Lo(w.z), x[4], acc);
  acc = fmaf(Hi(w.z), x[5], acc);
  acc = fmaf(Lo(w.w), x[6], acc);
  acc = fmaf(Hi(w.w), x[7], acc);
  return acc;
}

// v rounded to bf16 and back (the transformed activations are what a separate op would store).
__device__ __forceinline__ float RoundBf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

__device__ __forceinline__ void Expand8(const uint4& v, float (&f)[8]) {
  f[0] = Lo(v.x);
  f[1] = Hi(v.x);
  f[2] = Lo(v.y);
  f[3] = Hi(v.y);
  f[4] = Lo(v.z);
  f[5] = Hi(v.z);
  f[6] = Lo(v.w);
  f[7] = Hi(v.w);
}

__device__ __forceinline__ void Store(const SkinnyGemmSegment& s, int64_t offset, float v) {
  if (s.out_dtype == DType::kF32) {
    static_cast<float*>(s.out)[offset] = v;
  } else {
    static_cast<__nv_bfloat16*>(s.out)[offset] = __float2bfloat16_rn(v);
  }
}

// W [n, k]. Block: kTnWarps warps = (kTnWarps / S) row groups x S K slices; a row group is
// kTnRowsPerWarp consecutive rows of one segment. blockIdx.x walks the segments' row groups
// (block_begin: each segment's first block), blockIdx.y the batch.
// Programmatic launches: the first weight loads go out before WaitForPrerequisiteGrid (weights
// are constant), x is read and out written only after it (`waited`, per thread).
__device__ __forceinline__ void WaitOnce(const SkinnyGemmArgs& a, bool& waited) {
  if (a.programmatic && !waited) {
    pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }
  waited = true;
}

// Which segment work block bx belongs to, and its index within that segment (block_begin: each
// segment's first block; both kernels' grids walk the segments' blocks in order).
struct SegmentBlock {
  int seg, block;
};
__device__ __forceinline__ SegmentBlock SegmentOfBlock(const SkinnyGemmArgs& a,
                                                       const int4 block_begin, const int bx) {
  const int begins[4] = {block_begin.x, block_begin.y, block_begin.z, block_begin.w};
  int seg = 0;
#pragma unroll
  for (int s = 1; s < kSkinnyMaxSegments; ++s) {
    if (s < a.num_segments && bx >= begins[s]) seg = s;
  }
  return {seg, bx - begins[seg]};
}

template <int M, int S, SkinnyPrologue P>
__device__ __forceinline__ void SkinnyTnBlock(const SkinnyGemmArgs& a, const int4 block_begin,
                                              const int bx, bool& waited,
                                              [[maybe_unused]] const float* inv) {
  constexpr int kGroups = kTnWarps / S;
  constexpr int kRowsPerBlock = kGroups * kTnRowsPerWarp;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = warp / S, slice = warp % S;
  const SegmentBlock sb = SegmentOfBlock(a, block_begin, bx);
  const SkinnyGemmSegment& sg = a.seg[sb.seg];
  const int n = static_cast<int>(sg.n);
  const int row0 = sb.block * kRowsPerBlock + group * kTnRowsPerWarp;
  const int64_t b = blockIdx.y;
  const int chunks = static_cast<int>(a.k / 8);
  const int c_begin = chunks * slice / S, c_end = chunks * (slice + 1) / S;

  const uint4* w_rows[kTnRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kTnRowsPerWarp; ++r) {
    const int row = min(row0 + r, n - 1);  // rows past n read a valid row and are not stored
    w_rows[r] = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(sg.w) +
                                               b * a.w_batch_stride +
                                               static_cast<int64_t>(row) * a.k);
  }
  const uint4* x_rows[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    x_rows[m] = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.x) +
                                               b * a.x_batch_stride + m * a.x_stride);
  }

  // The SiLU prologue's up rows (skinny_gemm.h).
  [[maybe_unused]] const uint4* up_rows[M];
  if constexpr (P == SkinnyPrologue::kSiluMul) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      up_rows[m] = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.prologue.up) +
                                                  m * a.prologue.up_stride);
    }
  }

  float acc[kTnRowsPerWarp][M];
#pragma unroll
  for (int r = 0; r < kTnRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;

  for (int c0 = c_begin + lane; c0 < c_end; c0 += 32 * kTnUnroll) {
    uint4 wv[kTnUnroll][kTnRowsPerWarp];
#pragma unroll
    for (int u = 0; u < kTnUnroll; ++u) {
      const int c = c0 + 32 * u;
#pragma unroll
      for (int r = 0; r < kTnRowsPerWarp; ++r) {
        wv[u][r] = c < c_end ? LdgStream(w_rows[r] + c) : make_uint4(0, 0, 0, 0);
      }
    }
    WaitOnce(a, waited);
#pragma unroll
    for (int u = 0; u < kTnUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c < c_end) {
        [[maybe_unused]] float wn[8];
        if constexpr (P == SkinnyPrologue::kRmsNorm) {
          const float4* nw = reinterpret_cast<const float4*>(a.prologue.norm_weight) + 2 * c;
          const float4 w0 = __ldg(nw), w1 = __ldg(nw + 1);
          wn[0] = w0.x, wn[1] = w0.y, wn[2] = w0.z, wn[3] = w0.w;
          wn[4] = w1.x, wn[5] = w1.y, wn[6] = w1.z, wn[7] = w1.w;
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float xf[8];
          Expand8(__ldg(x_rows[m] + c), xf);
          if constexpr (P == SkinnyPrologue::kRmsNorm) {
#pragma unroll
            for (int j = 0; j < 8; ++j) xf[j] = RoundBf16(wn[j] * (xf[j] * inv[m]));
          } else if constexpr (P == SkinnyPrologue::kSiluMul) {
            float uf[8];
            Expand8(__ldg(up_rows[m] + c), uf);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              xf[j] = RoundBf16(__fmul_rn(__fdiv_rn(xf[j], 1.0f + expf(-xf[j])), uf[j]));
            }
          }
#pragma unroll
          for (int r = 0; r < kTnRowsPerWarp; ++r) acc[r][m] = Dot8(wv[u][r], xf, acc[r][m]);
        }
      }
    }
  }
  WaitOnce(a, waited);  // lanes with no chunk in their slice
#pragma unroll
  for (int r = 0; r < kTnRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], o);

  const int64_t out_base = b * a.out_batch_stride;
  if constexpr (S == 1) {
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kTnRowsPerWarp; ++r) {
        if (row0 + r < n) {
#pragma unroll
          for (int m = 0; m < M; ++m) {
            Store(sg, out_base + m * sg.out_stride + row0 + r, sg.alpha * acc[r][m]);
          }
        }
      }
    }
  } else {
    __shared__ float partial[kTnWarps][kTnRowsPerWarp][M];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kTnRowsPerWarp; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) partial[warp][r][m] = acc[r][m];
    }
    __syncthreads();
    // Lane (r, m) of each group's first warp adds the group's slices in slice order.
    if (slice == 0 && lane < kTnRowsPerWarp * M) {
      const int r = lane / M, m = lane % M;
      float sum = partial[warp][r][m];
#pragma unroll
      for (int j = 1; j < S; ++j) sum += partial[warp + j][r][m];
      if (row0 + r < n) Store(sg, out_base + m * sg.out_stride + row0 + r, sg.alpha * sum);
    }
  }
}

// The RMSNorm prologue's inverse norms of x's M rows (skinny_gemm.h), into inv (shared), once a
// block: warp w sums the squares of the row's chunks [w, w + 1) * chunks / kTnWarps (lane l
// those at l, l + 32, ... in element order, then a butterfly), and the 4 warp sums are added in
// warp order: the same order in every block and launch. Called by every thread of the block.
template <int M>
__device__ __forceinline__ void RowInvNorms(const SkinnyGemmArgs& a, float* inv) {
  __shared__ float part[kTnWarps][M];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int chunks = static_cast<int>(a.k / 8);
  const int c0 = chunks * warp / kTnWarps, c1 = chunks * (warp + 1) / kTnWarps;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const uint4* x = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.x) +
                                                    m * a.x_stride);
    float sq = 0.0f;
    for (int c = c0 + lane; c < c1; c += 32) {
      float xf[8];
      Expand8(__ldg(x + c), xf);
#pragma unroll
      for (int j = 0; j < 8; ++j) sq = fmaf(xf[j], xf[j], sq);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    if (lane == 0) part[warp][m] = sq;
  }
  __syncthreads();
  if (threadIdx.x < M) {
    float sq = part[0][threadIdx.x];
#pragma unroll
    for (int w = 1; w < kTnWarps; ++w) sq += part[w][threadIdx.x];
    // IEEE division and square root, as RmsNormRef and InvokeRmsNorm.
    inv[threadIdx.x] = 1.0f / sqrtf(sq / static_cast<float>(a.k) + a.prologue.eps);
  }
  __syncthreads();
}

// The grid is at most what fits on the device at once; each block walks work blocks bx =
// blockIdx.x, + gridDim.x, ... (no tail wave of small blocks, no block launch per 2 rows).
template <int M, int S, SkinnyPrologue P>
__global__ void __launch_bounds__(32 * kTnWarps)
    SkinnyTnKernel(const SkinnyGemmArgs a, const int4 block_begin, const int total_blocks) {
  bool waited = false;
  if (!a.programmatic) pdl::AllowDependentLaunch();
  const float* inv = nullptr;
  if constexpr (P == SkinnyPrologue::kRmsNorm) {
    __shared__ float s_inv[M];
    WaitOnce(a, waited);  // x is the previous kernel's output
    RowInvNorms<M>(a, s_inv);
    inv = s_inv;
  }
  for (int bx = blockIdx.x; bx < total_blocks; bx += gridDim.x) {
    SkinnyTnBlock<M, S, P>(a, block_begin, bx, waited, inv);
    if constexpr (S > 1) __syncthreads();  // the next block's partials reuse shared memory
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Blocks of kKernel (kThreads threads, no dynamic shared memory) one SM holds at once, queried
// once per kernel.
template <auto kKernel, int kThreads>
int ResidentBlocks() {
  static const int blocks = [] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kKernel, kThreads, 0) != cudaSuccess ||
        b < 1) {
      b = 1;
    }
    return b;
  }();
  return blocks;
}
template <int M, int S, SkinnyPrologue P>
int ResidentTnBlocks() {
  return ResidentBlocks<SkinnyTnKernel<M, S, P>, 32 * kTnWarps>();
}

// Each segment's first work block (SegmentOfBlock) at rows_per_block weight rows a block; returns
// the blocks of all segments.
int SegmentBlockBegins(const SkinnyGemmArgs& a, int rows_per_block, int4* begins) {
  int b[4] = {0, 0, 0, 0};
  int total = 0;
  for (int i = 0; i < a.num_segments; ++i) {
    b[i] = total;
    total += static_cast<int>((a.seg[i].n + rows_per_block - 1) / rows_per_block);
  }
  for (int i = a.num_segments; i < 4; ++i) b[i] = total;
  *begins = make_int4(b[0], b[1], b[2], b[3]);
  return total;
}

template <int M, int S, SkinnyPrologue P>
cudaError_t LaunchTnWith(const SkinnyGemmArgs& a, cudaStream_t stream) {
  int4 begins;
  const int total = SegmentBlockBegins(a, (kTnWarps / S) * kTnRowsPerWarp, &begins);
  const int grid_x = std::min(total, a.sm_count * ResidentTnBlocks<M, S, P>());
  return pdl::LaunchKernel(SkinnyTnKernel<M, S, P>, dim3(grid_x, a.batch), dim3(32 * kTnWarps), 0,
                           stream, a.programmatic, a, begins, total);
}

template <int M, SkinnyPrologue P>
cudaError_t LaunchTn(const SkinnyGemmArgs& a, cudaStream_t stream) {
  // K slices per row pair: the fewest that give every warp the device holds at once a share
  // (row pairs x S >= resident warps), each slice keeping >= 64 chunks (2 lane strides) where K
  // allows. Kimi-K2.5 rank 0 of 8: q_a + kv_a (7168 -> 2112) 4, q_b (1536 -> 1536) 2, o_proj
  // (1024 -> 7168) 1, gate + up + router (7168 -> 896) 4, lm_head 1.
  const int chunks = static_cast<int>(a.k / 8);
  int64_t pairs = 0;
  for (int i = 0; i < a.num_segments; ++i) pairs += (a.seg[i].n + 1) / 2;
  pairs *= a.batch;
  const int64_t resident_warps = static_cast<int64_t>(a.sm_count) * ResidentTnBlocks<M, 1, P>() *
                                 kTnWarps;
  int s = 1;
  for (int cand : {2, 4}) {
    if (pairs * s >= resident_warps || chunks / cand < 64) break;
    s = cand;
  }
  switch (s) {
    case 1: return LaunchTnWith<M, 1, P>(a, stream);
    case 2: return LaunchTnWith<M, 2, P>(a, stream);
    default: return LaunchTnWith<M, 4, P>(a, stream);
  }
}

template <SkinnyPrologue P>
cudaError_t LaunchRows(const SkinnyGemmArgs& a, cudaStream_t stream) {
  switch (a.m) {
    case 1: return LaunchTn<1, P>(a, stream);
    case 2: return LaunchTn<2, P>(a, stream);
    case 3: return LaunchTn<3, P>(a, stream);
    default: return LaunchTn<4, P>(a, stream);
  }
}

// ---------------------------------------------------------------------------------------------
// The tensor-core variant (SkinnyGemmArgs::mma): the same weight stream, the products on
// mma.sync.m16n8k16 with the weight as the A operand (16 weight rows a warp) and up to 8 (one
// n-tile) or 16 (two) activation rows as B. The CUDA-core kernel above does M fp32 FMAs a
// weight: from 5 rows it no longer keeps up with the weight stream (H200, session 10).
//
// A lane's loads are the CUDA-core kernel's 16-byte vectors, placed straight into fragments:
// lane (g, t) = (lane / 4, lane % 4) reads 8 consecutive columns 32c + 8t .. + 7 of weight rows
// g and g + 8 (vectors wa, wb) and of activation rows g (and g + 8). PTX ISA, "Matrix fragments
// for mma.m16n8k16" (.bf16): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..2t+1], a2 = A[g][2t+8..2t+9],
// a3 = A[g+8][2t+8..2t+9]; b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; d0, d1 = D[g][2t, 2t+1],
// d2, d3 = D[g+8][2t, 2t+1]. Two k-steps per 32 columns: step 0 takes words x and y of each
// vector as (a0 | a1, a2 | a3) and (b0, b1), step 1 words z and w. So the mma's k index 2t + i
// (i < 2) is column 32c + 8t + 4s + i and 2t + 8 + i is 32c + 8t + 4s + 2 + i for both operands:
// a permutation of the 32 columns, the same for A and B, which a dot product does not see.
// Summation: the mma's own order within each 16-column step, steps in column order per slice,
// slices added in slice order; independent of the other activation rows.
constexpr int kMmaWarps = 4;
constexpr int kMmaUnroll = 4;  // 32-column groups in flight per lane (2 x 64 B of weights each)

template <int NT, int S>
__device__ __forceinline__ void SkinnyMmaBlock(const SkinnyGemmArgs& a, const int4 block_begin,
                                               const int bx, bool& waited) {
  constexpr int kGroups = kMmaWarps / S;
  constexpr int kRowsPerBlock = kGroups * 16;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int group = warp / S, slice = warp % S;
  const SegmentBlock sb = SegmentOfBlock(a, block_begin, bx);
  const SkinnyGemmSegment& sg = a.seg[sb.seg];
  const int n = static_cast<int>(sg.n);
  const int row0 = sb.block * kRowsPerBlock + group * 16;
  const int64_t b = blockIdx.y;
  const int groups = static_cast<int>(a.k / 32);
  const int c_begin = groups * slice / S, c_end = groups * (slice + 1) / S;

  // Rows past n read row n - 1 and tokens past m read row m - 1; neither is stored.
  const __nv_bfloat16* w = static_cast<const __nv_bfloat16*>(sg.w) + b * a.w_batch_stride;
  const uint4* wa =
      reinterpret_cast<const uint4*>(w + static_cast<int64_t>(min(row0 + g, n - 1)) * a.k + 8 * t);
  const uint4* wb = reinterpret_cast<const uint4*>(
      w + static_cast<int64_t>(min(row0 + g + 8, n - 1)) * a.k + 8 * t);
  const uint4* xr[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    xr[nt] = reinterpret_cast<const uint4*>(
        static_cast<const __nv_bfloat16*>(a.x) + b * a.x_batch_stride +
        static_cast<int64_t>(min(nt * 8 + g, a.m - 1)) * a.x_stride + 8 * t);
  }

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;

  for (int c0 = c_begin; c0 < c_end; c0 += kMmaUnroll) {
    uint4 va[kMmaUnroll], vb[kMmaUnroll];
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int c = c0 + u;  // a 32-column group is 4 vectors of a row
      va[u] = c < c_end ? LdgStream(wa + 4 * c) : make_uint4(0, 0, 0, 0);
      vb[u] = c < c_end ? LdgStream(wb + 4 * c) : make_uint4(0, 0, 0, 0);
    }
    WaitOnce(a, waited);
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int c = c0 + u;
      if (c < c_end) {
        const uint32_t a0[4] = {va[u].x, vb[u].x, va[u].y, vb[u].y};
        const uint32_t a1[4] = {va[u].z, vb[u].z, va[u].w, vb[u].w};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint4 xv = __ldg(xr[nt] + 4 * c);
          ptx::MmaBf16(acc[nt], a0, xv.x, xv.y);
          ptx::MmaBf16(acc[nt], a1, xv.z, xv.w);
        }
      }
    }
  }
  WaitOnce(a, waited);  // slices with no column group

  const int64_t out_base = b * a.out_batch_stride;
  auto store = [&](int nt, int i, float v) {
    const int row = row0 + g + (i >= 2 ? 8 : 0), token = nt * 8 + 2 * t + (i & 1);
    if (row < n && token < a.m) Store(sg, out_base + token * sg.out_stride + row, sg.alpha * v);
  };
  if constexpr (S == 1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) store(nt, i, acc[nt][i]);
  } else {
    __shared__ float partial[kMmaWarps][NT][4][32];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][nt][i][lane] = acc[nt][i];
    __syncthreads();
    if (slice == 0) {  // the group's first warp adds its slices in slice order
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float sum = acc[nt][i];
#pragma unroll
          for (int j = 1; j < S; ++j) sum += partial[warp + j][nt][i][lane];
          store(nt, i, sum);
        }
    }
  }
}

template <int NT, int S>
__global__ void __launch_bounds__(32 * kMmaWarps)
    SkinnyMmaKernel(const SkinnyGemmArgs a, const int4 block_begin, const int total_blocks) {
  bool waited = false;
  if (!a.programmatic) pdl::AllowDependentLaunch();
  for (int bx = blockIdx.x; bx < total_blocks; bx += gridDim.x) {
    SkinnyMmaBlock<NT, S>(a, block_begin, bx, waited);
    if constexpr (S > 1) __syncthreads();  // the next block's partials reuse shared memory
  }
}

template <int NT, int S>
int ResidentMmaBlocks() {
  return ResidentBlocks<SkinnyMmaKernel<NT, S>, 32 * kMmaWarps>();
}

template <int NT, int S>
cudaError_t LaunchMmaWith(const SkinnyGemmArgs& a, cudaStream_t stream) {
  int4 begins;
  const int total = SegmentBlockBegins(a, (kMmaWarps / S) * 16, &begins);
  const int grid_x = std::min(total, a.sm_count * ResidentMmaBlocks<NT, S>());
  return pdl::LaunchKernel(SkinnyMmaKernel<NT, S>, dim3(grid_x, a.batch), dim3(32 * kMmaWarps), 0,
                           stream, a.programmatic, a, begins, total);
}

template <int NT>
cudaError_t LaunchMma(const SkinnyGemmArgs& a, cudaStream_t stream) {
  // K slices per 16-row tile, as LaunchTn chooses them: the fewest that give every resident warp
  // a share, each slice keeping >= 16 column groups (512 columns) where K allows.
  const int groups = static_cast<int>(a.k / 32);
  int64_t tiles = 0;
  for (int i = 0; i < a.num_segments; ++i) tiles += (a.seg[i].n + 15) / 16;
  tiles *= a.batch;
  const int64_t resident_warps =
      static_cast<int64_t>(a.sm_count) * ResidentMmaBlocks<NT, 1>() * kMmaWarps;
  int s = 1;
  for (int cand : {2, 4}) {
    if (tiles * s >= resident_warps || groups / cand < 16) break;
    s = cand;
  }
  switch (s) {
    case 1:
      return LaunchMmaWith<NT, 1>(a, stream);
    case 2:
      return LaunchMmaWith<NT, 2>(a, stream);
    default:
      return LaunchMmaWith<NT, 4>(a, stream);
  }
}

}  // namespace

bool SkinnyGemmSupports(const SkinnyGemmArgs& a) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (a.m < 1 || a.m > (a.mma ? kSkinnyMmaMaxRows : kSkinnyMaxRows) || a.k < 8 || a.k > kMax ||
      a.x == nullptr) {
    return false;
  }
  if (a.mma && (a.k % 32 != 0 || a.prologue.kind != SkinnyPrologue::kNone)) return false;
  if (a.num_segments < 1 || a.num_segments > kSkinnyMaxSegments) return false;
  if (a.batch < 1 || a.batch > 65535) return false;
  if (a.batch > 1 && (a.num_segments != 1 || a.x_batch_stride < 0 || a.w_batch_stride < 0 ||
                      a.out_batch_stride < 0 || a.w_batch_stride % 8 != 0)) {
    return false;
  }
  if (a.w_kn || a.k % 8 != 0 || !Aligned16(a.x) || a.x_stride % 8 != 0 ||
      (a.batch > 1 && a.x_batch_stride % 8 != 0)) {
    return false;
  }
  if (a.x_stride < a.k) return false;
  for (int i = 0; i < a.num_segments; ++i) {
    const SkinnyGemmSegment& s = a.seg[i];
    if (s.w == nullptr || s.out == nullptr || s.n < 1 || s.n > kMax || s.out_stride < s.n) {
      return false;
    }
    if (s.out_dtype != DType::kBF16 && s.out_dtype != DType::kF32) return false;
    if (!Aligned16(s.w)) return false;
  }
  const SkinnyPrologueArgs& pro = a.prologue;
  if (pro.kind != SkinnyPrologue::kNone && (a.num_segments != 1 || a.batch != 1)) return false;
  if (pro.kind == SkinnyPrologue::kRmsNorm && !(pro.norm_weight != nullptr &&
                                                 Aligned16(pro.norm_weight) && pro.eps >= 0.0f)) {
    return false;
  }
  if (pro.kind == SkinnyPrologue::kSiluMul &&
      !(pro.up != nullptr && Aligned16(pro.up) && pro.up_stride >= a.k && pro.up_stride % 8 == 0)) {
    return false;
  }
  return true;
}

cudaError_t InvokeSkinnyGemm(const SkinnyGemmArgs& a, cudaStream_t stream) {
  if (!SkinnyGemmSupports(a)) return cudaErrorInvalidValue;
  if (a.mma) return a.m <= 8 ? LaunchMma<1>(a, stream) : LaunchMma<2>(a, stream);
  switch (a.prologue.kind) {
    case SkinnyPrologue::kRmsNorm: return LaunchRows<SkinnyPrologue::kRmsNorm>(a, stream);
    case SkinnyPrologue::kSiluMul: return LaunchRows<SkinnyPrologue::kSiluMul>(a, stream);
    default: return LaunchRows<SkinnyPrologue::kNone>(a, stream);
  }
}

}  // namespace mlaserve
