// The model's shape and numerics, read from a Hugging Face checkpoint folder's config.json
// (and hf_quant_config.json where present).
//
// Accepted: DeepseekV3ForCausalLM (model_type deepseek_v3, kimi_k2), DeepseekV2ForCausalLM
// (q_lora_rank null, softmax scoring), and Kimi-K2.5 (KimiK25ForConditionalGeneration: the text
// model under "text_config", tensors prefixed "language_model."). RoPE settings in both
// spellings: "rope_scaling" + top-level "rope_theta" (released checkpoints) and
// "rope_parameters" with "rope_theta" inside (transformers 5).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace mlaserve {

struct RopeConfig {
  double theta = 10000.0;
  bool interleaved = true;  // DeepSeek stores the rotary dims as pairs (x0,x1),(x2,x3),...
  // YaRN (rope_type "yarn"); absent means plain RoPE.
  bool yarn = false;
  double factor = 1.0;
  double original_max_position_embeddings = 0;
  double beta_fast = 32;
  double beta_slow = 1;
  double mscale = 0;          // 0 = not given
  double mscale_all_dim = 0;  // 0 = not given
  std::optional<double> attention_factor;
  bool truncate = true;
};

struct QuantConfig {
  // kNvfp4: ModelOpt NVFP4. kInt4Group: compressed-tensors "pack-quantized" INT4 weight-only,
  // symmetric, one scale per group_size columns (Kimi-K2 Thinking / K2.5). kFp8Block: DeepSeek's
  // FP8 release format (e4m3 weights, weight_block_size block scales). Formats in
  // kernels/moe/nvfp4_ref.h, kernels/linear/int4_group_ref.h, kernels/linear/fp8_block_ref.h.
  enum class Method { kNone, kNvfp4, kInt4Group, kFp8Block };
  Method method = Method::kNone;
  int group_size = 16;                 // kNvfp4: 16; kInt4Group: the config group's group_size
  bool symmetric = true;               // kInt4Group (only symmetric schemes are accepted)
  std::vector<int> weight_block_size;  // kFp8Block: [rows, cols] of one scale block
  bool kv_cache_fp8 = false;
  // Modules that stay unquantized. ModelOpt: fnmatch-style '*' / '?' patterns. compressed-tensors
  // ("ignore"): an entry "re:<regex>" matches a name the regex matches from its start (Python
  // re.match), any other entry only the identical name (compressed_tensors/utils/match.py,
  // _match_name).
  std::vector<std::string> exclude_modules;
  // True when `module` (e.g. "model.layers.3.self_attn.q_a_proj") matches an exclude entry.
  bool IsExcluded(const std::string& module) const;
};

struct ModelConfig {
  std::string architecture;  // as config.json names it
  std::string model_type;
  std::string tensor_prefix;  // "" or "language_model." (Kimi-K2.5)

  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;      // dense MLP
  int moe_intermediate_size = 0;  // one routed expert
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int q_lora_rank = 0;  // 0: no q compression (DeepSeek-V2-Lite)
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  float rms_norm_eps = 1e-6f;
  int max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;

  // MoE
  int n_routed_experts = 0;
  int n_shared_experts = 0;
  int num_experts_per_tok = 0;
  int n_group = 1;
  int topk_group = 1;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
  bool softmax_scoring = false;  // scoring_func "softmax" (V2); else sigmoid
  bool has_score_correction_bias = true;  // V3 "noaux_tc"
  int first_k_dense_replace = 0;
  int moe_layer_freq = 1;

  RopeConfig rope;
  QuantConfig quant;

  int bos_token_id = -1;
  std::vector<int> eos_token_ids;

  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool IsMoeLayer(int layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  // Softmax scale = qk_head_dim^-0.5 × mscale², mscale = 0.1·mscale_all_dim·ln(factor) + 1
  // under YaRN with mscale_all_dim given (transformers' yarn_apply_mscale; DeepSeek-V3: × 1.8284).
  double SoftmaxScale() const;
  // The factor YaRN multiplies cos and sin by (transformers' attention_factor).
  double RopeAttentionScaling() const;
  // Inverse frequencies, qk_rope_head_dim / 2 of them, as transformers computes them.
  std::vector<float> RopeInvFreq() const;
};

// Parses a config.json document (the folder's hf_quant_config.json, if any, as `hf_quant`).
absl::StatusOr<ModelConfig> ParseModelConfig(const nlohmann::json& config,
                                             const nlohmann::json* hf_quant = nullptr);
// Reads <folder>/config.json and <folder>/hf_quant_config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& folder);

}  // namespace mlaserve
