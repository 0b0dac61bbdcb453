// DeepSeek FP8 block-128 (e4m3 weights, fp32 weight_scale_inv per 128 x 128 block) weight-only
// grouped GEMMs of the routed experts: bf16 activations, e4m3 weights dequantized in registers to
// bf16(fp32(e4m3 * s)), mma.sync m16n8k16 bf16 with fp32 accumulation; SM89 through SM120 (the
// e4m3 -> f16x2 conversion; older GPUs take a bit-manipulation path, fp8_moe_layout.h). The
// kernel is NVFP4's (moe_weight_only_gemm.cuh) with the FP8 format (fp8_moe_gemm.cuh): the same
// rows, tiles per token count (ChooseMoeTileTokens, kMoeTileTokens*), dispatch and combine, and
// the same batch invariance (no split-K: a row's result never depends on the other rows of its
// tile, on the tile size or on the batch).
//
// Weights: the layout of fp8_moe_layout.h, local experts stored back to back:
//   gate_up codes [E][2I/16][H/64][1024] B, scales [E][2I/16][H/64][2] fp32;
//   down codes [E][H/16][I/64][1024] B, scales [E][H/16][I/64][2] fp32.
//   (H = hidden, I = intermediate, E = local experts; no global scale.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>


#include "kernels/moe/nvfp4_moe_gemm.h"  // kMoeTileTokens*, ChooseMoeTileTokens

namespace mlaserve {

// The fields of Nvfp4MoeGemmParams (see there) without the global scale.
struct Fp8MoeGemmParams {
  int tile_tokens;    // kMoeTileTokens*, the same value InvokeMoeDispatch used
  bool programmatic;  // see Nvfp4MoeGemmParams::programmatic; only InvokeFp8Moe sets it
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
  const uint8_t* __restrict__ w_codes;   // e4m3, see the file comment
  const uint8_t* __restrict__ w_scales;  // fp32 pairs, see the file comment
  // gate_up output: h[r][i] = silu(gate) * up, bf16 [rows, n / 2].
  __nv_bfloat16* __restrict__ h;
  // down output: y[r][o] = routing weight * down(h[r])[o], fp32 [rows, n].
  const float* __restrict__ topk_weights;  // [tokens * top_k]
  float* __restrict__ y;
  // InvokeFp8DenseGemm only (a dense projection: one weight, num_local_experts 1, no routing; the
  // dispatch fields and h, topk_weights, y unused): out = dense_alpha * a W^T for dense_rows
  // contiguous rows of a ([dense_rows, k] bf16), into dense_out (bf16 [dense_rows, dense_n],
  // dense_n <= n: W's rows from dense_n on are padding).
  int dense_rows;
  int dense_n;
  float dense_alpha;
  __nv_bfloat16* __restrict__ dense_out;
  // 16-token tiles: run FewExpertMoeGemmKernel (moe_few_expert_gemm.cuh) instead of the tile
  // kernel (moe_few_expert.h says when each is faster).
  bool few_expert;
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
cudaError_t InvokeFp8MoeGateUp(const Fp8MoeGemmParams& params, cudaStream_t stream);
// Down projection; the epilogue multiplies by the row's routing weight.
cudaError_t InvokeFp8MoeDown(const Fp8MoeGemmParams& params, cudaStream_t stream);

// A dense projection through the down kernel in its dense mode (moe_weight_only_gemm.cuh kDense),
// tile_tokens rows a tile (kMoeTileTokens*; max_tiles = ceil(dense_rows / tile_tokens)). The
// weight is read once per row tile: meant for decode-sized dense_rows. Like the expert GEMMs, a
// row's result does not depend on the other rows or the tile size.
cudaError_t InvokeFp8DenseGemm(const Fp8MoeGemmParams& params, cudaStream_t stream);

// The rearranged weight [rows_p, cols_p] (codes and scales as above) back in row-major bf16,
// out[r][c] = bf16(fp32(e4m3 * s)) (the kernel's own values) for r < rows, c < cols (out's row
// stride: cols), for a bf16 GEMM of large row counts.
cudaError_t InvokeFp8TiledToBf16(const uint8_t* codes, const uint8_t* scales, int rows_p,
                                 int cols_p, int rows, int cols, __nv_bfloat16* out,
                                 cudaStream_t stream);

// For tests: out[i] = the kernel's register formation (Fp8PairToBf16, fp8_moe_layout.h) of the
// e4m3 pair codes[i] (bits 0..15) with scales[i], on the device ([n] each).
cudaError_t InvokeFp8PairDecodeCheck(const uint32_t* codes, const float* scales, uint32_t* out,
                                     int n, cudaStream_t stream);

namespace moe_gemm {
// One explicit instantiation per (projection, tile) lives in its own .cu file.
template <bool kGateUp, int kTileTokens>
cudaError_t Launch(const Fp8MoeGemmParams& params, cudaStream_t stream);
template <int kTileTokens>
cudaError_t LaunchDense(const Fp8MoeGemmParams& params, cudaStream_t stream);
}  // namespace moe_gemm

}  // namespace mlaserve
