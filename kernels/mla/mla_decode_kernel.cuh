// Split-KV MLA decode kernel: implementation, included by one small .cu per instantiation.
//
// Block = kRowGroups x kWarps warps; it owns 16 * kRowGroups query rows (rows = (s_q, head) pairs
// of one sequence) and walks its share of KV tokens in tiles of kTile (16 or 32):
//   cp.async ring of raw tiles (kStages deep) -> [fp8: dequantize to a bf16 tile in smem]
//   -> S = Q K^T: the 36 k-steps of 576 dims are split over the kWarps warps of a row group
//      (9 or 4-5 each, Q held in registers), partial S summed through smem
//   -> online softmax (fp32, exp2) -> P (bf16, in registers as the A operand)
//   -> O += P V: each warp owns 512 / kWarps output dims (fp32 mma accumulators).
// mma.sync m16n8k16 fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16" (A: a0..a3 =
// rows g, g+8 x cols 2c, 2c+8; B: b0, b1 = rows 2c, 2c+8 x col g; C: c0, c1 row g, c2, c3 row g+8,
// cols 2c, 2c+1; g = lane / 4, c = lane % 4). The C layout of two adjacent n8 tiles is the A
// layout of one k16 step, so P never leaves registers (as in FlashAttention-2).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mla/mla_decode_params.h"

namespace mlaserve::mla {

// bf16 rows in shared memory: 576 values + 16 B, so that the 8 rows one ldmatrix reads start in
// 8 different 16-B bank groups (1168 / 16 = 73, odd).
constexpr int kSmemRowBytes = 2 * kMlaQkDim + 16;
constexpr int kSmemLimit = 99 * 1024;  // SM120's per-block maximum.

template <KvCacheFormat kFormat, int kRowGroups, int kWarps, int kTile>
struct SplitKernelConfig {
  static constexpr int kThreads = kRowGroups * kWarps * 32;
  static constexpr int kRows = 16 * kRowGroups;
  static constexpr int kKSteps = kMlaQkDim / 16;                      // 36 k-steps of q.k
  static constexpr int kMaxKSteps = (kKSteps + kWarps - 1) / kWarps;  // per warp: 9 or 5
  static constexpr int kVDims = kMlaLatentDim / kWarps;               // per warp: 128 or 64
  static constexpr int kSTiles = kTile / 8;                           // n8 tiles of S
  static constexpr int kGlobalRowBytes = static_cast<int>(KvCacheBytesPerToken(kFormat));
  // bf16 rows land directly in the padded mma layout; fp8 rows are staged raw and converted.
  static constexpr int kRawRowBytes =
      kFormat == KvCacheFormat::kBf16 ? kSmemRowBytes : kGlobalRowBytes;
  static constexpr int kChunksPerRow = kGlobalRowBytes / 16;  // 72, 36, 41
  static constexpr int kRawStageBytes = kTile * kRawRowBytes;
  static constexpr int kConvBytes = kFormat == KvCacheFormat::kBf16 ? 0 : kTile * kSmemRowBytes;
  static constexpr int kExchangeBytes = kRowGroups * kWarps * 32 * (kTile / 2) * 4;
  // As many stages as fit under 99 KB (at most 6): 55-75 KB of KV in flight per block.
  static constexpr int kStagesFit = (kSmemLimit - kConvBytes - kExchangeBytes) / kRawStageBytes;
  static constexpr int kStages = kStagesFit > 6 ? 6 : kStagesFit;
  static constexpr int kSmemBytes = kStages * kRawStageBytes + kConvBytes + kExchangeBytes;
  static_assert(kStages >= 2, "need double buffering");
  static_assert(kSmemBytes <= kSmemLimit, "must fit SM120's 99 KB per block");
  static_assert(kGlobalRowBytes % 16 == 0, "rows are copied in 16-B chunks");
  static_assert(kTile == 16 || kTile == 32, "tiles of 16 or 32 tokens (within a 64-token block)");
  static_assert(kVDims % 16 == 0, "p.v columns per warp in pairs of n8 tiles");
};

__device__ __forceinline__ void CpAsync16(uint32_t smem, const void* gmem, bool valid) {
  // src-size 0 zero-fills: tokens past the sequence end read as 0, never as stale NaN bytes.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two e4m3 (low byte first) -> two bf16 of e4m3 * scale. Exact: e4m3 -> f16 is exact, and
// 4 significant bits times a power of two (or 1) fit bf16.
__device__ __forceinline__ uint32_t E4m3x2ToBf16x2(uint16_t two, float scale) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  return PackBf16(f.x * scale, f.y * scale);
}

__device__ __forceinline__ uint4 E4m3x8ToBf16x8(uint2 raw, float scale) {
  uint4 r;
  r.x = E4m3x2ToBf16x2(static_cast<uint16_t>(raw.x & 0xffff), scale);
  r.y = E4m3x2ToBf16x2(static_cast<uint16_t>(raw.x >> 16), scale);
  r.z = E4m3x2ToBf16x2(static_cast<uint16_t>(raw.y & 0xffff), scale);
  r.w = E4m3x2ToBf16x2(static_cast<uint16_t>(raw.y >> 16), scale);
  return r;
}

// Raw fp8 tile (16 rows of the global layout) -> bf16 tile in the padded mma layout.
template <KvCacheFormat kFormat, int kThreads, int kTile>
__device__ __forceinline__ void DequantizeTile(const uint8_t* raw, uint8_t* conv, int tid) {
  if constexpr (kFormat == KvCacheFormat::kFp8) {
    // 72 groups of 8 e4m3 per row; the per-layer scale is applied to scores and outputs.
    constexpr int kGroups = kMlaQkDim / 8;
#pragma unroll 3
    for (int i = tid; i < kTile * kGroups; i += kThreads) {
      const int r = i / kGroups, j = i - r * kGroups;
      const uint2 v = *reinterpret_cast<const uint2*>(raw + r * kMlaQkDim + j * 8);
      *reinterpret_cast<uint4*>(conv + r * kSmemRowBytes + j * 16) = E4m3x8ToBf16x8(v, 1.0f);
    }
  } else if constexpr (kFormat == KvCacheFormat::kFp8Tiled) {
    constexpr int kRowBytes = static_cast<int>(KvCacheBytesPerToken(kFormat));
    constexpr int kGroups = kMlaLatentDim / 8;  // 64; group j is in tile j / 16.
#pragma unroll 4
    for (int i = tid; i < kTile * kGroups; i += kThreads) {
      const int r = i / kGroups, j = i - r * kGroups;
      const uint8_t* row = raw + r * kRowBytes;
      const float scale =
          *reinterpret_cast<const float*>(row + kFp8TiledScaleOffset + 4 * (j / 16));
      const uint2 v = *reinterpret_cast<const uint2*>(row + j * 8);
      *reinterpret_cast<uint4*>(conv + r * kSmemRowBytes + j * 16) = E4m3x8ToBf16x8(v, scale);
    }
    // RoPE: 64 bf16 = 8 chunks of 16 B per row, copied as they are.
    for (int i = tid; i < kTile * 8; i += kThreads) {
      const int r = i / 8, j = i % 8;
      *reinterpret_cast<uint4*>(conv + r * kSmemRowBytes + 2 * kMlaLatentDim + j * 16) =
          *reinterpret_cast<const uint4*>(raw + r * kRowBytes + kFp8TiledRopeOffset + j * 16);
    }
  }
}

// Two blocks per SM where the shared memory allows it (H100/H200: 228 KB; SM120 runs one): the
// register cap that follows (255 for 128 threads, 128 for 256 or 512) keeps registers from
// limiting occupancy below what shared memory allows.
template <KvCacheFormat kFormat, int kRowGroups, int kWarps, int kTile>
__global__ void __launch_bounds__(SplitKernelConfig<kFormat, kRowGroups, kWarps, kTile>::kThreads,
                                  SplitKernelConfig<kFormat, kRowGroups, kWarps, kTile>::kThreads <=
                                          256
                                      ? 2
                                      : 1) MlaDecodeSplitKernel(const MlaDecodeKernelParams p) {
  using Cfg = SplitKernelConfig<kFormat, kRowGroups, kWarps, kTile>;
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kStages = Cfg::kStages;
  constexpr int kSTiles = Cfg::kSTiles;
  extern __shared__ __align__(128) uint8_t smem[];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rg = warp / kWarps, wr = warp % kWarps;
  const int g = lane >> 2, c = lane & 3;
  const int row_tiles = (p.rows + Cfg::kRows - 1) / Cfg::kRows;
  const int worker = blockIdx.x / row_tiles, mt = blockIdx.x % row_tiles;

  // Schedule (MlaDecodeScheduleKernel): cost prefix over sequences and the per-worker share.
  const int32_t* __restrict__ prefix = p.schedule;
  const int total = prefix[p.batch], share = prefix[p.batch + 1];
  const int cost_begin = worker * share;
  const int cost_end = min(cost_begin + share, total);
  if (cost_begin >= cost_end) return;
  int first_seq = 0;  // Last sequence whose cost range starts at or before cost_begin.
  {
    int lo = 0, hi = p.batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (prefix[mid] <= cost_begin)
        lo = mid;
      else
        hi = mid - 1;
    }
    first_seq = lo;
  }

  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint8_t* const conv_ptr = smem + kStages * Cfg::kRawStageBytes;
  const uint32_t conv_base = smem_base + kStages * Cfg::kRawStageBytes;
  float4* const exchange =
      reinterpret_cast<float4*>(smem + kStages * Cfg::kRawStageBytes + Cfg::kConvBytes);

  // This warp's share of q.k: k-steps [ks_begin, ks_begin + ks_count) of 36.
  constexpr int kBaseKs = Cfg::kKSteps / kWarps, kExtraKs = Cfg::kKSteps % kWarps;
  const int ks_count = kBaseKs + (wr < kExtraKs ? 1 : 0);
  const int ks_begin = wr * kBaseKs + min(wr, kExtraKs);
  // ldmatrix lane offsets inside a bf16 tile.
  // K (non-trans): matrices (tokens 0-7, dims +0), (0-7, +8), (8-15, +0), (8-15, +8).
  const uint32_t k_lane_off =
      ((lane & 7) + ((lane >> 4) << 3)) * kSmemRowBytes + ((lane >> 3) & 1) * 16 + ks_begin * 32;
  // V (trans): matrices (tokens 0-7, dims +0), (8-15, +0), (0-7, +8), (8-15, +8).
  const uint32_t v_lane_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * kSmemRowBytes +
                              (lane >> 4) * 16 + wr * Cfg::kVDims * 2;

  const int row_lo = mt * Cfg::kRows + rg * 16 + g;  // This thread's two accumulator rows.
  const int row_hi = row_lo + 8;

  for (int b = first_seq; b < p.batch && prefix[b] < cost_end; ++b) {
    const int seq_cost_begin = prefix[b], seq_cost_end = prefix[b + 1];
    const int len = p.seq_lens[b];
    const int ncost = (len + kCostTokens - 1) / kCostTokens;
    const int local_begin = max(cost_begin, seq_cost_begin) - seq_cost_begin;
    const int local_end = min(cost_end, seq_cost_end) - seq_cost_begin;
    // This piece's tokens [tok_begin, tok_end); tiles are aligned to kTile, so the first and
    // last may hold tokens of the neighbouring pieces, masked out below.
    const int tok_begin = min(max(local_begin - kSeqFixedCost, 0), ncost) * kCostTokens;
    const int tok_end = min(min(max(local_end - kSeqFixedCost, 0), ncost) * kCostTokens, len);
    const int t_begin = tok_begin / kTile;
    const int t_end = tok_end > tok_begin ? (tok_end + kTile - 1) / kTile : t_begin;
    const bool whole = seq_cost_begin >= cost_begin && seq_cost_end <= cost_end;
    const int32_t* __restrict__ blocks =
        p.block_table + static_cast<size_t>(b) * p.max_blocks_per_seq;

    // Q fragments for this warp's k-steps (4 registers of bf16 pairs each).
    uint32_t qf[Cfg::kMaxKSteps][4];
    {
      const uint32_t* q32 = reinterpret_cast<const uint32_t*>(p.q) +
                            static_cast<size_t>(b) * p.rows * (kMlaQkDim / 2);
      const bool lo_ok = row_lo < p.rows, hi_ok = row_hi < p.rows;
#pragma unroll
      for (int ks = 0; ks < Cfg::kMaxKSteps; ++ks) {
        const bool ok = ks < ks_count;
        const int k0 = (ks_begin + ks) * 16 + 2 * c;
        qf[ks][0] = ok && lo_ok ? q32[(row_lo * kMlaQkDim + k0) / 2] : 0u;
        qf[ks][1] = ok && hi_ok ? q32[(row_hi * kMlaQkDim + k0) / 2] : 0u;
        qf[ks][2] = ok && lo_ok ? q32[(row_lo * kMlaQkDim + k0 + 8) / 2] : 0u;
        qf[ks][3] = ok && hi_ok ? q32[(row_hi * kMlaQkDim + k0 + 8) / 2] : 0u;
      }
    }
    // Causal limit inside the new tokens: query i sees positions <= len - s_q + i.
    const int lim_lo = min(row_lo < p.rows ? len - p.s_q + row_lo / p.heads : len - 1, tok_end - 1);
    const int lim_hi = min(row_hi < p.rows ? len - p.s_q + row_hi / p.heads : len - 1, tok_end - 1);

    float o[Cfg::kVDims / 8][4];
#pragma unroll
    for (int n = 0; n < Cfg::kVDims / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;

    // All tokens of a tile lie in one 64-token block.
    auto issue = [&](int t, int stage, int32_t block) {
      const uint32_t dst = smem_base + stage * Cfg::kRawStageBytes;
      const uint8_t* src_block =
          p.kv_pool + static_cast<size_t>(block) * kKvBlockTokens * Cfg::kGlobalRowBytes;
#pragma unroll 2
      for (int i = tid; i < kTile * Cfg::kChunksPerRow; i += kThreads) {
        const int r = i / Cfg::kChunksPerRow, ch = i - r * Cfg::kChunksPerRow;
        const int tok = t * kTile + r;
        const bool valid = tok < len;
        const uint8_t* src =
            valid ? src_block + (tok % kKvBlockTokens) * Cfg::kGlobalRowBytes + ch * 16 : p.kv_pool;
        CpAsync16(dst + r * Cfg::kRawRowBytes + ch * 16, src, valid);
      }
    };
    constexpr int kTilesPerBlock = kKvBlockTokens / kTile;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (t_begin + s < t_end) issue(t_begin + s, s, blocks[(t_begin + s) / kTilesPerBlock]);
      CpAsyncCommit();
    }
    // Block id for the next tile to issue, loaded one iteration ahead to hide its latency.
    int32_t next_block =
        t_begin + kStages - 1 < t_end ? blocks[(t_begin + kStages - 1) / kTilesPerBlock] : 0;

    for (int t = t_begin; t < t_end; ++t) {
      const int it = t - t_begin;
      CpAsyncWait<kStages - 2>();
      __syncthreads();  // Tile t is in smem for all threads; tile t-1's buffers are free.
      {
        const int tn = t + kStages - 1;
        if (tn < t_end) issue(tn, (it + kStages - 1) % kStages, next_block);
        CpAsyncCommit();
        if (tn + 1 < t_end) next_block = blocks[(tn + 1) / kTilesPerBlock];
      }
      uint32_t tile = smem_base + (it % kStages) * Cfg::kRawStageBytes;
      if constexpr (kFormat != KvCacheFormat::kBf16) {
        DequantizeTile<kFormat, kThreads, kTile>(smem + (it % kStages) * Cfg::kRawStageBytes,
                                                 conv_ptr, tid);
        __syncthreads();
        tile = conv_base;
      }

      // Partial S over this warp's k-steps: 16 rows x kTile tokens (kSTiles n8 tiles).
      float s[kSTiles][4];
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < Cfg::kMaxKSteps; ++ks) {
        if (ks < ks_count) {
#pragma unroll
          for (int jj = 0; jj < kSTiles / 2; ++jj) {
            uint32_t kb[4];
            LdMatrixX4(kb, tile + k_lane_off + jj * 16 * kSmemRowBytes + ks * 32);
            MmaBf16(s[2 * jj], qf[ks], kb[0], kb[1]);
            MmaBf16(s[2 * jj + 1], qf[ks], kb[2], kb[3]);
          }
        }
      }
      float4* ex = exchange + ((rg * kWarps + wr) * 32 + lane) * kSTiles;
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) ex[j] = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
      __syncthreads();
      // Sum the partials in one fixed order: every warp of a row group must see bit-identical
      // S (same max, same P), or their output columns would be weighted inconsistently.
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float4* ew = exchange + ((rg * kWarps + w) * 32 + lane) * kSTiles;
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
          const float4 e = ew[j];
          s[j][0] += e.x;
          s[j][1] += e.y;
          s[j][2] += e.z;
          s[j][3] += e.w;
        }
      }

      // Scale to log2 units and mask (other pieces' tokens, past the end, causal).
      const int pos0 = t * kTile + 2 * c;
      float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = pos0 + j * 8 + (e & 1);
          const int lim = e < 2 ? lim_lo : lim_hi;
          s[j][e] = (pos >= tok_begin && pos <= lim) ? s[j][e] * p.score_scale_log2 : -INFINITY;
        }
        mx_lo = fmaxf(mx_lo, fmaxf(s[j][0], s[j][1]));
        mx_hi = fmaxf(mx_hi, fmaxf(s[j][2], s[j][3]));
      }
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      const float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
      // A row with nothing visible yet keeps max -inf; subtract 0 then so exp2 gives 0, not NaN.
      const float base_lo = new_lo == -INFINITY ? 0.0f : new_lo;
      const float base_hi = new_hi == -INFINITY ? 0.0f : new_hi;
      const float alpha_lo = exp2f(m_lo - base_lo), alpha_hi = exp2f(m_hi - base_hi);
      m_lo = new_lo;
      m_hi = new_hi;
      // P as A operands: k-step kk covers S n-tiles 2kk, 2kk+1.
      uint32_t pa[kSTiles / 2][4];
      float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
        uint32_t& plo = pa[j / 2][(j % 2) * 2];
        uint32_t& phi = pa[j / 2][(j % 2) * 2 + 1];
        plo = PackBf16(exp2f(s[j][0] - base_lo), exp2f(s[j][1] - base_lo));
        phi = PackBf16(exp2f(s[j][2] - base_hi), exp2f(s[j][3] - base_hi));
        // Normalize by the bf16 weights actually multiplied into V.
        const float2 flo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&plo));
        const float2 fhi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&phi));
        sum_lo += flo.x + flo.y;
        sum_hi += fhi.x + fhi.y;
      }
      l_lo = l_lo * alpha_lo + sum_lo;
      l_hi = l_hi * alpha_hi + sum_hi;
#pragma unroll
      for (int n = 0; n < Cfg::kVDims / 8; ++n) {
        o[n][0] *= alpha_lo;
        o[n][1] *= alpha_lo;
        o[n][2] *= alpha_hi;
        o[n][3] *= alpha_hi;
      }
      // O += P V over this warp's output dims.
#pragma unroll
      for (int kk = 0; kk < kSTiles / 2; ++kk) {
#pragma unroll
        for (int nn = 0; nn < Cfg::kVDims / 16; ++nn) {
          uint32_t vb[4];
          LdMatrixX4Trans(vb, tile + v_lane_off + kk * 16 * kSmemRowBytes + nn * 32);
          MmaBf16(o[2 * nn], pa[kk], vb[0], vb[1]);
          MmaBf16(o[2 * nn + 1], pa[kk], vb[2], vb[3]);
        }
      }
    }
    CpAsyncWait<0>();
    __syncthreads();  // The next piece's prologue reuses the stages.

    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    const float inv_lo = l_lo > 0.0f ? p.out_scale / l_lo : 0.0f;
    const float inv_hi = l_hi > 0.0f ? p.out_scale / l_hi : 0.0f;
    const float lse2_lo = l_lo > 0.0f ? m_lo + log2f(l_lo) : -INFINITY;  // log2 units
    const float lse2_hi = l_hi > 0.0f ? m_hi + log2f(l_hi) : -INFINITY;
    const int col0 = wr * Cfg::kVDims + 2 * c;
    constexpr float kLn2 = 0.693147180559945309f;
    const bool lse_writer = wr == 0 && c == 0;
    if (whole) {
      uint16_t* out = p.out + static_cast<size_t>(b) * p.rows * kMlaLatentDim;
      if (row_lo < p.rows) {
#pragma unroll
        for (int n = 0; n < Cfg::kVDims / 8; ++n) {
          *reinterpret_cast<uint32_t*>(out + row_lo * kMlaLatentDim + col0 + n * 8) =
              PackBf16(o[n][0] * inv_lo, o[n][1] * inv_lo);
        }
        if (p.lse != nullptr && lse_writer) {
          p.lse[static_cast<size_t>(b) * p.rows + row_lo] = lse2_lo * kLn2;
        }
      }
      if (row_hi < p.rows) {
#pragma unroll
        for (int n = 0; n < Cfg::kVDims / 8; ++n) {
          *reinterpret_cast<uint32_t*>(out + row_hi * kMlaLatentDim + col0 + n * 8) =
              PackBf16(o[n][2] * inv_hi, o[n][3] * inv_hi);
        }
        if (p.lse != nullptr && lse_writer) {
          p.lse[static_cast<size_t>(b) * p.rows + row_hi] = lse2_hi * kLn2;
        }
      }
    } else {
      const size_t slot = static_cast<size_t>(worker) + b;  // Unique per (sequence, worker).
      float* part = p.o_part + slot * p.rows * kMlaLatentDim;
      if (row_lo < p.rows) {
#pragma unroll
        for (int n = 0; n < Cfg::kVDims / 8; ++n) {
          *reinterpret_cast<float2*>(part + row_lo * kMlaLatentDim + col0 + n * 8) =
              make_float2(o[n][0] * inv_lo, o[n][1] * inv_lo);
        }
        if (lse_writer) p.lse_part[slot * p.rows + row_lo] = lse2_lo;
      }
      if (row_hi < p.rows) {
#pragma unroll
        for (int n = 0; n < Cfg::kVDims / 8; ++n) {
          *reinterpret_cast<float2*>(part + row_hi * kMlaLatentDim + col0 + n * 8) =
              make_float2(o[n][2] * inv_hi, o[n][3] * inv_hi);
        }
        if (lse_writer) p.lse_part[slot * p.rows + row_hi] = lse2_hi;
      }
    }
  }
}

template <KvCacheFormat kFormat, int kRowGroups, int kWarps, int kTile>
int MlaDecodeSplitBlocksPerSm() {
  using Cfg = SplitKernelConfig<kFormat, kRowGroups, kWarps, kTile>;
  static const int blocks = [] {
    auto kernel = MlaDecodeSplitKernel<kFormat, kRowGroups, kWarps, kTile>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Cfg::kSmemBytes) != cudaSuccess) {
      return 0;
    }
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Cfg::kThreads, Cfg::kSmemBytes) !=
        cudaSuccess) {
      return 0;
    }
    return n;
  }();
  return blocks;
}

template <KvCacheFormat kFormat, int kRowGroups, int kWarps, int kTile>
cudaError_t LaunchMlaDecodeSplit(const MlaDecodeKernelParams& p, int grid, cudaStream_t stream) {
  using Cfg = SplitKernelConfig<kFormat, kRowGroups, kWarps, kTile>;
  if (MlaDecodeSplitBlocksPerSm<kFormat, kRowGroups, kWarps, kTile>() == 0) {
    return cudaErrorInvalidConfiguration;
  }
  MlaDecodeSplitKernel<kFormat, kRowGroups, kWarps, kTile>
      <<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

#define MLASERVE_INSTANTIATE_MLA_DECODE_SPLIT(FORMAT, ROW_GROUPS, WARPS, TILE) \
  template cudaError_t LaunchMlaDecodeSplit<FORMAT, ROW_GROUPS, WARPS, TILE>(  \
      const MlaDecodeKernelParams&, int, cudaStream_t);                        \
  template int MlaDecodeSplitBlocksPerSm<FORMAT, ROW_GROUPS, WARPS, TILE>();

}  // namespace mlaserve::mla
