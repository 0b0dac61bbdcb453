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

#include "kernels/moe/moe_tile_expert.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/warp_ptx.cuh"

namespace mlaserve::moe_gemm {

// Warps a block (tuning builds may set MLASERVE_FEW_EXPERT_WARPS: 16 halves each warp's K slice,
// bench/moe/build_variants.sh FEW16).
#ifndef MLASERVE_FEW_EXPERT_WARPS
#define MLASERVE_FEW_EXPERT_WARPS 8
#endif
inline constexpr int kFewExpertWarps = MLASERVE_FEW_EXPERT_WARPS;
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
// Activation rows held at once (a tile's rows are taken in passes of this many; at decode batches
// of up to 4 tokens an expert has at most 4 rows, its top-k picks being distinct).
inline constexpr int kFewExpertPassRows = 4;
inline constexpr int kFewExpertChunkXBytes = 64 * 2;  // one row of one 64-column chunk
// Row padding that puts the rows of an ldmatrix on different banks.
inline constexpr int kFewExpertRowPad = 16;

// The 16-token tile kernel's wave tail (Params::wave_tail = W > 0 tiles a full wave of it, i.e.
// its resident blocks / its blocks a tile): of `tiles` row tiles, the first this returns run on
// the tile kernel and the rest on the few-expert kernel, launched right after it. The rest is a
// second wave's tiles where that wave would be less than half full: a wave of one block on a few
// SMs streams at a fraction of the bandwidth (H100, session 25: Kimi EP8 gate_up, 16 active
// experts are one wave of 512 blocks on 528 slots at 81% of copy bandwidth, 18 experts two waves
// at 70%). Past two waves the last one measured no better on the few-expert kernel, so only the
// second wave is split. Both kernels compute it from the same device count.
__host__ __device__ __forceinline__ int TileWaveSplit(int tiles, int wave_tiles) {
  if (wave_tiles <= 0 || tiles <= wave_tiles || tiles >= 2 * wave_tiles) return tiles;
  return 2 * (tiles - wave_tiles) < wave_tiles ? wave_tiles : tiles;
}

// Three blocks an SM for the 4-bit formats (80 registers), two for FP8 (whose ring holds twice the
// code bytes). The fused layer's (moe_few_expert_layer.cuh) and FP8's in the GEMM kernel; the
// 4-bit formats' GEMM configurations are below.
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
//
// One-token steps of the 4-bit formats (session 25) take the shared-memory ring instead
// (FewExpertRingGemm: kFewExpertSmemRing chunks a warp copied by cp.async, 2 rows a pass, 3 blocks
// an SM at 80 registers). H100, same call, 2 reps, few-expert layer from a graph: Kimi EP8 1
// token (1 active expert) 29.0 -> 28.1 us, all 256 local at 1 token (8) 112.9 -> 102.0; ring
// depth 4 beat 6 (29.2 us), 8 and 12 (30.0 / 32.6 in the call before: the deeper the ring, the
// later each warp's first chunk arrives behind every other warp's burst). For steps of 2+ tokens
// the same ring (at 3 blocks an SM) lost to the wide register ring at 4 (EP8 2 tokens 43.6 against
// 40.9 us), so they keep it. Tuning builds: MLASERVE_FEW_EXPERT_SMEM_RING=0 is the register ring
// (bench/moe/build_variants.sh).
#ifndef MLASERVE_FEW_EXPERT_SMEM_RING
#define MLASERVE_FEW_EXPERT_SMEM_RING 4
#endif
// Blocks an SM of the shared-memory ring and of the wide register ring (tuning builds).
#ifndef MLASERVE_FEW_EXPERT_RING_MIN_BLOCKS
#define MLASERVE_FEW_EXPERT_RING_MIN_BLOCKS 3
#endif
#ifndef MLASERVE_FEW_EXPERT_WIDE_MIN_BLOCKS
#define MLASERVE_FEW_EXPERT_WIDE_MIN_BLOCKS 4
#endif
inline constexpr int kFewExpertSmemRing = MLASERVE_FEW_EXPERT_SMEM_RING;

template <class Format, bool kWide>
struct FewExpertGemmConfig {
  static constexpr bool kFourBit = Format::kChunkCodeBytes <= 512;
  // Chunks a warp in the shared-memory ring (4-bit formats, one-token steps), 0 for the register
  // ring.
  static constexpr int kSmemRing = kFourBit && !kWide ? kFewExpertSmemRing : 0;
  // The wide register-ring configuration (steps of 2+ tokens).
  static constexpr bool kWideRegisterRing = kWide && kFourBit && kSmemRing == 0;
  static constexpr int kPassRows = kSmemRing > 0 || kWideRegisterRing ? 2 : kFewExpertPassRows;
  static constexpr int kDepth = kWideRegisterRing ? 3 : kFewExpertDepth;
  static constexpr int kMinBlocks = kSmemRing > 0       ? MLASERVE_FEW_EXPERT_RING_MIN_BLOCKS
                                    : kWideRegisterRing ? MLASERVE_FEW_EXPERT_WIDE_MIN_BLOCKS
                                                        : kFewExpertMinBlocks<Format>;
};

// The GEMM kernel's dynamic shared memory: a pass's activation rows over the whole K, the
// shared-memory ring (ring chunks of 512 code + 64 scale bytes a warp; 0 for the register ring),
// the K slices' sums ([8 warps][32 lanes][4] fp32), then the local experts' tile offsets and (ring
// only) row offsets.
inline constexpr int kFewExpertRingSlotBytes = 512 + 64;
inline int FewExpertSmemBytes(int k, int num_local_experts, int pass_rows, int ring = 0) {
  return pass_rows * (k / 64 * kFewExpertChunkXBytes + kFewExpertRowPad) +
         ring * kFewExpertWarps * kFewExpertRingSlotBytes + kFewExpertWarps * 32 * 16 +
         4 * (num_local_experts + 1) * (ring > 0 ? 2 : 1);
}
inline constexpr int kFewExpertMaxSmemBytes = 96 * 1024;  // SM120 allows 99 KB a block

// m-tiles a block: the fewest that leave every warp at least 8 chunks of K (gate_up at Kimi's
// hidden 7168: 1, 8 slices of 14 chunks; down at intermediate 2048: 2, 4 slices of 8).
inline int FewExpertTilesPerBlock(int k) {
  const int chunks = k / 64;
  return chunks >= 64 ? 1 : chunks >= 32 ? 2 : 4;
}

// One 16 x 64 chunk of a warp's m-tile against the activation rows whose ldmatrix address for
// this chunk is ld_addr: B fragments by ldmatrix x4, a pair of 16-column blocks at a time.
template <class Format>
__device__ __forceinline__ void FewExpertChunkMma(float (&acc)[4], const typename Format::Codes& cw,
                                                  const typename Format::Scales& sw,
                                                  uint32_t ld_addr) {
#pragma unroll
  for (int jp = 0; jp < 2; ++jp) {
    uint32_t b[4];  // (b0, b1) of block 2jp, then of block 2jp + 1
    ptx::LdMatrixX4(b, ld_addr + jp * 64);
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      uint32_t a[4];
      Format::Fragment(cw, sw, 2 * jp + jj, a);
      ptx::MmaBf16(acc, a, b[2 * jj], b[2 * jj + 1]);
    }
  }
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
        FewExpertChunkMma<Format>(acc, cw[d], sw[d], ld_addr + c * kFewExpertChunkXBytes);
        const int next = c + kDepth;
        if (next < nc) {
          cw[d] = Format::LoadCodes(codes + next * kChunkCode, lane);
          sw[d] = Format::LoadScales(scales + next * kChunkScale, g);
        }
      }
    }
  }
}

// A pass's epilogue, shared by both rings: each warp's partial sums (acc = (row g, pass row 2t4),
// (g, 2t4 + 1), (g + 8, 2t4), (g + 8, 2t4 + 1)) through s_sum ([8 warps][32 lanes][4] fp32),
// added in slice order by the warps of slice 0, then h (gate_up: m-tile mt holds gate rows of
// features 8mt..8mt+7 in rows g and their up rows in g + 8, so a lane has both for feature
// 8mt + g) or y (down, times the row's routing weight) for the pass's rows [row0, row0 + rows).
// Ends with the block barrier after which the rows and the sums may be overwritten.
template <class Format, bool kGateUp, int kMT>
__device__ __forceinline__ void FewExpertEpilogue(const typename Format::Params& p,
                                                  const float (&acc)[4], float* s_sum, int mt_begin,
                                                  int e, int row0, int rows) {
  constexpr int kSlices = kFewExpertWarps / kMT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  *reinterpret_cast<float4*>(s_sum + (warp * 32 + lane) * 4) =
      make_float4(acc[0], acc[1], acc[2], acc[3]);
  __syncthreads();
  if (warp < kMT) {
    float sum[4] = {acc[0], acc[1], acc[2], acc[3]};
#pragma unroll
    for (int s = 1; s < kSlices; ++s) {
      const float4 v = *reinterpret_cast<const float4*>(s_sum + ((s * kMT + warp) * 32 + lane) * 4);
      sum[0] += v.x;
      sum[1] += v.y;
      sum[2] += v.z;
      sum[3] += v.w;
    }
    const int mt = mt_begin + warp;  // global m-tile of this warp's rows
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 2 * t4 + half;  // row within the pass
      if (r < rows) {
        const int row = row0 + r;
        if constexpr (kGateUp) {
          const float gate = sum[half] * Format::GateAlpha(p, e);
          const float up = sum[2 + half] * Format::UpAlpha(p, e);
          const float hval = gate / (1.0f + __expf(-gate)) * up;
          p.h[static_cast<size_t>(row) * (p.n / 2) + mt * 8 + g] = __float2bfloat16_rn(hval);
        } else {
          const float wt =
              __ldg(p.topk_weights + __ldg(p.sorted_assignment + row)) * Format::DownAlpha(p, e);
          float* yrow = p.y + static_cast<size_t>(row) * p.n + mt * 16;
          yrow[g] = sum[half] * wt;
          yrow[g + 8] = sum[2 + half] * wt;
        }
      }
    }
  }
  __syncthreads();
}

// Activation rows [row0, row0 + rows) of a tile (rows <= kPassRows) over the whole K into shared
// memory, x_stride bytes apart: each row's source row read once (gate_up's rows are the tokens of
// sorted assignments), then the row's 16-byte vectors by cp.async (kAsync: one group, waited for
// here; the caller's barrier publishes it) or plain loads. Session 25: the loop this replaces
// divided by the row length and re-read the assignment for every vector, and its unrolled loads
// waited on two dependent global reads each.
template <bool kGateUp, int kPassRows, bool kAsync, class Params>
__device__ __forceinline__ void FewExpertLoadRows(const Params& p, uint8_t* smem, int x_stride,
                                                  int row0, int rows) {
  const int vecs_per_row = p.k / 8;  // bf16: 8 a vector
#pragma unroll
  for (int r = 0; r < kPassRows; ++r) {
    if (r < rows) {
      const int src_row = kGateUp ? __ldg(p.sorted_assignment + row0 + r) / p.top_k : row0 + r;
      const uint4* src = reinterpret_cast<const uint4*>(p.a + static_cast<size_t>(src_row) * p.k);
      uint8_t* dst = smem + r * x_stride;
      for (int v = threadIdx.x; v < vecs_per_row; v += kFewExpertThreads) {
        if constexpr (kAsync) {
          ptx::CpAsync16(dst + v * 16, src + v, true);
        } else {
          *reinterpret_cast<uint4*>(dst + v * 16) = __ldg(src + v);
        }
      }
    }
  }
  if constexpr (kAsync) {
    ptx::CpAsyncCommit();
    ptx::CpAsyncWait<0>();
  }
}

// The GEMM with the shared-memory ring (FewExpertGemmConfig::kSmemRing = R chunks a warp): the
// same items, K slices, MMA sequence and epilogue as the register ring below (so the same bits),
// but a warp's chunks are copied by cp.async into R slots of shared memory (one 16-byte copy a
// lane for the codes, four for the scales) and the copies run R chunks ahead of the MMAs as one
// stream over all the warp's items and passes, so the next item's weights are in flight while
// this one finishes and R is not bounded by registers. Row offsets come from shared memory, so
// the producer needs no global read to follow the items. Taken by one-token steps (the
// measurements above FewExpertGemmConfig); the hope that more bytes in flight would lift 1-2
// active experts from ~40% of copy bandwidth did not hold: deeper rings measured slower.
template <class Format, bool kGateUp, int kMT, class Cfg>
__device__ __forceinline__ void FewExpertRingGemm(const typename Format::Params& p) {
  constexpr int kRing = Cfg::kSmemRing, kPassRows = Cfg::kPassRows;
  constexpr int kSlices = kFewExpertWarps / kMT;
  constexpr int kChunkCode = Format::kChunkCodeBytes, kChunkScale = Format::kChunkScaleBytes;
  static_assert(
      kChunkCode == 512 && kChunkScale == 64 && kFewExpertRingSlotBytes == kChunkCode + kChunkScale,
      "the ring holds the 4-bit formats' chunks");
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2;
  const int k_chunks = p.k / 64;
  const int x_stride = k_chunks * kFewExpertChunkXBytes + kFewExpertRowPad;
  uint8_t* ring = smem + kPassRows * x_stride + warp * kRing * kFewExpertRingSlotBytes;
  float* s_sum = reinterpret_cast<float*>(smem + kPassRows * x_stride +
                                          kFewExpertWarps * kRing * kFewExpertRingSlotBytes);
  const int num_e = p.num_local_experts;
  int* s_tile_offsets = reinterpret_cast<int*>(s_sum + kFewExpertWarps * 32 * 4);  // [E + 1]
  int* s_row_offsets = s_tile_offsets + num_e + 1;                                 // [E + 1]

  if constexpr (kGateUp) {  // the dispatch offsets and x come from predecessors
    pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }
  // Down reads the offsets before its wait: dispatch finished before gate_up let down start.
  for (int i = tid; i <= num_e; i += kFewExpertThreads) {
    s_tile_offsets[i] = __ldcg(p.tile_offsets + i);
    s_row_offsets[i] = __ldcg(p.expert_offsets + i);
  }
  __syncthreads();
  const int m_blocks = p.n / (16 * kMT);
  const int items = s_tile_offsets[num_e] * m_blocks;  // (tile, m-block), tile-major
  const int mt_in_block = warp % kMT, slice = warp / kMT;
  const int c0 = k_chunks * slice / kSlices;
  const int nc = k_chunks * (slice + 1) / kSlices - c0;
  const size_t expert_code_bytes = static_cast<size_t>(p.n) * p.k / (1024 / kChunkCode);

  struct Item {
    int e, row_begin, valid_rows;
    const uint8_t* codes;  // this warp's chunk c0 of its m-tile
    const uint8_t* scales;
  };
  auto item_at = [&](int w) {  // shared memory only
    Item it;
    const int tile = w / m_blocks, m_block = w % m_blocks;
    const int lo = ExpertOfTileShared(s_tile_offsets, num_e, tile);
    it.e = lo;
    it.row_begin = s_row_offsets[lo] + (tile - s_tile_offsets[lo]) * 16;
    it.valid_rows = min(it.row_begin + 16, s_row_offsets[lo + 1]) - it.row_begin;
    const size_t chunk0 = static_cast<size_t>(m_block * kMT + mt_in_block) * k_chunks + c0;
    it.codes = p.w_codes + lo * expert_code_bytes + chunk0 * kChunkCode;
    it.scales =
        p.w_scales + lo * (expert_code_bytes / (kChunkCode / kChunkScale)) + chunk0 * kChunkScale;
    return it;
  };

  // The producer: chunk c of pass `pass` of the block's item w, copied into slot `slot`; it runs
  // kRing chunks ahead of the consumer over the same sequence (items w = blockIdx.x + j gridDim.x,
  // passes of kPassRows rows, chunks 0..nc-1). One cp.async group a chunk, empty past the end, so
  // "chunk i landed" is always wait_group kRing - 1 before chunk i is read.
  // The producer's state: its item, pass and chunk, this lane's source addresses for the chunk
  // (codes; lanes 0-3 also a quarter of the scales) and its slot's shared address.
  const uint32_t ring_addr = ptx::SmemAddr(ring) + lane * 16;
  const uint32_t ring_end = ring_addr + kRing * kFewExpertRingSlotBytes;
  const bool scale_lane = lane < kChunkScale / 16;
  int pw = blockIdx.x, ppass = 0, pc = 0, pvalid = 0;
  const uint8_t* pcodes = nullptr;
  const uint8_t* pscales = nullptr;
  uint32_t pslot = ring_addr;
  auto start_item = [&]() {
    if (pw < items) {
      const Item it = item_at(pw);
      pvalid = it.valid_rows;
      pcodes = it.codes + lane * 16;
      pscales = it.scales + lane * 16;
    }
  };
  start_item();
  auto produce = [&]() {
    if (pw < items) {
      ptx::CpAsync16(pslot, pcodes, true);
      if (scale_lane) ptx::CpAsync16(pslot + kChunkCode, pscales, true);
      pcodes += kChunkCode;
      pscales += kChunkScale;
      if (++pc == nc) {  // the item's pass is issued: the next pass re-reads it, or the next item
        pc = 0;
        pcodes -= nc * kChunkCode;
        pscales -= nc * kChunkScale;
        ppass += kPassRows;
        if (ppass >= pvalid) {
          ppass = 0;
          pw += gridDim.x;
          start_item();
        }
      }
    }
    pslot += kFewExpertRingSlotBytes;
    if (pslot == ring_end) pslot = ring_addr;
    ptx::CpAsyncCommit();
  };
#pragma unroll 1
  for (int i = 0; i < kRing; ++i) produce();
  if constexpr (!kGateUp) {  // h comes from gate_up
    pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }

  const uint8_t* cslot = ring;
  for (int w = blockIdx.x; w < items; w += gridDim.x) {
    const Item it = item_at(w);
    for (int pass = 0; pass < it.valid_rows; pass += kPassRows) {
      const int rows = min(kPassRows, it.valid_rows - pass);
      // (Plain loads: a cp.async group here would disturb the ring's group count.)
      FewExpertLoadRows<kGateUp, kPassRows, false>(p, smem, x_stride, it.row_begin + pass, rows);
      __syncthreads();
      const uint32_t ld_addr = ptx::SmemAddr(smem + min(lane & 7, rows - 1) * x_stride +
                                             c0 * kFewExpertChunkXBytes + (lane >> 3) * 16);
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
      for (int c = 0; c < nc; ++c) {
        ptx::CpAsyncWait<kRing - 1>();
        __syncwarp();  // the slot's scales were copied by lanes 0-3
        const typename Format::Codes cw = Format::LoadCodes(cslot, lane);
        const typename Format::Scales sw = Format::LoadScales(cslot + kChunkCode, g);
        __syncwarp();  // every lane has read the slot before it is copied over
        produce();
        cslot += kFewExpertRingSlotBytes;
        if (cslot == ring + kRing * kFewExpertRingSlotBytes) cslot = ring;
        FewExpertChunkMma<Format>(acc, cw, sw, ld_addr + c * kFewExpertChunkXBytes);
      }

      FewExpertEpilogue<Format, kGateUp, kMT>(p, acc, s_sum, (w % m_blocks) * kMT, it.e,
                                              it.row_begin + pass, rows);
    }
  }
  ptx::CpAsyncWait<0>();
}

template <class Format, bool kGateUp, int kMT, bool kWide>
__global__ void __launch_bounds__(kFewExpertThreads, FewExpertGemmConfig<Format, kWide>::kMinBlocks)
    FewExpertMoeGemmKernel(const typename Format::Params p) {
  if constexpr (FewExpertGemmConfig<Format, kWide>::kSmemRing > 0) {
    FewExpertRingGemm<Format, kGateUp, kMT, FewExpertGemmConfig<Format, kWide>>(p);
    return;
  }
  constexpr int kDepth = FewExpertGemmConfig<Format, kWide>::kDepth;
  constexpr int kPassRows = FewExpertGemmConfig<Format, kWide>::kPassRows;
  constexpr int kSlices = kFewExpertWarps / kMT;
  constexpr int kChunkCode = Format::kChunkCodeBytes, kChunkScale = Format::kChunkScaleBytes;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2;
  const int k_chunks = p.k / 64;
  const int x_stride = k_chunks * kFewExpertChunkXBytes + kFewExpertRowPad;
  float* s_sum = reinterpret_cast<float*>(smem + kPassRows * x_stride);            // [8][32][4]
  int* s_tile_offsets = reinterpret_cast<int*>(s_sum + kFewExpertWarps * 32 * 4);  // [E + 1]

  // As the tile kernel's wave tail (p.wave_tail > 0, TileWaveSplit): the tiles past the split.
  // The tile kernel before it waited for its own prerequisite before letting this one start, so
  // the offsets and activations are ready; this one waits for the tile kernel only at its end,
  // so that its dependents, which wait for it, see both.
  const bool tail = p.wave_tail > 0;
  if constexpr (kGateUp) {  // the dispatch offsets and x come from predecessors
    if (!tail) pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }
  // Down reads the offsets before its wait: dispatch finished before gate_up let down start.
  const int num_e = p.num_local_experts;
  for (int i = tid; i <= num_e; i += kFewExpertThreads)
    s_tile_offsets[i] = __ldcg(p.tile_offsets + i);
  __syncthreads();
  const int m_blocks = p.n / (16 * kMT);
  const int first_tile = tail ? TileWaveSplit(s_tile_offsets[num_e], p.wave_tail) : 0;
  const int items = (s_tile_offsets[num_e] - first_tile) * m_blocks;  // (tile, m-block), tile-major

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
    const int tile = first_tile + w / m_blocks;
    it.m_block = w % m_blocks;
    const int lo = ExpertOfTileShared(s_tile_offsets, num_e, tile);
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

  int w = blockIdx.x;
  Item it{};
  if (w < items) {
    it = item_at(w);
    prefetch(it);
  }
  if constexpr (!kGateUp) {  // h comes from gate_up
    if (!tail) pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }
  while (w < items) {
    const int next_w = w + gridDim.x;
    const int valid_rows = it.valid_rows;
    for (int pass = 0; pass < valid_rows; pass += kPassRows) {
      const int rows = min(kPassRows, valid_rows - pass);
      if (pass > 0) prefetch(it);  // a tile of more rows streams its weights again
      FewExpertLoadRows<kGateUp, kPassRows, true>(p, smem, x_stride, it.row_begin + pass, rows);
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

      FewExpertEpilogue<Format, kGateUp, kMT>(p, acc, s_sum, it.m_block * kMT, it.e,
                                              it.row_begin + pass, rows);
      if (last_pass) it = next_it;
    }
    w = next_w;
  }
  if (tail) pdl::WaitForPrerequisiteGrid();  // the tile kernel's tiles are done too
}

}  // namespace mlaserve::moe_gemm
