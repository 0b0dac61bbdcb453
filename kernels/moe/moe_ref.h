// Routed experts of a mixture-of-experts layer on the CPU: the oracle for the GPU grouped GEMMs
// and the CPU backend's own.
//
//   out[t] = sum_j w[t][j] * down_e(silu(gate_e x_t) * up_e x_t),  e = topk_ids[t][j],
// over the j whose expert is in [first_expert, first_expert + num_local_experts) (expert
// parallelism: each rank sums its own experts; the ranks' partial sums are then all-reduced).
// silu(v) = v / (1 + exp(-v)). Everything in fp32: dot products summed in ascending index, the
// terms j added in order j = 0..top_k-1. Weights are fp32 or NVFP4 (dequantized with
// DequantizeNvfp4, the project's one definition).
#pragma once

#include <cstdint>

namespace mlaserve {

// One projection [rows, cols]: fp32 (f32 set) or NVFP4 (nvfp4_packed and nvfp4_scale set).
struct MoeLinearRef {
  const float* f32 = nullptr;             // [rows, cols]
  const uint8_t* nvfp4_packed = nullptr;  // [rows, cols / 2], low nibble = even column
  const uint8_t* nvfp4_scale = nullptr;   // [rows, cols / 16] e4m3
  float nvfp4_global_scale = 1.0f;        // weight_scale_2
};

struct MoeExpertRef {
  MoeLinearRef gate;  // [intermediate, hidden]
  MoeLinearRef up;    // [intermediate, hidden]
  MoeLinearRef down;  // [hidden, intermediate]
};

struct MoeExpertsRefParams {
  int tokens;
  int hidden;        // 7168 for DeepSeek-V3 / Kimi-K2
  int intermediate;  // moe_intermediate_size, 2048
  int top_k;
  const float* x;             // [tokens, hidden]
  const int32_t* topk_ids;    // [tokens, top_k] global expert indices
  const float* topk_weights;  // [tokens, top_k]
  int first_expert;           // local experts: [first_expert, first_expert + num_local_experts)
  int num_local_experts;
  const MoeExpertRef* experts;  // [num_local_experts], experts[i] is expert first_expert + i
  float* out;                   // [tokens, hidden], overwritten
};

void MoeExpertsRef(const MoeExpertsRefParams& params);

// A dense gated MLP (shared experts, the first dense layers): out = down(silu(gate x) * up x),
// fp32 throughout. x [tokens, hidden], out [tokens, hidden].
void GatedMlpRef(const MoeExpertRef& weights, int tokens, int hidden, int intermediate,
                 const float* x, float* out);

}  // namespace mlaserve
