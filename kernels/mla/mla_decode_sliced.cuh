// Warp-sliced split-KV MLA decode kernel (16 query rows per block; more rows run as more blocks),
// included by one small .cu per instantiation.
//
// Why this shape (kernels/mla/NOTES.md, ncu profiles in bench/RESULTS.md): the first kernel of
// this directory (removed) was bound by shared memory and barriers: fp8 tiles took a dequantize
// pass through shared memory, every warp re-read all four partial score tiles, and three block
// barriers fell on every 16 tokens. Here:
//
// * Warp w owns a slice of every cache row: latent dims [128w, 128w + 128) (one fp8_tiled scale
//   tile) and RoPE dims [16w, 16w + 16). It copies exactly those bytes (cp.async, its own ring of
//   stages), computes the partial q.k over them, and computes O += P V for the same 128 output
//   dims. No other warp reads them, so a tile needs no block barrier to become visible: the warp
//   waits for its own copies and __syncwarp()s.
// * fp8 bytes are converted in registers (e4m3 -> f16 is exact), straight into the mma fragments,
//   and the mma runs in f16 (fp32 accumulate). q.k: the dims of a 16-dim k-step are permuted so a
//   thread's four B values are four consecutive bytes of one token (one 32-bit load; q is
//   permuted the same way, which leaves the dot product unchanged). p.v: a thread loads four
//   consecutive dims of four tokens (four 32-bit loads), interleaves token pairs with byte
//   permutes, and feeds four n8 tiles; output columns are permuted accordingly and a thread ends
//   up owning 8 consecutive dims. q goes to f16 with a power-of-two scale per (warp, row) so that
//   any bf16 q fits f16's range (exact for the values that matter: bf16's 8 significant bits fit
//   f16's 11 down to 2^-29 of the row's largest value); the scale is divided out of the fp32
//   partial scores exactly.
// * Per tile two block barriers: (1) the four partial score tiles are in shared memory; warp w
//   sums tokens [w * kTile / 4, ...) of all four in a fixed order (so the sums exist once and
//   every warp uses the same bits), masks, and writes exp2(s - m_w) with its slice max m_w and
//   sum l_w; (2) every warp reads the four (m_w, l_w), forms the running max and sum (all warps
//   the same way), and loads P as its mma A operand, scaling each slice by 2^(m_w - m).
// * fp8_tiled: a token's tile scale multiplies its partial score (q.k over the tile's 128 dims)
//   and its P entry for the p.v of that tile's dims (P * scale / sigma, sigma = the largest scale
//   seen so far in this warp's tile, a power of two, so P' <= 1 stays in f16's normal range and
//   O carries the factor sigma, rescaled exactly when sigma grows).
//
// mma.sync m16n8k16 fragment layouts: PTX ISA "Matrix Fragments for mma.m16n8k16 with
// floating point type" (A: a0 = (row g, cols 2c, 2c+1), a1 = (g+8, 2c..), a2 = (g, 2c+8..),
// a3 = (g+8, 2c+8..); B: b0 = (rows 2c, 2c+1; col g), b1 = (rows 2c+8, 2c+9; col g); C: c0, c1 =
// (row g; cols 2c, 2c+1), c2, c3 = row g+8; g = lane / 4, c = lane % 4; the lower 16 bits of a
// register hold the lower column / row index). cvt.rn.f16x2.e4m3x2: PTX ISA "cvt" (sm_89+), the
// upper byte goes to the upper half.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mla/e4m3_convert.cuh"
#include "kernels/mla/mla_decode_params.h"
#include "kernels/mla/mla_decode_schedule.cuh"
#include "kernels/mla/mla_decode_timeline.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/warp_ptx.cuh"

namespace mlaserve::mla {

namespace sliced {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kSmemLimit = 99 * 1024;  // SM120's per-block maximum.

// kSchedMax: the largest batch whose schedule the kernel computes itself (its shared-memory
// prefix array); larger batches read the schedule kernel's. The SM120 two-blocks variant takes 256.
// kQkE4m3 (fp8 formats): q.k on e4m3 x e4m3 MMAs straight from the cache bytes, q split into two
// e4m3 parts (the SM120 path: native there, emulated on SM90; see the kernel's q setup).
template <KvCacheFormat kFormat, int kTile, int kStages, int kSchedMax = kInlineScheduleMaxBatch,
          bool kQkE4m3 = false>
struct Config {
  static constexpr bool kBf16 = kFormat == KvCacheFormat::kBf16;
  static constexpr bool kTiled = kFormat == KvCacheFormat::kFp8Tiled;
  static constexpr int kRowBytes = static_cast<int>(KvCacheBytesPerToken(kFormat));
  // Shared-memory row stride: the global row, padded where the stride in 32-bit words would be
  // a multiple of 32 or 16 (bank conflicts of the fragment loads): 1152 -> 1168 (292 words,
  // = 4 mod 32), 576 -> 592 (148 = 20 mod 32); 656 (164 = 4 mod 32) is already conflict-free.
  static constexpr int kSmemRow = kRowBytes == 656 ? 656 : kRowBytes + 16;
  // Bytes of a row a warp copies: 16-B chunks of its latent slice, of its RoPE slice.
  static constexpr int kLatentChunks = kBf16 ? 16 : 8;
  static constexpr int kRopeChunks = kFormat == KvCacheFormat::kFp8 ? 1 : 2;
  static constexpr int kChunks = kLatentChunks + kRopeChunks;
  static constexpr int kRopeOffset = kBf16    ? 2 * kMlaLatentDim
                                     : kTiled ? kFp8TiledRopeOffset
                                              : kMlaLatentDim;
  static constexpr int kStageBytes = kTile * kSmemRow;
  static constexpr int kTileP = kTile + 8;  // Padded token stride of the score tiles (floats).
  static constexpr int kPartBytes = kWarps * 16 * kTileP * 4;
  static constexpr int kSTiles = kTile / 8;      // n8 tiles of S per warp.
  static constexpr int kPSteps = kTile / 16;     // k16 steps of P.V.
  static constexpr int kSlice = kTile / kWarps;  // Tokens each warp sums and exponentiates.
  // P ([16 rows][kTile tokens] f32) lives in the score tiles' padding where it fits (32-token
  // tiles: warp w's slice of P, tokens [8w, 8w + 8), in columns [32, 40) of partial tile w), else
  // in a buffer of its own. Safe: the q.k writes before barrier (1) touch columns < kTile only; P
  // is written after (1) and read after (2), and no warp writes the next tile's P before every
  // warp has passed that tile's (1), i.e. finished this tile's p.v. Saves 2,560 B a block, which
  // is what lets the fp8 variant fit two blocks in SM120's 100 KB (PAt below).
  static constexpr bool kPInPadding = kTileP - kTile == kSlice;
  static constexpr int kPBytes = kPInPadding ? 0 : 16 * kTileP * 4;
  static constexpr int kStatBytes = 2 * kWarps * 16 * 4;
  static constexpr int kSchedBytes = 4 * (kSchedMax + 2);
  static constexpr int kSmemBytes =
      kStages * kStageBytes + kPartBytes + kPBytes + kStatBytes + kSchedBytes;
  // P's (row, token) as a float offset from the score tiles' base.
  static __device__ __forceinline__ int PAt(int row, int tok) {
    if constexpr (kPInPadding) {
      return ((tok / kSlice) * 16 + row) * kTileP + kTile + tok % kSlice;
    } else {
      return kWarps * 16 * kTileP + row * kTileP + tok;
    }
  }
  // Two blocks an SM on SM120 (100 KB an SM, 1 KB reserved a block).
  static constexpr bool kTwoBlocksSm120 = 2 * (kSmemBytes + 1024) <= 100 * 1024;
  // Blocks per SM that the shared memory allows on an H200 (227 KB usable, 1 KB reserved per
  // block), at most 3: the register cap that follows (170 at 3) must not spill.
  static constexpr int kFitH200 = (227 * 1024) / (kSmemBytes + 1024);
  // The SM120 variants (e4m3 q.k, or a smaller in-kernel schedule) are built for SM120's
  // occupancy instead: two blocks where they fit (255 registers a thread), else one.
  static constexpr bool kForSm120 = kQkE4m3 || kSchedMax < kInlineScheduleMaxBatch;
  static constexpr int kMinBlocks = kForSm120      ? (kTwoBlocksSm120 ? 2 : 1)
                                    : kFitH200 < 1 ? 1
                                                   : (kFitH200 > 3 ? 3 : kFitH200);
  static_assert(kSmemBytes <= kSmemLimit, "must fit SM120's 99 KB per block");
  static_assert(kStages >= 2, "need double buffering");
  static_assert(!(kQkE4m3 && kBf16), "e4m3 q.k is for the fp8 formats");
  static_assert(kTile == 32 || kTile == 64, "tiles of 32 or 64 tokens (within a 64-token block)");
  static_assert(kSlice == 8 || kSlice == 16, "slice = 8 or 16 tokens");
};

using ptx::CpAsync16;
using ptx::CpAsync4;
using ptx::CpAsyncCommit;
using ptx::CpAsyncWait;
using ptx::LdMatrixX4;
using ptx::LdMatrixX4Trans;
using ptx::Lds32;
using ptx::LdsF32;
template <bool kF16>
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (kF16) {
    ptx::MmaF16(d, a, b0, b1);
  } else {
    ptx::MmaBf16(d, a, b0, b1);
  }
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
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) { return Pack<false>(lo, hi); }
__device__ __forceinline__ float Bf16Lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
// Four bf16 (p01: elements 0, 1; p23: 2, 3) times s (a power of two) as hi + lo, four e4m3 each
// (byte i = element i): hi = e4m3(x), lo = e4m3(x - hi). x has bf16's 8 significant bits, hi
// takes the top 4 (rounded), and x - hi (exact in f32) is a multiple of x's last place no larger
// than hi's half step: at most 4 significant bits, which e4m3 holds exactly down to its smallest
// step 2^-9. So hi + lo == x wherever x's last place is >= 2^-9 (|x| >= 2^-2), and the error is
// <= 2^-10 below that: with the row's largest |x| in [2^7, 2^8) (qexp), q is exact down to 2^-9
// of the row's largest element and off by at most 2^-17 of it under that.
__device__ __forceinline__ void SplitE4m3x4(uint32_t p01, uint32_t p23, float s, uint32_t& hi,
                                            uint32_t& lo) {
  const float x[4] = {Bf16Lo(p01) * s, Bf16Hi(p01) * s, Bf16Lo(p23) * s, Bf16Hi(p23) * s};
  uint32_t h = 0, l = 0;
#pragma unroll
  for (int i = 0; i < 4; i += 2) {
    const __nv_fp8x2_storage_t hb =
        __nv_cvt_float2_to_fp8x2(make_float2(x[i], x[i + 1]), __NV_SATFINITE, __NV_E4M3);
    const float2 hf = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(hb, __NV_E4M3)));
    const __nv_fp8x2_storage_t lb = __nv_cvt_float2_to_fp8x2(
        make_float2(x[i] - hf.x, x[i + 1] - hf.y), __NV_SATFINITE, __NV_E4M3);
    h |= static_cast<uint32_t>(hb) << (8 * i);
    l |= static_cast<uint32_t>(lb) << (8 * i);
  }
  hi = h;
  lo = l;
}

}  // namespace sliced

template <KvCacheFormat kFormat, int kTile, int kStages, int kSchedMax, bool kQkE4m3>
__global__ void __launch_bounds__(
    sliced::kThreads, sliced::Config<kFormat, kTile, kStages, kSchedMax, kQkE4m3>::kMinBlocks)
    MlaDecodeSlicedKernel(const MlaDecodeKernelParams p) {
  // Launched plainly: a programmatically launched combine may become resident now and wait for
  // this grid.
  pdl::AllowDependentLaunch();
  MlaTimelineStamp(p, blockIdx.x, kMlaEntry);
  using namespace sliced;
  using Cfg = Config<kFormat, kTile, kStages, kSchedMax, kQkE4m3>;
  constexpr bool kBf16 = Cfg::kBf16, kTiled = Cfg::kTiled;
  constexpr bool kF16 = !kBf16;  // mma type of the latent q.k and of p.v
  constexpr int kSTiles = Cfg::kSTiles, kPSteps = Cfg::kPSteps, kSlice = Cfg::kSlice;
  constexpr int kRow = Cfg::kSmemRow, kTileP = Cfg::kTileP;
  extern __shared__ __align__(128) uint8_t smem[];

  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int row_tiles = (p.rows + 15) / 16;
  const int worker = blockIdx.x / row_tiles, mt = blockIdx.x % row_tiles;

  // Schedule: cost prefix over sequences and the per-worker share (MlaDecodeScheduleKernel's
  // arithmetic). Small batches compute it here, in every block (and block 0 stores it for the
  // combine kernel); larger ones read what the schedule kernel wrote.
  const int32_t* prefix = p.schedule;
  if (p.inline_schedule) {
    prefix = InlineSchedule<kThreads, kSchedMax>(
        p, reinterpret_cast<int32_t*>(smem + Cfg::kSmemBytes - Cfg::kSchedBytes));
  }
  const int total = prefix[p.batch], share = prefix[p.batch + 1];
  const int cost_begin = worker * share;
  const int cost_end = min(cost_begin + share, total);
  if (cost_begin >= cost_end) return;
  const int first_seq = FirstSequence(prefix, p.batch, cost_begin);
  MlaTimelineStamp(p, blockIdx.x, kMlaScheduled);

  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t part_base = smem_base + kStages * Cfg::kStageBytes;  // [4][16][kTileP] f32, P
  // m [4][16], then l [4][16]
  const uint32_t stat_base = part_base + Cfg::kPartBytes + Cfg::kPBytes;

  // This warp's byte offsets inside a row.
  const int latent_off = w * (kBf16 ? 256 : 128);
  const int rope_off = Cfg::kRopeOffset + w * (kBf16 || kTiled ? 32 : 16);
  // ldmatrix lane offsets (bf16 data). K (non-trans): matrices (tokens 0-7, dims +0), (0-7, +8),
  // (8-15, +0), (8-15, +8). V (trans): (tokens 0-7, dims +0), (8-15, +0), (0-7, +8), (8-15, +8).
  const uint32_t k_lane_off = ((lane & 7) + ((lane >> 4) << 3)) * kRow + ((lane >> 3) & 1) * 16;
  const uint32_t v_lane_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * kRow + (lane >> 4) * 16;

  const int row_lo = mt * 16 + g, row_hi = row_lo + 8;  // This thread's two accumulator rows.

  for (int b = first_seq; b < p.batch && prefix[b] < cost_end; ++b) {
    // This piece's tokens [tok_begin, tok_end); tiles are aligned to kTile, so the first and
    // last may hold tokens of the neighbouring pieces, masked out below.
    const SeqPiece piece = PieceOfSequence(p, prefix, b, cost_begin, cost_end);
    const int len = piece.len, tok_begin = piece.tok_begin, tok_end = piece.tok_end;
    const bool whole = piece.whole;
    const int t_begin = tok_begin / kTile;
    const int t_end = tok_end > tok_begin ? (tok_end + kTile - 1) / kTile : t_begin;
    const int32_t* __restrict__ blocks =
        p.block_table + static_cast<size_t>(b) * p.max_blocks_per_seq;

    // Copies this warp's slice of tile t's rows (all in one 64-token block). Latent: kLatentChunks
    // consecutive lanes per row (one contiguous 128- or 256-B run), 32 / kLatentChunks rows per
    // instruction; RoPE: kRopeChunks lanes per row. Every address is a per-lane base plus a
    // compile-time offset; the per-token bounds check only matters on a sequence's last tile.
    constexpr int kLc = Cfg::kLatentChunks, kRc = Cfg::kRopeChunks;
    const int lat_lane_row = lane / kLc, lat_lane_off = latent_off + 16 * (lane % kLc);
    const int rope_lane_row = lane / kRc, rope_lane_off = rope_off + 16 * (lane % kRc);
    auto issue = [&](int t, int stage, int32_t block) {
      const uint32_t dst = smem_base + stage * Cfg::kStageBytes;
      const uint8_t* src_tile =
          p.kv_pool + (static_cast<size_t>(block) * kKvBlockTokens + (t * kTile) % kKvBlockTokens) *
                          Cfg::kRowBytes;
      const bool full = t * kTile + kTile <= len;  // warp-uniform
      const uint8_t* lat_src = src_tile + (lat_lane_row * Cfg::kRowBytes + lat_lane_off);
      const uint32_t lat_dst = dst + lat_lane_row * kRow + lat_lane_off;
#pragma unroll
      for (int k = 0; k < kTile * kLc / 32; ++k) {
        const int r = (32 / kLc) * k;  // + lat_lane_row
        const bool valid = full || t * kTile + r + lat_lane_row < len;
        CpAsync16(lat_dst + r * kRow, valid ? lat_src + r * Cfg::kRowBytes : p.kv_pool, valid);
      }
      const uint8_t* rope_src = src_tile + (rope_lane_row * Cfg::kRowBytes + rope_lane_off);
      const uint32_t rope_dst = dst + rope_lane_row * kRow + rope_lane_off;
#pragma unroll
      for (int k = 0; k < kTile * kRc / 32; ++k) {
        const int r = (32 / kRc) * k;
        const bool valid = full || t * kTile + r + rope_lane_row < len;
        CpAsync16(rope_dst + r * kRow, valid ? rope_src + r * Cfg::kRowBytes : p.kv_pool, valid);
      }
      if constexpr (kTiled) {
#pragma unroll
        for (int k = 0; k < kTile / 32; ++k) {
          const int r = lane + 32 * k;
          const bool valid = full || t * kTile + r < len;
          const int off = kFp8TiledScaleOffset + 4 * w;
          CpAsync4(dst + r * kRow + off, valid ? src_tile + r * Cfg::kRowBytes + off : p.kv_pool,
                   valid);
        }
      }
    };
    constexpr int kTilesPerBlock = kKvBlockTokens / kTile;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (t_begin + s < t_end) issue(t_begin + s, s, blocks[(t_begin + s) / kTilesPerBlock]);
      CpAsyncCommit();
    }
    int32_t next_block =
        t_begin + kStages - 1 < t_end ? blocks[(t_begin + kStages - 1) / kTilesPerBlock] : 0;

    // q fragments of this warp's 8 latent k-steps and 1 RoPE k-step. bf16 format: natural order,
    // bf16. fp8 formats: latent (and fp8's RoPE) permuted and in f16 times 2^qexp; fp8_tiled's
    // RoPE stays bf16 (its cache RoPE is bf16).
    uint32_t qf[9][4];
    // kQkE4m3: q * 2^qexp = hi + lo, both e4m3, as A operands of the 4 latent k32-steps and of
    // fp8's RoPE k16-step (qr).
    uint32_t qh[4][4], ql[4][4], qrh[2], qrl[2];
    float qdescale_lo = 1.0f, qdescale_hi = 1.0f;  // 2^-qexp per row (f16 k-steps only).
    {
      const uint16_t* qb = p.q + static_cast<size_t>(b) * p.rows * kMlaQkDim;
      const uint16_t* qr = p.q_rope + static_cast<int64_t>(b) * p.rows * p.q_rope_stride;
      const bool lo_ok = row_lo < p.rows, hi_ok = row_hi < p.rows;
      // Two bf16 at (row, k), k even; the RoPE k-step (ks 8) from q_rope.
      auto ld2 = [&](int row, bool ok, int k, bool rope) -> uint32_t {
        if (!ok) return 0u;
        const uint16_t* src = rope ? qr + row * p.q_rope_stride + (k - kMlaLatentDim)
                                   : qb + row * kMlaQkDim + k;
        return *reinterpret_cast<const uint32_t*>(src);
      };
      auto kdim = [&](int ks) {  // first dim of k-step ks (8 = RoPE)
        return ks < 8 ? w * 128 + ks * 16 : kMlaLatentDim + w * 16;
      };
      if constexpr (kBf16) {
#pragma unroll
        for (int ks = 0; ks < 9; ++ks) {
          const int k0 = kdim(ks) + 2 * c;
          qf[ks][0] = ld2(row_lo, lo_ok, k0, ks == 8);
          qf[ks][1] = ld2(row_hi, hi_ok, k0, ks == 8);
          qf[ks][2] = ld2(row_lo, lo_ok, k0 + 8, ks == 8);
          qf[ks][3] = ld2(row_hi, hi_ok, k0 + 8, ks == 8);
        }
      } else {
        constexpr int kF16Steps = kTiled ? 8 : 9;
        uint32_t raw[9][4];  // bf16 pairs, permuted: dims 4c, 4c+1 | 4c+2, 4c+3
        float amax_lo = 0.0f, amax_hi = 0.0f;
#pragma unroll
        for (int ks = 0; ks < kF16Steps; ++ks) {
          const int k0 = kdim(ks) + 4 * c;
          raw[ks][0] = ld2(row_lo, lo_ok, k0, ks == 8);
          raw[ks][1] = ld2(row_hi, hi_ok, k0, ks == 8);
          raw[ks][2] = ld2(row_lo, lo_ok, k0 + 2, ks == 8);
          raw[ks][3] = ld2(row_hi, hi_ok, k0 + 2, ks == 8);
          amax_lo =
              fmaxf(amax_lo, fmaxf(fmaxf(fabsf(Bf16Lo(raw[ks][0])), fabsf(Bf16Hi(raw[ks][0]))),
                                   fmaxf(fabsf(Bf16Lo(raw[ks][2])), fabsf(Bf16Hi(raw[ks][2])))));
          amax_hi =
              fmaxf(amax_hi, fmaxf(fmaxf(fabsf(Bf16Lo(raw[ks][1])), fabsf(Bf16Hi(raw[ks][1]))),
                                   fmaxf(fabsf(Bf16Lo(raw[ks][3])), fabsf(Bf16Hi(raw[ks][3])))));
        }
        amax_lo = fmaxf(amax_lo, __shfl_xor_sync(0xffffffffu, amax_lo, 1));
        amax_lo = fmaxf(amax_lo, __shfl_xor_sync(0xffffffffu, amax_lo, 2));
        amax_hi = fmaxf(amax_hi, __shfl_xor_sync(0xffffffffu, amax_hi, 1));
        amax_hi = fmaxf(amax_hi, __shfl_xor_sync(0xffffffffu, amax_hi, 2));
        // 2^qexp with amax * 2^qexp in [2^14, 2^15): below f16's max (65504) with headroom.
        // e4m3 q.k: in [2^7, 2^8), below e4m3's max (448).
        auto qexp = [](float amax) {
          if (!(amax > 0.0f) || !isfinite(amax)) return 0;
          const int e = ((__float_as_int(amax) >> 23) & 0xff) - 127;  // floor(log2) for normals
          return max(-100, min(100, (kQkE4m3 ? 7 : 14) - e));
        };
        const int e_lo = qexp(amax_lo), e_hi = qexp(amax_hi);
        const float s_lo = exp2f(static_cast<float>(e_lo)), s_hi = exp2f(static_cast<float>(e_hi));
        qdescale_lo = exp2f(static_cast<float>(-e_lo));
        qdescale_hi = exp2f(static_cast<float>(-e_hi));
        if constexpr (kQkE4m3) {
          // k32-step kk covers the f16 k-steps 2kk and 2kk + 1; register r of an e4m3 A fragment
          // holds dims 4c..4c+3 of row g (r even) or g + 8 (r odd) of step 2kk + r / 2, which are
          // raw[2kk + r / 2][r % 2] (dims 4c, 4c+1) and [r % 2 + 2] (4c+2, 4c+3). The K bytes are
          // loaded at the same dims, so the pairing needs nothing but the PTX rule that A
          // register r and B register r / 2 share their k.
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const uint32_t(&x)[4] = raw[2 * kk + r / 2];
              SplitE4m3x4(x[r % 2], x[r % 2 + 2], (r & 1) ? s_hi : s_lo, qh[kk][r], ql[kk][r]);
            }
          }
          if constexpr (!kTiled) {
            SplitE4m3x4(raw[8][0], raw[8][2], s_lo, qrh[0], qrl[0]);
            SplitE4m3x4(raw[8][1], raw[8][3], s_hi, qrh[1], qrl[1]);
          }
        } else {
#pragma unroll
          for (int ks = 0; ks < kF16Steps; ++ks) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float s = (i & 1) ? s_hi : s_lo;
              qf[ks][i] = Pack<true>(Bf16Lo(raw[ks][i]) * s, Bf16Hi(raw[ks][i]) * s);
            }
          }
        }
        if constexpr (kTiled) {  // RoPE k-step in bf16, natural order.
          const int k0 = kdim(8) + 2 * c;
          qf[8][0] = ld2(row_lo, lo_ok, k0, true);
          qf[8][1] = ld2(row_hi, hi_ok, k0, true);
          qf[8][2] = ld2(row_lo, lo_ok, k0 + 8, true);
          qf[8][3] = ld2(row_hi, hi_ok, k0 + 8, true);
        }
      }
    }
    // Causal limit inside the new tokens: query i sees positions <= len - s_q + i.
    const int lim_lo = min(row_lo < p.rows ? len - p.s_q + row_lo / p.heads : len - 1, tok_end - 1);
    const int lim_hi = min(row_hi < p.rows ? len - p.s_q + row_hi / p.heads : len - 1, tok_end - 1);
    // Rows this thread reduces in the exchange (phase 2): row lane / 2, 4 or 8 tokens.
    const int red_row = lane >> 1;
    const int red_lim =
        min(mt * 16 + red_row < p.rows ? len - p.s_q + (mt * 16 + red_row) / p.heads : len - 1,
            tok_end - 1);

    float o[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
    float sigma = 0.0f;  // fp8_tiled: largest tile scale of this warp's tile so far (O's unit).

    MlaTimelineStamp(p, blockIdx.x, kMlaQReady);
    for (int t = t_begin; t < t_end; ++t) {
      const int it = t - t_begin;
      if (it == 1) MlaTimelineStamp(p, blockIdx.x, kMlaFirstTileDone);
      CpAsyncWait<kStages - 2>();
      __syncwarp();  // This warp's slice of tile t is in smem; its stage from t-1 is free.
      {
        const int tn = t + kStages - 1;
        if (tn < t_end) issue(tn, (it + kStages - 1) % kStages, next_block);
        CpAsyncCommit();
        if (tn + 1 < t_end) next_block = blocks[(tn + 1) / kTilesPerBlock];
      }
      const uint32_t tile = smem_base + (it % kStages) * Cfg::kStageBytes;

      // ---- Partial S over this warp's dims: 16 rows x kTile tokens.
      float s[kSTiles][4];
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
      if constexpr (kBf16) {
#pragma unroll
        for (int ks = 0; ks < 9; ++ks) {
          const int off = ks < 8 ? latent_off + 32 * ks : rope_off;
#pragma unroll
          for (int jj = 0; jj < kSTiles / 2; ++jj) {
            uint32_t kb[4];
            LdMatrixX4(kb, tile + k_lane_off + jj * 16 * kRow + off);
            Mma<false>(s[2 * jj], qf[ks], kb[0], kb[1]);
            Mma<false>(s[2 * jj + 1], qf[ks], kb[2], kb[3]);
          }
        }
      } else if constexpr (kQkE4m3) {
        // The cache bytes are the B operands as they lie: token 8j + g, dims 4c..4c+3 of f16
        // k-steps 2kk and 2kk + 1 (the q setup's pairing).
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const int off = latent_off + 32 * kk + 4 * c;
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) {
            const uint32_t addr = tile + (8 * j + g) * kRow + off;
            const uint32_t b0 = Lds32(addr), b1 = Lds32(addr + 16);
            ptx::MmaE4m3K32(s[j], qh[kk], b0, b1);
            ptx::MmaE4m3K32(s[j], ql[kk], b0, b1);
          }
        }
        if constexpr (!kTiled) {
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) {
            const uint32_t b = Lds32(tile + (8 * j + g) * kRow + rope_off + 4 * c);
            ptx::MmaE4m3K16(s[j], qrh, b);
            ptx::MmaE4m3K16(s[j], qrl, b);
          }
        }
      } else {
        constexpr int kF16Steps = kTiled ? 8 : 9;
#pragma unroll
        for (int ks = 0; ks < kF16Steps; ++ks) {
          const int off = (ks < 8 ? latent_off + 16 * ks : rope_off) + 4 * c;
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) {
            uint32_t b0, b1;
            E4m3x4ToF16x2x2(Lds32(tile + (8 * j + g) * kRow + off), b0, b1);
            Mma<true>(s[j], qf[ks], b0, b1);
          }
        }
      }
      if constexpr (!kBf16) {
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
          s[j][0] *= qdescale_lo;
          s[j][1] *= qdescale_lo;
          s[j][2] *= qdescale_hi;
          s[j][3] *= qdescale_hi;
        }
        if constexpr (kTiled) {
          // Latent partial times each token's tile scale, plus the bf16 RoPE partial.
          float sr[kSTiles][4];
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) sr[j][0] = sr[j][1] = sr[j][2] = sr[j][3] = 0.0f;
#pragma unroll
          for (int jj = 0; jj < kSTiles / 2; ++jj) {
            uint32_t kb[4];
            LdMatrixX4(kb, tile + k_lane_off + jj * 16 * kRow + rope_off);
            Mma<false>(sr[2 * jj], qf[8], kb[0], kb[1]);
            Mma<false>(sr[2 * jj + 1], qf[8], kb[2], kb[3]);
          }
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) {
            const uint32_t sc = tile + (8 * j + 2 * c) * kRow + kFp8TiledScaleOffset + 4 * w;
            const float sc0 = LdsF32(sc), sc1 = LdsF32(sc + kRow);
            s[j][0] = s[j][0] * sc0 + sr[j][0];
            s[j][1] = s[j][1] * sc1 + sr[j][1];
            s[j][2] = s[j][2] * sc0 + sr[j][2];
            s[j][3] = s[j][3] * sc1 + sr[j][3];
          }
        }
      }
      {
        float* part = reinterpret_cast<float*>(smem + kStages * Cfg::kStageBytes);
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
          *reinterpret_cast<float2*>(part + (w * 16 + g) * kTileP + 8 * j + 2 * c) =
              make_float2(s[j][0], s[j][1]);
          *reinterpret_cast<float2*>(part + (w * 16 + g + 8) * kTileP + 8 * j + 2 * c) =
              make_float2(s[j][2], s[j][3]);
        }
      }
      __syncthreads();  // (1) Partial scores of all warps are in smem.

      // ---- Warp w: tokens [w * kSlice, (w + 1) * kSlice) of all 16 rows. Lane: row lane / 2,
      // kSlice / 2 consecutive tokens.
      {
        constexpr int kPer = kSlice / 2;  // 4 or 8
        const float* part = reinterpret_cast<const float*>(smem + kStages * Cfg::kStageBytes);
        const int tok0 = w * kSlice + (lane & 1) * kPer;
        float x[kPer];
#pragma unroll
        for (int i = 0; i < kPer; ++i) x[i] = 0.0f;
#pragma unroll
        for (int ww = 0; ww < kWarps; ++ww) {
#pragma unroll
          for (int i = 0; i < kPer; i += 4) {
            const float4 v =
                *reinterpret_cast<const float4*>(part + (ww * 16 + red_row) * kTileP + tok0 + i);
            x[i] += v.x;
            x[i + 1] += v.y;
            x[i + 2] += v.z;
            x[i + 3] += v.w;
          }
        }
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int pos = t * kTile + tok0 + i;
          x[i] = (pos >= tok_begin && pos <= red_lim) ? x[i] * p.score_scale_log2 : -INFINITY;
          mx = fmaxf(mx, x[i]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float base = mx == -INFINITY ? 0.0f : mx;
        float sum = 0.0f;
        float* pbuf = reinterpret_cast<float*>(smem + kStages * Cfg::kStageBytes);
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          x[i] = exp2f(x[i] - base);
          sum += x[i];
        }
#pragma unroll
        for (int i = 0; i < kPer; i += 4) {
          *reinterpret_cast<float4*>(pbuf + Cfg::PAt(red_row, tok0 + i)) =
              make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        if ((lane & 1) == 0) {
          float* stat = reinterpret_cast<float*>(smem + kStages * Cfg::kStageBytes +
                                                 Cfg::kPartBytes + Cfg::kPBytes);
          stat[w * 16 + red_row] = mx;
          stat[(kWarps + w) * 16 + red_row] = sum;
        }
      }
      __syncthreads();  // (2) P slices and their (max, sum) are in smem.

      // ---- Running max and sum (identical in every warp), P as A operands, O += P V.
      float f_lo[kWarps], f_hi[kWarps];
      {
        float ms_lo[kWarps], ms_hi[kWarps], mt_lo = -INFINITY, mt_hi = -INFINITY;
#pragma unroll
        for (int ww = 0; ww < kWarps; ++ww) {
          ms_lo[ww] = LdsF32(stat_base + (ww * 16 + g) * 4);
          ms_hi[ww] = LdsF32(stat_base + (ww * 16 + g + 8) * 4);
          mt_lo = fmaxf(mt_lo, ms_lo[ww]);
          mt_hi = fmaxf(mt_hi, ms_hi[ww]);
        }
        // Lazy max (as FlashAttention-4): the reference max moves only when a tile's max exceeds
        // it by more than 2^8, so P (up to 2^8, f16/bf16-safe) and the fp32 sums stay in range
        // while O is rescaled only a few times per sequence. The softmax is invariant to the
        // reference, so this changes nothing but rounding.
        constexpr float kLazyLog2 = 8.0f;
        const float new_lo = mt_lo > m_lo + kLazyLog2 ? mt_lo : m_lo;
        const float new_hi = mt_hi > m_hi + kLazyLog2 ? mt_hi : m_hi;
        // A row with nothing visible yet keeps max -inf; subtract 0 then so exp2 gives 0, not NaN.
        const float base_lo = new_lo == -INFINITY ? 0.0f : new_lo;
        const float base_hi = new_hi == -INFINITY ? 0.0f : new_hi;
        const float alpha_lo = exp2f(m_lo - base_lo), alpha_hi = exp2f(m_hi - base_hi);
        m_lo = new_lo;
        m_hi = new_hi;
        float add_lo = 0.0f, add_hi = 0.0f;
#pragma unroll
        for (int ww = 0; ww < kWarps; ++ww) {
          f_lo[ww] = exp2f(ms_lo[ww] - base_lo);
          f_hi[ww] = exp2f(ms_hi[ww] - base_hi);
          add_lo += LdsF32(stat_base + ((kWarps + ww) * 16 + g) * 4) * f_lo[ww];
          add_hi += LdsF32(stat_base + ((kWarps + ww) * 16 + g + 8) * 4) * f_hi[ww];
        }
        l_lo = l_lo * alpha_lo + add_lo;
        l_hi = l_hi * alpha_hi + add_hi;
        float oscale_lo = alpha_lo, oscale_hi = alpha_hi;
        if constexpr (kTiled) {
          // sigma: the largest scale of this warp's tile among the tile's tokens (zero-filled
          // rows read 0), as O's unit; O is rescaled exactly (powers of two) when it grows.
          float smax = 0.0f;
#pragma unroll
          for (int r = lane; r < kTile; r += 32) {
            smax = fmaxf(smax, LdsF32(tile + r * kRow + kFp8TiledScaleOffset + 4 * w));
          }
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) {
            smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, off));
          }
          const float new_sigma = fmaxf(sigma, smax);
          if (sigma > 0.0f && new_sigma > sigma) {
            oscale_lo *= sigma / new_sigma;
            oscale_hi *= sigma / new_sigma;
          }
          sigma = new_sigma;
        }
        // Once the running max settles (most tiles) no row of the warp needs rescaling.
        if (__any_sync(0xffffffffu, oscale_lo != 1.0f || oscale_hi != 1.0f)) {
#pragma unroll
          for (int n = 0; n < 16; ++n) {
            o[n][0] *= oscale_lo;
            o[n][1] *= oscale_lo;
            o[n][2] *= oscale_hi;
            o[n][3] *= oscale_hi;
          }
        }
      }
      const float inv_sigma = kTiled && sigma > 0.0f ? 1.0f / sigma : 1.0f;
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk) {
        uint32_t pa[4];
        {
          // Tokens 16kk + 2c (+1) lie in slice (16kk) / kSlice, 16kk + 8 + 2c in (16kk + 8) /
          // kSlice.
          const int t0 = 16 * kk + 2 * c, t1 = t0 + 8;
          const int kSl0 = kSlice == 8 ? 2 * kk : kk;  // slice indices (constant after unrolling)
          const int kSl1 = kSlice == 8 ? 2 * kk + 1 : kk;
          const float* pbuf = reinterpret_cast<const float*>(smem + kStages * Cfg::kStageBytes);
          const float2 a = *reinterpret_cast<const float2*>(pbuf + Cfg::PAt(g, t0));
          const float2 bq = *reinterpret_cast<const float2*>(pbuf + Cfg::PAt(g + 8, t0));
          const float2 cq = *reinterpret_cast<const float2*>(pbuf + Cfg::PAt(g, t1));
          const float2 d = *reinterpret_cast<const float2*>(pbuf + Cfg::PAt(g + 8, t1));
          float r0 = 1.0f, r1 = 1.0f, r8 = 1.0f, r9 = 1.0f;  // token tile-scale / sigma
          if constexpr (kTiled) {
            const uint32_t sc = tile + t0 * kRow + kFp8TiledScaleOffset + 4 * w;
            r0 = LdsF32(sc) * inv_sigma;
            r1 = LdsF32(sc + kRow) * inv_sigma;
            r8 = LdsF32(sc + 8 * kRow) * inv_sigma;
            r9 = LdsF32(sc + 9 * kRow) * inv_sigma;
          }
          const float fl0 = f_lo[kSl0], fh0 = f_hi[kSl0], fl1 = f_lo[kSl1], fh1 = f_hi[kSl1];
          pa[0] = Pack<kF16>(a.x * fl0 * r0, a.y * fl0 * r1);
          pa[1] = Pack<kF16>(bq.x * fh0 * r0, bq.y * fh0 * r1);
          pa[2] = Pack<kF16>(cq.x * fl1 * r8, cq.y * fl1 * r9);
          pa[3] = Pack<kF16>(d.x * fh1 * r8, d.y * fh1 * r9);
        }
        if constexpr (kBf16) {
#pragma unroll
          for (int nn = 0; nn < 8; ++nn) {
            uint32_t vb[4];
            LdMatrixX4Trans(vb, tile + v_lane_off + kk * 16 * kRow + latent_off + nn * 32);
            Mma<false>(o[2 * nn], pa, vb[0], vb[1]);
            Mma<false>(o[2 * nn + 1], pa, vb[2], vb[3]);
          }
        } else {
          // Tokens 16kk + {2c, 2c+1, 2c+8, 2c+9}; dims 32nn + 4g .. +3 of this warp's slice.
          const uint32_t vrow = tile + (16 * kk + 2 * c) * kRow + latent_off + 4 * g;
#pragma unroll
          for (int nn = 0; nn < 4; ++nn) {
            const uint32_t v0 = Lds32(vrow + nn * 32), v1 = Lds32(vrow + kRow + nn * 32);
            const uint32_t v8 = Lds32(vrow + 8 * kRow + nn * 32);
            const uint32_t v9 = Lds32(vrow + 9 * kRow + nn * 32);
            // Byte j of each pair register: (token 2c, dim j), (token 2c+1, dim j), ...
            const uint32_t lo01 = __byte_perm(v0, v1, 0x5140), hi01 = __byte_perm(v0, v1, 0x7362);
            const uint32_t lo23 = __byte_perm(v8, v9, 0x5140), hi23 = __byte_perm(v8, v9, 0x7362);
            // n8 tile (nn, j): column n <-> dim 32nn + 4n + j.
            uint32_t f0[4], f1[4];  // f0: tokens (2c, 2c+1), f1: (2c+8, 2c+9); dims j = 0..3
            E4m3x4ToF16x2x2(lo01, f0[0], f0[1]);
            E4m3x4ToF16x2x2(hi01, f0[2], f0[3]);
            E4m3x4ToF16x2x2(lo23, f1[0], f1[1]);
            E4m3x4ToF16x2x2(hi23, f1[2], f1[3]);
#pragma unroll
            for (int j = 0; j < 4; ++j) Mma<true>(o[4 * nn + j], pa, f0[j], f1[j]);
          }
        }
      }
    }
    CpAsyncWait<0>();
    __syncthreads();  // The next piece's prologue reuses the stages and the exchange buffers.
    MlaTimelineStamp(p, blockIdx.x, kMlaTilesDone);

    const float unit = kTiled ? sigma : 1.0f;
    const float inv_lo = l_lo > 0.0f ? p.out_scale * unit / l_lo : 0.0f;
    const float inv_hi = l_hi > 0.0f ? p.out_scale * unit / l_hi : 0.0f;
    const float lse2_lo = l_lo > 0.0f ? m_lo + log2f(l_lo) : -INFINITY;  // log2 units
    const float lse2_hi = l_hi > 0.0f ? m_hi + log2f(l_hi) : -INFINITY;
    constexpr float kLn2 = 0.693147180559945309f;
    const bool lse_writer = w == 0 && c == 0;
    // The thread's output values: bf16 format: n8 tile n covers dims 128w + 8n + {2c, 2c+1};
    // fp8: for each nn, 8 consecutive dims 128w + 32nn + 8c + {0..7} = tiles (nn, j) col 2c -> +j,
    // col 2c+1 -> +4+j.
    auto store_row = [&](int row, int half, float inv) {
      if constexpr (kBf16) {
        if (whole) {
          uint16_t* out = p.out + (static_cast<size_t>(b) * p.rows + row) * kMlaLatentDim;
#pragma unroll
          for (int n = 0; n < 16; ++n) {
            *reinterpret_cast<uint32_t*>(out + w * 128 + 8 * n + 2 * c) =
                PackBf16(o[n][2 * half] * inv, o[n][2 * half + 1] * inv);
          }
        } else {
          const size_t slot = static_cast<size_t>(worker) + b;
          float* part = p.o_part + (slot * p.rows + row) * kMlaLatentDim;
#pragma unroll
          for (int n = 0; n < 16; ++n) {
            *reinterpret_cast<float2*>(part + w * 128 + 8 * n + 2 * c) =
                make_float2(o[n][2 * half] * inv, o[n][2 * half + 1] * inv);
          }
        }
      } else {
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) {
          float v[8];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            v[j] = o[4 * nn + j][2 * half] * inv;
            v[4 + j] = o[4 * nn + j][2 * half + 1] * inv;
          }
          const int col = w * 128 + 32 * nn + 8 * c;
          if (whole) {
            uint16_t* out = p.out + (static_cast<size_t>(b) * p.rows + row) * kMlaLatentDim;
            *reinterpret_cast<uint4*>(out + col) =
                make_uint4(PackBf16(v[0], v[1]), PackBf16(v[2], v[3]), PackBf16(v[4], v[5]),
                           PackBf16(v[6], v[7]));
          } else {
            const size_t slot = static_cast<size_t>(worker) + b;
            float* part = p.o_part + (slot * p.rows + row) * kMlaLatentDim;
            *reinterpret_cast<float4*>(part + col) = make_float4(v[0], v[1], v[2], v[3]);
            *reinterpret_cast<float4*>(part + col + 4) = make_float4(v[4], v[5], v[6], v[7]);
          }
        }
      }
    };
    const size_t slot = static_cast<size_t>(worker) + b;  // Unique per (sequence, worker).
    if (row_lo < p.rows) {
      store_row(row_lo, 0, inv_lo);
      if (lse_writer) {
        if (whole) {
          if (p.lse != nullptr) p.lse[static_cast<size_t>(b) * p.rows + row_lo] = lse2_lo * kLn2;
        } else {
          p.lse_part[slot * p.rows + row_lo] = lse2_lo;
        }
      }
    }
    if (row_hi < p.rows) {
      store_row(row_hi, 1, inv_hi);
      if (lse_writer) {
        if (whole) {
          if (p.lse != nullptr) p.lse[static_cast<size_t>(b) * p.rows + row_hi] = lse2_hi * kLn2;
        } else {
          p.lse_part[slot * p.rows + row_hi] = lse2_hi;
        }
      }
    }
  }
  MlaTimelineStamp(p, blockIdx.x, kMlaSplitExit);
}

template <KvCacheFormat kFormat, int kTile, int kStages, int kSchedMax, bool kQkE4m3>
int MlaDecodeSlicedBlocksPerSm() {
  using Cfg = sliced::Config<kFormat, kTile, kStages, kSchedMax, kQkE4m3>;
  static const int blocks = DecodeKernelBlocksPerSm(
      reinterpret_cast<const void*>(
          &MlaDecodeSlicedKernel<kFormat, kTile, kStages, kSchedMax, kQkE4m3>),
      sliced::kThreads, Cfg::kSmemBytes);
  return blocks;
}

template <KvCacheFormat kFormat, int kTile, int kStages, int kSchedMax, bool kQkE4m3>
cudaError_t LaunchMlaDecodeSliced(const MlaDecodeKernelParams& p, int grid, cudaStream_t stream) {
  using Cfg = sliced::Config<kFormat, kTile, kStages, kSchedMax, kQkE4m3>;
  if (MlaDecodeSlicedBlocksPerSm<kFormat, kTile, kStages, kSchedMax, kQkE4m3>() == 0) {
    return cudaErrorInvalidConfiguration;
  }
  if (p.inline_schedule && p.batch > kSchedMax) return cudaErrorInvalidValue;
  MlaDecodeSlicedKernel<kFormat, kTile, kStages, kSchedMax, kQkE4m3>
      <<<grid, sliced::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// SCHED_MAX: the largest batch the kernel schedules itself (kInlineScheduleMaxBatch, or less for
// a variant that must save shared memory); QK_E4M3: q.k on e4m3 MMAs (fp8 formats).
#define MLASERVE_INSTANTIATE_MLA_DECODE_SLICED(FORMAT, TILE, STAGES, SCHED_MAX, QK_E4M3) \
  template cudaError_t LaunchMlaDecodeSliced<FORMAT, TILE, STAGES, SCHED_MAX, QK_E4M3>(  \
      const MlaDecodeKernelParams&, int, cudaStream_t);                                  \
  template int MlaDecodeSlicedBlocksPerSm<FORMAT, TILE, STAGES, SCHED_MAX, QK_E4M3>();

}  // namespace mlaserve::mla
