// INT4 (compressed-tensors pack-quantized, group 32) weight-only grouped GEMMs of the routed
// experts: bf16 activations, INT4 weights with bf16 group scales dequantized in registers to
// bf16(q * s), mma.sync m16n8k16 bf16 with fp32 accumulation; SM80 through SM120. The kernel is
// NVFP4's (moe_weight_only_gemm.cuh) with the INT4 format (int4_moe_gemm.cuh): the same rows,
// tiles (ChooseMoeTileTokens, kMoeTileTokens*), dispatch and combine, and the same batch
// invariance (no split-K: a row's result never depends on the other rows of its tile, on the tile
// size or on the batch).
//
// Weights: the layout of int4_moe_layout.h, local experts stored back to back:
//   gate_up codes [E][2I/16][H/64][512] B, scales [E][2I/16][H/64][64] B (bf16 pairs);
//   down codes [E][H/16][I/64][512] B, scales [E][H/16][I/64][64] B.
//   (H = hidden, I = intermediate, E = local experts; no global scale.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>


#include "kernels/moe/nvfp4_moe_gemm.h"  // kMoeTileTokens*, ChooseMoeTileTokens

namespace mlaserve {

// The fields of Nvfp4MoeGemmParams (see there) without the global scale.
struct Int4MoeGemmParams {
  int tile_tokens;    // kMoeTileTokens*, the same value InvokeMoeDispatch used
  bool programmatic;  // see Nvfp4MoeGemmParams::programmatic; only InvokeInt4Moe sets it
  int num_local_experts;
  int n;          // weight rows: 2 * intermediate (gate_up) or hidden (down); multiple of 128
  int k;          // hidden (gate_up) or intermediate (down); multiple of 128
  int max_tiles;  // upper bound of tile_offsets[E]: rows / tile_tokens + min(E, rows)
  const int32_t* __restrict__ expert_offsets;     // [E + 1] row offsets
  const int32_t* __restrict__ tile_offsets;       // [E + 1] row-tile offsets
  const int32_t* __restrict__ sorted_assignment;  // [rows] assignment index t * top_k + j
  int top_k;
  // gate_up reads x[sorted_assignment[r] / top_k] ([tokens, k] bf16); down reads a[r] ([rows, k]).
  const __nv_bfloat16* __restrict__ a;
  const uint8_t* __restrict__ w_codes;   // see the file comment
  const uint8_t* __restrict__ w_scales;  // bf16 pairs, see the file comment
  // gate_up output: h[r][i] = silu(gate) * up, bf16 [rows, n / 2].
  __nv_bfloat16* __restrict__ h;
  // down output: y[r][o] = routing weight * down(h[r])[o], fp32 [rows, n].
  const float* __restrict__ topk_weights;  // [tokens * top_k]
  float* __restrict__ y;
  // 16-token tiles: run FewExpertMoeGemmKernel (moe_few_expert_gemm.cuh) instead of the tile
  // kernel (moe_few_expert.h says when each is faster).
  bool few_expert;
  // 128-token tiles: the SM90 wgmma kernel where it applies (Nvfp4MoeGemmParams::prefill_wgmma).
  bool prefill_wgmma;
  // 16-token tiles on the tile kernel: 0, or the wave tail (moe_few_expert_gemm.cuh's
  // TileWaveSplit): the tiles of a last wave left less than half full run on the few-expert
  // kernel, launched after the tile kernel. -1 takes the device's wave (its resident blocks / the
  // blocks a tile) and launches the few-expert kernel only where expected_tiles is past one wave
  // by less than half (an empty launch costs ~3 us); N > 0 is N tiles a wave, launched whenever
  // max_tiles passes it (tests). Not in the batch-invariant mode (the few-expert kernel's
  // summation order differs).
  int wave_tail = 0;
  int expected_tiles = 0;  // the tiles a step of this size is expected to have (wave_tail -1)
};

// Fused gate+up projection with SiLU(gate) * up in the epilogue.
cudaError_t InvokeInt4MoeGateUp(const Int4MoeGemmParams& params, cudaStream_t stream);
// Down projection; the epilogue multiplies by the row's routing weight.
cudaError_t InvokeInt4MoeDown(const Int4MoeGemmParams& params, cudaStream_t stream);

namespace moe_gemm {
// One explicit instantiation per (projection, tile) lives in its own .cu file.
template <bool kGateUp, int kTileTokens>
cudaError_t Launch(const Int4MoeGemmParams& params, cudaStream_t stream);
}  // namespace moe_gemm

}  // namespace mlaserve
