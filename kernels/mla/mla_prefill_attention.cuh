// Causal flash attention of the MLA prefill (mla_prefill.h, step 2), FlashAttention-2 style.
//
// Block = 4 warps = 64 query rows of one (sequence, head); warp w owns rows 16 w .. 16 w + 15.
// Key tiles of 64 rows go through a 2-stage cp.async ring in shared memory:
//   K tile [64, D + 8] bf16 (D = qk_nope + 64: k_nope from kv, then the shared k_rope)
//   V tile [64, v_dim + 8] bf16
// The 8-element row pad makes every ldmatrix phase hit 8 distinct 16-B bank groups (row
// stride / 16 B is odd for every supported D and v_dim). Largest case (128, 128):
// 2 x (64 x 200 + 64 x 136) x 2 B = 86,016 B, under SM120's 101,376 B per block. The Q tile is
// staged through stage 1's K buffer once and then lives in registers (D / 16 A fragments).
//
// S = Q K^T and O += P V are mma.sync m16n8k16 bf16 with fp32 accumulators. Softmax is online,
// in the log2 domain (scores times softmax_scale * log2 e, exp2); P is rounded to bf16 for the
// P.V product, the row sums l use the unrounded fp32 P. Output O / l rounded to bf16 (RNE).
// Key j (sequence-local) is visible to query row i when j <= context_len + i; tiles past the
// last row's limit are not visited, so a block of rows [m0, m0 + 64) visits
// (context_len + min(m0 + 63, n - 1)) / 64 + 1 tiles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mla/kv_cache_format.h"
#include "kernels/mla/mla_prefill_params.h"
#include "kernels/warp_ptx.cuh"

namespace mlaserve::mla {

constexpr int kPrefillKeyTile = 64;  // Keys per pipeline stage.
constexpr int kPrefillWarps = 4;
static_assert(kPrefillThreads == kPrefillWarps * 32 && kPrefillBlockRows == kPrefillWarps * 16,
              "one warp per 16 query rows");

template <int kNope, int kV>
struct MlaPrefillShape {
  static constexpr int kD = kNope + kMlaRopeDim;  // q.k dims.
  static constexpr int kKStride = kD + 8;         // Shared row strides, elements.
  static constexpr int kVStride = kV + 8;
  static constexpr int kKTileElems = kPrefillKeyTile * kKStride;
  static constexpr int kStageElems = kKTileElems + kPrefillKeyTile * kVStride;
  static constexpr int kSmemBytes = 2 * kStageElems * 2;
  static_assert(kNope % 16 == 0 && kV % 16 == 0, "mma k-steps and ldmatrix pairs need 16 | dims");
  static_assert(kSmemBytes <= 101376, "SM120 allows at most 99 KB of shared memory per block");
  static_assert(kPrefillBlockRows * kKStride <= kKTileElems, "the Q tile is staged in a K buffer");
};

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low 16 bits) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <int kNope, int kV>
__global__ void __launch_bounds__(kPrefillThreads, 2)
    MlaPrefillKernel(const MlaPrefillKernelArgs a) {
  using Shape = MlaPrefillShape<kNope, kV>;
  constexpr int kD = Shape::kD;
  constexpr int kKvCols = kNope + kV;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint16_t* smem = reinterpret_cast<uint16_t*>(smem_raw);

  const int s = blockIdx.z, h = blockIdx.y;
  // Reversed so the longest (latest, most keys) row tiles start first.
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kPrefillBlockRows;
  const int q0 = a.q_begin[s];
  const int n = a.q_begin[s + 1] - q0;
  if (m0 >= n) return;
  const int64_t kv0 = a.kv_begin[s];
  const int kv_len = a.kv_begin[s + 1] - a.kv_begin[s];
  const int ctx = a.context_lens[s];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rows_here = min(kPrefillBlockRows, n - m0);

  if (ctx < 0 || kv_len != ctx + n) {  // Inconsistent metadata: NaN rows, never a wild read.
    for (int e = tid; e < rows_here * kV; e += kPrefillThreads) {
      const int r = e / kV, d = e % kV;
      a.out[(static_cast<int64_t>(q0 + m0 + r) * a.heads + h) * kV + d] = 0xffffu;
    }
    return;
  }

  // Stage st (0, 1) of the ring: K at smem + st * kStageElems, V right after it.
  auto load_tile = [&](int kt, int st) {
    uint16_t* sk = smem + st * Shape::kStageElems;
    uint16_t* sv = sk + Shape::kKTileElems;
    constexpr int kKChunks = kD / 8, kNopeChunks = kNope / 8, kVChunks = kV / 8;  // 16-B chunks
    for (int c = tid; c < kPrefillKeyTile * kKChunks; c += kPrefillThreads) {
      const int r = c / kKChunks, ch = c % kKChunks;
      const int j = kt * kPrefillKeyTile + r;
      const bool valid = j < kv_len;
      const int64_t row = kv0 + (valid ? j : 0);
      const uint16_t* src = ch < kNopeChunks
                                ? a.kv + (row * a.heads + h) * kKvCols + ch * 8
                                : a.k_rope + row * kMlaRopeDim + (ch - kNopeChunks) * 8;
      ptx::CpAsync16(sk + r * Shape::kKStride + ch * 8, src, valid);
    }
    for (int c = tid; c < kPrefillKeyTile * kVChunks; c += kPrefillThreads) {
      const int r = c / kVChunks, ch = c % kVChunks;
      const int j = kt * kPrefillKeyTile + r;
      const bool valid = j < kv_len;
      const int64_t row = kv0 + (valid ? j : 0);
      ptx::CpAsync16(sv + r * Shape::kVStride + ch * 8,
                     a.kv + (row * a.heads + h) * kKvCols + kNope + ch * 8, valid);
    }
  };

  // Q tile -> stage 1's K buffer (group 0), key tile 0 -> stage 0 (group 1).
  {
    uint16_t* sq = smem + Shape::kStageElems;
    constexpr int kQChunks = kD / 8;
    for (int c = tid; c < kPrefillBlockRows * kQChunks; c += kPrefillThreads) {
      const int r = c / kQChunks, ch = c % kQChunks;
      const bool valid = m0 + r < n;
      const int64_t row = q0 + (valid ? m0 + r : 0);
      ptx::CpAsync16(sq + r * Shape::kKStride + ch * 8, a.q + (row * a.heads + h) * kD + ch * 8,
                     valid);
    }
    ptx::CpAsyncCommit();
  }
  load_tile(0, 0);
  ptx::CpAsyncCommit();
  ptx::CpAsyncWait<1>();
  __syncthreads();
  uint32_t qf[kD / 16][4];  // A fragments of the warp's 16 rows, all of D.
  {
    const uint16_t* sq = smem + Shape::kStageElems;
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      ptx::LdMatrixX4(qf[ks],
                      sq + (warp * 16 + (lane & 15)) * Shape::kKStride + ks * 16 + (lane >> 4) * 8);
    }
  }
  __syncthreads();  // Stage 1 is free for tile 1.

  // This thread's two rows (fragment rows lane / 4 and lane / 4 + 8 of the warp's 16).
  const int row_a = m0 + warp * 16 + (lane >> 2);
  const int limit_a = ctx + row_a, limit_b = ctx + row_a + 8;  // Last visible key (inclusive).
  const int warp_first_limit = ctx + m0 + warp * 16;
  const int last_row = m0 + rows_here - 1;
  const int num_tiles = (ctx + last_row) / kPrefillKeyTile + 1;

  float o[kV / 8][4];
#pragma unroll
  for (int i = 0; i < kV / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

  for (int kt = 0; kt < num_tiles; ++kt) {
    if (kt + 1 < num_tiles) {
      load_tile(kt + 1, (kt + 1) & 1);
      ptx::CpAsyncCommit();
      ptx::CpAsyncWait<1>();
    } else {
      ptx::CpAsyncWait<0>();
    }
    __syncthreads();
    const uint16_t* sk = smem + (kt & 1) * Shape::kStageElems;
    const uint16_t* sv = sk + Shape::kKTileElems;

    float sc[kPrefillKeyTile / 8][4];  // S for 16 rows x 64 keys: 8 n-blocks of 8 keys.
#pragma unroll
    for (int i = 0; i < kPrefillKeyTile / 8; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
#pragma unroll
      for (int nb2 = 0; nb2 < kPrefillKeyTile / 16; ++nb2) {
        uint32_t b[4];  // b0, b1 of n-block 2 nb2, then of 2 nb2 + 1.
        ptx::LdMatrixX4(b, sk + (nb2 * 16 + (lane >> 4) * 8 + (lane & 7)) * Shape::kKStride +
                               ks * 16 + ((lane >> 3) & 1) * 8);
        ptx::MmaBf16(sc[2 * nb2], qf[ks], b[0], b[1]);
        ptx::MmaBf16(sc[2 * nb2 + 1], qf[ks], b[2], b[3]);
      }
    }

    // Scale to the log2 domain; mask keys past each row's causal limit (only tiles that reach
    // past the warp's first row need it).
    const bool need_mask = kt * kPrefillKeyTile + kPrefillKeyTile - 1 > warp_first_limit;
    float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < kPrefillKeyTile / 8; ++nb) {
      const int j = kt * kPrefillKeyTile + nb * 8 + 2 * (lane & 3);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = sc[nb][e] * a.scale_log2;
        if (need_mask && j + (e & 1) > (e < 2 ? limit_a : limit_b)) x = -INFINITY;
        sc[nb][e] = x;
      }
      mx_a = fmaxf(mx_a, fmaxf(sc[nb][0], sc[nb][1]));
      mx_b = fmaxf(mx_b, fmaxf(sc[nb][2], sc[nb][3]));
    }
    // A row's 64 scores are spread over the 4 lanes of a quad.
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    const float new_a = fmaxf(m_a, mx_a), new_b = fmaxf(m_b, mx_b);
    // Key 0 is visible to every row and tile 0 comes first, so new_* is finite; the guard keeps
    // -inf - -inf (NaN) out should that ever change.
    const float use_a = new_a == -INFINITY ? 0.0f : new_a;
    const float use_b = new_b == -INFINITY ? 0.0f : new_b;
    const float alpha_a = exp2f(m_a - use_a), alpha_b = exp2f(m_b - use_b);
    m_a = new_a;
    m_b = new_b;
    float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
    for (int nb = 0; nb < kPrefillKeyTile / 8; ++nb) {
      sc[nb][0] = exp2f(sc[nb][0] - use_a);
      sc[nb][1] = exp2f(sc[nb][1] - use_a);
      sc[nb][2] = exp2f(sc[nb][2] - use_b);
      sc[nb][3] = exp2f(sc[nb][3] - use_b);
      sum_a += sc[nb][0] + sc[nb][1];
      sum_b += sc[nb][2] + sc[nb][3];
    }
    l_a = l_a * alpha_a + sum_a;  // Per-thread partial sums; the quad is summed at the end.
    l_b = l_b * alpha_b + sum_b;
#pragma unroll
    for (int i = 0; i < kV / 8; ++i) {
      o[i][0] *= alpha_a;
      o[i][1] *= alpha_a;
      o[i][2] *= alpha_b;
      o[i][3] *= alpha_b;
    }

    // O += P V: the S accumulators of key blocks 2 kk, 2 kk + 1 are the A fragment of k-step kk.
#pragma unroll
    for (int kk = 0; kk < kPrefillKeyTile / 16; ++kk) {
      const uint32_t pa[4] = {PackBf16x2(sc[2 * kk][0], sc[2 * kk][1]),
                              PackBf16x2(sc[2 * kk][2], sc[2 * kk][3]),
                              PackBf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                              PackBf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
      for (int vb2 = 0; vb2 < kV / 16; ++vb2) {
        uint32_t b[4];  // b0, b1 of v-block 2 vb2, then of 2 vb2 + 1 (V is [key][dim]: .trans).
        ptx::LdMatrixX4Trans(
            b, ptx::SmemAddr(sv + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * Shape::kVStride +
                             vb2 * 16 + (lane >> 4) * 8));
        ptx::MmaBf16(o[2 * vb2], pa, b[0], b[1]);
        ptx::MmaBf16(o[2 * vb2 + 1], pa, b[2], b[3]);
      }
    }
    __syncthreads();  // Everyone is done with stage kt & 1 before tile kt + 2 overwrites it.
  }

  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  const float inv_a = 1.0f / l_a, inv_b = 1.0f / l_b;
  const int row_b = row_a + 8;
#pragma unroll
  for (int i = 0; i < kV / 8; ++i) {
    const int d = i * 8 + 2 * (lane & 3);
    if (row_a < n) {
      *reinterpret_cast<uint32_t*>(a.out + (static_cast<int64_t>(q0 + row_a) * a.heads + h) * kV +
                                   d) = PackBf16x2(o[i][0] * inv_a, o[i][1] * inv_a);
    }
    if (row_b < n) {
      *reinterpret_cast<uint32_t*>(a.out + (static_cast<int64_t>(q0 + row_b) * a.heads + h) * kV +
                                   d) = PackBf16x2(o[i][2] * inv_b, o[i][3] * inv_b);
    }
  }
}

template <int kNope, int kV>
cudaError_t LaunchMlaPrefill(const MlaPrefillKernelArgs& args, dim3 grid, cudaStream_t stream) {
  constexpr int kSmem = MlaPrefillShape<kNope, kV>::kSmemBytes;
  const cudaError_t err = cudaFuncSetAttribute(MlaPrefillKernel<kNope, kV>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  MlaPrefillKernel<kNope, kV><<<grid, kPrefillThreads, kSmem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace mlaserve::mla

// One explicit instantiation per .cu in prefill_instantiations/.
#define MLASERVE_INSTANTIATE_MLA_PREFILL(NOPE, V)                \
  template cudaError_t mlaserve::mla::LaunchMlaPrefill<NOPE, V>( \
      const mlaserve::mla::MlaPrefillKernelArgs&, dim3, cudaStream_t)
