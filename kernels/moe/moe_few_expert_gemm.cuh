// The routed experts' decode GEMMs when few experts are active: the same function as
// WeightOnlyMoeGemmKernel's 16-token decode tile (moe_weight_only_gemm.cuh), for any weight
// format policy, organised for one to a few dozen active experts instead of many.
//
// Why a second kernel. The tile kernel gives each block 128 weight rows x the whole K with 4
// warps and a block-wide cp.async pipeline. With one active expert (Kimi-K2.5 EP8 at batch 1)
// that is 32 gate_up and 56 down blocks for 132 SMs: one block, 4 warps, per SM, each warp
// dequantizing about 2 integer / bf16 operations per weight in dependent chains, so the SM is
// bound by instruction latency: 0.6-1.0 TB/s (bench/RESULTS.md, "Decode at batch 1-8"). Two
// attempts that split K over blocks (the tile kernel's split-K, then 8-warp blocks over K ranges
// with fp32 partials added by the tile's last block) measured slower still (H200, 2026-12-03):
// their short blocks paid a chain of dependent global round trips each (offsets, activations,
// partials, a counter) for a few KB of weights.
//
// Here a block of 8 warps owns kMT 16-row m-tiles of one expert tile over the whole K: warp w
// streams m-tile w % kMT over K slice w / kMT (8 / kMT slices) through a ring of a few chunks
// of codes and scales in registers (plain loads straight into the lane's A-fragment words: the
// layout already stores each lane's 16 bytes of a 16 x 64 chunk together), with no barrier in
// the K loop; the slices are added in slice order in shared memory (no global partials, no
// counters). The tile's activation rows, a pass of 2 or 4 at a time (FewExpertGemmConfig), sit in
// shared memory for the whole K. The grid is persistent: blocks take work items (tile, m-block) in
// turn, reading the dispatch offsets once, and issue the next item's first weight loads before the
// current item's epilogue. Same rounding points as the tile kernel, a different fp32 summation
// order (so the deterministic mode does not use it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/programmatic_launch.cuh"
#include "kernels/warp_ptx.cuh"

namespace mlaserve::moe_gemm {

inline constexpr int kFewExpertWarps = 8;
inline constexpr int kFewExpertThreads = 32 * kFewExpertWarps;
// Chunks in flight per warp, and blocks an SM for the 4-bit formats (the register budget); both
// overridable for tuning builds (bench/moe/build_variants.sh).
#ifndef MLASERVE_FEW_EXPERT_DEPTH
#define MLASERVE_FEW_EXPERT_DEPTH 4
#endif
#ifndef MLASERVE_FEW_EXPERT_MIN_BLOCKS
#define MLASERVE_FEW_EXPERT_MIN_BLOCKS 3
#endif
inline constexpr int kFewExpertDepth = MLASERVE_FEW_EXPERT_DEPTH;
// L2 bulk prefetch of each block's items in the GEMM kernel (FewExpertMoeGemmKernel); off until
// measured (worker/backend/NOTES.md: build_variants.sh FEWL2).
#ifndef MLASERVE_FEW_EXPERT_L2_PREFETCH
#define MLASERVE_FEW_EXPERT_L2_PREFETCH 0
#endif
inline constexpr bool kFewExpertL2Prefetch = MLASERVE_FEW_EXPERT_L2_PREFETCH != 0;
// Activation rows held at once (a tile's rows are taken in passes of this many; at decode batches
// of up to 4 tokens an expert has at most 4 rows, its top-k picks being distinct).
inline constexpr int kFewExpertPassRows = 4;
inline constexpr int kFewExpertChunkXBytes = 64 * 2;  // one row of one 64-column chunk
// Row padding that puts the rows of an ldmatrix on different banks.
inline constexpr int kFewExpertRowPad = 16;

// Three blocks an SM for the 4-bit formats (80 registers), two for FP8 (whose ring holds twice the
// code bytes). The fused layer's (moe_few_expert_layer.cuh); the GEMM kernel's are below.
template <class Format>
inline constexpr int kFewExpertMinBlocks =
    Format::kChunkCodeBytes <= 512 ? MLASERVE_FEW_EXPERT_MIN_BLOCKS : 2;

// The GEMM kernel's ring depth, activation rows a pass and blocks an SM, per format and per
// step size. kWide (steps of 2+ tokens, for the 4-bit formats): 2 rows a pass (33 KB of shared
// memory a block at K = 7,168 instead of 61.6 KB) and 4 blocks an SM with a 3-chunk ring (64
// registers, no spills): as many chunks in flight an SM as 3 blocks x 4 chunks, but 528 block
// slots on 132 SMs instead of 396, so the items of 2 active experts (512 gate_up, 448 down) are
// one round instead of two. Measured on the H100 (bench/RESULTS.md, session 24; same runs, 2 reps,
// NVFP4, the few-expert layer): Kimi EP8 2 tokens (2 active experts) 50.1 -> 41.7 us, 4 tokens (5)
// 82.4 -> 78.7, 8 (10) 132.9 -> 126.5, 16 (15) 185.7 -> 170.0; DeepSeek EP8 4-16 tokens 1.05-1.09x,
// all 256 local 1-16 tokens 1.05-1.08x; but one active expert (DeepSeek EP8 2 tokens in that
// draw) 30.7 -> 32.2 us: with 256 items on fewer slots than either config has, the deeper ring
// is what counts. A one-token step (0-1 active experts an EP8 rank, mostly) keeps the deep ring.
// A 4-chunk ring at 4 blocks (spilling 24-32 bytes) lost to the 3-chunk one. A tile with more
// rows than a pass takes more passes (its weights streamed again, mostly from L2). Every output
// row sees the same MMA sequence in every configuration (rows are independent columns of the
// MMAs), so the bits do not depend on it. FP8 keeps 4 rows, a 4-chunk ring and 2 blocks (its
// A/B measured 1.00x: both of its configurations are this one). The rule as built (one token: the
// deep ring; more: wide), same call against the old binary: Kimi EP8 2 tokens 49.9 -> 41.8 us, 4
// tokens 82.2 -> 78.4, all 256 at 1 token 115.9 / 115.5. On SM120 (100 KB of shared memory an
// SM) the wide blocks fit 3 an SM at K = 7,168 and the 64-register cap buys nothing: unmeasured.
template <class Format, bool kWide>
struct FewExpertGemmConfig {
  static constexpr bool kChanged = kWide && Format::kChunkCodeBytes <= 512;
  static constexpr int kPassRows = kChanged ? 2 : kFewExpertPassRows;
  static constexpr int kDepth = kChanged ? 3 : kFewExpertDepth;
  static constexpr int kMinBlocks = kChanged ? 4 : kFewExpertMinBlocks<Format>;
};

// The GEMM kernel's dynamic shared memory: a pass's activation rows over the whole K, the K
// slices' sums ([8 warps][32 lanes][4] fp32), then the local experts' tile offsets.
inline int FewExpertSmemBytes(int k, int num_local_experts, int pass_rows) {
  return pass_rows * (k / 64 * kFewExpertChunkXBytes + kFewExpertRowPad) +
         kFewExpertWarps * 32 * 16 + 4 * (num_local_experts + 1);
}
inline constexpr int kFewExpertMaxSmemBytes = 96 * 1024;  // SM120 allows 99 KB a block

// m-tiles a block: the fewest that leave every warp at least 8 chunks of K (gate_up at Kimi's
// hidden 7168: 1, 8 slices of 14 chunks; down at intermediate 2048: 2, 4 slices of 8).
inline int FewExpertTilesPerBlock(int k) {
  const int chunks = k / 64;
  return chunks >= 64 ? 1 : chunks >= 32 ? 2 : 4;
}

// A warp's K slice of one 16-row m-tile: its nc chunks in order through the register ring (chunk
// c in slot c % kDepth, the first kDepth already loaded; each slot reloaded with chunk c + kDepth
// of codes / scales once computed), against the activation rows
// whose ldmatrix address for chunk 0 is ld_addr. FewExpertMoeGemmKernel and the fused layer
// (moe_few_expert_layer.cuh) share it: the same MMA sequence, so the same bits.
template <class Format, int kDepth>
__device__ __forceinline__ void FewExpertSliceMma(float (&acc)[4],
                                                  typename Format::Codes (&cw)[kDepth],
                                                  typename Format::Scales (&sw)[kDepth],
                                                  uint32_t ld_addr, int nc, const uint8_t* codes,
                                                  const uint8_t* scales, int lane, int g) {
  constexpr int kChunkCode = Format::kChunkCodeBytes, kChunkScale = Format::kChunkScaleBytes;
  for (int base = 0; base < nc; base += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int c = base + d;
      if (c < nc) {
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          uint32_t b[4];  // (b0, b1) of block 2jp, then of block 2jp + 1
          ptx::LdMatrixX4(b, ld_addr + c * kFewExpertChunkXBytes + jp * 64);
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            uint32_t a[4];
            Format::Fragment(cw[d], sw[d], 2 * jp + jj, a);
            ptx::MmaBf16(acc, a, b[2 * jj], b[2 * jj + 1]);
          }
        }
        const int next = c + kDepth;
        if (next < nc) {
          cw[d] = Format::LoadCodes(codes + next * kChunkCode, lane);
          sw[d] = Format::LoadScales(scales + next * kChunkScale, g);
        }
      }
    }
  }
}

template <class Format, bool kGateUp, int kMT, bool kWide>
__global__ void __launch_bounds__(kFewExpertThreads, FewExpertGemmConfig<Format, kWide>::kMinBlocks)
    FewExpertMoeGemmKernel(const typename Format::Params p) {
  constexpr int kDepth = FewExpertGemmConfig<Format, kWide>::kDepth;
  constexpr int kPassRows = FewExpertGemmConfig<Format, kWide>::kPassRows;
  constexpr int kSlices = kFewExpertWarps / kMT;
  constexpr int kChunkCode = Format::kChunkCodeBytes, kChunkScale = Format::kChunkScaleBytes;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int k_chunks = p.k / 64;
  const int x_stride = k_chunks * kFewExpertChunkXBytes + kFewExpertRowPad;
  float* s_sum = reinterpret_cast<float*>(smem + kPassRows * x_stride);            // [8][32][4]
  int* s_tile_offsets = reinterpret_cast<int*>(s_sum + kFewExpertWarps * 32 * 4);  // [E + 1]

  if constexpr (kGateUp) {  // the dispatch offsets and x come from predecessors
    pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }
  // Down reads the offsets before its wait: dispatch finished before gate_up let down start.
  const int num_e = p.num_local_experts;
  for (int i = tid; i <= num_e; i += kFewExpertThreads)
    s_tile_offsets[i] = __ldcg(p.tile_offsets + i);
  __syncthreads();
  const int m_blocks = p.n / (16 * kMT);
  const int items = s_tile_offsets[num_e] * m_blocks;  // (tile, m-block), tile-major

  // This warp's m-tile within the block and K slice [c0, c0 + nc) in 64-column chunks.
  const int mt_in_block = warp % kMT, slice = warp / kMT;
  const int c0 = k_chunks * slice / kSlices;
  const int nc = k_chunks * (slice + 1) / kSlices - c0;
  const size_t expert_code_bytes = static_cast<size_t>(p.n) * p.k / (1024 / kChunkCode);

  struct Item {
    int e, row_begin, valid_rows, m_block;
    const uint8_t* codes;
    const uint8_t* scales;
  };
  auto item_at = [&](int w) {
    Item it;
    const int tile = w / m_blocks;
    it.m_block = w % m_blocks;
    // The largest e with tile_offsets[e] <= tile (experts without rows are skipped by "largest").
    int lo = 0, hi = num_e - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (s_tile_offsets[mid] <= tile) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    it.e = lo;
    it.row_begin = __ldcg(p.expert_offsets + lo) + (tile - s_tile_offsets[lo]) * 16;
    it.valid_rows = min(it.row_begin + 16, __ldcg(p.expert_offsets + lo + 1)) - it.row_begin;
    const size_t chunk0 = static_cast<size_t>(it.m_block * kMT + mt_in_block) * k_chunks + c0;
    it.codes = p.w_codes + lo * expert_code_bytes + chunk0 * kChunkCode;
    it.scales =
        p.w_scales + lo * (expert_code_bytes / (kChunkCode / kChunkScale)) + chunk0 * kChunkScale;
    return it;
  };

  // The ring: chunk c of the slice lives in slot c % kDepth until computed.
  typename Format::Codes cw[kDepth];
  typename Format::Scales sw[kDepth];
  auto prefetch = [&](const Item& it) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (d < nc) {
        cw[d] = Format::LoadCodes(it.codes + d * kChunkCode, lane);
        sw[d] = Format::LoadScales(it.scales + d * kChunkScale, g);
      }
    }
  };

  // kFewExpertL2Prefetch (tuning builds; not measured yet): lane 0 of each warp asks L2 for its
  // K slice of every item the block will take, one bulk request each for codes and scales, so
  // the memory system streams the whole working set at once instead of the register ring's few
  // chunks a warp; the ring's loads then hit L2. The down GEMM does it before its programmatic
  // wait (its items need only the dispatch offsets), i.e. while gate_up finishes.
  if constexpr (kFewExpertL2Prefetch) {
    if (lane == 0) {
      for (int w2 = blockIdx.x; w2 < items; w2 += gridDim.x) {
        const Item it2 = item_at(w2);
        ptx::PrefetchL2Bulk(it2.codes, static_cast<uint32_t>(nc * kChunkCode));
        if constexpr (kChunkScale % 16 == 0) {
          ptx::PrefetchL2Bulk(it2.scales, static_cast<uint32_t>(nc * kChunkScale));
        }
      }
    }
  }
  int w = blockIdx.x;
  Item it{};
  if (w < items) {
    it = item_at(w);
    prefetch(it);
  }
  if constexpr (!kGateUp) {  // h comes from gate_up
    pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }
  while (w < items) {
    const int next_w = w + gridDim.x;
    const int valid_rows = it.valid_rows;
    for (int pass = 0; pass < valid_rows; pass += kPassRows) {
      const int rows = min(kPassRows, valid_rows - pass);
      if (pass > 0) prefetch(it);  // a tile of more rows streams its weights again
      // Activation rows [pass, pass + rows) of the tile over the whole K into shared memory.
      const int vecs_per_row = k_chunks * (kFewExpertChunkXBytes / 16);
      for (int v = tid; v < rows * vecs_per_row; v += kFewExpertThreads) {
        const int r = v / vecs_per_row, col_vec = v % vecs_per_row;
        const int row = it.row_begin + pass + r;
        const int src_row = kGateUp ? __ldg(p.sorted_assignment + row) / p.top_k : row;
        const uint4 val = __ldg(
            reinterpret_cast<const uint4*>(p.a + static_cast<size_t>(src_row) * p.k) + col_vec);
        *reinterpret_cast<uint4*>(smem + r * x_stride + col_vec * 16) = val;
      }
      __syncthreads();

      // B fragments by ldmatrix x4, a pair of 16-column blocks at a time: matrices (block 2jp,
      // k 0-7), (2jp, k 8-15), (2jp+1, k 0-7), (2jp+1, k 8-15); lane l gives the address of row
      // l & 7 of matrix l >> 3. Rows past the pass read its last row (their output columns are
      // not stored).
      const uint32_t ld_addr = ptx::SmemAddr(smem + min(lane & 7, rows - 1) * x_stride +
                                             c0 * kFewExpertChunkXBytes + (lane >> 3) * 16);
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      FewExpertSliceMma<Format, kDepth>(acc, cw, sw, ld_addr, nc, it.codes, it.scales, lane, g);
      const bool last_pass = pass + kPassRows >= valid_rows;
      // The next item's first weight loads go out before this one's epilogue (its offsets are in
      // shared memory; only the two expert offsets are global reads).
      Item next_it{};
      if (last_pass && next_w < items) {
        next_it = item_at(next_w);
        prefetch(next_it);
      }

      // The slices' sums, added in slice order: acc = (row g, pass row 2t4), (g, 2t4 + 1),
      // (g + 8, 2t4), (g + 8, 2t4 + 1).
      *reinterpret_cast<float4*>(s_sum + (warp * 32 + lane) * 4) =
          make_float4(acc[0], acc[1], acc[2], acc[3]);
      __syncthreads();
      if (warp < kMT) {
        float sum[4] = {acc[0], acc[1], acc[2], acc[3]};
#pragma unroll
        for (int s = 1; s < kSlices; ++s) {
          const float4 v =
              *reinterpret_cast<const float4*>(s_sum + ((s * kMT + warp) * 32 + lane) * 4);
          sum[0] += v.x;
          sum[1] += v.y;
          sum[2] += v.z;
          sum[3] += v.w;
        }
        const int mt = it.m_block * kMT + warp;  // global m-tile of this warp's rows
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 2 * t4 + half;  // row within the pass
          if (r < rows) {
            const int row = it.row_begin + pass + r;
            if constexpr (kGateUp) {
              // m-tile mt holds gate rows of features 8mt..8mt+7 (rows g) and their up rows
              // (g + 8): the lane has both for feature 8mt + g.
              const float gate = sum[half] * Format::GateAlpha(p, it.e);
              const float up = sum[2 + half] * Format::UpAlpha(p, it.e);
              const float hval = gate / (1.0f + __expf(-gate)) * up;
              p.h[static_cast<size_t>(row) * (p.n / 2) + mt * 8 + g] = __float2bfloat16_rn(hval);
            } else {
              const float wt = __ldg(p.topk_weights + __ldg(p.sorted_assignment + row)) *
                               Format::DownAlpha(p, it.e);
              float* yrow = p.y + static_cast<size_t>(row) * p.n + mt * 16;
              yrow[g] = sum[half] * wt;
              yrow[g + 8] = sum[2 + half] * wt;
            }
          }
        }
      }
      __syncthreads();  // the next pass or item overwrites the rows and the sums
      if (last_pass) it = next_it;
    }
    w = next_w;
  }
}

}  // namespace mlaserve::moe_gemm
