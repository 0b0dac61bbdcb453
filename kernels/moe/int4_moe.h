// The routed experts of one MoE layer on the GPU, INT4 weight-only path (compressed-tensors
// pack-quantized checkpoints, Kimi-K2 Thinking / K2.5): dispatch -> fused gate+up GEMM (SiLU *
// up) -> down GEMM (x routing weight) -> combine (+ shared expert output), the NVFP4 sequence of
// nvfp4_moe.h with the INT4 GEMMs (int4_moe_gemm.h). Same function as MoeExpertsRef (moe_ref.h)
// on the weights bf16(q * s) (int4_moe_layout.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>


namespace mlaserve {

// A rank's local experts on the device, in the layout of int4_moe_layout.h / int4_moe_gemm.h.
struct Int4MoeWeights {
  int first_expert;
  int num_local_experts;
  int hidden;                     // multiple of 128
  int intermediate;               // multiple of 128
  const uint8_t* gate_up_codes;   // [E][2I/16][H/64][512]
  const uint8_t* gate_up_scales;  // [E][2I/16][H/64][64]
  const uint8_t* down_codes;      // [E][H/16][I/64][512]
  const uint8_t* down_scales;     // [E][H/16][I/64][64]
};

// As Nvfp4MoeParams (nvfp4_moe.h), whose workspace (Nvfp4MoeWorkspaceBytes, CarveNvfp4MoeWorkspace)
// and programmatic-launch rule (kMoeProgrammaticMaxRows) this path shares.
struct Int4MoeParams {
  Int4MoeWeights weights;
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
  // 128-token tiles on the SM90 warpgroup-MMA kernel where the device has it (as
  // Nvfp4MoeParams::prefill_wgmma; false: the mma.sync kernel, bit-identical to decode tiles).
  bool prefill_wgmma = true;
};

// Each stage alone, launched plainly; InvokeInt4Moe runs all four.
cudaError_t InvokeInt4MoeDispatchStage(const Int4MoeParams& params, cudaStream_t stream);
cudaError_t InvokeInt4MoeGateUpStage(const Int4MoeParams& params, cudaStream_t stream);
cudaError_t InvokeInt4MoeDownStage(const Int4MoeParams& params, cudaStream_t stream);
cudaError_t InvokeInt4MoeCombineStage(const Int4MoeParams& params, cudaStream_t stream);
cudaError_t InvokeInt4Moe(const Int4MoeParams& params, cudaStream_t stream);

}  // namespace mlaserve
