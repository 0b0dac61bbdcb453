// Mixture-of-experts router on the CPU: the oracle for the GPU router and the CPU backend's own.
//
// The rule (DESIGN.md "Model", checked against Hugging Face transformers'
// DeepseekV3TopkRouter and DeepseekV2Moe.route_tokens_to_experts, read 2026-11-29):
//  1. scores = sigmoid(logits)  (softmax over the experts when softmax_scoring, DeepSeek-V2).
//  2. choice = scores + bias (bias = e_score_correction_bias; none: + 0). Used for selection only.
//  3. Groups (n_group > 1): the experts split into n_group equal consecutive groups. Group score =
//     sum of the two largest choice values in the group (sigmoid, DeepSeek-V3's noaux_tc), or the
//     largest choice value (softmax, V2's group_limited_greedy). The topk_group best groups stay;
//     the experts of the others are excluded (-inf, as DeepSeek's reference code; transformers
//     fills 0.0, which differs only when a choice value is negative).
//  4. The top_k experts by choice value among those left.
//  5. weight = the UNBIASED score of each chosen expert; if norm_topk_prob, divided by
//     (their sum + 1e-20) as transformers does; then times routed_scaling_factor.
// V2 "greedy" routing is n_group = topk_group = 1.
//
// Determinism (the GPU router gives identical ids and weight bits from the same logits):
//  - scores use router_math::Sigmoid / Exp (same bits on host and device);
//  - softmax's sum adds experts e = l, l+32, l+64, ... into 32 partial sums l = 0..31, then
//    combines them by the butterfly p[l] + p[l ^ o] for o = 16, 8, 4, 2, 1 (a warp's shuffle
//    reduction), result in lane 0;
//  - ranking uses router_math::Better (higher value first, the LOWER index on ties; NaN as -inf);
//  - outputs are in rank order: topk_ids[t][0] is the best expert. Transformers returns them
//    unsorted (torch.topk sorted=False); only the set and the weight of each expert matter;
//  - the normalising sum adds the k unbiased scores in rank order.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace mlaserve {

struct MoeRouterConfig {
  int num_experts;       // n_routed_experts (256 DeepSeek-V3/R1, 384 Kimi-K2/K2.5)
  int top_k;             // num_experts_per_tok
  int n_group;           // expert groups (1: no grouping)
  int topk_group;        // groups kept per token
  bool softmax_scoring;  // false: sigmoid (V3), true: softmax (V2)
  bool norm_topk_prob;
  float routed_scaling_factor;
};

// OK when num_experts % n_group == 0, 1 <= topk_group <= n_group <= 32, and the kept groups hold
// at least top_k experts; num_experts <= 1024 and top_k <= 32 (the GPU kernel's limits).
absl::Status ValidateMoeRouterConfig(const MoeRouterConfig& config);

// logits [tokens, num_experts] fp32 (hidden @ gate^T, computed in fp32); bias [num_experts] or
// nullptr. Writes topk_ids [tokens, top_k] (expert indices, rank order) and topk_weights
// [tokens, top_k]. The config must pass ValidateMoeRouterConfig (aborts otherwise).
void MoeRouteRef(const MoeRouterConfig& config, const float* logits, const float* bias, int tokens,
                 int32_t* topk_ids, float* topk_weights);

// The router logits in fp32 from BF16 gate weights, as transformers computes them
// (F.linear(hidden.float(), weight.float())): logits[t][e] = sum_k hidden[t][k] * gate[e][k],
// summed in fp32 in ascending k. hidden [tokens, hidden_size] and gate [num_experts, hidden_size]
// are bf16 bit patterns.
void MoeRouterLogitsRef(const uint16_t* hidden_bf16, const uint16_t* gate_bf16, int tokens,
                        int hidden_size, int num_experts, float* logits);

}  // namespace mlaserve
