// Sums each token's expert outputs in slot order (deterministic: no atomics, fixed order).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace mlaserve {

struct MoeCombineParams {
  int tokens;
  int hidden;  // multiple of 4
  int top_k;
  // [tokens * top_k], -1: expert of another rank; nullptr: row t * top_k + j for every slot (the
  // fused few-expert layer's routed sums, top_k 1, moe_few_expert_layer.h).
  const int32_t* assignment_row;
  const float* y;                   // [rows, hidden] weighted expert outputs
  const __nv_bfloat16* shared_out;  // [tokens, hidden] added last, or nullptr
  float* out;                       // [tokens, hidden] or nullptr
  __nv_bfloat16* out_bf16;          // [tokens, hidden] or nullptr
  // Launch programmatically dependent on the previous kernel of the stream (sm_90+, see
  // kernels/programmatic_launch.cuh): the kernel reads nothing before that kernel has finished.
  bool programmatic;
};

// tokens <= 65535 (one grid row per token).
// out[t] = ((y[row(t,0)] + y[row(t,1)]) + ...) + shared_out[t], skipping rows of -1, fp32.
cudaError_t InvokeMoeCombine(const MoeCombineParams& params, cudaStream_t stream);

}  // namespace mlaserve
