// The routed experts of a 1-4 token decode step as one launch: the dispatch, the few-expert gate_up
// and down GEMMs and the combine of Invoke{Nvfp4,Int4,Fp8}Moe (moe_few_expert_gemm.cuh, then
// moe_combine.cu) in one persistent kernel (moe_few_expert_layer.cuh), with the same results bit
// for bit.
//
// Why. With one to a few experts active, a layer's four kernels each pay a launch, a ramp-up and
// a tail for a few MB of weights, and the down GEMM's weight stream starts only when gate_up's
// ends: at batch 1 of Kimi-K2.5's shard the four took ~32 us (ncu, one kernel at a time) for the
// ~25 MB one expert holds, 11% of copy bandwidth (bench/RESULTS.md, session 11: dispatch 3.8,
// gate_up 14.4, down 9.7, combine 4.0 us). Here every block reads the <= 32 routing ids itself (no
// dispatch), takes gate_up items first and down items after, and issues a down item's first weight
// loads before it waits for gate_up to finish everywhere (a counter in global memory), so the two
// weight streams overlap; each down item covers a block of output rows for every active expert and
// sums the experts in slot order itself (no combine, no fp32 round trip through global memory).
//
// Measured (bench/RESULTS.md, sessions 17 and 38): the same bits as the four launches, faster
// alone at one token (H100: 24.0 against 26.4 us from graphs, Kimi EP8, one active expert) but
// not in the model's step, so off by default (MoeExpertsRunParams::few_expert_layer). Session
// 38's timeline (moe_bench --timeline) of that call: gate_up's 16.5 MB stream in ~9.7 us (56% of
// copy bandwidth) while a third of the blocks wait for it, then down's 8.3 MB in ~5 us: the two
// streams do not overlap. Tried there and dropped: every block asking the copy engine for its
// items' weights in L2 up front (cp.async.bulk.prefetch.L2, one or two items ahead): 1.13-1.53x
// slower at 1-4 tokens; the prefetches delayed each block's x row and first chunks (staged at
// 5.4 us median instead of 3.7) and the streams ran no faster.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/moe/moe_combine.h"
#include "kernels/moe/nvfp4_moe.h"
#include "kernels/moe/nvfp4_moe_gemm.h"

namespace mlaserve {

// Diagnostics (moe_bench --timeline on, with a build whose kernels have MLASERVE_KERNEL_TIMELINE:
// cmake -DMLASERVE_KERNEL_TIMELINE=ON): where a call passes a timeline, thread 0 of every block
// writes the %globaltimer (ns) at these points of its run into
// [block][kFewExpertLayerTimelineEvents] (an event a block never reaches stays as it was: the
// caller zeroes the buffer). Other builds write nothing.
enum FewExpertLayerEvent {
  kLayerEntry = 0,      // first instruction
  kLayerPrerequisite,   // after the wait for the previous kernel (programmatic launches)
  kLayerStaged,         // assignments laid out, x rows and the first item's weights requested
  kLayerGateUpDone,     // the block's last gate_up item counted
  kLayerDownWaitBegin,  // the block starts waiting for every gate_up item
  kLayerDownWaitEnd,    // ... and has its h rows
  kLayerLastItemDone,   // the block's last item finished
  kLayerExit,           // after the counters' reset
  kFewExpertLayerTimelineEvents
};

// Where the fused layer applies: 1..kFewExpertLayerMaxTokens tokens (each active expert then has
// at most 4 rows, one pass of the few-expert kernel's activation rows), tokens * top_k <= 32 (one
// warp lays out the assignments), and its shared memory within the few-expert kernel's budget.
inline constexpr int kFewExpertLayerMaxTokens = 4;
inline constexpr int kFewExpertLayerMaxRows = 32;
// hidden and intermediate: the padded sizes (multiples of 128). Defined in
// nvfp4_moe_few_expert_layer.cu (the shared memory layout is moe_few_expert_layer.cuh's).
bool FewExpertLayerApplies(int tokens, int top_k, int hidden, int intermediate);

// What the fused kernel needs beyond the two GEMMs' format parameters (whose n, k, w_codes,
// w_scales and alpha fields it reads; hidden and intermediate are the padded sizes).
struct FewExpertLayerArgs {
  int tokens = 0, top_k = 0;
  int first_expert = 0, num_local_experts = 0;
  int hidden = 0, intermediate = 0;
  const __nv_bfloat16* x = nullptr;     // [tokens, hidden]
  const int32_t* topk_ids = nullptr;    // [tokens, top_k] global expert ids
  const float* topk_weights = nullptr;  // [tokens, top_k]
  __nv_bfloat16* h = nullptr;           // workspace: [tokens * top_k, intermediate]
  // Added to the routed sum in the kernel, or nullptr.
  const __nv_bfloat16* shared_out = nullptr;
  // Outputs [tokens, hidden] (either may be nullptr): the routed sum (+ shared_out), as the
  // combine writes them.
  float* out = nullptr;
  __nv_bfloat16* out_bf16 = nullptr;
  // Two ints in device memory, 0 before the launch; the kernel leaves them 0 (its last block
  // resets them). One pair per stream of launches: launches sharing a pair must not overlap.
  int* counters = nullptr;
  bool programmatic = false;  // launched programmatically dependent on the stream's previous kernel
  // Diagnostics: [grid][kFewExpertLayerTimelineEvents] stamps (see FewExpertLayerEvent), or null.
  uint64_t* timeline = nullptr;
};

// One instantiation per weight format; the gate_up / down parameters are those the format's
// few-expert GEMM launches would get (n, k, w_codes, w_scales and the format's own scale fields
// are read). cudaErrorInvalidValue where FewExpertLayerApplies is false or args are incomplete.
struct Nvfp4MoeGemmParams;
struct Int4MoeGemmParams;
struct Fp8MoeGemmParams;
cudaError_t InvokeFewExpertLayer(const Nvfp4MoeGemmParams& gate_up, const Nvfp4MoeGemmParams& down,
                                 const FewExpertLayerArgs& args, cudaStream_t stream);
cudaError_t InvokeFewExpertLayer(const Int4MoeGemmParams& gate_up, const Int4MoeGemmParams& down,
                                 const FewExpertLayerArgs& args, cudaStream_t stream);
cudaError_t InvokeFewExpertLayer(const Fp8MoeGemmParams& gate_up, const Fp8MoeGemmParams& down,
                                 const FewExpertLayerArgs& args, cudaStream_t stream);

// Whether Invoke{Nvfp4,Int4,Fp8}Moe's call `p` runs as the fused layer: the few-expert kernel
// asked for, the counters given, 16-token tiles, and FewExpertLayerApplies.
template <class MoeParams>
bool TakesFewExpertLayer(const MoeParams& p) {
  return p.few_expert && p.few_expert_layer_counters != nullptr &&
         p.tile_tokens == kMoeTileTokensSmall &&
         FewExpertLayerApplies(p.tokens, p.top_k, p.weights.hidden, p.weights.intermediate);
}

// That call through the fused kernel (no dispatch; one the caller made is not read): `p` is the
// call's parameters (weights, tokens, tensors, shared_out / shared_ready, outputs, counters), the
// GEMM parameters those of its few-expert launches, ws its workspace. Where a shared expert on
// another stream is joined by shared_ready, the kernel leaves the routed sums in ws.y (fp32) and
// a combine adds shared_out after the wait (the same bits: MoeCombine adds shared_out last).
template <class MoeParams, class GemmParams>
cudaError_t RunFewExpertLayer(const MoeParams& p, const GemmParams& gate_up, const GemmParams& down,
                              const Nvfp4MoeWorkspace& ws, bool programmatic, cudaStream_t stream) {
  if (p.workspace_bytes < Nvfp4MoeWorkspaceBytes(p.tokens, p.top_k, p.weights.num_local_experts,
                                                 p.weights.hidden, p.weights.intermediate)) {
    return cudaErrorInvalidValue;
  }
  FewExpertLayerArgs a;
  a.tokens = p.tokens;
  a.top_k = p.top_k;
  a.first_expert = p.weights.first_expert;
  a.num_local_experts = p.weights.num_local_experts;
  a.hidden = p.weights.hidden;
  a.intermediate = p.weights.intermediate;
  a.x = p.x;
  a.topk_ids = p.topk_ids;
  a.topk_weights = p.topk_weights;
  a.h = ws.h;
  a.counters = p.few_expert_layer_counters;
  a.programmatic = programmatic;
  a.timeline = p.few_expert_layer_timeline;
  if (p.shared_ready == nullptr) {
    a.shared_out = p.shared_out;
    a.out = p.out;
    a.out_bf16 = p.out_bf16;
    return InvokeFewExpertLayer(gate_up, down, a, stream);
  }
  a.out = ws.y;
  if (cudaError_t e = InvokeFewExpertLayer(gate_up, down, a, stream); e != cudaSuccess) return e;
  if (cudaError_t e = cudaStreamWaitEvent(stream, p.shared_ready, 0); e != cudaSuccess) return e;
  MoeCombineParams c{};
  c.tokens = p.tokens;
  c.hidden = p.weights.hidden;
  c.top_k = 1;
  c.assignment_row = nullptr;  // token t's routed sum is row t of y
  c.y = ws.y;
  c.shared_out = p.shared_out;
  c.out = p.out;
  c.out_bf16 = p.out_bf16;
  c.programmatic = programmatic;
  return InvokeMoeCombine(c, stream);
}

}  // namespace mlaserve
