// NVFP4 weight-only grouped GEMMs of the routed experts (bf16 activations, NVFP4 weights
// dequantized in registers, mma.sync m16n8k16 bf16 with fp32 accumulation; SM80 through SM120;
// on SM90 the 128-token prefill tiles run on warpgroup MMA, moe_weight_only_wgmma.cuh).
//
// Rows are expert-grouped assignments (token, slot) made by InvokeMoeDispatch: rows
// expert_offsets[e] .. expert_offsets[e+1]-1 belong to local expert e, in ascending assignment
// index. Each thread block computes a [kBM weight rows x tile_tokens rows] tile over the whole K
// (no split-K), so a row's result never depends on which other rows share its tile or on the
// tile size: the same input gives the same bits at any batch size or order.
//
// Weights: the layout of nvfp4_moe_layout.h, local experts stored back to back:
//   gate_up codes  [E][2I/16][H/64][512] B, scales [E][2I/16][H/64][64] B, global [E][2] fp32
//   (weight_scale_2 of gate, of up);   down codes [E][H/16][I/64][512] B, scales
//   [E][H/16][I/64][64] B, global [E] fp32.  (H = hidden, I = intermediate, E = local experts.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>


namespace mlaserve {

// Tokens per tile the launchers support. Small tiles waste no weight bandwidth in decode (the
// weight tile is streamed once per row tile); 128 is the compute-bound prefill shape.
inline constexpr int kMoeTileTokensSmall = 16;
inline constexpr int kMoeTileTokensMedium = 64;
inline constexpr int kMoeTileTokensLarge = 128;

// The tile size for an expected load of tokens * top_k / num_experts rows per expert.
int ChooseMoeTileTokens(int tokens, int top_k, int num_experts);

struct Nvfp4MoeGemmParams {
  int tile_tokens;  // kMoeTileTokens*, the same value InvokeMoeDispatch used
  // Launch programmatically dependent on the previous kernel of the stream (sm_90+; see
  // kernels/programmatic_launch.cuh). Only InvokeNvfp4Moe sets it: the down GEMM then reads the
  // dispatch offsets before waiting, which is safe only right after gate_up.
  bool programmatic;
  int num_local_experts;
  int n;          // weight rows: 2 * intermediate (gate_up) or hidden (down); multiple of 128
  int k;          // hidden (gate_up) or intermediate (down); multiple of 128
  int max_tiles;  // upper bound of tile_offsets[E]: rows / tile_tokens + min(E, rows)
  const int32_t* __restrict__ expert_offsets;     // [E + 1] row offsets
  const int32_t* __restrict__ tile_offsets;       // [E + 1] row-tile offsets
  const int32_t* __restrict__ sorted_assignment;  // [rows] assignment index t * top_k + j
  int top_k;
  // Activations: gate_up reads x[sorted_assignment[r] / top_k] ([tokens, k] bf16); down reads
  // a[r] ([rows, k] bf16, gate_up's output).
  const __nv_bfloat16* __restrict__ a;
  const uint8_t* __restrict__ w_codes;  // see the file comment
  const uint8_t* __restrict__ w_scales;
  const float* __restrict__ w_global_scale;  // [E][2] gate_up, [E] down
  // gate_up output: h[r][i] = silu(gate) * up, bf16 [rows, n / 2].
  __nv_bfloat16* __restrict__ h;
  // down output: y[r][o] = routing weight * down(h[r])[o], fp32 [rows, n].
  const float* __restrict__ topk_weights;  // [tokens * top_k]
  float* __restrict__ y;
  // 16-token tiles: run FewExpertMoeGemmKernel (moe_few_expert_gemm.cuh) instead of the tile
  // kernel (moe_few_expert.h says when each is faster).
  bool few_expert;
  // 128-token tiles: run WeightOnlyMoeGemmWgmmaKernel (moe_weight_only_wgmma.cuh) where the
  // device is SM 9.0; false keeps the mma.sync kernel, whose K order
  // is the decode tiles' (the batch-invariant mode needs that).
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
cudaError_t InvokeNvfp4MoeGateUp(const Nvfp4MoeGemmParams& params, cudaStream_t stream);
// Down projection; the epilogue multiplies by the row's routing weight.
cudaError_t InvokeNvfp4MoeDown(const Nvfp4MoeGemmParams& params, cudaStream_t stream);

namespace moe_gemm {
// One explicit instantiation per (projection, tile) lives in its own .cu file.
template <bool kGateUp, int kTileTokens>
cudaError_t Launch(const Nvfp4MoeGemmParams& params, cudaStream_t stream);
}  // namespace moe_gemm

}  // namespace mlaserve
