// SM90a split-KV MLA decode kernel with q.k and P.V on e4m3 tensor cores (the FP8 tensor-core
// form, kernels/mla/NOTES.md session 32): the fp8 and fp8_tiled cache formats, 64 query rows a
// block. Same schedule, pieces, partial outputs and combine as the other kernels
// (mla_decode_wgmma.cuh); the arithmetic is the form MlaDecodeRef emulates with fp8_mma = kQkPv
// (mla_decode_ref.h), which the accuracy test measured on the trained model (issue 18's bounds
// hold).
//
// Why: at 64-128 heads every fp8 kernel here was bound by bf16-rate tensor work plus the e4m3 ->
// f16 conversion of each cache byte (64-row kernel: 0.50 / 0.26 of copy bandwidth at 64 / 128
// heads x batch 64 x 32k on the H100, session 33). On e4m3 wgmma the tensor work halves and the
// cache bytes are the MMA's operand as they are: nothing is converted.
//
// * Q (64 rows x 576) is rounded to e4m3 once a sequence piece, with one scale a row (the smallest
//   power of two >= amax / 448, the emulation's rule: exact scaling, so ties round alike):
//   [5 blocks of 128 dims][64 rows][128 B], 128-byte swizzle, K-major;
//   block 4 holds the 64 RoPE dims in its rows' first 64 bytes.
// * A tile is kTile = 32 cache rows of one 64-token block (contiguous bytes), copied by cp.async
//   straight into the same 5-block K-major layout (the q.k's B operand): a kStages-deep ring.
// * S = Q K^T: warpgroup g takes latent dim groups 2g and 2g + 1 (4 k32 steps each, m64n32k32) and
//   RoPE k-step g; each group is summed in a fresh accumulator and added in fp32 after it (the
//   tensor core's e4m3 sums are ~22-bit: promote every 128 dims, DeepSeek-V3 report 3.3.2), the
//   partials exchanged through shared memory as in mla_decode_wgmma.cuh.
// * P.V: e4m3 wgmma has no transposed operand, so V (the tile's latent dims) is transposed in
//   shared memory into [512 dims][32 tokens] (no swizzle: 8 x 16-B core matrices), tokens permuted
//   within each 16 so that P's accumulator registers are the A fragment as they are: A register 0
//   holds columns 4c .. 4c + 3 of row g (c = lane % 4), which the S accumulator has as columns 2c,
//   2c + 1, 8 + 2c, 9 + 2c; so V^T's byte 4c + i of a 16 is token {2c, 2c + 1, 8 + 2c, 9 + 2c}[i].
//   The transpose runs while the q.k is on the tensor cores; a lane rotation keeps its 32-bit
//   loads and stores free of bank conflicts (see Transpose).
// * Softmax: the running max is exact (no lazy rescale) so P <= 1, and P x 256 is rounded to e4m3
//   (as the emulation; e4m3's normal range reaches 2^-6 / 256 of the row's largest weight); the
//   row sums are fp32 over the unrounded weights. warpgroup g multiplies P by V^T's dims
//   [256g, 256g + 256) with one m64n256k32 a tile.
// * fp8_tiled: block 4 holds the bf16 RoPE dims (128 B a row; bf16 m64n32k16 steps 2g, 2g + 1);
//   each group's promoted q.k is multiplied by its tokens' tile scale (and q's row scale); P.V runs
//   one P a 128-column group (two m64n128k32): P x 256 x the token's tile scale / the group's
//   running largest scale, the group's O columns rescaled when that grows and multiplied back at
//   the end.
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
constexpr int kThreads = 256;  // Two warpgroups.
constexpr int kTile = 32;
constexpr int kQkBlocks = 5;       // 128-B K-major blocks: 4 latent, 1 RoPE
constexpr float kPScale = 256.0f;  // P in (0, 1] times this before the e4m3 rounding

template <KvCacheFormat kFormat, int kStages>
struct Config {
  static constexpr bool kTiled = kFormat == KvCacheFormat::kFp8Tiled;
  static constexpr int kRowBytes = static_cast<int>(KvCacheBytesPerToken(kFormat));
  static constexpr int kQBytes = kQkBlocks * kRows * 128;   // 40,960
  static constexpr int kKBlockBytes = kTile * 128;          // 4,096
  static constexpr int kKBytes = kQkBlocks * kKBlockBytes;  // 20,480: one ring slot
  static constexpr int kVtBytes = kMlaLatentDim * kTile;    // 16,384
  static constexpr int kSxBytes = 2 * 16 * 128 * 4;         // both warpgroups' partial S
  static constexpr int kScBytes = kTiled ? kTile * 16 : 0;  // fp8_tiled: a slot's tile scales
  static constexpr int kQOff = 0;
  static constexpr int kKOff = kQOff + kQBytes;
  static constexpr int kVtOff = kKOff + kStages * kKBytes;
  static constexpr int kScOff = kVtOff + kVtBytes;
  static constexpr int kSxOff = kScOff + kStages * kScBytes;
  static constexpr int kQScaleOff = kSxOff + kSxBytes;  // 64 floats
  static constexpr int kSchedOff = kQScaleOff + 4 * kRows;
  static constexpr int kSchedBytes = 4 * (kInlineScheduleMaxBatch + 2);
  static constexpr int kSmemBytes = kSchedOff + kSchedBytes + 1024;  // + alignment slack
  static_assert(kFormat == KvCacheFormat::kFp8 || kTiled, "the fp8 formats");
  static_assert(kStages >= 2, "need a ring");
  static_assert(kSmemBytes <= 227 * 1024, "H100 / H200: 227 KB per block");
};

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

template <KvCacheFormat kFormat, int kStages>
__global__ void __launch_bounds__(f8mma::kThreads, 1)
    MlaDecodeFp8MmaKernel(const MlaDecodeKernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl::AllowDependentLaunch();
  using namespace f8mma;
  using Cfg = Config<kFormat, kStages>;
  constexpr bool kTiled = Cfg::kTiled;
  constexpr int kRowBytes = Cfg::kRowBytes;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem_raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (smem_raw_addr + 1023u) & ~1023u;  // swizzle atoms 1024-B aligned
  uint8_t* smem = smem_raw + (base - smem_raw_addr);
  const uint32_t q_smem = base + Cfg::kQOff, k_smem = base + Cfg::kKOff;
  const uint32_t vt_smem = base + Cfg::kVtOff, sc_smem = base + Cfg::kScOff;
  float* qscale = reinterpret_cast<float*>(smem + Cfg::kQScaleOff);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform (uniform registers)
  const int tw = tid & 127;
  const int wq = tw >> 5;
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

  const int lrow_lo = 16 * wq + g, lrow_hi = lrow_lo + 8;
  const int row_lo = mt * kRows + lrow_lo, row_hi = mt * kRows + lrow_hi;

  // Tile copy: thread (row ct, 16-B chunk cch) copies chunks cch + 8j (j = 0..3: latent block j)
  // and, for cch < 4, chunk 32 + cch (the RoPE block's first 64 bytes). Swizzled destination.
  const int ct = tid >> 3, cch = tid & 7;
  const uint32_t op_off = ct * 128 + ((cch ^ (ct & 7)) << 4);

  // Transpose: lane (c = lane % 4, b = lane / 4 % 2, r = lane / 8) of warp w, step s (0..3) takes
  // dims 4 dq .. 4 dq + 3 with dq = 8 (2w + s % 2) + 2r + b, tokens 16 (s / 2) + {2c, 2c + 1,
  // 8 + 2c, 9 + 2c}. Loads: the 32 lanes read 32 distinct banks (the swizzle's chunk XOR with
  // token 2c, and dq % 4). Stores: output word j goes to dim 4 dq + (j ^ r), so a store's lanes
  // cover all 8 rows of a core matrix x 4 words: 32 banks.
  const int tb = (lane >> 2) & 1, tr = lane >> 3;
  // The byte permutes' selectors (lane constants: the rotation by r is in them).
  const uint32_t sel1_a = (tr & 2) ? 0x7362u : 0x5140u, sel1_b = (tr & 2) ? 0x5140u : 0x7362u;
  const uint32_t sel_a = (tr & 1) ? 0x7632u : 0x5410u, sel_b = (tr & 1) ? 0x5410u : 0x7632u;
  // Addresses (ring slot 0, h = 0) for the steps' two dim quads (s % 2 = 0, 1): the loads of
  // tokens 2c + e (token u's swizzle XOR is that of u % 8 = 2c + e; the other tokens are at
  // constant offsets), the stores' V^T row 8 (dq / 2) + 4b, word c. Computed once: the loop then
  // adds constants (and the slot), no per-tile address arithmetic.
  uint32_t t_ld[2][2], t_st[2];
#pragma unroll
  for (int sp = 0; sp < 2; ++sp) {
    const int dqi = 8 * (2 * warp + sp) + 2 * tr + tb;  // 0..127
    const int chunk = (dqi >> 2) & 7;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      t_ld[sp][e] = k_smem + (dqi >> 5) * Cfg::kKBlockBytes + (dqi & 3) * 4 + (2 * c + e) * 128 +
                    ((chunk ^ (2 * c + e)) << 4);
    }
    t_st[sp] = vt_smem + (dqi >> 1) * 256 + tb * 64 + 4 * c;
  }
  const uint32_t t_x = tr * 16;  // row (j ^ r) of a core matrix: (16 j) ^ t_x

  const wgmma::Desc dq = wgmma::Desc128B(q_smem, 16, 1024);
  const wgmma::Desc dk = wgmma::Desc128B(k_smem, 16, 1024);
  const wgmma::Desc dv = wgmma::DescNoSwizzle(vt_smem + wgi * (256 / 8) * 256, 128, 256);

  for (int b = first_seq; b < p.batch && prefix[b] < cost_end; ++b) {
    const SeqPiece piece = PieceOfSequence(p, prefix, b, cost_begin, cost_end);
    const int len = piece.len, tok_begin = piece.tok_begin, tok_end = piece.tok_end;
    const bool whole = piece.whole;
    const int t_begin = tok_begin / kTile;
    const int n_tiles = tok_end > tok_begin ? (tok_end + kTile - 1) / kTile - t_begin : 0;
    const int32_t* __restrict__ blocks =
        p.block_table + static_cast<size_t>(b) * p.max_blocks_per_seq;
    constexpr int kTilesPerBlock = kKvBlockTokens / kTile;
    // Rows past the sequence's end are zero-filled (src-size 0), never stale bytes.
    auto copy_tile = [&](int t, int slot) {
      const uint8_t* src = p.kv_pool +
                           (static_cast<size_t>(blocks[t / kTilesPerBlock]) * kKvBlockTokens +
                            (t % kTilesPerBlock) * kTile + ct) *
                               kRowBytes +
                           cch * 16;
      const bool valid = t * kTile + ct < len;
      const uint32_t dst = k_smem + slot * Cfg::kKBytes + op_off;
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
        ptx::CpAsync16(dst + kb * Cfg::kKBlockBytes, src + kb * 128, valid);
      }
      if constexpr (kTiled) {  // bf16 RoPE (128 B), and the 4 tile scales
        ptx::CpAsync16(dst + 4 * Cfg::kKBlockBytes, src + kFp8TiledRopeOffset, valid);
        if (cch == 0) {
          ptx::CpAsync16(sc_smem + slot * Cfg::kScBytes + ct * 16, src + kFp8TiledScaleOffset,
                         valid);
        }
      } else {  // e4m3 RoPE (64 B), the block's other 64 B zero-filled
        ptx::CpAsync16(dst + 4 * Cfg::kKBlockBytes, src + kMlaLatentDim, valid && cch < 4);
      }
    };
    // V^T of ring slot `slot`'s latent dims (see above).
    auto transpose = [&](int slot) {
      const uint32_t so = slot * Cfg::kKBytes;
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const int sp = s & 1, h = s >> 1;
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          w[i] = f8mma::Lds32(t_ld[sp][i & 1] + so + (16 * h + 8 * (i >> 1)) * 128);
        }
        // 4 x 4 byte transpose: out word j = dim j ^ r's bytes of tokens w0..w3.
        const uint32_t a01 = __byte_perm(w[0], w[1], sel1_a), b01 = __byte_perm(w[0], w[1], sel1_b);
        const uint32_t a23 = __byte_perm(w[2], w[3], sel1_a), b23 = __byte_perm(w[2], w[3], sel1_b);
        const uint32_t out[4] = {__byte_perm(a01, a23, sel_a), __byte_perm(a01, a23, sel_b),
                                 __byte_perm(b01, b23, sel_a), __byte_perm(b01, b23, sel_b)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          f8mma::Sts32(t_st[sp] + h * 128 + ((16u * j) ^ t_x), out[j]);
        }
      }
    };

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_tiles) copy_tile(t_begin + s, s);
      ptx::CpAsyncCommit();
    }

    f8mma::StoreQ<kTiled>(p, b, mt, q_smem, qscale, tid);

    const int lim_lo = min(row_lo < p.rows ? len - p.s_q + row_lo / p.heads : len - 1, tok_end - 1);
    const int lim_hi = min(row_hi < p.rows ? len - p.s_q + row_hi / p.heads : len - 1, tok_end - 1);
    const int lim_min = min(lim_lo, lim_hi);

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
    float qd_lo = 1.0f, qd_hi = 1.0f;
    float rs[2] = {0.0f, 0.0f};  // fp8_tiled: running largest tile scale of the groups 2g, 2g + 1
    float4* const sx_base = reinterpret_cast<float4*>(smem + Cfg::kSxOff);

    for (int it = 0; it < n_tiles; ++it) {
      // Tile it landed; the previous tile's V^T reads (its P.V) and q.k are done everywhere.
      ptx::CpAsyncWait<kStages - 2>();
      wgmma::FenceProxyAsyncShared();
      __syncthreads();
      if (it == 0) {
        qd_lo = qscale[lrow_lo];
        qd_hi = qscale[lrow_hi];
      }
      const int slot = it % kStages;
      // Broadcast from lane 0 so the compiler sees it warp-uniform: the descriptors stay in
      // uniform registers (as wgi above).
      const uint32_t kunits =
          __shfl_sync(0xffffffffu, static_cast<uint32_t>(slot * Cfg::kKBytes) >> 4, 0);
      // This warpgroup's partial S: latent groups 2g, 2g + 1 (fresh accumulators) and its half of
      // the RoPE dims (fp8: e4m3 k-step g; fp8_tiled: bf16 k16 steps 2g, 2g + 1).
      float s[16], a1[16], a2[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) s[i] = a1[i] = a2[i] = 0.0f;
      wgmma::FenceRegs(s);
      wgmma::FenceRegs(a1);
      wgmma::FenceRegs(a2);
      wgmma::Fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int kb = 2 * wgi;
        const uint32_t qoff = (kb * (kRows * 128) + 32 * k) >> 4;
        const uint32_t koff = (kb * Cfg::kKBlockBytes + 32 * k) >> 4;
        wgmma::WgmmaM64N32K32E4m3SS(s, dq.lo + qoff, dq.hi, dk.lo + kunits + koff, dk.hi, k);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int kb = 2 * wgi + 1;
        const uint32_t qoff = (kb * (kRows * 128) + 32 * k) >> 4;
        const uint32_t koff = (kb * Cfg::kKBlockBytes + 32 * k) >> 4;
        wgmma::WgmmaM64N32K32E4m3SS(a1, dq.lo + qoff, dq.hi, dk.lo + kunits + koff, dk.hi, k);
      }
      if constexpr (kTiled) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const uint32_t qoff = (4 * (kRows * 128) + 32 * (2 * wgi + k)) >> 4;
          const uint32_t koff = (4 * Cfg::kKBlockBytes + 32 * (2 * wgi + k)) >> 4;
          wgmma::WgmmaM64N32K16SS<false>(a2, dq.lo + qoff, dq.hi, dk.lo + kunits + koff, dk.hi, k);
        }
      } else {
        const uint32_t qoff = (4 * (kRows * 128) + 32 * wgi) >> 4;
        const uint32_t koff = (4 * Cfg::kKBlockBytes + 32 * wgi) >> 4;
        wgmma::WgmmaM64N32K32E4m3SS(a2, dq.lo + qoff, dq.hi, dk.lo + kunits + koff, dk.hi, 0);
      }
      wgmma::Commit();
      // Beside the q.k: the next copy (into the slot tile it - 1 left) and this tile's V^T.
      const int tn = it + kStages - 1;
      if (tn < n_tiles) copy_tile(t_begin + tn, tn % kStages);
      ptx::CpAsyncCommit();
      transpose(slot);
      wgmma::Wait<0>();
      wgmma::FenceRegs(s);
      wgmma::FenceRegs(a1);
      wgmma::FenceRegs(a2);
      // fp8_tiled: this warpgroup's tile scales of the thread's 8 tokens (columns 8j + 2c + e)
      // (zero-filled rows: 0), which also scale P below.
      float2 sc[4][2];
      if constexpr (kTiled) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int tk = 8 * j + 2 * c + e;
            const float* scp =
                reinterpret_cast<const float*>(smem + Cfg::kScOff + slot * Cfg::kScBytes + tk * 16);
            sc[j][e] = *reinterpret_cast<const float2*>(scp + 2 * wgi);
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = sc[j][e & 1];
            s[4 * j + e] = (e < 2 ? qd_lo : qd_hi) * (s[4 * j + e] * f.x + a1[4 * j + e] * f.y) +
                           a2[4 * j + e];
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) s[i] = s[i] + a1[i] + a2[i];
      }
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4) {
        sx_base[(wgi * 4 + q4) * 128 + tw] =
            make_float4(s[4 * q4], s[4 * q4 + 1], s[4 * q4 + 2], s[4 * q4 + 3]);
      }
      wgmma::FenceProxyAsyncShared();  // V^T (generic writes) for the P.V's async reads
      __syncthreads();
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4) {
        const float4 v = sx_base[((1 - wgi) * 4 + q4) * 128 + tw];
        s[4 * q4] += v.x;
        s[4 * q4 + 1] += v.y;
        s[4 * q4 + 2] += v.z;
        s[4 * q4 + 3] += v.w;
      }

      // Online softmax (log2 domain, exact running max), identical in both warpgroups.
      const int t = t_begin + it;
      // (fp8_tiled's q scales are in S already.)
      const float sl_lo = (kTiled ? 1.0f : qd_lo) * p.score_scale_log2;
      const float sl_hi = (kTiled ? 1.0f : qd_hi) * p.score_scale_log2;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[4 * j + 0] *= sl_lo;
        s[4 * j + 1] *= sl_lo;
        s[4 * j + 2] *= sl_hi;
        s[4 * j + 3] *= sl_hi;
      }
      if (!(t * kTile >= tok_begin && t * kTile + kTile - 1 <= lim_min)) {  // edge tiles only
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int pos = t * kTile + 8 * j + 2 * c + (e & 1);
            if (pos < tok_begin || pos > (e >= 2 ? lim_hi : lim_lo)) s[4 * j + e] = -INFINITY;
          }
        }
      }
      float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mx_lo = fmaxf(mx_lo, fmaxf(s[4 * j + 0], s[4 * j + 1]));
        mx_hi = fmaxf(mx_hi, fmaxf(s[4 * j + 2], s[4 * j + 3]));
      }
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      const float base_lo = mx_lo == -INFINITY ? 0.0f : mx_lo;
      const float base_hi = mx_hi == -INFINITY ? 0.0f : mx_hi;
      const float alpha_lo = exp2f(m_lo - base_lo), alpha_hi = exp2f(m_hi - base_hi);
      m_lo = mx_lo;
      m_hi = mx_hi;
      float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
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
      // P x 256 in e4m3, in the A fragment's order (see the top): register 0 row lo columns
      // {2c, 2c + 1, 8 + 2c, 9 + 2c}, register 1 the same of row hi, registers 2-3 at + 16.
      auto pack = [](const float(&w)[16], uint32_t(&a)[4]) {
        a[0] = f8mma::E4m3x4(w[0], w[1], w[4], w[5]);
        a[1] = f8mma::E4m3x4(w[2], w[3], w[6], w[7]);
        a[2] = f8mma::E4m3x4(w[8], w[9], w[12], w[13]);
        a[3] = f8mma::E4m3x4(w[10], w[11], w[14], w[15]);
      };
      if constexpr (kTiled) {
        // One P a 128-column group: P x 256 x the token's tile scale / the group's running
        // largest scale (rs, raised here with the group's O columns scaled down to match), so that
        // O's columns hold sum P x V / rs; the epilogue multiplies rs back.
        uint32_t pa[2][4];
#pragma unroll
        for (int gi = 0; gi < 2; ++gi) {
          float tmax = 0.0f;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            tmax = fmaxf(tmax, gi ? fmaxf(sc[j][0].y, sc[j][1].y) : fmaxf(sc[j][0].x, sc[j][1].x));
          }
          tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
          tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));  // the tile's 32 tokens
          if (tmax > rs[gi]) {  // the same in every thread of the warpgroup
            const float f = rs[gi] / tmax;
#pragma unroll
            for (int i = 0; i < 64; ++i) o[64 * gi + i] *= f;
            rs[gi] = tmax;
          }
          const float inv_rs = rs[gi] > 0.0f ? kPScale / rs[gi] : 0.0f;
          float w[16];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 f = sc[j][e & 1];
              w[4 * j + e] = s[4 * j + e] * (gi ? f.y : f.x) * inv_rs;
            }
          }
          pack(w, pa[gi]);
        }
        wgmma::FenceRegs(o);
        wgmma::Fence();
        wgmma::WgmmaM64N128K32E4m3RS(*reinterpret_cast<float(*)[64]>(o), pa[0], dv.lo, dv.hi, 1);
        wgmma::WgmmaM64N128K32E4m3RS(*reinterpret_cast<float(*)[64]>(o + 64), pa[1],
                                     dv.lo + (((128 / 8) * 256) >> 4), dv.hi, 1);
        wgmma::Commit();
        wgmma::Wait<0>();
        wgmma::FenceRegs(o);
        wgmma::UseRegs(pa);
      } else {
        uint32_t pa[1][4];
        float w[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) w[i] = kPScale * s[i];
        pack(w, pa[0]);
        wgmma::FenceRegs(o);
        wgmma::Fence();
        wgmma::WgmmaM64N256K32E4m3RS(o, pa[0], dv.lo, dv.hi, 1);
        wgmma::Commit();
        wgmma::Wait<0>();
        wgmma::FenceRegs(o);
        wgmma::UseRegs(pa);
      }
    }
    ptx::CpAsyncWait<0>();
    __syncthreads();  // The next piece's prologue reuses Q, the ring, V^T and the exchange.

    f8mma::StoreRows<kTiled>(p, o, rs, b, worker, whole, row_lo, row_hi, m_lo, m_hi, l_lo, l_hi,
                             wgi, c);
  }
#endif
}

// 1 on an SM90 device (one block an SM), 0 elsewhere: the plan then refuses the variant.
template <KvCacheFormat kFormat, int kStages>
int MlaDecodeFp8MmaBlocksPerSm() {
  static const int blocks = [] {
    if (!wgmma::CurrentDeviceIsSm90()) return 0;
    return DecodeKernelBlocksPerSm(
        reinterpret_cast<const void*>(&MlaDecodeFp8MmaKernel<kFormat, kStages>), f8mma::kThreads,
        f8mma::Config<kFormat, kStages>::kSmemBytes);
  }();
  return blocks;
}

template <KvCacheFormat kFormat, int kStages>
cudaError_t LaunchMlaDecodeFp8Mma(const MlaDecodeKernelParams& p, int grid, cudaStream_t stream) {
  if (MlaDecodeFp8MmaBlocksPerSm<kFormat, kStages>() == 0) return cudaErrorInvalidConfiguration;
  MlaDecodeFp8MmaKernel<kFormat, kStages>
      <<<grid, f8mma::kThreads, f8mma::Config<kFormat, kStages>::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

#define MLASERVE_INSTANTIATE_MLA_DECODE_FP8MMA(FORMAT, STAGES)                                  \
  template cudaError_t LaunchMlaDecodeFp8Mma<FORMAT, STAGES>(const MlaDecodeKernelParams&, int, \
                                                             cudaStream_t);                     \
  template int MlaDecodeFp8MmaBlocksPerSm<FORMAT, STAGES>();

}  // namespace mlaserve::mla
