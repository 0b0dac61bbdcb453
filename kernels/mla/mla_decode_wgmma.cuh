// SM90a split-KV MLA decode kernel on warpgroup MMA (wgmma): 64 query rows (heads x s_q) per
// block, so one copy of each KV tile serves up to 64 heads; included by one small .cu per
// instantiation. Same schedule, partial outputs and combine as the warp-sliced kernel
// (mla_decode_sliced.cuh); only the per-tile work differs.
//
// Why (kernels/mla/NOTES.md): the sliced kernel computes 16 rows per block, so 64 heads run as
// 4 blocks that each copy, convert and multiply every KV byte (0.18-0.27 of copy bandwidth at 64
// heads, 0.07-0.14 at 128). Here a block of two warpgroups (256 threads) owns 64 rows:
//
// * Q (64 x 576) sits in shared memory once per sequence piece, in the 128-byte-swizzled K-major
//   layout wgmma reads (kernels/wgmma_ptx.cuh), as bf16 (bf16 cache) or f16 (fp8 caches, each
//   row times a power of two 2^e so its largest value lies in [2^14, 2^15); e is divided out of
//   the fp32 scores exactly, as in the sliced kernel).
// * A KV tile is kTile = 32 consecutive rows of one 64-token cache block (contiguous bytes). Its
//   operand form is [9 blocks of 64 dims][32 tokens][128 B] (swizzled), which serves as S's
//   K-major B operand and as P.V's MN-major B operand. bf16: cp.async straight into a 3-deep
//   ring of operand tiles. fp8: cp.async into a 3-deep ring of raw tiles; tile t + 1 is
//   converted into the other of two operand tiles while tile t's q.k runs on the tensor cores:
//   e4m3 -> f16 exactly (cvt.rn.f16x2.e4m3x2), fp8_tiled's tile scale multiplied in (a power of
//   two >= 2^-14: exact in f16 as long as the latent's magnitude stays below 32768, which an
//   RMS-normed latent does by orders of magnitude), fp8_tiled's bf16 RoPE to f16 (exact for
//   |x| >= 2^-14, absolute error < 2^-25 below).
// * S = Q K^T: warpgroup g computes the partial over k-steps 2k + g (k = 0..17, of 36) with
//   m64n32k16 from shared memory; the two partials are exchanged through shared memory and
//   added (a + b = b + a: both warpgroups hold the same bits), so both run the identical online
//   softmax (log2 domain, lazy max as the sliced kernel: P <= 2^8).
// * O += P V: P stays in registers (the accumulator layout repacks into the A fragment) and
//   warpgroup g multiplies it by output dims [256g, 256g + 256) with m64n256k16, V transposed
//   by the descriptor. O is 128 fp32 registers per thread.
//
// * kAhead (fp8 formats; variant wgmma_rows64_tile32_ahead, the plan's choice for them from 64
//   rows; kernels/mla/NOTES.md sessions 22-23): the loop runs one tile ahead, tile it + 1's q.k
//   issued before tile it's softmax so that the tensor cores run it beside the softmax and queue
//   tile it's P.V behind it (FlashAttention-3's intra-warpgroup overlap). 1.03-1.13x the chained
//   loop on the H100 in the fp8 formats; the same loop in bf16 (session 22) measured 0.93-1.04x
//   and was removed.
//
// Where it stands (H200, bench/RESULTS.md "The wgmma MLA decode kernel"): 64 heads x batch 64 x
// 32k at 0.61 (bf16) / 0.29 (fp8) / 0.31 (fp8_tiled) of copy bandwidth, 1.65-2.3x the sliced
// kernel; ncu (fp8_tiled): shared-memory wavefronts at 59% of peak, tensor pipe 31%, stalls on
// shared-memory results and the two barriers per tile. Each 32-token tile re-reads Q (72 KB) for
// the m64n32 q.k: at 32 tokens the q.k is shared-memory-bound before it is tensor-bound.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mla/e4m3_convert.cuh"
#include "kernels/mla/mla_decode_params.h"
#include "kernels/mla/mla_decode_schedule.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/warp_ptx.cuh"
#include "kernels/wgmma_ptx.cuh"

namespace mlaserve::mla {

namespace wg {

constexpr int kRows = 64;
constexpr int kThreads = 256;               // Two warpgroups.
constexpr int kQkSteps = kMlaQkDim / 16;    // 36 k16 steps of q.k.
constexpr int kDimBlocks = kMlaQkDim / 64;  // 9 blocks of 64 dims (8 latent, 1 RoPE).

template <KvCacheFormat kFormat, int kTile, int kStages, bool kAhead>
struct Config {
  static constexpr bool kBf16 = kFormat == KvCacheFormat::kBf16;
  static constexpr bool kTiled = kFormat == KvCacheFormat::kFp8Tiled;
  static constexpr int kRowBytes = static_cast<int>(KvCacheBytesPerToken(kFormat));
  // bf16: cp.async straight into a ring of kStages operand tiles. fp8: a ring of kStages raw
  // tiles, converted into two operand tiles (tile t + 1 converted while tile t's S runs).
  static constexpr int kKvBufs = kBf16 ? kStages : 2;
  static constexpr int kRawBufs = kBf16 ? 0 : kStages;
  static constexpr int kQBytes = kDimBlocks * kRows * 128;     // 73,728
  static constexpr int kKvBlockBytes = kTile * 128;            // one 64-dim block of a tile
  static constexpr int kKvBytes = kDimBlocks * kKvBlockBytes;  // 36,864 at 32 tokens
  static constexpr int kRawBytes = kTile * kRowBytes;          // one raw tile
  static constexpr int kSRegs = kTile / 2;                     // S accumulators per thread
  // Partial-S exchange buffer (both warpgroups' partials).
  static constexpr int kSxBytes = 2 * kSRegs * 128 * 4;
  static constexpr int kQOff = 0;
  static constexpr int kKvOff = kQOff + kQBytes;
  static constexpr int kRawOff = kKvOff + kKvBufs * kKvBytes;
  static constexpr int kSxOff = kRawOff + kRawBufs * kRawBytes;
  static constexpr int kQScaleOff = kSxOff + kSxBytes;  // 64 floats
  static constexpr int kSchedOff = kQScaleOff + 4 * kRows;
  static constexpr int kSchedBytes = 4 * (kInlineScheduleMaxBatch + 2);
  static constexpr int kSmemBytes = kSchedOff + kSchedBytes + 1024;  // + alignment slack
  static_assert(kTile == 32, "a thread copies / converts one 16-B chunk of each 64-dim block");
  static_assert(kStages >= 2, "need a ring");
  static_assert(kRowBytes % 16 == 0, "16-B copies");
  static_assert(kSmemBytes <= 227 * 1024, "H200: 227 KB per block");
  static_assert(!(kAhead && kBf16),
                "the tile-ahead loop is the fp8 formats' (bf16 lost, session 23)");
};

__device__ __forceinline__ uint32_t HMul2(uint32_t a, __half2 s) {
  __half2 v = __hmul2(*reinterpret_cast<__half2*>(&a), s);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <bool kF16>
__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  if constexpr (kF16) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}
__device__ __forceinline__ float Bf16Lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ uint32_t Bf16x2ToF16x2(uint32_t v) {
  return Pack<true>(Bf16Lo(v), Bf16Hi(v));
}
__device__ __forceinline__ void Sts128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

}  // namespace wg

template <KvCacheFormat kFormat, int kTile, int kStages, bool kAhead>
__global__ void __launch_bounds__(wg::kThreads, 1)
    MlaDecodeWgmmaKernel(const MlaDecodeKernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // Launched plainly: a programmatically launched combine may become resident now and wait for
  // this grid.
  pdl::AllowDependentLaunch();
  using namespace wg;
  using Cfg = Config<kFormat, kTile, kStages, kAhead>;
  constexpr bool kBf16 = Cfg::kBf16, kTiled = Cfg::kTiled;
  constexpr bool kF16 = !kBf16;
  constexpr int kSRegs = Cfg::kSRegs;
  extern __shared__ uint8_t smem_raw[];
  // 1024-B aligned base: the swizzle atoms of the wgmma operands must be.
  const uint32_t smem_raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (smem_raw_addr + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - smem_raw_addr);
  const uint32_t q_smem = base + Cfg::kQOff, kv_smem = base + Cfg::kKvOff;
  const uint32_t raw_smem = base + Cfg::kRawOff;
  float* qscale = reinterpret_cast<float*>(smem + Cfg::kQScaleOff);

  const int tid = threadIdx.x, lane = tid & 31;
  // Warpgroup index, broadcast from lane 0 so the compiler knows it is warp-uniform and keeps the
  // wgmma descriptors in uniform registers (as CUTLASS's canonical_warp_group_idx).
  const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int tw = tid & 127;               // thread in warpgroup
  const int wq = tw >> 5;                 // warp in warpgroup: rows 16wq .. 16wq + 15
  const int g = lane >> 2, c = lane & 3;  // accumulator row / column group
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

  // This thread's two rows (of the block's 64) and their indices in the sequence's rows.
  const int lrow_lo = 16 * wq + g, lrow_hi = lrow_lo + 8;
  const int row_lo = mt * kRows + lrow_lo, row_hi = mt * kRows + lrow_hi;

  // Tile copy / conversion: thread (token ct, 16-B chunk cch) of each 64-dim block kb: one
  // 128-B row of a block is 8 consecutive threads. Destination chunk swizzled (cch ^ ct % 8).
  const int ct = tid >> 3, cch = tid & 7;
  const uint32_t op_off = ct * 128 + ((cch ^ (ct & 7)) << 4);  // + kb * kKvBlockBytes

  // Descriptors (kernels/wgmma_ptx.cuh): bases here; per k-step offsets are compile-time
  // constants added to the low half. Warpgroup g takes the q.k k-steps 2k + g (k = 0..17): step
  // 2k + g lies in 64-dim block k / 2 at byte 32 (2 (k % 2) + g) of the 128-B row.
  const wgmma::Desc dq = wgmma::Desc128B(q_smem + 32 * wgi, 16, 1024);
  const wgmma::Desc dk = wgmma::Desc128B(kv_smem + 32 * wgi, 16, 1024);
  const wgmma::Desc dv =
      wgmma::Desc128B(kv_smem + 4 * wgi * Cfg::kKvBlockBytes, Cfg::kKvBlockBytes, 1024);

  for (int b = first_seq; b < p.batch && prefix[b] < cost_end; ++b) {
    const SeqPiece piece = PieceOfSequence(p, prefix, b, cost_begin, cost_end);
    const int len = piece.len, tok_begin = piece.tok_begin, tok_end = piece.tok_end;
    const bool whole = piece.whole;
    const int t_begin = tok_begin / kTile;
    const int n_tiles = tok_end > tok_begin ? (tok_end + kTile - 1) / kTile - t_begin : 0;
    const int32_t* __restrict__ blocks =
        p.block_table + static_cast<size_t>(b) * p.max_blocks_per_seq;
    constexpr int kTilesPerBlock = kKvBlockTokens / kTile;
    auto tile_src = [&](int t) {  // kTile consecutive rows of one cache block: contiguous bytes
      return p.kv_pool + (static_cast<size_t>(blocks[t / kTilesPerBlock]) * kKvBlockTokens +
                          (t % kTilesPerBlock) * kTile) *
                             Cfg::kRowBytes;
    };
    // Rows past the sequence's end are zero-filled (never stale NaN bytes): src-size 0 reads
    // nothing, and their addresses lie in the same 64-token cache block (no dummy pointer).
    auto copy_operand = [&](int t, int buf) {  // bf16: straight into the swizzled operand tile
      const uint8_t* src = tile_src(t) + ct * Cfg::kRowBytes + cch * 16;
      const bool valid = t * kTile + ct < len;
      const uint32_t dst = kv_smem + buf * Cfg::kKvBytes + op_off;
#pragma unroll
      for (int kb = 0; kb < kDimBlocks; ++kb) {
        ptx::CpAsync16(dst + kb * Cfg::kKvBlockBytes, src + kb * 128, valid);
      }
    };
    auto copy_raw = [&](int t, int slot) {  // fp8: raw bytes
      constexpr int kChunks = Cfg::kRawBytes / 16;
      const uint8_t* src = tile_src(t);
      const uint32_t dst = raw_smem + slot * Cfg::kRawBytes;
      const int valid_bytes = (len - t * kTile) * Cfg::kRowBytes;
#pragma unroll
      for (int j = 0; j < (kChunks + kThreads - 1) / kThreads; ++j) {
        const int i = tid + kThreads * j;
        if (j + 1 < (kChunks + kThreads - 1) / kThreads || i < kChunks) {
          const bool valid = 16 * i < valid_bytes;
          ptx::CpAsync16(dst + 16 * i, src + 16 * i, valid);
        }
      }
    };
    // fp8: raw slot -> operand buffer: e4m3 -> f16 exactly, fp8_tiled's power-of-two tile scale
    // multiplied in (exact, see the top), fp8_tiled's bf16 RoPE -> f16.
    auto convert = [&](int slot, int buf) {
      const uint8_t* src = smem + Cfg::kRawOff + slot * Cfg::kRawBytes + ct * Cfg::kRowBytes;
      uint8_t* dst = smem + Cfg::kKvOff + buf * Cfg::kKvBytes + op_off;
      uint4 v[kDimBlocks];
#pragma unroll
      for (int kb = 0; kb < kDimBlocks; ++kb) {  // all loads first (latency overlap)
        if (kTiled && kb == 8) {
          v[kb] = *reinterpret_cast<const uint4*>(src + kFp8TiledRopeOffset + cch * 16);
        } else {
          const uint2 e = *reinterpret_cast<const uint2*>(src + kb * 64 + cch * 8);
          v[kb].x = e.x;
          v[kb].y = e.y;
        }
      }
      float sc[kFp8TilesPerRow];
      if constexpr (kTiled) {
        const float4 s4 = *reinterpret_cast<const float4*>(src + kFp8TiledScaleOffset);
        sc[0] = s4.x;
        sc[1] = s4.y;
        sc[2] = s4.z;
        sc[3] = s4.w;
      }
#pragma unroll
      for (int kb = 0; kb < kDimBlocks; ++kb) {
        uint4 w;
        if (kTiled && kb == 8) {
          w = make_uint4(Bf16x2ToF16x2(v[kb].x), Bf16x2ToF16x2(v[kb].y), Bf16x2ToF16x2(v[kb].z),
                         Bf16x2ToF16x2(v[kb].w));
        } else {
          E4m3x4ToF16x2x2(v[kb].x, w.x, w.y);
          E4m3x4ToF16x2x2(v[kb].y, w.z, w.w);
          if constexpr (kTiled) {
            const __half2 s2 = __float2half2_rn(sc[kb >> 1]);
            w.x = HMul2(w.x, s2);
            w.y = HMul2(w.y, s2);
            w.z = HMul2(w.z, s2);
            w.w = HMul2(w.w, s2);
          }
        }
        *reinterpret_cast<uint4*>(dst + kb * Cfg::kKvBlockBytes) = w;
      }
    };

    // Prologue copies (one commit group per tile slot, empty groups past the end).
    if constexpr (kBf16) {
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < n_tiles) copy_operand(t_begin + s, s);
        ptx::CpAsyncCommit();
      }
    } else {
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        if (s < n_tiles) copy_raw(t_begin + s, s);
        ptx::CpAsyncCommit();
      }
    }

    // Q rows of this block into shared memory (swizzled, K-major). fp8 caches: f16 with a
    // power-of-two scale per row; its inverse goes to qscale[] for the scores.
    {
      const uint16_t* qb = p.q + static_cast<size_t>(b) * p.rows * kMlaQkDim;
      const int lr = tid >> 2, part = tid & 3;  // 4 threads per row, 18 chunks each
      const int row = mt * kRows + lr;
      const bool ok = row < p.rows;
      const uint4* src = reinterpret_cast<const uint4*>(qb + static_cast<size_t>(row) * kMlaQkDim);
      // 16-B chunks 64..71 (the RoPE dims) from q_rope.
      const uint4* rsrc = reinterpret_cast<const uint4*>(
          p.q_rope + (static_cast<int64_t>(b) * p.rows + row) * p.q_rope_stride);
      auto chunk = [&](int cc) {
        return cc < kMlaLatentDim / 8 ? src[cc] : rsrc[cc - kMlaLatentDim / 8];
      };
      float sc = 1.0f;
      if constexpr (kF16) {
        float amax = 0.0f;
        if (ok) {
#pragma unroll 6
          for (int k = 0; k < 18; ++k) {
            const uint4 v = chunk(part + 4 * k);
            const uint32_t w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              amax = fmaxf(amax, fmaxf(fabsf(Bf16Lo(w4[i])), fabsf(Bf16Hi(w4[i]))));
            }
          }
        }
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        int e = 0;
        if (amax > 0.0f && isfinite(amax)) {
          const int ex = ((__float_as_int(amax) >> 23) & 0xff) - 127;
          e = max(-100, min(100, 14 - ex));
        }
        sc = exp2f(static_cast<float>(e));
        if (part == 0) qscale[lr] = exp2f(static_cast<float>(-e));
      }
#pragma unroll 6
      for (int k = 0; k < 18; ++k) {
        const int cc = part + 4 * k, kb = cc >> 3, ch = cc & 7;
        uint4 v = ok ? chunk(cc) : make_uint4(0, 0, 0, 0);
        if constexpr (kF16) {
          v.x = Pack<true>(Bf16Lo(v.x) * sc, Bf16Hi(v.x) * sc);
          v.y = Pack<true>(Bf16Lo(v.y) * sc, Bf16Hi(v.y) * sc);
          v.z = Pack<true>(Bf16Lo(v.z) * sc, Bf16Hi(v.z) * sc);
          v.w = Pack<true>(Bf16Lo(v.w) * sc, Bf16Hi(v.w) * sc);
        }
        Sts128(q_smem + kb * (kRows * 128) + lr * 128 + ((ch ^ (lr & 7)) << 4), v);
      }
    }
    if constexpr (!kBf16) {
      ptx::CpAsyncWait<kStages - 1>();  // this thread's part of raw tile 0
      __syncthreads();                  // everyone's part
      if (n_tiles > 0) convert(0, 0);
    }
    // (Q and the first operand tile reach the async proxy through the loop's first fence.)

    const int lim_lo = min(row_lo < p.rows ? len - p.s_q + row_lo / p.heads : len - 1, tok_end - 1);
    const int lim_hi = min(row_hi < p.rows ? len - p.s_q + row_hi / p.heads : len - 1, tok_end - 1);
    const int lim_min = min(lim_lo, lim_hi);

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
    float qd_lo = 1.0f, qd_hi = 1.0f;

    // The per-tile steps, shared by the two loops below.
    auto units = [](int buf) { return static_cast<uint32_t>(buf * Cfg::kKvBytes) >> 4; };
    // This warpgroup's partial S (its 18 k-steps) of the operand tile at buf_units: issued and
    // committed, not waited for.
    auto issue_qk = [&](float(&s)[kSRegs], uint32_t buf_units) {
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) s[i] = 0.0f;
      wgmma::FenceRegs(s);
      wgmma::Fence();
#pragma unroll
      for (int k = 0; k < kQkSteps / 2; ++k) {
        const uint32_t qoff = ((k >> 1) * (kRows * 128) + (k & 1) * 64) >> 4;
        const uint32_t koff = ((k >> 1) * Cfg::kKvBlockBytes + (k & 1) * 64) >> 4;
        wgmma::WgmmaM64N32K16SS<kF16>(s, dq.lo + qoff, dq.hi, dk.lo + buf_units + koff, dk.hi,
                                      k > 0 ? 1 : 0);
      }
      wgmma::Commit();
    };
    // Partials exchanged through shared memory: float4 [warpgroup][4][128].
    float4* const sx_base = reinterpret_cast<float4*>(smem + Cfg::kSxOff);
    auto exchange_write = [&](const float(&s)[kSRegs]) {
#pragma unroll
      for (int q4 = 0; q4 < kSRegs / 4; ++q4) {
        sx_base[(wgi * (kSRegs / 4) + q4) * 128 + tw] =
            make_float4(s[4 * q4], s[4 * q4 + 1], s[4 * q4 + 2], s[4 * q4 + 3]);
      }
    };
    auto exchange_add = [&](float(&s)[kSRegs]) {  // after a barrier behind the writes
#pragma unroll
      for (int q4 = 0; q4 < kSRegs / 4; ++q4) {
        const float4 v = sx_base[((1 - wgi) * (kSRegs / 4) + q4) * 128 + tw];
        s[4 * q4] += v.x;
        s[4 * q4 + 1] += v.y;
        s[4 * q4 + 2] += v.z;
        s[4 * q4 + 3] += v.w;
      }
    };
    // Online softmax of tile it's full S (log2 domain; identical in both warpgroups), then O +=
    // P V over this warpgroup's 256 output dims from the operand tile at buf_units: issued and
    // committed, not waited for; P's registers go back to the caller (live until the wait).
    auto softmax_pv = [&](float(&s)[kSRegs], int it, uint32_t buf_units,
                          uint32_t(&pa)[kTile / 16][4]) {
      const int t = t_begin + it;
      const float sl_lo = qd_lo * p.score_scale_log2, sl_hi = qd_hi * p.score_scale_log2;
#pragma unroll
      for (int j = 0; j < kSRegs / 4; ++j) {
        s[4 * j + 0] *= sl_lo;
        s[4 * j + 1] *= sl_lo;
        s[4 * j + 2] *= sl_hi;
        s[4 * j + 3] *= sl_hi;
      }
      if (!(t * kTile >= tok_begin && t * kTile + kTile - 1 <= lim_min)) {  // edge tiles only
#pragma unroll
        for (int j = 0; j < kSRegs / 4; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int pos = t * kTile + 8 * j + 2 * c + (e & 1);
            if (pos < tok_begin || pos > (e >= 2 ? lim_hi : lim_lo)) s[4 * j + e] = -INFINITY;
          }
        }
      }
      float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
      for (int j = 0; j < kSRegs / 4; ++j) {
        mx_lo = fmaxf(mx_lo, fmaxf(s[4 * j + 0], s[4 * j + 1]));
        mx_hi = fmaxf(mx_hi, fmaxf(s[4 * j + 2], s[4 * j + 3]));
      }
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      constexpr float kLazyLog2 = 8.0f;  // see mla_decode_sliced.cuh
      const float new_lo = mx_lo > m_lo + kLazyLog2 ? mx_lo : m_lo;
      const float new_hi = mx_hi > m_hi + kLazyLog2 ? mx_hi : m_hi;
      const float base_lo = new_lo == -INFINITY ? 0.0f : new_lo;
      const float base_hi = new_hi == -INFINITY ? 0.0f : new_hi;
      const float alpha_lo = exp2f(m_lo - base_lo), alpha_hi = exp2f(m_hi - base_hi);
      m_lo = new_lo;
      m_hi = new_hi;
      float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
      for (int j = 0; j < kSRegs / 4; ++j) {
        s[4 * j + 0] = exp2f(s[4 * j + 0] - base_lo);
        s[4 * j + 1] = exp2f(s[4 * j + 1] - base_lo);
        s[4 * j + 2] = exp2f(s[4 * j + 2] - base_hi);
        s[4 * j + 3] = exp2f(s[4 * j + 3] - base_hi);
        sum_lo += s[4 * j + 0] + s[4 * j + 1];
        sum_hi += s[4 * j + 2] + s[4 * j + 3];
      }
      sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, 1);
      sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, 2);
      sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, 1);
      sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, 2);
      l_lo = l_lo * alpha_lo + sum_lo;
      l_hi = l_hi * alpha_hi + sum_hi;
      if (__any_sync(0xffffffffu, alpha_lo != 1.0f || alpha_hi != 1.0f)) {
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          o[4 * n + 0] *= alpha_lo;
          o[4 * n + 1] *= alpha_lo;
          o[4 * n + 2] *= alpha_hi;
          o[4 * n + 3] *= alpha_hi;
        }
      }
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        pa[kk][0] = Pack<kF16>(s[8 * kk + 0], s[8 * kk + 1]);
        pa[kk][1] = Pack<kF16>(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = Pack<kF16>(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = Pack<kF16>(s[8 * kk + 6], s[8 * kk + 7]);
      }
      wgmma::FenceRegs(o);
      wgmma::Fence();
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        wgmma::WgmmaM64N256K16RSTransB<kF16>(o, pa[kk], dv.lo + buf_units + ((kk * 16 * 128) >> 4),
                                             dv.hi, 1);
      }
      wgmma::Commit();
    };

    if constexpr (kAhead) {
      // kAhead (fp8 formats): software-pipelined one tile ahead (FlashAttention-3's
      // intra-warpgroup overlap): tile it + 1's q.k is issued before tile it's softmax and runs on
      // the tensor cores beside it and beside tile it's P.V, which follows it in the same queue.
      // Two operand tiles are all that fits beside Q and the raw ring (a third would take ~240 KB
      // of the 227), so tile it + 2 is converted after tile it's P.V has released its operand
      // tile: the conversion no longer overlaps a q.k (the chained loop's one overlap) but the
      // tensor work of two tiles does. Tile it + 1's partials are written after a barrier that
      // follows every read of tile it's, so one exchange buffer serves. The step is called with
      // a literal `next` (the last tile peeled): ptxas serializes every wgmma when the q.k issue
      // and its wait_group 1 sit under runtime conditions it cannot pair (warning C7514). Raw tile
      // t lives in ring slot t % kStages; its slot is refilled (tile t + kStages) at the first
      // barrier after every thread has converted it. One cp.async group a step (empty where nothing
      // is copied), so "raw tile it + 2 landed" is wait_group<2> at the end of step it (groups of
      // tiles it + 3 and it + 4 may still be in flight).
      static_assert(kStages == 3, "the commit-group counts below assume a 3-deep raw ring");
      float sa[kSRegs], sb[kSRegs];
      if (n_tiles > 0) {
        // Tile 0 was converted into operand tile 0 above (every thread its own row chunks).
        wgmma::FenceProxyAsyncShared();
        __syncthreads();  // operand tile 0, Q and qscale complete; raw slot 0 free
        qd_lo = qscale[lrow_lo];
        qd_hi = qscale[lrow_hi];
        issue_qk(sa, units(0));
        if (kStages < n_tiles) copy_raw(t_begin + kStages, 0);
        ptx::CpAsyncCommit();
        if (n_tiles > 1) {  // tile 1 into operand tile 1, beside tile 0's q.k
          ptx::CpAsyncWait<2>();  // raw tile 1 (groups of tiles 2 and 3 may be pending)
          __syncthreads();        // everyone's part of it
          convert(1, 1);
        }
        wgmma::Wait<0>();
        wgmma::FenceRegs(sa);
        exchange_write(sa);
        wgmma::FenceProxyAsyncShared();
        __syncthreads();  // tile 0's partials; operand tile 1; raw slot 1 free
      }
      auto step = [&](bool next, float(&s)[kSRegs], float(&sn)[kSRegs], int it) {
        exchange_add(s);
        if (next) {
          // Every thread's reads of the exchange are done before tile it + 1's partials are
          // written, and every thread converted raw tile it + 1 (end of the previous step, or
          // above), whose slot now takes tile it + 4.
          __syncthreads();
          issue_qk(sn, units((it + 1) & 1));
          const int tn = it + 4;
          if (tn < n_tiles) copy_raw(t_begin + tn, tn % kStages);
        }
        ptx::CpAsyncCommit();
        uint32_t pa[kTile / 16][4];
        softmax_pv(s, it, units(it & 1), pa);
        if (next) {
          wgmma::Wait<1>();  // tile it + 1's q.k (committed before this P.V)
          wgmma::FenceRegs(sn);
          exchange_write(sn);
        }
        wgmma::Wait<0>();
        wgmma::FenceRegs(o);
        wgmma::UseRegs(pa);
        ptx::CpAsyncWait<2>();  // raw tile it + 2
        // Both warpgroups' P.V of tile it are done (its operand tile is free), tile it + 1's
        // partials are written, raw tile it + 2 is complete.
        __syncthreads();
        if (it + 2 < n_tiles) convert((it + 2) % kStages, it & 1);
        wgmma::FenceProxyAsyncShared();
      };
      constexpr bool more = true, last = false;
      int it = 0;
      for (; it + 2 < n_tiles; it += 2) {
        step(more, sa, sb, it);
        step(more, sb, sa, it + 1);
      }
      if (it + 1 < n_tiles) {
        step(more, sa, sb, it);
        step(last, sb, sa, it + 1);
      } else if (it < n_tiles) {
        step(last, sa, sb, it);
      }
    } else {
      for (int it = 0; it < n_tiles; ++it) {
        // (1) bf16: tile it landed; fp8: raw tile it + 1 landed and tile it's operand converted.
        // Both: the previous tile's operand reads are done.
        ptx::CpAsyncWait<kStages - 2>();
        wgmma::FenceProxyAsyncShared();
        __syncthreads();
        if (kF16 && it == 0) {
          qd_lo = qscale[lrow_lo];
          qd_hi = qscale[lrow_hi];
        }
        const int buf = kBf16 ? it % kStages : it & 1;
        // Partial S over this warpgroup's 18 k-steps, in flight while the next tile is converted
        // or copied.
        float s[kSRegs];
        issue_qk(s, units(buf));
        if constexpr (kBf16) {
          const int tn = it + kStages - 1;
          if (tn < n_tiles) copy_operand(t_begin + tn, tn % kStages);
        } else {
          if (it + 1 < n_tiles) convert((it + 1) % kStages, (it + 1) & 1);
          const int tn = it + kStages;
          if (tn < n_tiles) copy_raw(t_begin + tn, it % kStages);
        }
        ptx::CpAsyncCommit();
        wgmma::Wait<0>();
        wgmma::FenceRegs(s);
        exchange_write(s);
        __syncthreads();  // (2) both partials are in shared memory.
        exchange_add(s);
        uint32_t pa[kTile / 16][4];
        softmax_pv(s, it, units(buf), pa);
        wgmma::Wait<0>();
        wgmma::FenceRegs(o);
        wgmma::UseRegs(pa);
      }
    }
    ptx::CpAsyncWait<0>();
    __syncthreads();  // The next piece's prologue reuses Q, the buffers and the exchange.

    const float inv_lo = l_lo > 0.0f ? p.out_scale / l_lo : 0.0f;
    const float inv_hi = l_hi > 0.0f ? p.out_scale / l_hi : 0.0f;
    const float lse2_lo = l_lo > 0.0f ? m_lo + log2f(l_lo) : -INFINITY;  // log2 units
    const float lse2_hi = l_hi > 0.0f ? m_hi + log2f(l_hi) : -INFINITY;
    constexpr float kLn2 = 0.693147180559945309f;
    const size_t slot = static_cast<size_t>(worker) + b;  // Unique per (sequence, worker).
    auto store_row = [&](int row, int half, float inv, float lse2) {
      const int col0 = 256 * wgi + 2 * c;
      if (whole) {
        uint16_t* out = p.out + (static_cast<size_t>(b) * p.rows + row) * kMlaLatentDim;
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          *reinterpret_cast<uint32_t*>(out + col0 + 8 * n) =
              Pack<false>(o[4 * n + 2 * half] * inv, o[4 * n + 2 * half + 1] * inv);
        }
        if (wgi == 0 && c == 0 && p.lse != nullptr) {
          p.lse[static_cast<size_t>(b) * p.rows + row] = lse2 * kLn2;
        }
      } else {
        float* part = p.o_part + (slot * p.rows + row) * kMlaLatentDim;
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          *reinterpret_cast<float2*>(part + col0 + 8 * n) =
              make_float2(o[4 * n + 2 * half] * inv, o[4 * n + 2 * half + 1] * inv);
        }
        if (wgi == 0 && c == 0) p.lse_part[slot * p.rows + row] = lse2;
      }
    };
    if (row_lo < p.rows) store_row(row_lo, 0, inv_lo, lse2_lo);
    if (row_hi < p.rows) store_row(row_hi, 1, inv_hi, lse2_hi);
  }
#endif
}

// 1 on an SM90 device (the kernel fits one block per SM), 0 elsewhere: the plan then refuses
// this variant (MlaDecodeVariantAvailable).
template <KvCacheFormat kFormat, int kTile, int kStages, bool kAhead>
int MlaDecodeWgmmaBlocksPerSm() {
  using Cfg = wg::Config<kFormat, kTile, kStages, kAhead>;
  static const int blocks = [] {
    if (!wgmma::CurrentDeviceIsSm90()) return 0;
    return DecodeKernelBlocksPerSm(
        reinterpret_cast<const void*>(&MlaDecodeWgmmaKernel<kFormat, kTile, kStages, kAhead>),
        wg::kThreads, Cfg::kSmemBytes);
  }();
  return blocks;
}

template <KvCacheFormat kFormat, int kTile, int kStages, bool kAhead>
cudaError_t LaunchMlaDecodeWgmma(const MlaDecodeKernelParams& p, int grid, cudaStream_t stream) {
  using Cfg = wg::Config<kFormat, kTile, kStages, kAhead>;
  if (MlaDecodeWgmmaBlocksPerSm<kFormat, kTile, kStages, kAhead>() == 0) {
    return cudaErrorInvalidConfiguration;
  }
  MlaDecodeWgmmaKernel<kFormat, kTile, kStages, kAhead>
      <<<grid, wg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

#define MLASERVE_INSTANTIATE_MLA_DECODE_WGMMA(FORMAT, TILE, STAGES, AHEAD) \
  template cudaError_t LaunchMlaDecodeWgmma<FORMAT, TILE, STAGES, AHEAD>(  \
      const MlaDecodeKernelParams&, int, cudaStream_t);                    \
  template int MlaDecodeWgmmaBlocksPerSm<FORMAT, TILE, STAGES, AHEAD>();

}  // namespace mlaserve::mla
