// The routed experts' decode GEMMs when few experts are active (moe_split_k.h): the same function
// as WeightOnlyMoeGemmKernel's decode tile (moe_weight_only_gemm.cuh), for any weight format
// policy, organised for one to a few dozen active experts instead of many.
//
// Why a second kernel. The tile kernel gives each block 128 weight rows x the whole K with 4
// warps and a block-wide cp.async pipeline. With one active expert (Kimi-K2.5 EP8 at batch 1)
// that is 32 gate_up and 56 down blocks for 132 SMs: one block, 4 warps, per SM. Each of those
// warps dequantizes about 2 integer / bf16 operations per weight in dependent chains, so with one
// warp per scheduler the SM is bound by instruction latency, not by memory: measured 0.6-1.0 TB/s
// (bench/RESULTS.md, "Decode at batch 1-8"). Splitting that kernel's K over more blocks did not
// help (its blocks still held 4 warps and synchronised every stage; H200, 2026-12-01).
//
// Here a block is 8 warps over the same 128 weight rows and one K range (a split): warp w streams
// m-tile w (16 rows) of the range on its own, with a ring of kDepth chunks of codes and scales in
// registers (ld.global straight into the lane's A-fragment words: the layout already stores each
// lane's 16 bytes of a 16 x 64 chunk together), and no block barrier in the K loop. The block's
// activation rows of its K range sit in shared memory, loaded once (ldmatrix reads B fragments).
// The splits of a tile add their fp32 partials in split order (the last block of the tile to
// arrive does it), then one epilogue: the same rounding points as the tile kernel, a different
// fp32 summation order (so the deterministic mode does not use this kernel).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/moe/moe_split_k.h"
#include "kernels/programmatic_launch.cuh"
#include "kernels/warp_ptx.cuh"

namespace mlaserve::moe_gemm {

inline constexpr int kFewExpertWarps = 8;             // 8 m-tiles = 128 weight rows a block
inline constexpr int kFewExpertThreads = 32 * kFewExpertWarps;
inline constexpr int kFewExpertMaxRows = 16;          // rows of a 16-token dispatch tile
inline constexpr int kFewExpertDepth = 4;             // chunks in flight per warp
// Activation bytes of one row of one 64-column chunk, and the row padding that puts the 8 rows of
// an ldmatrix on different banks.
inline constexpr int kFewExpertChunkXBytes = 64 * 2;
inline constexpr int kFewExpertRowPad = 16;

// Dynamic shared memory: kFewExpertMaxRows activation rows of the longest K range of a split
// (at most kMoeSplitKMaxChunksPerSplit chunks: 64.3 KB, beside 8 KB of static sums).
inline int FewExpertSmemBytes(int k, int splits) {
  const int chunks = (k / 64 + splits - 1) / splits;
  return kFewExpertMaxRows * (chunks * kFewExpertChunkXBytes + kFewExpertRowPad);
}
inline constexpr int kFewExpertMaxSmemBytes =
    kFewExpertMaxRows * (kMoeSplitKMaxChunksPerSplit * kFewExpertChunkXBytes + kFewExpertRowPad);

// Three blocks an SM for the 4-bit formats (79-80 registers on sm_90a, no spills), two for FP8
// (whose ring holds twice the code bytes; with three it spills).
template <class Format>
inline constexpr int kFewExpertMinBlocks = Format::kChunkCodeBytes <= 512 ? 3 : 2;

template <class Format, bool kGateUp>
__global__ void __launch_bounds__(kFewExpertThreads, kFewExpertMinBlocks<Format>)
    FewExpertMoeGemmKernel(const typename Format::Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float s_acc[128][kFewExpertMaxRows];  // the block's sums [weight row][tile row]
  __shared__ int s_last;
  constexpr int kChunkCode = Format::kChunkCodeBytes, kChunkScale = Format::kChunkScaleBytes;

  if constexpr (kGateUp) {  // the dispatch offsets and x come from predecessors
    pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }
  // The expert and rows of tile blockIdx.y, as in WeightOnlyMoeGemmKernel (down reads the
  // offsets before its wait: dispatch finished before gate_up let down start).
  const int tile = blockIdx.y;
  const int num_e = p.num_local_experts;
  if (tile >= __ldcg(p.tile_offsets + num_e)) return;
  int lo = 0, hi = num_e - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldcg(p.tile_offsets + mid) <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int e = lo;
  const int row_begin = __ldcg(p.expert_offsets + e) + (tile - __ldcg(p.tile_offsets + e)) * 16;
  const int valid_rows = min(row_begin + 16, __ldcg(p.expert_offsets + e + 1)) - row_begin;

  const int splits = p.split_k.splits;
  const int n_block = static_cast<int>(blockIdx.x) / splits;
  const int split = static_cast<int>(blockIdx.x) % splits;
  const int k_chunks = p.k / 64;
  const int c0 = k_chunks * split / splits;
  const int nc = k_chunks * (split + 1) / splits - c0;  // chunks of this split
  const int x_stride = nc * kFewExpertChunkXBytes + kFewExpertRowPad;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int mt = n_block * kFewExpertWarps + warp;  // this warp's 16-row m-tile
  const size_t expert_code_bytes = static_cast<size_t>(p.n) * p.k / (1024 / kChunkCode);
  const uint8_t* codes_g = p.w_codes + e * expert_code_bytes +
                           (static_cast<size_t>(mt) * k_chunks + c0) * kChunkCode;
  const uint8_t* scales_g = p.w_scales + e * (expert_code_bytes / (kChunkCode / kChunkScale)) +
                            (static_cast<size_t>(mt) * k_chunks + c0) * kChunkScale;

  // The ring: chunk c of the range lives in slot c % kDepth until computed.
  typename Format::Codes cw[kFewExpertDepth];
  typename Format::Scales sw[kFewExpertDepth];
#pragma unroll
  for (int d = 0; d < kFewExpertDepth; ++d) {
    if (d < nc) {
      cw[d] = Format::LoadCodes(codes_g + d * kChunkCode, lane);
      sw[d] = Format::LoadScales(scales_g + d * kChunkScale, g);
    }
  }
  if constexpr (!kGateUp) {  // h comes from gate_up
    pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }

  // Activation rows [0, valid_rows) of columns [64 c0, 64 (c0 + nc)) into shared memory.
  {
    const int vecs_per_row = nc * (kFewExpertChunkXBytes / 16);
    for (int v = tid; v < valid_rows * vecs_per_row; v += kFewExpertThreads) {
      const int r = v / vecs_per_row, col_vec = v % vecs_per_row;
      const int src_row = kGateUp ? __ldg(p.sorted_assignment + row_begin + r) / p.top_k
                                  : row_begin + r;
      const uint4 val = __ldg(reinterpret_cast<const uint4*>(
          p.a + static_cast<size_t>(src_row) * p.k + c0 * 64 + col_vec * 8));
      *reinterpret_cast<uint4*>(smem + r * x_stride + col_vec * 16) = val;
    }
  }
  __syncthreads();

  // ldmatrix x4 of n-tile nt, a pair of 16-column blocks: matrices (block 2jp, k 0-7), (2jp,
  // k 8-15), (2jp+1, k 0-7), (2jp+1, k 8-15); lane l gives the address of row l & 7 of matrix
  // l >> 3. Rows past the tile read the last valid row (their output columns are not stored).
  const int n_tiles = (valid_rows + 7) >> 3;
  const int ld_col_bytes = (lane >> 3) * 16;  // 8 columns per matrix
  uint32_t ld_row_addr[2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int r = min(nt * 8 + (lane & 7), valid_rows - 1);
    ld_row_addr[nt] = ptx::SmemAddr(smem + r * x_stride + ld_col_bytes);
  }

  float acc[2][4] = {};
  for (int base = 0; base < nc; base += kFewExpertDepth) {
#pragma unroll
    for (int d = 0; d < kFewExpertDepth; ++d) {
      const int c = base + d;
      if (c < nc) {
        uint32_t b[2][4][2];  // [n-tile][16-column block][b0, b1]
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          if (nt < n_tiles) {
#pragma unroll
            for (int jp = 0; jp < 2; ++jp) {
              uint32_t r4[4];
              ptx::LdMatrixX4(r4, ld_row_addr[nt] + c * kFewExpertChunkXBytes + jp * 64);
              b[nt][2 * jp][0] = r4[0];
              b[nt][2 * jp][1] = r4[1];
              b[nt][2 * jp + 1][0] = r4[2];
              b[nt][2 * jp + 1][1] = r4[3];
            }
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t a[4];
          Format::Fragment(cw[d], sw[d], j, a);
          ptx::MmaBf16(acc[0], a, b[0][j][0], b[0][j][1]);
          if (n_tiles > 1) ptx::MmaBf16(acc[1], a, b[1][j][0], b[1][j][1]);
        }
        const int next = c + kFewExpertDepth;
        if (next < nc) {
          cw[d] = Format::LoadCodes(codes_g + next * kChunkCode, lane);
          sw[d] = Format::LoadScales(scales_g + next * kChunkScale, g);
        }
      }
    }
  }

  // The warp's sums to s_acc: acc[nt] = (row g, tile row 8nt + 2t4), (g, +1), (g + 8, 2t4),
  // (g + 8, +1).
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = nt * 8 + 2 * t4 + (q & 1);
      if (r < valid_rows) s_acc[warp * 16 + g + (q >> 1) * 8][r] = acc[nt][q];
    }
  }
  __syncthreads();

  const int outputs = 128 * valid_rows;
  if (splits > 1) {
    // This split's sums to its partial slot; the tile's last block to arrive adds all slots in
    // split order (its own read back too, so the order does not depend on who is last).
    const int tile_id = blockIdx.y * (p.n / 128) + n_block;
    float* part = p.split_k.partial +
                  static_cast<size_t>(tile_id) * splits * kMoeSplitKPartialFloatsPerBlock;
    for (int i = tid; i < outputs; i += kFewExpertThreads) {
      const int o = i / valid_rows, r = i % valid_rows;
      __stcg(part + split * kMoeSplitKPartialFloatsPerBlock + o * kFewExpertMaxRows + r,
             s_acc[o][r]);
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(p.split_k.counters + tile_id, 1) == splits - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int i = tid; i < outputs; i += kFewExpertThreads) {
      const int o = i / valid_rows, r = i % valid_rows;
      const float* src = part + o * kFewExpertMaxRows + r;
      float sum = __ldcg(src);
      for (int z = 1; z < splits; ++z) sum += __ldcg(src + z * kMoeSplitKPartialFloatsPerBlock);
      s_acc[o][r] = sum;
    }
    if (tid == 0) p.split_k.counters[tile_id] = 0;  // ready for the next launch
    __syncthreads();
  }

  // Epilogue, consecutive threads on consecutive output columns.
  if constexpr (kGateUp) {
    // Feature f of the block's 64: m-tile f / 8 holds gate row f % 8 and up row f % 8 + 8.
    const float alpha_gate = Format::GateAlpha(p, e);
    const float alpha_up = Format::UpAlpha(p, e);
    const int inter = p.n / 2;
    for (int i = tid; i < 64 * valid_rows; i += kFewExpertThreads) {
      const int f = i % 64, r = i / 64;
      const int row = (f / 8) * 16 + f % 8;
      const float gate = s_acc[row][r] * alpha_gate;
      const float up = s_acc[row + 8][r] * alpha_up;
      const float hval = gate / (1.0f + __expf(-gate)) * up;
      p.h[static_cast<size_t>(row_begin + r) * inter + n_block * 64 + f] =
          __float2bfloat16_rn(hval);
    }
  } else {
    const float alpha = Format::DownAlpha(p, e);
    for (int i = tid; i < outputs; i += kFewExpertThreads) {
      const int o = i % 128, r = i / 128;
      const float w = __ldg(p.topk_weights + __ldg(p.sorted_assignment + row_begin + r)) * alpha;
      p.y[static_cast<size_t>(row_begin + r) * p.n + n_block * 128 + o] = s_acc[o][r] * w;
    }
  }
}

}  // namespace mlaserve::moe_gemm
