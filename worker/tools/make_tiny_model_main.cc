// mlaserve-make-tiny-model: writes the project's embedded default model, a small DeepSeek-V3
// with random weights and DeepSeek-V3's real tokenizer, so that every part of the server runs
// end to end on a machine with no checkpoint (its text is gibberish: the weights are random).
//
//   mlaserve-make-tiny-model --tokenizer-dir DIR --out DIR [--seed N]
//
// Shape: MLA with the real dims (kv_lora_rank 512, rope 64), 4 heads, hidden 128, 4 layers
// (the first dense), 16 routed experts in 4 groups, top-4, one shared expert, YaRN as
// DeepSeek-V3. Weights bf16, normal(0, 0.05) (norms 1, router bias uniform [0, 0.1]).
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/command_line.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, tokenizer_dir, "",
          "Folder with DeepSeek-V3's tokenizer.json and tokenizer_config.json; required.");
ABSL_FLAG(std::string, out, "", "The model folder to write; required.");
ABSL_FLAG(uint64_t, seed, 20261129, "Seed of the random weights.");

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

int Fail(const std::string& msg) {
  std::fprintf(stderr, "mlaserve-make-tiny-model: %s\n", msg.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mlaserve;
  ParseFlags(argc, argv, "mlaserve-make-tiny-model --tokenizer-dir DIR --out DIR [--seed N]");
  const std::string tok_dir = RequiredFlag(FLAGS_tokenizer_dir, "DIR");
  const std::string out = RequiredFlag(FLAGS_out, "DIR");
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  std::ifstream tok_config_in(fs::path(tok_dir) / "tokenizer_config.json");
  if (!fs::exists(fs::path(tok_dir) / "tokenizer.json") || !tok_config_in) {
    return Fail(tok_dir + " has no tokenizer.json and tokenizer_config.json (run scripts/install_deps.sh)");
  }
  const int vocab = 129280, hidden = 128, inter = 256, moe_inter = 64, layers = 4, heads = 4;
  const int q_lora = 96, kv_lora = 512, nope = 32, rope = 64, v = 32, experts = 16;
  json config = {
      {"architectures", {"DeepseekV3ForCausalLM"}}, {"model_type", "deepseek_v3"},
      {"vocab_size", vocab}, {"hidden_size", hidden}, {"intermediate_size", inter},
      {"moe_intermediate_size", moe_inter}, {"num_hidden_layers", layers},
      {"num_attention_heads", heads}, {"num_key_value_heads", heads}, {"n_shared_experts", 1},
      {"n_routed_experts", experts}, {"num_experts_per_tok", 4}, {"n_group", 4},
      {"topk_group", 2}, {"routed_scaling_factor", 2.5}, {"norm_topk_prob", true},
      {"first_k_dense_replace", 1}, {"moe_layer_freq", 1}, {"topk_method", "noaux_tc"},
      {"scoring_func", "sigmoid"}, {"q_lora_rank", q_lora}, {"kv_lora_rank", kv_lora},
      {"qk_nope_head_dim", nope}, {"qk_rope_head_dim", rope}, {"v_head_dim", v},
      {"hidden_act", "silu"}, {"max_position_embeddings", 163840}, {"rms_norm_eps", 1e-6},
      {"rope_theta", 10000},
      {"rope_scaling", {{"type", "yarn"}, {"factor", 40}, {"original_max_position_embeddings", 4096},
                        {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}}},
      {"tie_word_embeddings", false}, {"bos_token_id", 0}, {"eos_token_id", 1}};
  fs::create_directories(out);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::uniform_real_distribution<float> uniform(0.0f, 0.1f);
  struct Spec {
    std::string name;
    std::vector<int64_t> shape;
    char kind;  // 'w' normal, 'n' ones, 'b' bias (fp32)
  };
  std::vector<Spec> specs = {{"model.embed_tokens.weight", {vocab, hidden}, 'w'},
                             {"model.norm.weight", {hidden}, 'n'},
                             {"lm_head.weight", {vocab, hidden}, 'w'}};
  for (int l = 0; l < layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const std::string a = p + "self_attn.";
    for (const Spec& s : std::vector<Spec>{
             {p + "input_layernorm.weight", {hidden}, 'n'},
             {p + "post_attention_layernorm.weight", {hidden}, 'n'},
             {a + "q_a_proj.weight", {q_lora, hidden}, 'w'},
             {a + "q_a_layernorm.weight", {q_lora}, 'n'},
             {a + "q_b_proj.weight", {heads * (nope + rope), q_lora}, 'w'},
             {a + "kv_a_proj_with_mqa.weight", {kv_lora + rope, hidden}, 'w'},
             {a + "kv_a_layernorm.weight", {kv_lora}, 'n'},
             {a + "kv_b_proj.weight", {heads * (nope + v), kv_lora}, 'w'},
             {a + "o_proj.weight", {hidden, heads * v}, 'w'}}) {
      specs.push_back(s);
    }
    const std::string m = p + "mlp.";
    if (l == 0) {
      specs.push_back({m + "gate_proj.weight", {inter, hidden}, 'w'});
      specs.push_back({m + "up_proj.weight", {inter, hidden}, 'w'});
      specs.push_back({m + "down_proj.weight", {hidden, inter}, 'w'});
      continue;
    }
    specs.push_back({m + "gate.weight", {experts, hidden}, 'w'});
    specs.push_back({m + "gate.e_score_correction_bias", {experts}, 'b'});
    for (const char* proj : {"gate_proj", "up_proj"}) {
      specs.push_back({absl::StrCat(m, "shared_experts.", proj, ".weight"), {moe_inter, hidden}, 'w'});
    }
    specs.push_back({m + "shared_experts.down_proj.weight", {hidden, moe_inter}, 'w'});
    for (int e = 0; e < experts; ++e) {
      const std::string ex = absl::StrCat(m, "experts.", e, ".");
      specs.push_back({ex + "gate_proj.weight", {moe_inter, hidden}, 'w'});
      specs.push_back({ex + "up_proj.weight", {moe_inter, hidden}, 'w'});
      specs.push_back({ex + "down_proj.weight", {hidden, moe_inter}, 'w'});
    }
  }
  SafetensorsStreamWriter writer((fs::path(out) / "model.safetensors").string());
  for (const Spec& s : specs) {
    if (auto st = writer.Declare(s.name, s.kind == 'b' ? DType::kF32 : DType::kBF16, s.shape); !st.ok()) {
      return Fail(std::string(st.message()));
    }
  }
  writer.SetMetadata({{"format", "pt"}});
  if (auto st = writer.Begin(); !st.ok()) return Fail(std::string(st.message()));
  for (const Spec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    std::vector<uint8_t> bytes;
    if (s.kind == 'b') {
      bytes.resize(n * 4);
      for (int64_t i = 0; i < n; ++i) {
        const float x = uniform(rng);
        std::memcpy(&bytes[i * 4], &x, 4);
      }
    } else {
      bytes.resize(n * 2);
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t x = FloatToBf16(s.kind == 'n' ? 1.0f : normal(rng));
        std::memcpy(&bytes[i * 2], &x, 2);
      }
    }
    if (auto st = writer.Append(bytes); !st.ok()) return Fail(std::string(st.message()));
  }
  if (auto st = writer.Finish(); !st.ok()) return Fail(std::string(st.message()));
  std::ofstream(fs::path(out) / "config.json") << config.dump(2) << "\n";
  std::error_code ec;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    fs::copy_file(fs::path(tok_dir) / f, fs::path(out) / f, fs::copy_options::overwrite_existing, ec);
    if (ec) return Fail(absl::StrCat("copy ", f, ": ", ec.message()));
  }
  std::printf("wrote %s (%zu tensors)\n", out.c_str(), specs.size());
  return 0;
}
