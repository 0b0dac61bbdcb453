// BF16 grouped GEMMs of the routed experts (bf16 activations and weights, mma.sync m16n8k16 bf16
// with fp32 accumulation; SM80 through SM120). The BF16 twin of nvfp4_moe_gemm.h: same rows
// (expert-grouped assignments from InvokeMoeDispatch), same tiles, same epilogues, same
// invariance (a row's result never depends on the other rows of its tile or on the tile size).
//
// Weights are rearranged at load time (InvokeRelayoutBf16MoeWeight) into mma A-fragment order so
// that a lane's four A registers of a 16x16 tile are one 16-byte word:
//   [rows/16][cols/64][4 j][32 lanes][8 bf16], lane = 4g + t holds, for columns 64c + 16j ..+15
//   of m-tile m: W[g][2t..2t+1], W[g+8][2t..2t+1], W[g][2t+8..2t+9], W[g+8][2t+8..2t+9]
//   (a0..a3 of PTX "Matrix fragments for mma.m16n8k16", the lower column in the low half).
// A 16x64 chunk is 2048 contiguous bytes, so a block streams each weight tile with 16-byte
// cp.async copies and a warp reads its fragments from shared memory conflict-free (no ldmatrix
// needed for A). The fused gate+up projection interleaves the two as the NVFP4 layout does:
// m-tile i holds gate rows 8i..8i+7 then up rows 8i..8i+7.
//
// Per expert (H = hidden, I = intermediate, both multiples of 128 here, E = local experts):
//   gate_up [E][2I/16][H/64][4][32][8] bf16,  down [E][H/16][I/64][4][32][8] bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace mlaserve {

struct Bf16MoeGemmParams {
  int tile_tokens;    // kMoeTileTokens* (nvfp4_moe_gemm.h), the value InvokeMoeDispatch used
  bool programmatic;  // as Nvfp4MoeGemmParams::programmatic
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
  const __nv_bfloat16* __restrict__ w;     // [E][n/16][k/64][4][32][8], see the file comment
  __nv_bfloat16* __restrict__ h;           // gate_up: bf16 [rows, n / 2] = silu(gate) * up
  const float* __restrict__ topk_weights;  // [tokens * top_k]
  float* __restrict__ y;                   // down: fp32 [rows, n] = routing weight * down(h[r])
};

cudaError_t InvokeBf16MoeGateUp(const Bf16MoeGemmParams& params, cudaStream_t stream);
cudaError_t InvokeBf16MoeDown(const Bf16MoeGemmParams& params, cudaStream_t stream);

// Rearranges one expert projection from the checkpoint's row-major bf16 into the layout above,
// zero-padded: src [src_rows, src_cols] (device) -> dst [n, k] tiled (device), n % 16 == 0,
// k % 64 == 0. With up != nullptr, src is gate and up is up (each [src_rows, src_cols]) and dst is
// the interleaved [n = 2 * padded intermediate, k] gate_up projection.
struct Bf16MoeRelayoutParams {
  const __nv_bfloat16* src;
  const __nv_bfloat16* up;
  int src_rows, src_cols;
  int n, k;
  __nv_bfloat16* dst;
};
cudaError_t InvokeRelayoutBf16MoeWeight(const Bf16MoeRelayoutParams& params, cudaStream_t stream);

namespace bf16_moe_gemm {
// One explicit instantiation per (projection, tile) lives in its own .cu file.
template <bool kGateUp, int kTileTokens>
cudaError_t Launch(const Bf16MoeGemmParams& params, cudaStream_t stream);
}  // namespace bf16_moe_gemm

}  // namespace mlaserve
