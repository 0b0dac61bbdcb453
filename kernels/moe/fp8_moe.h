// The routed experts of one MoE layer on the GPU, FP8 weight-only path (DeepSeek-V3 / R1 releases:
// e4m3 weights, one fp32 scale per 128 x 128 block): dispatch -> fused gate+up GEMM (SiLU * up) ->
// down GEMM (x routing weight) -> combine (+ shared expert output), the NVFP4 sequence of
// nvfp4_moe.h with the FP8 GEMMs (fp8_moe_gemm.h), as int4_moe.h is with INT4's. Same function as
// MoeExpertsRef (moe_ref.h) on the weights bf16(fp32(e4m3 * s)) (fp8_moe_layout.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>


namespace mlaserve {

// A rank's local experts on the device, in the layout of fp8_moe_layout.h / fp8_moe_gemm.h.
struct Fp8MoeWeights {
  int first_expert;
  int num_local_experts;
  int hidden;                     // multiple of 128
  int intermediate;               // multiple of 128
  const uint8_t* gate_up_codes;   // [E][2I/16][H/64][1024] e4m3
  const uint8_t* gate_up_scales;  // [E][2I/16][H/64][2] fp32
  const uint8_t* down_codes;      // [E][H/16][I/64][1024] e4m3
  const uint8_t* down_scales;     // [E][H/16][I/64][2] fp32
};

// As Nvfp4MoeParams (nvfp4_moe.h), whose workspace (Nvfp4MoeWorkspaceBytes, CarveNvfp4MoeWorkspace)
// and programmatic-launch rule (kMoeProgrammaticMaxRows) this path shares.
struct Fp8MoeParams {
  Fp8MoeWeights weights;
  int tokens;
  int top_k;
  int tile_tokens;  // kMoeTileTokens*; see ChooseMoeTileTokens
  bool plain_launches;
  // With the programmatic launches above, the dispatch too (MoeDispatchParams::programmatic);
  // false launches it plainly, as before session 12 (for A/B runs).
  bool programmatic_dispatch = true;
  // The caller has already dispatched this call's ids into the workspace (MoeExpertsRunParams::
  // route: the router fused with the dispatch); the call starts at gate_up.
  bool dispatched = false;
  const __nv_bfloat16* x;           // [tokens, hidden]
  const int32_t* topk_ids;          // [tokens, top_k] global expert ids
  const float* topk_weights;        // [tokens, top_k]
  const __nv_bfloat16* shared_out;  // [tokens, hidden] or nullptr
  // When set, Invoke*Moe makes the stream wait for this event before the combine reads
  // shared_out (a shared expert computed on another stream beside the routed experts).
  cudaEvent_t shared_ready = nullptr;
  float* out;                       // [tokens, hidden] fp32, or nullptr
  __nv_bfloat16* out_bf16;          // [tokens, hidden], or nullptr
  void* workspace;                  // Nvfp4MoeWorkspaceBytes, 256-byte aligned
  size_t workspace_bytes;
  // 16-token tiles: both GEMMs on the few-expert kernel (moe_few_expert.h).
  bool few_expert;
  // 16-token tiles on the tile kernel: its wave tail on the few-expert kernel
  // (Nvfp4MoeGemmParams::wave_tail; 0 off, -1 the device's wave).
  int wave_tail = 0;
  int expected_tiles = 0;  // Nvfp4MoeGemmParams::expected_tiles
  // With few_expert, 1-4 tokens: the whole layer as one launch (moe_few_expert_layer.h) where it
  // applies, with these two device ints as its counters (0 between calls; one pair per stream);
  // nullptr keeps the four launches.
  int* few_expert_layer_counters = nullptr;
  // Diagnostics for that launch (moe_few_expert_layer.h, FewExpertLayerArgs::timeline), or null.
  uint64_t* few_expert_layer_timeline = nullptr;
};

// Each stage alone, launched plainly; InvokeFp8Moe runs all four.
cudaError_t InvokeFp8MoeDispatchStage(const Fp8MoeParams& params, cudaStream_t stream);
cudaError_t InvokeFp8MoeGateUpStage(const Fp8MoeParams& params, cudaStream_t stream);
cudaError_t InvokeFp8MoeDownStage(const Fp8MoeParams& params, cudaStream_t stream);
cudaError_t InvokeFp8MoeCombineStage(const Fp8MoeParams& params, cudaStream_t stream);
cudaError_t InvokeFp8Moe(const Fp8MoeParams& params, cudaStream_t stream);

}  // namespace mlaserve
