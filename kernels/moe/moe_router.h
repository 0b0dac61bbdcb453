// Mixture-of-experts router on the GPU: fp32 logits from BF16 gate weights (cuBLAS), then the
// selection of moe_router_ref.h with identical expert ids and weight bits for the same logits.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/moe/moe_dispatch.h"
#include "kernels/moe/moe_router_ref.h"

namespace mlaserve {

struct MoeRouterLogitsParams {
  int tokens;
  int hidden;
  int num_experts;
  const __nv_bfloat16* hidden_states;  // [tokens, hidden]
  const __nv_bfloat16* gate_weight;    // [num_experts, hidden] (the checkpoint's mlp.gate.weight)
  float* logits;                       // [tokens, num_experts]
  cublasHandle_t cublas;               // set to `stream` by the launcher
};

// logits = hidden_states @ gate_weight^T: bf16 products (exact in fp32), fp32 sums
// (CUBLAS_COMPUTE_32F). The summation order is cuBLAS's, so logits match MoeRouterLogitsRef to
// fp32 rounding, not bit for bit.
cublasStatus_t InvokeMoeRouterLogits(const MoeRouterLogitsParams& params, cudaStream_t stream);

struct MoeRouteParams {
  MoeRouterConfig config;  // must pass ValidateMoeRouterConfig
  int tokens;
  const float* logits;  // [tokens, num_experts]
  const float* bias;    // [num_experts] e_score_correction_bias, or nullptr
  int32_t* topk_ids;    // [tokens, top_k], rank order
  float* topk_weights;  // [tokens, top_k]
  // Launch programmatically dependent on the stream's previous kernel
  // (kernels/programmatic_launch.cuh): the kernel waits for it before reading anything.
  bool programmatic = false;
  // At up to 512 tokens with sigmoid scoring and one expert group (Kimi-K2's router): a block of
  // 4 warps a token, each ranking a quarter of the experts, then one warp merging their picks
  // (moe_router.cu). Same ids and weight bits; false keeps one warp a token everywhere.
  // CudaOps sets it by default (SetMoeRouteSplit); moe_gpu_test's
  // RouterIdsAndWeightsIdenticalToCpu runs both paths.
  bool split = false;
};

// One warp per token (or one block: MoeRouteParams::split); same rule, arithmetic and tie-breaking
// as MoeRouteRef.
cudaError_t InvokeMoeRoute(const MoeRouteParams& params, cudaStream_t stream);

// The router, then the routed experts' dispatch of its ids (dispatch.topk_ids == route.topk_ids;
// same tokens and top_k): InvokeMoeRoute and InvokeMoeDispatch's outputs, bit for bit. Where the
// split path serves the route (MoeRouteParams::split) and the batch has at most 256 assignments
// (decode), one kernel does both: its blocks count themselves done on `counter` (a device int
// that is 0 before the call and is 0 again after it; one per stream) and the last one places the
// assignments (moe_router.cu); the launch is programmatic as route.programmatic says. Otherwise,
// or with counter nullptr, the two launches.
cudaError_t InvokeMoeRouteDispatch(const MoeRouteParams& route, const MoeDispatchParams& dispatch,
                                   int* counter, cudaStream_t stream);

}  // namespace mlaserve
