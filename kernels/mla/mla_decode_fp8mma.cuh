// The FP8 tensor-core form of MLA decode on SM90a (kernels/mla/NOTES.md, sessions 32-34): the
// pieces of the e4m3-wgmma kernel (mla_decode_fp8mma64.cuh) that define its arithmetic, which is
// the form MlaDecodeRef emulates with fp8_mma = kQkPv (mla_decode_ref.h) and which the accuracy
// test measured on the trained model (issue 18's bounds hold).
//
// Why the form: at 64-128 heads every fp8 kernel here was bound by bf16-rate tensor work plus the
// e4m3 -> f16 conversion of each cache byte (64-row kernel: 0.50 / 0.26 of copy bandwidth at 64 /
// 128 heads x batch 64 x 32k on the H100, session 33). On e4m3 wgmma the tensor work halves and
// the cache bytes are the MMA's operand as they are: nothing is converted.
//
// * Q (64 rows x 576) is rounded to e4m3 once a sequence piece, with one scale a row (the smallest
//   power of two >= amax / 448, the emulation's rule: exact scaling, so ties round alike):
//   [5 blocks of 128 dims][64 rows][128 B], 128-byte swizzle, K-major; block 4 holds the 64 RoPE
//   dims in its rows' first 64 bytes (fp8_tiled: q's bf16 RoPE dims, 128 B, for bf16 MMAs). See
//   StoreQ.
// * Cache rows are copied straight into the same 5-block K-major layout (the q.k's B operand).
//   Each 128-dim group of the q.k is summed in a fresh accumulator and added in fp32 after it (the
//   tensor core's e4m3 sums are ~22-bit: promote every 128 dims, DeepSeek-V3 report 3.3.2).
// * P.V: e4m3 wgmma has no transposed operand, so V (the tile's latent dims) is transposed in
//   shared memory into [512 dims][32 tokens] a 32-token half (no swizzle: 8 x 16-B core
//   matrices), tokens permuted within each 16 so that P's accumulator registers are the A fragment
//   as they are: A register 0 holds columns 4c .. 4c + 3 of row g (c = lane % 4), which the S
//   accumulator has as columns 2c, 2c + 1, 8 + 2c, 9 + 2c; so V^T's byte 4c + i of a 16 is token
//   {2c, 2c + 1, 8 + 2c, 9 + 2c}[i]. The transpose: 4x4 byte transposes with a lane rotation, so
//   that its 32-bit loads and stores are free of bank conflicts.
// * Softmax: the running max is exact (no lazy rescale) so P <= 1, and P x 256 is rounded to e4m3
//   (as the emulation; e4m3's normal range reaches 2^-6 / 256 of the row's largest weight); the
//   row sums are fp32 over the unrounded weights.
// * fp8_tiled: each group's promoted q.k is multiplied by its tokens' tile scale (and q's row
//   scale); P.V runs one P a 128-column group: P x 256 x the token's tile scale / the group's
//   running largest scale, the group's O columns rescaled when that grows and multiplied back at
//   the end (StoreRows).
//
// The first kernel of the form (session 33: 32-token tiles, the q.k split by dims between the
// warpgroups with partial scores exchanged) measured 0.91-1.14x the f16-converting kernel on the
// H200 and lost to the 64-token kernel in 22 of 24 cases (session 34, bench/RESULTS.md; 2-5% faster
// only in fp8_tiled at batch 1 x 4k); removed.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mla/mla_decode_params.h"
#include "kernels/mla/mla_decode_schedule.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/warp_ptx.cuh"
#include "kernels/wgmma_ptx.cuh"

namespace mlaserve::mla {

namespace f8mma {

constexpr int kRows = 64;
constexpr int kThreads = 256;      // Two warpgroups.
constexpr int kQkBlocks = 5;       // 128-B K-major blocks: 4 latent, 1 RoPE
constexpr float kPScale = 256.0f;  // P in (0, 1] times this before the e4m3 rounding

__device__ __forceinline__ float Bf16Lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
// Two floats to two e4m3 bytes (round to nearest even, saturating): lo in the low byte.
__device__ __forceinline__ uint32_t E4m3x2(float lo, float hi) {
  return static_cast<uint32_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ uint32_t E4m3x4(float a, float b, float c, float d) {
  return E4m3x2(a, b) | (E4m3x2(c, d) << 16);
}
__device__ __forceinline__ uint32_t Lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void Sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void Sts64(uint32_t addr, uint32_t a, uint32_t b) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(addr), "r"(a), "r"(b) : "memory");
}

// Q rows into shared memory as e4m3 with one scale a row (from amax over the dims on e4m3
// MMAs, as MlaDecodeRef's emulation: all 576 in fp8, the 512 latent ones in fp8_tiled, whose
// RoPE block holds q's bf16 RoPE dims as they are); the scale goes to qscale[]. 4 threads a
// row, each 9 of the row's 36 16-B e4m3 chunks (two bf16 chunks each).
// Row tile mt of sequence b; the block's 256 threads, tid = threadIdx.x.
template <bool kTiled>
__device__ __forceinline__ void StoreQ(const MlaDecodeKernelParams& p, int b, int mt,
                                       uint32_t q_smem, float* qscale, int tid) {
  const uint16_t* qb = p.q + static_cast<size_t>(b) * p.rows * kMlaQkDim;
  const int lr = tid >> 2, part = tid & 3;
  const int row = mt * kRows + lr;
  const bool ok = row < p.rows;
  const uint4* src = reinterpret_cast<const uint4*>(qb + static_cast<size_t>(row) * kMlaQkDim);
  const uint4* rsrc = reinterpret_cast<const uint4*>(
      p.q_rope + (static_cast<int64_t>(b) * p.rows + row) * p.q_rope_stride);
  auto chunk = [&](int cc) {  // bf16 chunk cc (8 values) of the row
    return cc < kMlaLatentDim / 8 ? src[cc] : rsrc[cc - kMlaLatentDim / 8];
  };
  uint4 v[18];
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < 9; ++k) {
    const int cc = part + 4 * k;  // e4m3 chunk: bf16 chunks 2cc, 2cc + 1
    v[2 * k] = ok ? chunk(2 * cc) : make_uint4(0, 0, 0, 0);
    v[2 * k + 1] = ok ? chunk(2 * cc + 1) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (kTiled && k == 8) continue;  // the RoPE dims (bf16 MMA)
      const uint32_t w4[4] = {v[2 * k + e].x, v[2 * k + e].y, v[2 * k + e].z, v[2 * k + e].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        amax = fmaxf(amax, fmaxf(fabsf(f8mma::Bf16Lo(w4[i])), fabsf(f8mma::Bf16Hi(w4[i]))));
      }
    }
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  // The smallest power of two >= amax / 448 (MlaDecodeRef's rule): q / qs is exact, so q's
  // e4m3 roundings (ties included) are the reference's.
  int qe = 0;  // qs = 2^qe
  if (amax > 0.0f && isfinite(amax)) {
    int e = 0;
    const float f = frexpf(amax, &e);
    qe = f <= 448.0f / 512.0f ? e - 9 : e - 8;
  }
  const float qs = ldexpf(1.0f, qe), qinv = ldexpf(1.0f, -qe);
  if (part == 0) qscale[lr] = qs;
#pragma unroll
  for (int k = 0; k < 9; ++k) {
    const int cc = part + 4 * k, kb = cc >> 3, ch = cc & 7;
    if (kTiled && k == 8) {  // bf16 chunks 2 (cc - 32) and + 1 of the RoPE block
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int bc = 2 * (cc - 32) + e;
        const uint4 x = v[16 + e];
        const uint32_t dst = q_smem + 4 * (kRows * 128) + lr * 128 + ((bc ^ (lr & 7)) << 4);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(x.x), "r"(x.y),
                     "r"(x.z), "r"(x.w)
                     : "memory");
      }
      continue;
    }
    uint32_t o4[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const uint4 x = v[2 * k + e];
      o4[2 * e] = f8mma::E4m3x4(f8mma::Bf16Lo(x.x) * qinv, f8mma::Bf16Hi(x.x) * qinv,
                                f8mma::Bf16Lo(x.y) * qinv, f8mma::Bf16Hi(x.y) * qinv);
      o4[2 * e + 1] = f8mma::E4m3x4(f8mma::Bf16Lo(x.z) * qinv, f8mma::Bf16Hi(x.z) * qinv,
                                    f8mma::Bf16Lo(x.w) * qinv, f8mma::Bf16Hi(x.w) * qinv);
    }
    const uint32_t dst = q_smem + kb * (kRows * 128) + lr * 128 + ((ch ^ (lr & 7)) << 4);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(o4[0]), "r"(o4[1]),
                 "r"(o4[2]), "r"(o4[3])
                 : "memory");
    if (k == 8) {  // fp8: the RoPE block's other 64 B zeroed
      const uint32_t dz = q_smem + kb * (kRows * 128) + lr * 128 + (((ch + 4) ^ (lr & 7)) << 4);
      asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(dz), "r"(0u) : "memory");
    }
  }
}

// The epilogue: rows row_lo and row_hi (this thread's, lo = half 0) of O to the output (a
// whole sequence) or to the piece's partial (slot worker + b). O's columns hold sum (256 P) x V
// (fp8_tiled: / rs of their column group), l the sum of P, m the running max (log2 units).
template <bool kTiled>
__device__ __forceinline__ void StoreRows(const MlaDecodeKernelParams& p, const float (&o)[128],
                                          const float (&rs)[2], int b, int worker, bool whole,
                                          int row_lo, int row_hi, float m_lo, float m_hi,
                                          float l_lo, float l_hi, int wgi, int c) {
  // (fp8_tiled: P x 256 / rs, rs multiplied back per column group in store_row.)
  const float inv_lo = l_lo > 0.0f ? p.out_scale / (kPScale * l_lo) : 0.0f;
  const float inv_hi = l_hi > 0.0f ? p.out_scale / (kPScale * l_hi) : 0.0f;
  const float lse2_lo = l_lo > 0.0f ? m_lo + log2f(l_lo) : -INFINITY;  // log2 units
  const float lse2_hi = l_hi > 0.0f ? m_hi + log2f(l_hi) : -INFINITY;
  constexpr float kLn2 = 0.693147180559945309f;
  const size_t slot = static_cast<size_t>(worker) + b;  // Unique per (sequence, worker).
  auto store_row = [&](int row, int half, float inv, float lse2) {
    const int col0 = 256 * wgi + 2 * c;
    // fp8_tiled: O's columns of group 2g + n / 16 hold sum P x V / rs (see the P.V).
    auto f = [&](int n) { return kTiled ? inv * rs[n >> 4] : inv; };
    if (whole) {
      uint16_t* out = p.out + (static_cast<size_t>(b) * p.rows + row) * kMlaLatentDim;
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        const __nv_bfloat162 v =
            __floats2bfloat162_rn(o[4 * n + 2 * half] * f(n), o[4 * n + 2 * half + 1] * f(n));
        *reinterpret_cast<__nv_bfloat162*>(out + col0 + 8 * n) = v;
      }
      if (wgi == 0 && c == 0 && p.lse != nullptr) {
        p.lse[static_cast<size_t>(b) * p.rows + row] = lse2 * kLn2;
      }
    } else {
      float* part = p.o_part + (slot * p.rows + row) * kMlaLatentDim;
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        *reinterpret_cast<float2*>(part + col0 + 8 * n) =
            make_float2(o[4 * n + 2 * half] * f(n), o[4 * n + 2 * half + 1] * f(n));
      }
      if (wgi == 0 && c == 0) p.lse_part[slot * p.rows + row] = lse2;
    }
  };
  if (row_lo < p.rows) store_row(row_lo, 0, inv_lo, lse2_lo);
  if (row_hi < p.rows) store_row(row_hi, 1, inv_hi, lse2_hi);
}

}  // namespace f8mma

}  // namespace mlaserve::mla
