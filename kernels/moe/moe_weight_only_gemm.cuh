// The weight-only grouped GEMM of the routed experts, whatever format its weights are in: NVFP4
// (nvfp4_moe_gemm.cuh), compressed-tensors INT4 (int4_moe_gemm.cuh) or DeepSeek's FP8 block-128
// (fp8_moe_gemm.cuh). A format is a policy struct: its Params type (the fields below, plus the
// format's own); its layout's bytes per 16 x 64 chunk of weights (kChunkCodeBytes codes,
// kChunkScaleBytes scales, each tile row's chunks stored back to back along K); its lane vectors
// Codes / Scales, read from a chunk in shared memory by LoadCodes / LoadScales; Fragment (a lane's
// A fragment of one 16-column block of the chunk as bf16 pairs, from those vectors); the epilogue
// multipliers GateAlpha / UpAlpha / DownAlpha; and Tile<kTileTokens>, its tile shapes. The 4-bit
// formats share FourBitLanes (512 code bytes: one 16-byte vector a lane; 64 scale bytes: 8 a lane)
// and TileFor; FP8 has 1024 code bytes (two 16-byte vectors a lane) and 8 scale bytes per chunk.
//
// Orientation: out^T = W x^T. The weight is the mma A operand (16 weight rows per m-tile), the
// activation rows are the B operand (8 rows per n-tile), so a decode tile with 1..16 rows wastes
// MMA lanes, not weight bandwidth. Per block: kBM weight rows x kBN activation rows, K streamed
// in kBK steps through a kStages-deep cp.async pipeline (codes, scales and activation rows of a
// step land in shared memory together). Each block covers the whole K (no split-K), so a row's
// result does not depend on the other rows of its tile or on the tile size.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/moe/moe_few_expert_gemm.cuh"
#include "kernels/moe/moe_tile_expert.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/resident_blocks.h"
#include "kernels/warp_ptx.cuh"

namespace mlaserve::moe_gemm {

using ptx::CpAsync16;
using ptx::CpAsync8;
using ptx::CpAsyncCommit;
using ptx::CpAsyncWait;
using ptx::LdMatrixX4;
using ptx::MmaBf16;

// a * b on bf16 pairs, subnormal inputs kept (PTX bf16 arithmetic has no flush-to-zero mode);
// written as fma with -0 so that it assembles for sm_80 too.
__device__ __forceinline__ uint32_t MulBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}
// Both halves of x = its upper (hi) or lower half. Fed to MulBf16x2, ptxas folds it into the
// multiply's operand swizzle (HMUL2.BF16_V2 R, R, R.H0_H0 / .H1_H1: no instruction of its own;
// SASS read with nvdisasm, kernels/moe NOTES in bench/RESULTS.md session 21).
__device__ __forceinline__ uint32_t Bf16x2Broadcast(uint32_t x, bool hi) {
  uint32_t d;
  if (hi) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n mov.b32 %0, {h, h};\n}\n" : "=r"(d) : "r"(x));
  } else {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n mov.b32 %0, {l, l};\n}\n" : "=r"(d) : "r"(x));
  }
  return d;
}

template <int kBM_, int kBN_, int kBK_, int kWarpsM_, int kWarpsN_, int kStages_, int kMinBlocks_,
          int kChunkCodeBytes_ = 512, int kChunkScaleBytes_ = 64>
struct TileConfig {
  static constexpr int kMinBlocks = kMinBlocks_;  // blocks per SM the register budget allows
  static constexpr int kBM = kBM_;                // weight rows per block
  static constexpr int kBN = kBN_;                // activation rows per block (the tile_tokens)
  static constexpr int kBK = kBK_;                // K per pipeline stage
  static constexpr int kWarpsM = kWarpsM_;
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kWM = kBM / kWarpsM;  // weight rows per warp
  static constexpr int kWN = kBN / kWarpsN;  // activation rows per warp
  static constexpr int kMT = kWM / 16;
  static constexpr int kNT = kWN / 8;
  static constexpr int kChunksK = kBK / 64;  // 64-column layout chunks per stage
  static constexpr int kChunkCodeBytes = kChunkCodeBytes_;    // of one 16 x 64 chunk
  static constexpr int kChunkScaleBytes = kChunkScaleBytes_;  // of one 16 x 64 chunk
  static constexpr int kCodeBytes = kBM / 16 * kChunksK * kChunkCodeBytes;
  static constexpr int kScaleBytes = kBM / 16 * kChunksK * kChunkScaleBytes;
  // A 16-row tile's scales of one stage are contiguous: copied in pieces of up to 16 bytes.
  static constexpr int kScaleCopyBytes =
      kChunksK * kChunkScaleBytes < 16 ? kChunksK * kChunkScaleBytes : 16;
  static constexpr int kScaleCopiesPerTile = kChunksK * kChunkScaleBytes / kScaleCopyBytes;
  static constexpr int kScaleCopies = kBM / 16 * kScaleCopiesPerTile;
  static constexpr int kXBytes = kBN * kBK * 2;
  static constexpr int kStageBytes = kCodeBytes + kScaleBytes + kXBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static constexpr int kXChunksPerRow = kBK / 8;  // 16-byte chunks of one activation row
  static constexpr int kXIters = kBN * kXChunksPerRow / kThreads;
  static constexpr int kCodeIters = kCodeBytes / 16 / kThreads;
  static_assert(kBM % (16 * kWarpsM) == 0 && kBN % (16 * kWarpsN) == 0, "warp tile");
  static_assert(kBK % 64 == 0 && kXChunksPerRow >= 8, "k step");
  static_assert(kXIters >= 1 && kBN * kXChunksPerRow % kThreads == 0, "X load");
  static_assert(kThreads % kXChunksPerRow == 0, "X load: fixed column chunk per thread");
  static_assert(kCodeIters >= 1 && (kCodeBytes / 16) % kThreads == 0, "code load");
  static_assert(kChunkCodeBytes % 16 == 0, "code vectors");
  static_assert(kScaleCopyBytes == 16 || kScaleCopyBytes == 8, "scale copies: cp.async 16 or 8");
  static_assert(kChunksK * kChunkScaleBytes % kScaleCopyBytes == 0, "scale copies");
  static_assert(kScaleCopies <= kThreads, "scale load");
  // SM120 allows 99 KB of dynamic shared memory per block.
  static_assert(kSmemBytes <= 99 * 1024, "shared memory");
};

template <bool kDense, class Params>
__device__ __forceinline__ int DenseRows(const Params& p) {
  if constexpr (kDense) {
    return p.dense_rows;
  } else {
    return 0;
  }
}

// kDense (a format whose Params has the dense_* fields, FP8's): one weight and no routing, a
// plain projection out = alpha * a W^T of p.dense_rows contiguous activation rows into
// p.dense_out, bf16 [dense_rows, dense_n] (dense_n <= n: the weight's rows past it are padding
// and not stored); expert_offsets, tile_offsets, sorted_assignment and
// topk_weights are not read. Launched with kGateUp false.
// Few active experts run FewExpertMoeGemmKernel instead (moe_few_expert.h). Code for them stays
// out of this kernel: a split-K tail compiled in here, unused, cost the decode GEMMs 10-15%
// (H200, moe_bench --decode, the same binary with and without it: ep8 / 64 tokens 350 -> 303 us,
// all_256 / 8 tokens 546 -> 483 us).
template <class Cfg, bool kGateUp, class Format, bool kDense = false>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    WeightOnlyMoeGemmKernel(const typename Format::Params p) {
  static_assert(!(kDense && kGateUp), "the dense mode is a down-like projection");
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kBK = Cfg::kBK, kStages = Cfg::kStages;
  constexpr int kMT = Cfg::kMT, kNT = Cfg::kNT;

  // Which expert and which rows: ExpertOfTile (moe_tile_expert.cuh).
  //
  // Programmatic launch (InvokeNvfp4Moe, InvokeInt4Moe): gate_up waits for dispatch before
  // reading anything. Down reads the dispatch offsets (__ldcg: from L2, never a stale L1 line) and
  // streams its first weight stages before waiting for gate_up's h: dispatch finished before
  // gate_up allowed down to start, and weights are constant.
  if constexpr (kGateUp) {
    pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }
  // (Dense: e = 0 and row tile `tile`; the grid has exactly ceil(dense_rows / kBN) of them.)
  const int tile = blockIdx.y;
  const int num_e = p.num_local_experts;
  if constexpr (!kDense) {  // (past a wave tail's split the few-expert kernel takes the tiles)
    if (tile >= TileWaveSplit(__ldcg(p.tile_offsets + num_e), p.wave_tail)) return;
  }
  const int e = kDense ? 0 : ExpertOfTile(p.tile_offsets, num_e, tile);
  const int row_begin =
      kDense ? tile * kBN
             : __ldcg(p.expert_offsets + e) + (tile - __ldcg(p.tile_offsets + e)) * kBN;
  const int row_end =
      min(row_begin + kBN, kDense ? DenseRows<kDense>(p) : __ldcg(p.expert_offsets + e + 1));
  const int valid_rows = row_end - row_begin;  // 1..kBN

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / Cfg::kWarpsN, warp_n = warp % Cfg::kWarpsN;
  const int k_chunks_total = p.k / 64;
  const int mt_block = blockIdx.x * (kBM / 16);  // first 16-row weight tile of this block

  // Global sources.
  constexpr int kChunkCode = Cfg::kChunkCodeBytes, kChunkScale = Cfg::kChunkScaleBytes;
  const size_t expert_code_bytes = static_cast<size_t>(p.n) * p.k / (1024 / kChunkCode);
  const uint8_t* codes_g = p.w_codes + e * expert_code_bytes +
                           static_cast<size_t>(mt_block) * k_chunks_total * kChunkCode;
  const uint8_t* scales_g = p.w_scales + e * (expert_code_bytes / (kChunkCode / kChunkScale)) +
                            static_cast<size_t>(mt_block) * k_chunks_total * kChunkScale;
  // Each thread copies the same 16-byte column chunk of kXIters activation rows every stage.
  const int x_chunk = tid % Cfg::kXChunksPerRow;
  int x_row[Cfg::kXIters];  // source row of each copied activation row, -1 past the tile
#pragma unroll
  for (int i = 0; i < Cfg::kXIters; ++i) {
    const int r = row_begin + (tid + i * Cfg::kThreads) / Cfg::kXChunksPerRow;
    x_row[i] = r >= row_end ? -1 : kGateUp ? __ldg(p.sorted_assignment + r) / p.top_k : r;
  }

  auto load_weights = [&](int stage, int kt) {
    uint8_t* s_codes = smem + stage * Cfg::kStageBytes;
    uint8_t* s_scales = s_codes + Cfg::kCodeBytes;
    // Codes: per 16-row tile a contiguous run of kChunksK * kChunkCode bytes.
#pragma unroll
    for (int i = 0; i < Cfg::kCodeIters; ++i) {
      const int c = tid + i * Cfg::kThreads;
      const int mt = c / (Cfg::kChunksK * (kChunkCode / 16)),
                within = c % (Cfg::kChunksK * (kChunkCode / 16));
      const uint8_t* src =
          codes_g + (static_cast<size_t>(mt) * k_chunks_total + kt * Cfg::kChunksK) * kChunkCode +
          within * 16;
      CpAsync16(s_codes + c * 16, src, true);
    }
    if (tid < Cfg::kScaleCopies) {
      constexpr int kCopy = Cfg::kScaleCopyBytes;
      const int mt = tid / Cfg::kScaleCopiesPerTile, within = tid % Cfg::kScaleCopiesPerTile;
      const uint8_t* src =
          scales_g + (static_cast<size_t>(mt) * k_chunks_total + kt * Cfg::kChunksK) * kChunkScale +
          within * kCopy;
      if constexpr (kCopy == 16) {
        CpAsync16(s_scales + tid * kCopy, src, true);
      } else {
        CpAsync8(s_scales + tid * kCopy, src, true);
      }
    }
  };
  // Activation rows, 16-byte chunks swizzled by (row & 7) against ldmatrix bank conflicts. Rows
  // past the tile are not loaded at all (a decode tile often holds 1-8 of its 16 rows): whatever
  // their shared memory holds only reaches output columns of those rows, which are never stored.
  auto load_x = [&](int stage, int kt) {
    uint8_t* s_x = smem + stage * Cfg::kStageBytes + Cfg::kCodeBytes + Cfg::kScaleBytes;
#pragma unroll
    for (int i = 0; i < Cfg::kXIters; ++i) {
      const int row = (tid + i * Cfg::kThreads) / Cfg::kXChunksPerRow;
      uint8_t* dst = s_x + row * (kBK * 2) + ((x_chunk ^ (row & 7)) * 16);
      if (x_row[i] >= 0) {
        CpAsync16(dst, p.a + static_cast<size_t>(x_row[i]) * p.k + kt * kBK + x_chunk * 8, true);
      }
    }
  };

  float acc[kMT][kNT][4];
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

  const int k_tiles = p.k / kBK;
  // Weights of the first kStages - 1 stages go into the first commit group (before down's wait),
  // so stage s is complete once group s is: the wait_group counts below stay as in a plain
  // pipeline.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_weights(s, s);
  }
  if constexpr (!kGateUp) {
    pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_x(s, s);
    CpAsyncCommit();
  }

  const int g = lane >> 2;
  const int ld_row_in_tile = (lane & 7) + ((lane >> 4) << 3);  // ldmatrix x4 row provider
  const int ld_chunk_hi = (lane >> 3) & 1;

  for (int kt = 0; kt < k_tiles; ++kt) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    {
      const int next = kt + kStages - 1;
      if (next < k_tiles) {
        load_weights(next % kStages, next);
        load_x(next % kStages, next);
      }
      CpAsyncCommit();
    }
    const uint8_t* s_codes = smem + (kt % kStages) * Cfg::kStageBytes;
    const uint8_t* s_scales = s_codes + Cfg::kCodeBytes;
    const uint8_t* s_x = s_scales + Cfg::kScaleBytes;
#pragma unroll
    for (int kc = 0; kc < Cfg::kChunksK; ++kc) {
      typename Format::Codes cw[kMT];
      typename Format::Scales sw[kMT];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const int t16 = warp_m * kMT + mt;
        cw[mt] = Format::LoadCodes(s_codes + (t16 * Cfg::kChunksK + kc) * kChunkCode, lane);
        sw[mt] = Format::LoadScales(s_scales + (t16 * Cfg::kChunksK + kc) * kChunkScale, g);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t b[kNT][2];
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          // Decode tiles: skip a pair of n-tiles with no row in the tile (warp-uniform).
          if (kBN <= 16 && warp_n * Cfg::kWN + np * 16 >= valid_rows) break;
          const int row = warp_n * Cfg::kWN + np * 16 + ld_row_in_tile;
          const int chunk = (kc * 64 + j * 16) / 8 + ld_chunk_hi;
          uint32_t r4[4];
          LdMatrixX4(r4, s_x + row * (kBK * 2) + ((chunk ^ (row & 7)) * 16));
          b[2 * np][0] = r4[0];
          b[2 * np][1] = r4[1];
          b[2 * np + 1][0] = r4[2];
          b[2 * np + 1][1] = r4[3];
        }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          uint32_t a[4];
          Format::Fragment(cw[mt], sw[mt], j, a);
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            if (kBN > 16 || warp_n * Cfg::kWN + nt * 8 < valid_rows) {
              MmaBf16(acc[mt][nt], a, b[nt][0], b[nt][1]);
            }
          }
        }
      }
    }
  }
  CpAsyncWait<0>();

  // Epilogue. acc[mt][nt]: c0 (weight row g, activation row 2t), c1 (g, 2t+1), c2 (g+8, 2t),
  // c3 (g+8, 2t+1).
  const int t4 = lane & 3;
  if constexpr (kDense) {
    const float alpha = p.dense_alpha;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = row_begin + warp_n * Cfg::kWN + nt * 8 + 2 * t4 + half;
        if (r < row_end) {
          const size_t row = static_cast<size_t>(r) * p.dense_n;
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            const int o = (mt_block + warp_m * kMT + mt) * 16 + g;
#pragma unroll
            for (int hi8 = 0; hi8 < 2; ++hi8) {
              const float v = acc[mt][nt][2 * hi8 + half] * alpha;
              if (o + 8 * hi8 < p.dense_n) p.dense_out[row + o + 8 * hi8] = __float2bfloat16_rn(v);
            }
          }
        }
      }
    }
  } else if constexpr (kGateUp) {
    const float alpha_gate = Format::GateAlpha(p, e);
    const float alpha_up = Format::UpAlpha(p, e);
    const int inter = p.n / 2;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const int feature = (mt_block + warp_m * kMT + mt) * 8 + g;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = row_begin + warp_n * Cfg::kWN + nt * 8 + 2 * t4 + half;
          if (r < row_end) {
            const float gate = acc[mt][nt][half] * alpha_gate;
            const float up = acc[mt][nt][2 + half] * alpha_up;
            const float hval = gate / (1.0f + __expf(-gate)) * up;
            p.h[static_cast<size_t>(r) * inter + feature] = __float2bfloat16_rn(hval);
          }
        }
      }
    }
  } else {
    const float alpha = Format::DownAlpha(p, e);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = row_begin + warp_n * Cfg::kWN + nt * 8 + 2 * t4 + half;
        if (r < row_end) {
          const float w = __ldg(p.topk_weights + __ldg(p.sorted_assignment + r)) * alpha;
          float* yrow = p.y + static_cast<size_t>(r) * p.n;
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            const int o = (mt_block + warp_m * kMT + mt) * 16 + g;
            yrow[o] = acc[mt][nt][half] * w;
            yrow[o + 8] = acc[mt][nt][2 + half] * w;
          }
        }
      }
    }
  }
}

// Tile shapes of the 4-bit formats by tokens per tile (their stage bytes are the same). Shared
// memory: 53 KB, 50 KB, 82 KB (sm_120 allows 99 KB). The measurements below are of the NVFP4
// format; INT4 runs the same tiles, not separately tuned. FP8's are in fp8_moe_gemm.cuh.
template <int kTileTokens>
struct TileFor;
// Decode: weight-stream bound and, on Hopper, close to instruction-issue bound (dequantization
// costs about 2 integer/bf16 ops per weight). Measured on the H200 (bench/RESULTS.md, 2026-11-29,
// all 256 experts, % of copy bandwidth at 8 / 32 / 64 / 128 tokens): 8 warps x 1 m-tile, K step
// 128, 4 stages, 3 blocks/SM 63.0 / 67.3 / 67.7 / 65.2; K step 256 60.6 / 64.7 / 63.8 / 63.4;
// 6 stages 59.5 / 63.5 / 63.3 / 63.2; 4 warps x 2 m-tiles with 4 blocks/SM 64.7 / 69.4 / 68.4 /
// 66.8, the default (moe_gpu_test passed with it, same RESULTS.md section).
#ifndef MLASERVE_MOE_DECODE_BK
#define MLASERVE_MOE_DECODE_BK 128
#endif
#ifndef MLASERVE_MOE_DECODE_STAGES
#define MLASERVE_MOE_DECODE_STAGES 4
#endif
#ifndef MLASERVE_MOE_DECODE_WARPS_M
#define MLASERVE_MOE_DECODE_WARPS_M 4
#endif
#ifndef MLASERVE_MOE_DECODE_MIN_BLOCKS
#define MLASERVE_MOE_DECODE_MIN_BLOCKS 4
#endif
template <>
struct TileFor<16> {
  using Cfg = TileConfig<128, 16, MLASERVE_MOE_DECODE_BK, MLASERVE_MOE_DECODE_WARPS_M, 1,
                         MLASERVE_MOE_DECODE_STAGES, MLASERVE_MOE_DECODE_MIN_BLOCKS>;
};
template <>
struct TileFor<64> {
  using Cfg = TileConfig<128, 64, 64, 4, 2, 4, 2>;
};
// Prefill: MMA bound. Measured (8192 tokens, all 256 experts, GEMM TFLOP/s): 4 x 2 warps 251.1
// (spills 32 B); 3 stages 259.4; 2 x 4 warps with 1 block/SM 201.3; 8 warps along M (warp tile
// 16 x 128) 265.9, the default (moe_gpu_test passed with it).
#ifndef MLASERVE_MOE_PREFILL_STAGES
#define MLASERVE_MOE_PREFILL_STAGES 4
#endif
#ifndef MLASERVE_MOE_PREFILL_WARPS_M
#define MLASERVE_MOE_PREFILL_WARPS_M 8
#endif
#ifndef MLASERVE_MOE_PREFILL_MIN_BLOCKS
#define MLASERVE_MOE_PREFILL_MIN_BLOCKS 2
#endif
template <>
struct TileFor<128> {
  using Cfg =
      TileConfig<128, 128, 64, MLASERVE_MOE_PREFILL_WARPS_M, 8 / MLASERVE_MOE_PREFILL_WARPS_M,
                 MLASERVE_MOE_PREFILL_STAGES, MLASERVE_MOE_PREFILL_MIN_BLOCKS>;
};

// The lane vectors of the 4-bit layouts (nvfp4_moe_layout.h, int4_moe_layout.h): per 16 x 64
// chunk 512 code bytes, one 16-byte vector a lane, and 64 scale bytes, 8 for each group g of
// lanes (rows g and g + 8).
struct FourBitLanes {
  static constexpr int kChunkCodeBytes = 512;
  static constexpr int kChunkScaleBytes = 64;
  using Codes = uint4;
  using Scales = uint2;
  static __device__ __forceinline__ uint4 LoadCodes(const uint8_t* chunk, int lane) {
    return *reinterpret_cast<const uint4*>(chunk + lane * 16);
  }
  static __device__ __forceinline__ uint2 LoadScales(const uint8_t* chunk, int g) {
    return *reinterpret_cast<const uint2*>(chunk + g * 8);
  }
  template <int kTileTokens>
  using Tile = TileFor<kTileTokens>;
};

// The few-expert kernel (moe_few_expert_gemm.cuh) over a persistent grid: as many blocks as the
// device holds at once, at most one a work item.
template <class Format, bool kGateUp, int kMT, bool kWide>
cudaError_t LaunchFewExpertMoeGemm(const typename Format::Params& p, cudaStream_t stream) {
  auto* kernel = FewExpertMoeGemmKernel<Format, kGateUp, kMT, kWide>;
  using Cfg = FewExpertGemmConfig<Format, kWide>;
  const int smem = FewExpertSmemBytes(p.k, p.num_local_experts, Cfg::kPassRows, Cfg::kSmemRing);
  ResidentBlocks rb;
  if (cudaError_t err = QueryResidentBlocks(kernel, kFewExpertThreads, smem, &rb);
      err != cudaSuccess) {
    return err;
  }
  const long long items = static_cast<long long>(p.max_tiles) * (p.n / (16 * kMT));
  const int grid = static_cast<int>(std::min<long long>(items, std::max(1, rb.sms * rb.per_sm)));
  return pdl::LaunchKernel(kernel, dim3(grid), dim3(kFewExpertThreads), smem, stream,
                           p.programmatic, p);
}

// The m-tiles a block for K (FewExpertTilesPerBlock).
template <class Format, bool kGateUp, bool kWide>
cudaError_t LaunchFewExpertMoeGemmForK(const typename Format::Params& p, cudaStream_t stream) {
  switch (FewExpertTilesPerBlock(p.k)) {
    case 1:
      return LaunchFewExpertMoeGemm<Format, kGateUp, 1, kWide>(p, stream);
    case 2:
      return LaunchFewExpertMoeGemm<Format, kGateUp, 2, kWide>(p, stream);
    default:
      return LaunchFewExpertMoeGemm<Format, kGateUp, 4, kWide>(p, stream);
  }
}

template <class Format, bool kGateUp, int kTileTokens, bool kDense = false>
cudaError_t LaunchWeightOnlyMoeGemm(const typename Format::Params& p, cudaStream_t stream) {
  using Cfg = typename Format::template Tile<kTileTokens>::Cfg;
  static_assert(Cfg::kChunkCodeBytes == Format::kChunkCodeBytes &&
                    Cfg::kChunkScaleBytes == Format::kChunkScaleBytes,
                "the tiles' chunk bytes are the format's");
  if (p.n % Cfg::kBM != 0 || p.k % Cfg::kBK != 0 || p.max_tiles < 0 || p.max_tiles > 65535) {
    return cudaErrorInvalidValue;
  }
  if (p.max_tiles == 0) return cudaSuccess;
  if constexpr (kTileTokens <= 16 && !kDense) {
    // The few-expert kernel where asked for and its shared memory (a pass's activation rows over
    // the whole K, the ring) fits; the tile kernel computes the same function otherwise.
    using Narrow = FewExpertGemmConfig<Format, false>;
    using Wide = FewExpertGemmConfig<Format, true>;
    const auto smem_of = [&](auto cfg) {
      using C = decltype(cfg);
      return FewExpertSmemBytes(p.k, p.num_local_experts, C::kPassRows, C::kSmemRing);
    };
    const bool few_fits = std::max(smem_of(Narrow{}), smem_of(Wide{})) <= kFewExpertMaxSmemBytes;
    if (p.few_expert && few_fits) {
      // One token (at most top_k rows; max_tiles = rows / 16 + min(E, rows)) keeps the deep ring,
      // steps of more tokens take the wide configuration (FewExpertGemmConfig).
      if constexpr (Wide::kWideRegisterRing) {
        if (p.max_tiles > p.top_k) {
          return LaunchFewExpertMoeGemmForK<Format, kGateUp, true>(p, stream);
        }
      }
      return LaunchFewExpertMoeGemmForK<Format, kGateUp, false>(p, stream);
    }
    // The wave tail (TileWaveSplit): the tile kernel for the first wave, then the few-expert
    // kernel for the tiles a second, mostly empty wave would hold. Launched where the step is
    // expected to need it (the real count is on the device; where it has no tail, the few-expert
    // launch finds no item).
    if (p.wave_tail != 0 && few_fits) {
      auto* kernel = WeightOnlyMoeGemmKernel<Cfg, kGateUp, Format, kDense>;
      ResidentBlocks rb;
      cudaError_t err = QueryResidentBlocks(kernel, Cfg::kThreads, Cfg::kSmemBytes, &rb);
      if (err != cudaSuccess) return err;
      // The device's wave where the caller did not fix one.
      const int wave_tiles = p.wave_tail > 0 ? p.wave_tail : rb.sms * rb.per_sm / (p.n / Cfg::kBM);
      const bool tail = p.wave_tail > 0 ? p.max_tiles > wave_tiles
                                        : wave_tiles > 0 && p.expected_tiles > wave_tiles &&
                                              2 * p.expected_tiles < 3 * wave_tiles;
      if (tail) {
        typename Format::Params q = p;
        q.wave_tail = wave_tiles;
        err = pdl::LaunchKernel(kernel, dim3(p.n / Cfg::kBM, p.max_tiles), dim3(Cfg::kThreads),
                                Cfg::kSmemBytes, stream, p.programmatic, q);
        if (err != cudaSuccess) return err;
        return LaunchFewExpertMoeGemmForK<Format, kGateUp, true>(q, stream);
      }
    }
  }
  typename Format::Params q = p;
  q.wave_tail = 0;
  auto* kernel = WeightOnlyMoeGemmKernel<Cfg, kGateUp, Format, kDense>;
  if (cudaError_t err = OptInDynamicSmem(kernel, Cfg::kSmemBytes); err != cudaSuccess) return err;
  return pdl::LaunchKernel(kernel, dim3(p.n / Cfg::kBM, p.max_tiles), dim3(Cfg::kThreads),
                           Cfg::kSmemBytes, stream, p.programmatic, q);
}

}  // namespace mlaserve::moe_gemm
