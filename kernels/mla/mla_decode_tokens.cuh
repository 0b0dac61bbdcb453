// SM90a split-KV MLA decode kernel for few query rows (<= 16 a block) over the fp8 caches, with a
// KV tile's 64 tokens as the warpgroup MMA's M dimension ("token-major"); included by one small
// .cu per instantiation. Same schedule, partial outputs and combine as the other decode kernels
// (mla_decode_sliced.cuh); only the per-tile work differs.
//
// Why (kernels/mla/NOTES.md, session 20): at 8-16 heads the sliced kernel (16 query rows as
// mma.sync's M) reaches 0.52-0.68 of copy bandwidth in the fp8 formats, issue- and latency-bound
// at ~1,400 warp instructions per warp and 64 tokens (conversions, shared loads, 68 HMMAs a
// 32-token tile per warp). With the 64 tokens of a tile as M and the 16 query rows as N, both
// products run on m64n16k16 warpgroup MMAs whose A operand comes from registers, converted from
// the raw cache bytes once per product, and nothing of the tile is written back to shared memory:
//
// * S^T [64 tokens][16 rows] = K [64][576] Q^T [576][16]. A = K: thread (warp w, lane g = lane / 4,
//   c = lane % 4) holds tokens 16w + g and 16w + g + 8 (M rows g, g + 8 of warp w) and four k's a
//   k16 step; the k dimension is permuted (the product does not care, Q is stored permuted the same
//   way) so that a thread's four k's of four consecutive k16 steps are 16 consecutive cache bytes:
//   one 16-B shared load a token feeds 4 k-steps (cvt.rn.f16x2.e4m3x2 straight into the A
//   registers). B = Q as f16 (fp8_tiled's RoPE part as bf16) in shared memory, once per piece.
// * O^T [512 dims][16 rows] += V^T [512][64 tokens] P^T [64][16]: A = V^T from registers, thread
//   (w, g) owning the 16 consecutive latent dims of 16-B chunk 8w + g in all 8 m64 tiles (the M
//   dimension permuted: dim 16 (8w + g) + 2i + h is row 16w + g + 8h of m-tile i), so one 16-B
//   load per token and two byte permutes make the token pairs of four A registers; B = P^T (f16)
//   in shared memory, written by the softmax.
// * fp8_tiled: the latent's q.k is accumulated per 128-dim scale tile and folded with the tokens'
//   power-of-two scales in fp32; V's scale is multiplied into the converted f16 pairs (exact, as
//   in mla_decode_wgmma.cuh). fp8: the per-layer scale is applied to the fp32 scores and outputs.
// * A tile = one 64-token cache block (contiguous bytes), copied by cp.async into [chunk][token]
//   16-B columns 1,040 B apart (16 B of padding: the copies, the q.k loads and the p.v loads are
//   all free of bank conflicts); two tiles in flight, two blocks an SM (~108 KB each).
//
// Why not FP8 tensor cores for q.k (e4m3 x e4m3 wgmma, no K conversion, q split in two e4m3
// parts): Hopper's FP8 MMAs accumulate in a ~22-bit fixed-point form that truncates each
// product below the largest one's 14th bit (DeepSeek-V3 report section 3.5.2; deepseek-ai/DeepGEMM
// issues 37 and 50; SageAttention's FP22 accumulator finding): a biased error of ~2^-14 of the
// largest product per term, ~0.05 in the scores of mla_decode_gpu_test's cases against its LSE
// bound of 4e-3. f16 inputs accumulate in fp32.
//
// Rounding: as the other kernels (exact f16 K, V and q times a power of two; P in f16).
//
// Measured (H100, 2026-12-05, session 20; bench/mla/results/h100_2026-12-05_s20_tokens_kernel.csv):
// correct (mla_decode_gpu_test 13/13, memcheck and racecheck clean) but 0.63-0.86x the sliced
// kernels at 8-16 heads, batch 1-128, 4k-128k, both formats (fp8 8 heads b64 x 32k: 0.57 of copy
// bandwidth against 0.83). The m64n16k16 MMAs are the limit: 68 a tile, ~5,600 SM cycles a tile
// where the instructions (~1,100 a warp) and the bytes need far fewer; small-N warpgroup MMAs cost
// about as much as N = 64 ones. Kept in the history only (kernels/mla/NOTES.md, session 20).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mla/mla_decode_params.h"
#include "kernels/mla/mla_decode_schedule.cuh"
#include "kernels/mla/mla_decode_wgmma.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/warp_ptx.cuh"
#include "kernels/wgmma_ptx.cuh"

namespace mlaserve::mla {

namespace tk {

constexpr int kRows = 16;           // query rows (heads x s_q) a block: the MMAs' N
constexpr int kTile = 64;           // tokens a tile: one cache block, the MMAs' M
constexpr int kThreads = 128;       // one warpgroup
constexpr int kChunkStride = 1040;  // shared bytes between a tile's 16-B columns (64 x 16 + 16)
constexpr int kQkSteps = kMlaQkDim / 16;     // 36 k16 steps of q.k (fp8_tiled: 32 latent + 4 RoPE)
constexpr int kPvSteps = kTile / 16;         // 4 k16 steps of p.v
constexpr int kMTiles = kMlaLatentDim / 64;  // 8 m64 tiles of output dims
static_assert(kTile == kKvBlockTokens, "a tile is one cache block");

template <KvCacheFormat kFormat>
struct Config {
  static constexpr bool kTiled = kFormat == KvCacheFormat::kFp8Tiled;
  static constexpr int kRowBytes = static_cast<int>(KvCacheBytesPerToken(kFormat));
  static constexpr int kChunks = kRowBytes / 16;  // 36 (fp8) or 41 (fp8_tiled)
  static constexpr int kStages = 2;
  static constexpr int kStageBytes = kChunks * kChunkStride;
  // Q: [36 k16 steps][2 k halves][16 rows][8 x 16-bit], the B operand's K-major core matrices.
  static constexpr int kQStepBytes = 2 * kRows * 16;  // 512
  static constexpr int kQBytes = kQkSteps * kQStepBytes;
  // P^T: [8 token groups][16 rows][8 f16], the p.v B operand.
  static constexpr int kPBytes = (kTile / 8) * kRows * 16;  // 2,048
  static constexpr int kRawOff = 0;
  static constexpr int kQOff = kRawOff + kStages * kStageBytes;
  static constexpr int kPOff = kQOff + kQBytes;
  static constexpr int kRedOff = kPOff + kPBytes;             // float [16 rows][4 warps]
  static constexpr int kQScaleOff = kRedOff + kRows * 4 * 4;  // float [16]
  static constexpr int kSchedOff = kQScaleOff + kRows * 4;
  static constexpr int kSmemBytes = kSchedOff + 4 * (kInlineScheduleMaxBatch + 2);
  static_assert(kRowBytes % 16 == 0, "16-B columns");
  static_assert(2 * (kSmemBytes + 1024) <= 228 * 1024, "two blocks an H200 SM");
};

// The 16-B cache column holding k16 steps 4j .. 4j + 3 of lane c (k-permutation of q.k): groups
// 0..7 are the latent (groups 2t, 2t + 1 within 128-dim scale tile t: columns 8t .. 8t + 7, the
// lanes' columns 2 apart for conflict-free loads), group 8 is fp8's e4m3 RoPE (columns 32..35).
__device__ __forceinline__ int QkColumn(int j, int c) {
  return j < 8 ? 8 * (j >> 1) + 2 * c + (j & 1) : 32 + c;
}

// Byte permutes: lo = [a.b0, b.b0, a.b1, b.b1], hi = [a.b2, b.b2, a.b3, b.b3] (token pairs).
__device__ __forceinline__ uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ uint4 Lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ float4 Lds128F(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ void Sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void Sts16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ float Comp(const float4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
template <int N>
__device__ __forceinline__ void UseRegs1(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

}  // namespace tk

template <KvCacheFormat kFormat>
__global__ void __launch_bounds__(tk::kThreads, 2)
    MlaDecodeTokensKernel(const MlaDecodeKernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // Launched plainly: a programmatically launched combine may become resident now.
  pdl::AllowDependentLaunch();
  using namespace tk;
  using Cfg = Config<kFormat>;
  constexpr bool kTiled = Cfg::kTiled;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t raw_smem = base + Cfg::kRawOff, q_smem = base + Cfg::kQOff;
  const uint32_t p_smem = base + Cfg::kPOff, red_smem = base + Cfg::kRedOff;
  float* qscale = reinterpret_cast<float*>(smem + Cfg::kQScaleOff);

  const int tid = threadIdx.x, lane = tid & 31;
  const int w = __shfl_sync(0xffffffffu, tid >> 5, 0);  // warp-uniform
  const int g = lane >> 2, c = lane & 3;
  const int row_tiles = (p.rows + kRows - 1) / kRows;
  const int worker = blockIdx.x / row_tiles, mt = blockIdx.x % row_tiles;

  const int32_t* prefix = p.schedule;
  if (p.inline_schedule) {
    prefix = InlineSchedule<kThreads>(p, reinterpret_cast<int32_t*>(smem + Cfg::kSchedOff));
  }
  const int total = prefix[p.batch], share = prefix[p.batch + 1];
  const int cost_begin = worker * share;
  const int cost_end = min(cost_begin + share, total);
  if (cost_begin >= cost_end) return;
  const int first_seq = FirstSequence(prefix, p.batch, cost_begin);

  // Descriptors (no swizzle, K-major: core matrices of 8 rows x 16 B; LBO = bytes between the
  // two core matrices of a k16 step, SBO = bytes between 8-row groups).
  auto desc_lo = [](uint32_t addr, uint32_t lbo) {
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16);
  };
  const uint32_t dq_lo = desc_lo(q_smem, 256), dp_lo = desc_lo(p_smem, 256);
  const uint32_t d_hi = 128 >> 4;  // SBO 128 B, swizzle mode 0

  // This thread's query rows (accumulator columns 8jn + 2c + e) as hn = 2jn + e.
  int hrow[4];
#pragma unroll
  for (int hn = 0; hn < 4; ++hn) hrow[hn] = mt * kRows + 8 * (hn >> 1) + 2 * c + (hn & 1);

  // p.v: this thread's latent column (16 dims) and its scale tile (fp8_tiled).
  const int vcol = 8 * w + g;

  for (int b = first_seq; b < p.batch && prefix[b] < cost_end; ++b) {
    const SeqPiece piece = PieceOfSequence(p, prefix, b, cost_begin, cost_end);
    const int len = piece.len, tok_begin = piece.tok_begin, tok_end = piece.tok_end;
    const int t_begin = tok_begin / kTile;
    const int n_tiles = tok_end > tok_begin ? (tok_end + kTile - 1) / kTile - t_begin : 0;
    const int32_t* __restrict__ blocks =
        p.block_table + static_cast<size_t>(b) * p.max_blocks_per_seq;

    // Tile copy: thread (token tid / 8 + 16 pass, column tid % 8 + 8 k); rows past the sequence's
    // end are zero-filled (the pool's unused slots may hold NaN bytes).
    auto copy_tile = [&](int t, int slot) {
      const uint8_t* src =
          p.kv_pool + static_cast<size_t>(blocks[t]) * kKvBlockTokens * Cfg::kRowBytes;
      const int valid = len - t * kTile;
      const int tok0 = tid >> 3, col0 = tid & 7;
      const uint32_t dst = raw_smem + slot * Cfg::kStageBytes + col0 * kChunkStride + tok0 * 16;
#pragma unroll
      for (int pass = 0; pass < 4; ++pass) {
        const int tok = tok0 + 16 * pass;
        const bool ok = tok < valid;
        const uint8_t* s = src + tok * Cfg::kRowBytes + col0 * 16;
#pragma unroll
        for (int k = 0; k < (Cfg::kChunks + 7) / 8; ++k) {
          if (8 * k + 7 < Cfg::kChunks || col0 + 8 * k < Cfg::kChunks) {
            ptx::CpAsync16(dst + pass * 256 + k * 8 * kChunkStride, ok ? s + 128 * k : p.kv_pool,
                           ok);
          }
        }
      }
    };
    if (n_tiles > 0) copy_tile(t_begin, 0);
    ptx::CpAsyncCommit();

    // Q rows into shared memory, permuted as the q.k A registers read K (QkColumn): row r = tid / 8
    // reads 16-B chunks (8 dims) tid % 8 + 8k, k = 0..8 (k = 8: the RoPE dims, from q_rope).
    // f16 times 2^e (largest |q| of the row's scaled dims in [2^14, 2^15); e divided out of the
    // scores), except fp8_tiled's RoPE dims, bf16 as given (the bf16 RoPE MMAs).
    {
      const int qr = tid >> 3, part = tid & 7;
      const int row = mt * kRows + qr;
      const bool ok = row < p.rows;
      const uint4* src =
          reinterpret_cast<const uint4*>(p.q + (static_cast<size_t>(b) * p.rows + row) * kMlaQkDim);
      const uint4* rsrc = reinterpret_cast<const uint4*>(
          p.q_rope + (static_cast<int64_t>(b) * p.rows + row) * p.q_rope_stride);
      uint4 v[9];
#pragma unroll
      for (int k = 0; k < 9; ++k) {
        v[k] = !ok ? make_uint4(0, 0, 0, 0) : k < 8 ? src[part + 8 * k] : rsrc[part];
      }
      constexpr int kScaled = kTiled ? 8 : 9;
      float amax = 0.0f;
#pragma unroll
      for (int k = 0; k < kScaled; ++k) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t x = Word(v[k], i);
          amax = fmaxf(amax, fmaxf(fabsf(wg::Bf16Lo(x)), fabsf(wg::Bf16Hi(x))));
        }
      }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
      int e = 0;
      if (amax > 0.0f && isfinite(amax)) {
        const int ex = ((__float_as_int(amax) >> 23) & 0xff) - 127;
        e = max(-100, min(100, 14 - ex));
      }
      const float sc = exp2f(static_cast<float>(e));
      if (part == 0) qscale[qr] = exp2f(static_cast<float>(-e));
#pragma unroll
      for (int k = 0; k < 9; ++k) {
        const int cc = part + 8 * k;  // 16-B chunk of q: dims 8cc .. 8cc + 7
        if (kTiled && k == 8) {
          // RoPE dims 8 blk + r (blk = part = 2c' + vv, r = 4s + 2hh + e'): k16 step 32 + 2vv + s,
          // k = 8hh + 2c' + e'.
          const int cq = part >> 1, vv = part & 1;
#pragma unroll
          for (int i = 0; i < 4; ++i) {  // word i: r = 2i, 2i + 1 -> s = i / 2, hh = i % 2
            const uint32_t addr = q_smem + (32 + 2 * vv + (i >> 1)) * Cfg::kQStepBytes +
                                  (i & 1) * 256 + qr * 16 + 4 * cq;
            Sts32(addr, Word(v[k], i));
          }
        } else {
          // Latent (and fp8's RoPE) dims 16 col + r (r = 8 (cc % 2) + 2i + e'; u = r / 4,
          // hh = (r / 2) % 2): column col = cc / 2 is QkColumn(j, c') for one (j, c').
          const int col = cc >> 1;
          const int j = col < 32 ? 2 * (col >> 3) + (col & 1) : 8;
          const int cq = col < 32 ? (col & 7) >> 1 : col - 32;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = 8 * (cc & 1) + 2 * i;
            const int u = r >> 2, hh = (r >> 1) & 1;
            const uint32_t x = Word(v[k], i);
            const uint32_t addr =
                q_smem + (4 * j + u) * Cfg::kQStepBytes + hh * 256 + qr * 16 + 4 * cq;
            Sts32(addr, wg::Pack<true>(wg::Bf16Lo(x) * sc, wg::Bf16Hi(x) * sc));
          }
        }
      }
    }
    wgmma::FenceProxyAsyncShared();  // Q's writes, read by the MMAs after the loop's barrier

    // Causal / piece limits of this thread's rows (rows past p.rows: finite zero q, any limit).
    int lim[4];
#pragma unroll
    for (int hn = 0; hn < 4; ++hn) {
      lim[hn] = min(hrow[hn] < p.rows ? len - p.s_q + hrow[hn] / p.heads : len - 1, tok_end - 1);
    }
    const int lim_min = min(min(lim[0], lim[1]), min(lim[2], lim[3]));

    float o[kMTiles][8];
#pragma unroll
    for (int i = 0; i < kMTiles; ++i)
#pragma unroll
      for (int r = 0; r < 8; ++r) o[i][r] = 0.0f;
    float m[4], l[4], qd[4];
#pragma unroll
    for (int hn = 0; hn < 4; ++hn) {
      m[hn] = -INFINITY;
      l[hn] = 0.0f;
      qd[hn] = 1.0f;
    }

    for (int it = 0; it < n_tiles; ++it) {
      const int t = t_begin + it;
      const uint32_t slot = raw_smem + (it & 1) * Cfg::kStageBytes;
      ptx::CpAsyncWait<0>();  // this thread's copies of tile it
      __syncthreads();        // (0) everyone's; the other slot's last readers are done
      if (it == 0) {
#pragma unroll
        for (int hn = 0; hn < 4; ++hn) qd[hn] = qscale[8 * (hn >> 1) + 2 * c + (hn & 1)];
      }
      if (it + 1 < n_tiles) copy_tile(t + 1, (it + 1) & 1);
      ptx::CpAsyncCommit();

      // ---- S^T = K Q^T (tokens 16w + g (+8) x rows of hn), A from registers.
      const uint32_t tok_addr = slot + (16 * w + g) * 16;
      float s[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) s[r] = 0.0f;
      float acc[2][8];
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int r = 0; r < 8; ++r) acc[a][r] = 0.0f;
      float rope[8];
      float4 sc0 = make_float4(1.f, 1.f, 1.f, 1.f), sc8 = sc0;
      uint4 xr0[2], xr8[2];
      if constexpr (kTiled) {
        sc0 = Lds128F(slot + 32 * kChunkStride + (16 * w + g) * 16);
        sc8 = Lds128F(slot + 32 * kChunkStride + (16 * w + g + 8) * 16);
        // RoPE (bf16, columns 33 + 2c + vv): k16 steps 2vv + s, registers straight from the bytes.
#pragma unroll
        for (int vv = 0; vv < 2; ++vv) {
          xr0[vv] = Lds128(tok_addr + (33 + 2 * c + vv) * kChunkStride);
          xr8[vv] = Lds128(tok_addr + (33 + 2 * c + vv) * kChunkStride + 128);
        }
#pragma unroll
        for (int r = 0; r < 8; ++r) rope[r] = 0.0f;
        wgmma::FenceRegs(rope);
        wgmma::Fence();
#pragma unroll
        for (int kr = 0; kr < 4; ++kr) {
          const uint32_t ar[4] = {
              Word(xr0[kr >> 1], 2 * (kr & 1)), Word(xr8[kr >> 1], 2 * (kr & 1)),
              Word(xr0[kr >> 1], 2 * (kr & 1) + 1), Word(xr8[kr >> 1], 2 * (kr & 1) + 1)};
          wgmma::WgmmaM64N16K16RS<false>(rope, ar, dq_lo + (((32 + kr) * Cfg::kQStepBytes) >> 4),
                                         d_hi, 1);
        }
        wgmma::Commit();
      }
      constexpr int kGroups = kTiled ? 8 : 9;
      uint32_t a[2][4][4];
      auto load_convert = [&](int j, uint32_t(&dst)[4][4]) {
        const uint32_t addr = tok_addr + QkColumn(j, c) * kChunkStride;
        const uint4 x0 = Lds128(addr), x8 = Lds128(addr + 128);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          wg::E4m3x4ToF16x2x2(Word(x0, u), dst[u][0], dst[u][2]);
          wg::E4m3x4ToF16x2x2(Word(x8, u), dst[u][1], dst[u][3]);
        }
      };
      load_convert(0, a[0]);
#pragma unroll
      for (int j = 0; j < kGroups; ++j) {
        float(&d)[8] = acc[kTiled ? ((j >> 1) & 1) : 0];
        wgmma::FenceRegs(d);
        wgmma::Fence();
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          wgmma::WgmmaM64N16K16RS<true>(d, a[j & 1][u],
                                        dq_lo + (((4 * j + u) * Cfg::kQStepBytes) >> 4), d_hi, 1);
        }
        wgmma::Commit();
        if (j + 1 < kGroups) {
          // Group j - 1 (the other register set) must be done before its registers are rewritten.
          wgmma::Wait<1>();
          if (kTiled && j == 0) {  // the RoPE group (first committed) read these
            UseRegs1(reinterpret_cast<uint32_t(&)[4]>(xr0[0]));
            UseRegs1(reinterpret_cast<uint32_t(&)[4]>(xr0[1]));
            UseRegs1(reinterpret_cast<uint32_t(&)[4]>(xr8[0]));
            UseRegs1(reinterpret_cast<uint32_t(&)[4]>(xr8[1]));
          }
          UseRegs1(a[(j + 1) & 1][0]);
          UseRegs1(a[(j + 1) & 1][1]);
          UseRegs1(a[(j + 1) & 1][2]);
          UseRegs1(a[(j + 1) & 1][3]);
          if (kTiled && (j & 1) == 0 && j >= 2) {
            // Scale tile j / 2 - 1 (groups j - 2, j - 1) is complete: fold it.
            float(&f)[8] = acc[((j >> 1) - 1) & 1];
            wgmma::FenceRegs(f);
            const int st = (j >> 1) - 1;
#pragma unroll
            for (int r = 0; r < 8; ++r) s[r] = fmaf(Comp((r & 2) ? sc8 : sc0, st), f[r], s[r]);
#pragma unroll
            for (int r = 0; r < 8; ++r) f[r] = 0.0f;
          }
          load_convert(j + 1, a[(j + 1) & 1]);
        }
      }
      wgmma::Wait<0>();
      UseRegs1(a[0][0]);
      UseRegs1(a[0][1]);
      UseRegs1(a[0][2]);
      UseRegs1(a[0][3]);
      UseRegs1(a[1][0]);
      UseRegs1(a[1][1]);
      UseRegs1(a[1][2]);
      UseRegs1(a[1][3]);
      wgmma::FenceRegs(acc[0]);
      wgmma::FenceRegs(acc[1]);
      if constexpr (kTiled) {
        wgmma::FenceRegs(rope);
        // Scale tile 3 (groups 6, 7 in acc[1]); tiles 0-2 were folded in the loop.
#pragma unroll
        for (int r = 0; r < 8; ++r) s[r] = fmaf(Comp((r & 2) ? sc8 : sc0, 3), acc[1][r], s[r]);
      } else {
#pragma unroll
        for (int r = 0; r < 8; ++r) s[r] = acc[0][r];
      }

      // Accumulator register r: token 16w + g + 8 (r % 4 >= 2), row hn = 2 (r / 4) + (r & 1).
      // ---- Scores in log2 units, masks, the tile's row maxima over the warpgroup.
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int hn = 2 * (r >> 2) + (r & 1);
        float x = s[r] * qd[hn];
        if constexpr (kTiled) x += rope[r];
        s[r] = x * p.score_scale_log2;
      }
      if (!(t * kTile >= tok_begin && t * kTile + kTile - 1 <= lim_min)) {  // edge tiles only
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          const int hn = 2 * (r >> 2) + (r & 1);
          const int pos = t * kTile + 16 * w + g + ((r & 2) ? 8 : 0);
          if (pos < tok_begin || pos > lim[hn]) s[r] = -INFINITY;
        }
      }
      float mx[4];
#pragma unroll
      for (int hn = 0; hn < 4; ++hn) {
        const int r = 4 * (hn >> 1) + (hn & 1);
        mx[hn] = fmaxf(s[r], s[r + 2]);
        mx[hn] = fmaxf(mx[hn], __shfl_xor_sync(0xffffffffu, mx[hn], 4));
        mx[hn] = fmaxf(mx[hn], __shfl_xor_sync(0xffffffffu, mx[hn], 8));
        mx[hn] = fmaxf(mx[hn], __shfl_xor_sync(0xffffffffu, mx[hn], 16));
      }
      if (g == 0) {
#pragma unroll
        for (int hn = 0; hn < 4; ++hn) {
          const int n = 8 * (hn >> 1) + 2 * c + (hn & 1);
          asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(red_smem + (n * 4 + w) * 4), "f"(mx[hn])
                       : "memory");
        }
      }
      __syncthreads();  // (1) the warps' maxima
      float alpha[4], basev[4];
#pragma unroll
      for (int hn = 0; hn < 4; ++hn) {
        const int n = 8 * (hn >> 1) + 2 * c + (hn & 1);
        const float4 r4 = Lds128F(red_smem + n * 16);
        const float tmax = fmaxf(fmaxf(r4.x, r4.y), fmaxf(r4.z, r4.w));
        constexpr float kLazyLog2 = 8.0f;  // see mla_decode_sliced.cuh: P <= 2^8
        const float nm = tmax > m[hn] + kLazyLog2 ? tmax : m[hn];
        basev[hn] = nm == -INFINITY ? 0.0f : nm;
        alpha[hn] = exp2f(m[hn] - basev[hn]);
        m[hn] = nm;
      }
      // P (f16) into P^T's core matrices: token 16w + g + 8 (r & 2 ? 1 : 0), row n.
#pragma unroll
      for (int hn = 0; hn < 4; ++hn) {
        const int n = 8 * (hn >> 1) + 2 * c + (hn & 1);
        const int r = 4 * (hn >> 1) + (hn & 1);
        const float p0 = exp2f(s[r] - basev[hn]), p8 = exp2f(s[r + 2] - basev[hn]);
        l[hn] = l[hn] * alpha[hn] + (p0 + p8);
        Sts16(p_smem + (2 * w) * 256 + n * 16 + g * 2, __half_as_ushort(__float2half_rn(p0)));
        Sts16(p_smem + (2 * w + 1) * 256 + n * 16 + g * 2, __half_as_ushort(__float2half_rn(p8)));
      }
      wgmma::FenceProxyAsyncShared();
      __syncthreads();  // (2) P^T is complete; the maxima are read
      if (alpha[0] != 1.0f || alpha[1] != 1.0f || alpha[2] != 1.0f || alpha[3] != 1.0f) {
#pragma unroll
        for (int i = 0; i < kMTiles; ++i)
#pragma unroll
          for (int r = 0; r < 8; ++r) o[i][r] *= alpha[2 * (r >> 2) + (r & 1)];
      }

      // ---- O^T += V^T P^T: k16 step kk (tokens 16kk ..), A registers of m-tile i:
      // {dim 2i, tokens 2c, 2c+1}, {dim 2i+1, same}, {dim 2i, tokens 2c+8, 2c+9}, {dim 2i+1, same}.
      uint32_t va[2][kMTiles][4];
      auto load_v = [&](int kk, uint32_t(&dst)[kMTiles][4]) {
        const uint32_t addr = slot + vcol * kChunkStride + (16 * kk + 2 * c) * 16;
        const uint4 x0 = Lds128(addr), x1 = Lds128(addr + 16);
        const uint4 x8 = Lds128(addr + 128), x9 = Lds128(addr + 144);
        __half2 s01 = __float2half2_rn(1.0f), s89 = s01;
        if constexpr (kTiled) {
          const uint32_t sa = slot + 32 * kChunkStride + (16 * kk + 2 * c) * 16 + 4 * w;
          s01 = __floats2half2_rn(ptx::LdsF32(sa), ptx::LdsF32(sa + 16));
          s89 = __floats2half2_rn(ptx::LdsF32(sa + 128), ptx::LdsF32(sa + 144));
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint32_t lo01 = Prmt(Word(x0, q), Word(x1, q), 0x5140);
          const uint32_t hi01 = Prmt(Word(x0, q), Word(x1, q), 0x7362);
          const uint32_t lo89 = Prmt(Word(x8, q), Word(x9, q), 0x5140);
          const uint32_t hi89 = Prmt(Word(x8, q), Word(x9, q), 0x7362);
          wg::E4m3x4ToF16x2x2(lo01, dst[2 * q][0], dst[2 * q][1]);
          wg::E4m3x4ToF16x2x2(lo89, dst[2 * q][2], dst[2 * q][3]);
          wg::E4m3x4ToF16x2x2(hi01, dst[2 * q + 1][0], dst[2 * q + 1][1]);
          wg::E4m3x4ToF16x2x2(hi89, dst[2 * q + 1][2], dst[2 * q + 1][3]);
          if constexpr (kTiled) {
#pragma unroll
            for (int i2 = 2 * q; i2 < 2 * q + 2; ++i2) {
              dst[i2][0] = wg::HMul2(dst[i2][0], s01);
              dst[i2][1] = wg::HMul2(dst[i2][1], s01);
              dst[i2][2] = wg::HMul2(dst[i2][2], s89);
              dst[i2][3] = wg::HMul2(dst[i2][3], s89);
            }
          }
        }
      };
      load_v(0, va[0]);
#pragma unroll
      for (int kk = 0; kk < kPvSteps; ++kk) {
#pragma unroll
        for (int i = 0; i < kMTiles; ++i) wgmma::FenceRegs(o[i]);
        wgmma::Fence();
#pragma unroll
        for (int i = 0; i < kMTiles; ++i) {
          wgmma::WgmmaM64N16K16RS<true>(o[i], va[kk & 1][i], dp_lo + ((kk * 512) >> 4), d_hi, 1);
        }
        wgmma::Commit();
        if (kk + 1 < kPvSteps) {
          wgmma::Wait<1>();
#pragma unroll
          for (int i = 0; i < kMTiles; ++i) UseRegs1(va[(kk + 1) & 1][i]);
          load_v(kk + 1, va[(kk + 1) & 1]);
        }
      }
      wgmma::Wait<0>();
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
        UseRegs1(va[0][i]);
        UseRegs1(va[1][i]);
        wgmma::FenceRegs(o[i]);
      }
    }
    ptx::CpAsyncWait<0>();

    // Row sums over the warpgroup (each thread summed its own tokens).
#pragma unroll
    for (int hn = 0; hn < 4; ++hn) {
      l[hn] += __shfl_xor_sync(0xffffffffu, l[hn], 4);
      l[hn] += __shfl_xor_sync(0xffffffffu, l[hn], 8);
      l[hn] += __shfl_xor_sync(0xffffffffu, l[hn], 16);
    }
    __syncthreads();  // the last tile's maxima are read
    if (g == 0) {
#pragma unroll
      for (int hn = 0; hn < 4; ++hn) {
        const int n = 8 * (hn >> 1) + 2 * c + (hn & 1);
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(red_smem + (n * 4 + w) * 4), "f"(l[hn])
                     : "memory");
      }
    }
    __syncthreads();
#pragma unroll
    for (int hn = 0; hn < 4; ++hn) {
      const int n = 8 * (hn >> 1) + 2 * c + (hn & 1);
      const float4 r4 = Lds128F(red_smem + n * 16);
      l[hn] = (r4.x + r4.y) + (r4.z + r4.w);
    }
    __syncthreads();  // the next piece reuses Q, the ring and the exchange

    constexpr float kLn2 = 0.693147180559945309f;
    const size_t out_slot = static_cast<size_t>(worker) + b;  // unique per (sequence, worker)
#pragma unroll
    for (int hn = 0; hn < 4; ++hn) {
      const int row = hrow[hn];
      if (row >= p.rows) continue;
      const float inv = l[hn] > 0.0f ? p.out_scale / l[hn] : 0.0f;
      const float lse2 = l[hn] > 0.0f ? m[hn] + log2f(l[hn]) : -INFINITY;
      // Register 4 (hn / 2) + 2h + (hn % 2) of m-tile i: dim 16 vcol + 2i + h.
      const int r0 = 4 * (hn >> 1) + (hn & 1);
      if (piece.whole) {
        uint32_t pk[8];
#pragma unroll
        for (int i = 0; i < kMTiles; ++i)
          pk[i] = wg::Pack<false>(o[i][r0] * inv, o[i][r0 + 2] * inv);
        uint2* out = reinterpret_cast<uint2*>(  // p.out is 8-B aligned (InvokeMlaDecode)
            p.out + (static_cast<size_t>(b) * p.rows + row) * kMlaLatentDim + 16 * vcol);
#pragma unroll
        for (int q = 0; q < 4; ++q) out[q] = make_uint2(pk[2 * q], pk[2 * q + 1]);
        if (w == 0 && g == 0 && p.lse != nullptr) {
          p.lse[static_cast<size_t>(b) * p.rows + row] = lse2 * kLn2;
        }
      } else {
        float4* part = reinterpret_cast<float4*>(
            p.o_part + (out_slot * p.rows + row) * kMlaLatentDim + 16 * vcol);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          part[q] = make_float4(o[2 * q][r0] * inv, o[2 * q][r0 + 2] * inv, o[2 * q + 1][r0] * inv,
                                o[2 * q + 1][r0 + 2] * inv);
        }
        if (w == 0 && g == 0) p.lse_part[out_slot * p.rows + row] = lse2;
      }
    }
  }
#endif
}

// 2 on an SM90 device (two blocks an SM), 0 elsewhere: the plan then refuses this variant.
template <KvCacheFormat kFormat>
int MlaDecodeTokensBlocksPerSm() {
  static const int blocks = [] {
    if (!wgmma::CurrentDeviceIsSm90()) return 0;
    return DecodeKernelBlocksPerSm(reinterpret_cast<const void*>(&MlaDecodeTokensKernel<kFormat>),
                                   tk::kThreads, tk::Config<kFormat>::kSmemBytes);
  }();
  return blocks;
}

template <KvCacheFormat kFormat>
cudaError_t LaunchMlaDecodeTokens(const MlaDecodeKernelParams& p, int grid, cudaStream_t stream) {
  if (MlaDecodeTokensBlocksPerSm<kFormat>() == 0) return cudaErrorInvalidConfiguration;
  MlaDecodeTokensKernel<kFormat>
      <<<grid, tk::kThreads, tk::Config<kFormat>::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

#define MLASERVE_INSTANTIATE_MLA_DECODE_TOKENS(FORMAT)                                  \
  template cudaError_t LaunchMlaDecodeTokens<FORMAT>(const MlaDecodeKernelParams&, int, \
                                                     cudaStream_t);                     \
  template int MlaDecodeTokensBlocksPerSm<FORMAT>();

}  // namespace mlaserve::mla
