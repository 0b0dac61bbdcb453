// The routed experts of one MoE layer on the GPU, NVFP4 weight-only path:
// dispatch -> fused gate+up GEMM (SiLU * up) -> down GEMM (x routing weight) -> combine
// (+ shared expert output). Same function as MoeExpertsRef (moe_ref.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>


namespace mlaserve {

// A rank's local experts on the device, in the layout of nvfp4_moe_layout.h / nvfp4_moe_gemm.h.
struct Nvfp4MoeWeights {
  int first_expert;
  int num_local_experts;
  int hidden;                         // multiple of 128
  int intermediate;                   // multiple of 128
  const uint8_t* gate_up_codes;       // [E][2I/16][H/64][512]
  const uint8_t* gate_up_scales;      // [E][2I/16][H/64][64]
  const float* gate_up_global_scale;  // [E][2]: weight_scale_2 of gate, of up
  const uint8_t* down_codes;          // [E][H/16][I/64][512]
  const uint8_t* down_scales;         // [E][H/16][I/64][64]
  const float* down_global_scale;     // [E]
};

struct Nvfp4MoeParams {
  Nvfp4MoeWeights weights;
  int tokens;
  int top_k;
  int tile_tokens;  // kMoeTileTokens*; see ChooseMoeTileTokens
  // InvokeNvfp4Moe launches gate_up, down and combine with programmatic dependent launch
  // (sm_90+, not on the legacy default stream nullptr) for decode batches of at most
  // kMoeProgrammaticMaxRows assignments (see there); true turns that off (for timing
  // comparisons). The stage functions below always launch plainly.
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
  // 128-token tiles: both GEMMs on the SM90 warpgroup-MMA kernel where the device has it
  // (moe_weight_only_wgmma.cuh); false keeps them on the mma.sync kernel, whose results are
  // bit-identical to the decode tiles' (the batch-invariant mode sets false).
  bool prefill_wgmma = true;
};

// Programmatic launches (kernels/programmatic_launch.cuh) for batches of tokens * top_k <= this
// with 16-token tiles. Measured on the H200 (bench/RESULTS.md, 2026-11-29, layer time plain ->
// programmatic, top-8): 7-10 us saved at 1-32 tokens (all 256 experts, 1 token: 92.5 -> 85.7 us),
// but 2118 -> 2553 us at 128 tokens with all 256 experts (cause not established) and no gain
// beyond noise in prefill, so larger batches launch plainly.
inline constexpr int kMoeProgrammaticMaxRows = 256;

size_t Nvfp4MoeWorkspaceBytes(int tokens, int top_k, int num_local_experts, int hidden,
                              int intermediate);

// Views of the workspace (for tests and benchmarks that time the stages one by one).
struct Nvfp4MoeWorkspace {
  int32_t* expert_counts;
  int32_t* expert_offsets;
  int32_t* tile_offsets;
  int32_t* sorted_assignment;
  int32_t* assignment_row;
  __nv_bfloat16* h;  // [tokens * top_k, intermediate]
  float* y;          // [tokens * top_k, hidden]
};
Nvfp4MoeWorkspace CarveNvfp4MoeWorkspace(void* workspace, int tokens, int top_k,
                                         int num_local_experts, int hidden, int intermediate);

// Each stage alone, launched plainly; InvokeNvfp4Moe runs all four.
cudaError_t InvokeNvfp4MoeDispatchStage(const Nvfp4MoeParams& params, cudaStream_t stream);
cudaError_t InvokeNvfp4MoeGateUpStage(const Nvfp4MoeParams& params, cudaStream_t stream);
cudaError_t InvokeNvfp4MoeDownStage(const Nvfp4MoeParams& params, cudaStream_t stream);
cudaError_t InvokeNvfp4MoeCombineStage(const Nvfp4MoeParams& params, cudaStream_t stream);
cudaError_t InvokeNvfp4Moe(const Nvfp4MoeParams& params, cudaStream_t stream);

}  // namespace mlaserve
