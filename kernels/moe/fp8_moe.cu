// The FP8 layer sequence (fp8_moe.h): nvfp4_moe.cu's, with the FP8 GEMMs (as int4_moe.cu with
// INT4's).
#include <algorithm>

#include "kernels/moe/fp8_moe.h"
#include "kernels/moe/fp8_moe_gemm.h"
#include "kernels/moe/moe_combine.h"
#include "kernels/moe/moe_dispatch.h"
#include "kernels/moe/moe_few_expert_layer.h"
#include "kernels/moe/nvfp4_moe.h"

namespace mlaserve {
namespace {

Nvfp4MoeWorkspace Carve(const Fp8MoeParams& p) {
  return CarveNvfp4MoeWorkspace(p.workspace, p.tokens, p.top_k, p.weights.num_local_experts,
                                p.weights.hidden, p.weights.intermediate);
}

Fp8MoeGemmParams GemmParams(const Fp8MoeParams& p, const Nvfp4MoeWorkspace& ws, bool gate_up,
                            bool programmatic) {
  const Fp8MoeWeights& w = p.weights;
  const int rows = p.tokens * p.top_k;
  Fp8MoeGemmParams g{};
  g.tile_tokens = p.tile_tokens;
  g.programmatic = programmatic;
  g.num_local_experts = w.num_local_experts;
  g.n = gate_up ? 2 * w.intermediate : w.hidden;
  g.k = gate_up ? w.hidden : w.intermediate;
  g.max_tiles = rows / p.tile_tokens + std::min(w.num_local_experts, rows);
  g.expert_offsets = ws.expert_offsets;
  g.tile_offsets = ws.tile_offsets;
  g.sorted_assignment = ws.sorted_assignment;
  g.top_k = p.top_k;
  g.a = gate_up ? p.x : ws.h;
  g.w_codes = gate_up ? w.gate_up_codes : w.down_codes;
  g.w_scales = gate_up ? w.gate_up_scales : w.down_scales;
  g.h = ws.h;
  g.topk_weights = p.topk_weights;
  g.y = ws.y;
  g.few_expert = p.few_expert;
  g.wave_tail = p.wave_tail;
  g.expected_tiles = p.expected_tiles;
  return g;
}

cudaError_t Combine(const Fp8MoeParams& p, cudaStream_t stream, bool programmatic) {
  const Nvfp4MoeWorkspace ws = Carve(p);
  MoeCombineParams c{};
  c.tokens = p.tokens;
  c.hidden = p.weights.hidden;
  c.top_k = p.top_k;
  c.assignment_row = ws.assignment_row;
  c.y = ws.y;
  c.shared_out = p.shared_out;
  c.out = p.out;
  c.out_bf16 = p.out_bf16;
  c.programmatic = programmatic;
  return InvokeMoeCombine(c, stream);
}

}  // namespace

namespace {
cudaError_t Dispatch(const Fp8MoeParams& p, cudaStream_t stream, bool programmatic) {
  if (p.workspace_bytes < Nvfp4MoeWorkspaceBytes(p.tokens, p.top_k, p.weights.num_local_experts,
                                                 p.weights.hidden, p.weights.intermediate)) {
    return cudaErrorInvalidValue;
  }
  const Nvfp4MoeWorkspace ws = Carve(p);
  MoeDispatchParams d{};
  d.tokens = p.tokens;
  d.top_k = p.top_k;
  d.first_expert = p.weights.first_expert;
  d.num_local_experts = p.weights.num_local_experts;
  d.tile_tokens = p.tile_tokens;
  d.topk_ids = p.topk_ids;
  d.expert_counts = ws.expert_counts;
  d.expert_offsets = ws.expert_offsets;
  d.tile_offsets = ws.tile_offsets;
  d.sorted_assignment = ws.sorted_assignment;
  d.assignment_row = ws.assignment_row;
  d.programmatic = programmatic;
  return InvokeMoeDispatch(d, stream);
}
}  // namespace

cudaError_t InvokeFp8MoeDispatchStage(const Fp8MoeParams& p, cudaStream_t stream) {
  return Dispatch(p, stream, false);
}

cudaError_t InvokeFp8MoeGateUpStage(const Fp8MoeParams& p, cudaStream_t stream) {
  return InvokeFp8MoeGateUp(GemmParams(p, Carve(p), true, false), stream);
}

cudaError_t InvokeFp8MoeDownStage(const Fp8MoeParams& p, cudaStream_t stream) {
  return InvokeFp8MoeDown(GemmParams(p, Carve(p), false, false), stream);
}

cudaError_t InvokeFp8MoeCombineStage(const Fp8MoeParams& p, cudaStream_t stream) {
  return Combine(p, stream, false);
}

// As InvokeNvfp4Moe: dispatch, gate_up, down and combine programmatically in small
// decode batches.
cudaError_t InvokeFp8Moe(const Fp8MoeParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  const bool pdl = !p.plain_launches && p.tile_tokens == kMoeTileTokensSmall &&
                   static_cast<long long>(p.tokens) * p.top_k <= kMoeProgrammaticMaxRows;
  const Nvfp4MoeWorkspace ws = Carve(p);
  if (TakesFewExpertLayer(p)) {
    return RunFewExpertLayer(p, GemmParams(p, ws, true, pdl), GemmParams(p, ws, false, pdl), ws,
                             pdl, stream);
  }
  if (!p.dispatched) {
    if (cudaError_t e = Dispatch(p, stream, pdl && p.programmatic_dispatch); e != cudaSuccess) {
      return e;
    }
  }
  if (cudaError_t e = InvokeFp8MoeGateUp(GemmParams(p, ws, true, pdl), stream); e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = InvokeFp8MoeDown(GemmParams(p, ws, false, pdl), stream); e != cudaSuccess) {
    return e;
  }
  if (p.shared_ready != nullptr) {
    if (cudaError_t e = cudaStreamWaitEvent(stream, p.shared_ready, 0); e != cudaSuccess) return e;
  }
  return Combine(p, stream, pdl);
}

}  // namespace mlaserve
