// config.json parsing: the released checkpoints' configs (values as their vendors publish them),
// the transformers-written fixtures (checked against transformers' own softmax scale, RoPE
// scaling and inverse frequencies), and clear errors for what we do not run.
#include "common/model_config.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/safetensors.h"
#include "gtest/gtest.h"

namespace mlaserve {
namespace {

using json = nlohmann::json;

// DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3), trimmed to the fields a loader reads.
const char* kDeepSeekV3 = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
  "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
  "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
  "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
  "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
  "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
  "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
  "first_k_dense_replace": 3, "norm_topk_prob": true, "scoring_func": "sigmoid",
  "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
  "rope_theta": 10000,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
  "tie_word_embeddings": false, "bos_token_id": 0, "eos_token_id": 1,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]}
})";

// DeepSeek-V2-Lite: no q_lora, softmax scoring, greedy top-k, mscale 0.707.
const char* kDeepSeekV2Lite = R"({
  "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
  "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
  "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
  "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0,
  "kv_lora_rank": 512, "q_lora_rank": null, "qk_rope_head_dim": 64, "v_head_dim": 128,
  "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
  "num_experts_per_tok": 6, "first_k_dense_replace": 1, "norm_topk_prob": false,
  "scoring_func": "softmax", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
  "rope_theta": 10000,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                   "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"}
})";

// Kimi-K2.5 layout: the DeepSeek-V3-shaped text model nested under text_config (Kimi-K2 values).
const char* kKimiK25 = R"({
  "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
  "text_config": {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "n_shared_experts": 1, "n_routed_experts": 384, "routed_scaling_factor": 2.827,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "norm_topk_prob": true,
    "scoring_func": "sigmoid", "max_position_embeddings": 262144, "rms_norm_eps": 1e-05,
    "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "bos_token_id": 163584, "eos_token_id": 163585
  },
  "vision_config": {"hidden_size": 1152}
})";

// An NVFP4 export as nvidia's ModelOpt writes hf_quant_config.json.
const char* kNvfp4Quant = R"({
  "producer": {"name": "modelopt", "version": "0.35.0"},
  "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                   "exclude_modules": ["lm_head", "model.layers.*.self_attn*",
                                       "model.layers.*.mlp.gate", "*shared_experts*",
                                       "model.layers.0.mlp*"]}
})";

TEST(ModelConfigTest, DeepSeekV3) {
  auto c = ParseModelConfig(json::parse(kDeepSeekV3));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 7168);
  EXPECT_EQ(c->q_lora_rank, 1536);
  EXPECT_EQ(c->n_group, 8);
  EXPECT_EQ(c->topk_group, 4);
  EXPECT_FALSE(c->softmax_scoring);
  EXPECT_TRUE(c->has_score_correction_bias);
  EXPECT_FALSE(c->IsMoeLayer(2));
  EXPECT_TRUE(c->IsMoeLayer(3));
  EXPECT_TRUE(c->rope.yarn);
  EXPECT_EQ(c->tensor_prefix, "");
  EXPECT_EQ(c->quant.method, QuantConfig::Method::kFp8Block);
  // DESIGN.md: 192^-0.5 * (0.1 * 1.0 * ln 40 + 1)^2 ≈ 0.13523.
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c->SoftmaxScale(), m * m / std::sqrt(192.0), 1e-12);
  EXPECT_NEAR(c->SoftmaxScale(), 0.13523, 5e-6);
  EXPECT_DOUBLE_EQ(c->RopeAttentionScaling(), 1.0);  // mscale / mscale_all_dim
  EXPECT_EQ(c->RopeInvFreq().size(), 32u);
}

TEST(ModelConfigTest, DeepSeekV2Lite) {
  auto c = ParseModelConfig(json::parse(kDeepSeekV2Lite));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->q_lora_rank, 0);
  EXPECT_TRUE(c->softmax_scoring);
  EXPECT_FALSE(c->has_score_correction_bias);
  EXPECT_FALSE(c->norm_topk_prob);
  const double m = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c->SoftmaxScale(), m * m / std::sqrt(192.0), 1e-12);
}

TEST(ModelConfigTest, KimiK25NestedTextConfigAndPrefix) {
  auto c = ParseModelConfig(json::parse(kKimiK25));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tensor_prefix, "language_model.");
  EXPECT_EQ(c->n_routed_experts, 384);
  EXPECT_EQ(c->num_attention_heads, 64);
  EXPECT_FLOAT_EQ(c->routed_scaling_factor, 2.827f);
  EXPECT_DOUBLE_EQ(c->rope.theta, 50000.0);
  EXPECT_DOUBLE_EQ(c->rope.beta_fast, 1.0);
  EXPECT_EQ(c->bos_token_id, 163584);
  ASSERT_EQ(c->eos_token_ids.size(), 1u);
  EXPECT_EQ(c->eos_token_ids[0], 163585);
}

TEST(ModelConfigTest, Nvfp4ExcludeWildcards) {
  json quant = json::parse(kNvfp4Quant);
  auto c = ParseModelConfig(json::parse(kDeepSeekV3), &quant);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->quant.method, QuantConfig::Method::kNvfp4);
  EXPECT_TRUE(c->quant.kv_cache_fp8);
  EXPECT_TRUE(c->quant.IsExcluded("lm_head"));
  EXPECT_TRUE(c->quant.IsExcluded("model.layers.7.self_attn.q_a_proj"));
  EXPECT_TRUE(c->quant.IsExcluded("model.layers.7.mlp.gate"));
  EXPECT_TRUE(c->quant.IsExcluded("model.layers.7.mlp.shared_experts.down_proj"));
  EXPECT_TRUE(c->quant.IsExcluded("model.layers.0.mlp.down_proj"));
  EXPECT_FALSE(c->quant.IsExcluded("model.layers.7.mlp.experts.3.down_proj"));
  EXPECT_FALSE(c->quant.IsExcluded("model.layers.7.mlp.gate_up"));
  // Newer exports: quantization_config in config.json with "ignore".
  json cfg = json::parse(kDeepSeekV3);
  cfg["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"},
                                {"ignore", {"lm_head", "*self_attn*"}}};
  auto c2 = ParseModelConfig(cfg);
  ASSERT_TRUE(c2.ok()) << c2.status();
  EXPECT_EQ(c2->quant.method, QuantConfig::Method::kNvfp4);
  EXPECT_TRUE(c2->quant.IsExcluded("model.layers.1.self_attn.kv_b_proj"));
}

TEST(ModelConfigTest, ClearErrors) {
  json llama = json::parse(R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})");
  auto a = ParseModelConfig(llama);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(std::string(a.status().message()).find("unsupported architecture \"LlamaForCausalLM\""),
            std::string::npos);
  json missing = json::parse(kDeepSeekV3);
  missing.erase("kv_lora_rank");
  auto b = ParseModelConfig(missing);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(std::string(b.status().message()).find("missing integer field \"kv_lora_rank\""),
            std::string::npos);
  json wrong = json::parse(kDeepSeekV3);
  wrong["hidden_size"] = "big";
  EXPECT_FALSE(ParseModelConfig(wrong).ok());
  json groups = json::parse(kDeepSeekV3);
  groups["n_group"] = 7;
  EXPECT_NE(std::string(ParseModelConfig(groups).status().message()).find("not divisible"),
            std::string::npos);
  json rope = json::parse(kDeepSeekV3);
  rope["rope_scaling"]["type"] = "longrope";
  EXPECT_FALSE(ParseModelConfig(rope).ok());
  json quant = json::parse(kDeepSeekV3);
  quant["quantization_config"] = {{"quant_method", "gptq"}};
  EXPECT_FALSE(ParseModelConfig(quant).ok());
  EXPECT_EQ(LoadModelConfig("/nonexistent/model").status().code(), absl::StatusCode::kNotFound);
}

// The fixtures were written by transformers 5 (rope_parameters spelling); their golden file
// records transformers' softmax scale, RoPE attention scaling and inverse frequencies.
class FixtureConfigTest : public ::testing::TestWithParam<const char*> {};

TEST_P(FixtureConfigTest, MatchesTransformers) {
  const std::string dir =
      std::string(std::getenv("MLASERVE_SOURCE_DIR")) + "/tests/fixtures/models/" + GetParam();
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  auto golden = SafetensorsFile::Open(dir + "/golden.safetensors");
  ASSERT_TRUE(golden.ok()) << golden.status();
  const double scale = std::stod((*golden)->metadata().at("softmax_scale"));
  const double attn = std::stod((*golden)->metadata().at("rope_attention_scaling"));
  EXPECT_NEAR(c->SoftmaxScale(), scale, 1e-12 * scale);
  EXPECT_NEAR(c->RopeAttentionScaling(), attn, 1e-12);
  const TensorInfo* inv = (*golden)->Find("rope.inv_freq");
  ASSERT_NE(inv, nullptr);
  const auto bytes = (*golden)->Data(*inv);
  const std::vector<float> ours = c->RopeInvFreq();
  ASSERT_EQ(ours.size() * 4, bytes.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    float want;
    std::memcpy(&want, bytes.data() + 4 * i, 4);
    // Same float steps as transformers; allow 2 ulp for pow/log implementations.
    EXPECT_NEAR(ours[i], want, 2.5e-7f * std::fabs(want)) << i;
  }
}

// Found by fuzz/model_config_fuzzer: a qk_rope_head_dim of 481119564 passed validation and
// RopeInvFreq allocated 1.9 GB for it; shape fields are bounded now.
TEST(ModelConfigTest, AbsurdSizesAreErrors) {
  for (const char* field : {"qk_rope_head_dim", "hidden_size", "kv_lora_rank", "vocab_size",
                            "num_hidden_layers", "num_attention_heads"}) {
    json big = json::parse(kDeepSeekV3);
    big[field] = 481119564;
    auto c = ParseModelConfig(big);
    ASSERT_FALSE(c.ok()) << field;
    EXPECT_NE(c.status().message().find(std::string(field) + " 481119564 exceeds"),
              std::string::npos)
        << c.status();
  }
  for (const char* field : {"q_lora_rank", "n_routed_experts", "moe_intermediate_size"}) {
    json bad = json::parse(kDeepSeekV3);
    bad[field] = -3;
    auto c = ParseModelConfig(bad);
    ASSERT_FALSE(c.ok()) << field;
    EXPECT_NE(c.status().message().find(std::string(field) + " -3 is outside"), std::string::npos)
        << c.status();
  }
}

// Found by fuzz/model_config_fuzzer: a model_type of another type threw json::type_error out of
// ParseModelConfig (a crash at load) instead of returning an error.
TEST(ModelConfigTest, NonStringModelTypeIsAnError) {
  for (const char* where : {"", "text_config"}) {
    json config = json::parse(kDeepSeekV3);
    if (*where) {
      config["text_config"] = json::parse(kDeepSeekV3);
      config["text_config"]["model_type"] = 512;
    } else {
      config["model_type"] = 512;
    }
    auto c = ParseModelConfig(config);
    ASSERT_FALSE(c.ok()) << where;
    EXPECT_NE(c.status().message().find("\"model_type\" is not a string: 512"), std::string::npos)
        << c.status();
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureConfigTest,
                         ::testing::Values("dsv3-tiny", "kimi-tiny", "noqlora-tiny"));

}  // namespace
}  // namespace mlaserve
