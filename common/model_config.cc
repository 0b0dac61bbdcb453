#include "common/model_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mlaserve {
namespace {

using json = nlohmann::json;

// fnmatch with '*' (any run) and '?' (one character), as ModelOpt's exclude lists use.
bool WildcardMatch(const std::string& pattern, const std::string& text) {
  size_t p = 0, t = 0, star = std::string::npos, mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == text[t])) {
      ++p;
      ++t;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = t;
    } else if (star != std::string::npos) {
      p = star + 1;
      t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

class Reader {
 public:
  Reader(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

  absl::Status status() const { return status_; }

  int Int(const char* key) {
    if (!j_.contains(key) || !j_[key].is_number_integer()) {
      Fail(absl::StrCat("missing integer field \"", key, "\""));
      return 0;
    }
    return j_[key].get<int>();
  }
  int IntOr(const char* key, int fallback) {
    if (!j_.contains(key) || j_[key].is_null()) return fallback;
    if (!j_[key].is_number_integer()) {
      Fail(absl::StrCat("field \"", key, "\" is not an integer"));
      return fallback;
    }
    return j_[key].get<int>();
  }
  double NumberOr(const char* key, double fallback) {
    if (!j_.contains(key) || j_[key].is_null()) return fallback;
    if (!j_[key].is_number()) {
      Fail(absl::StrCat("field \"", key, "\" is not a number"));
      return fallback;
    }
    return j_[key].get<double>();
  }
  bool BoolOr(const char* key, bool fallback) {
    if (!j_.contains(key) || j_[key].is_null()) return fallback;
    if (!j_[key].is_boolean()) {
      Fail(absl::StrCat("field \"", key, "\" is not a boolean"));
      return fallback;
    }
    return j_[key].get<bool>();
  }
  std::string StringOr(const char* key, const std::string& fallback) {
    if (!j_.contains(key) || j_[key].is_null()) return fallback;
    if (!j_[key].is_string()) {
      Fail(absl::StrCat("field \"", key, "\" is not a string"));
      return fallback;
    }
    return j_[key].get<std::string>();
  }
  void Fail(const std::string& msg) {
    if (status_.ok()) status_ = absl::InvalidArgumentError(absl::StrCat(where_, ": ", msg));
  }

 private:
  const json& j_;
  std::string where_;
  absl::Status status_;
};

double YarnMscale(double scale, double mscale) {
  if (scale <= 1) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

absl::Status ParseRope(const json& text, Reader& r, RopeConfig& rope, int max_positions) {
  // transformers 5 writes "rope_parameters" (theta inside); checkpoints write "rope_scaling" and
  // a top-level "rope_theta".
  const json* params = nullptr;
  if (text.contains("rope_parameters") && text["rope_parameters"].is_object()) {
    params = &text["rope_parameters"];
  } else if (text.contains("rope_scaling") && text["rope_scaling"].is_object()) {
    params = &text["rope_scaling"];
  }
  rope.theta = r.NumberOr("rope_theta", 10000.0);
  rope.interleaved = r.BoolOr("rope_interleave", true);
  if (params == nullptr) return absl::OkStatus();
  Reader p(*params, "config.json rope parameters");
  rope.theta = p.NumberOr("rope_theta", rope.theta);
  std::string type = p.StringOr("rope_type", p.StringOr("type", "default"));
  if (type == "default") return p.status();
  if (type != "yarn") {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: rope type \"", type, "\" is not supported (DeepSeek-V3 models use \"yarn\")"));
  }
  rope.yarn = true;
  rope.original_max_position_embeddings = p.NumberOr("original_max_position_embeddings", 0);
  if (rope.original_max_position_embeddings <= 0) {
    return absl::InvalidArgumentError(
        "config.json: yarn rope parameters need \"original_max_position_embeddings\"");
  }
  rope.factor = p.NumberOr("factor", max_positions / rope.original_max_position_embeddings);
  // transformers: `beta_fast or 32`, `beta_slow or 1`.
  rope.beta_fast = p.NumberOr("beta_fast", 0);
  if (rope.beta_fast == 0) rope.beta_fast = 32;
  rope.beta_slow = p.NumberOr("beta_slow", 0);
  if (rope.beta_slow == 0) rope.beta_slow = 1;
  rope.mscale = p.NumberOr("mscale", 0);
  rope.mscale_all_dim = p.NumberOr("mscale_all_dim", 0);
  if (params->contains("attention_factor") && !(*params)["attention_factor"].is_null()) {
    rope.attention_factor = p.NumberOr("attention_factor", 1.0);
  }
  rope.truncate = p.BoolOr("truncate", true);
  return p.status();
}

// DeepSeek-V3/R1: {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
// "activation_scheme": "dynamic"} (format: kernels/linear/fp8_block_ref.h). The activation scheme
// is how DeepSeek's own GEMMs quantize activations (per 128 columns, at run time); it does not
// change the weights, and mlaserve multiplies unquantized activations.
absl::Status ParseFp8Block(const json& qc, QuantConfig& q) {
  Reader r(qc, "quantization config (fp8)");
  q.method = QuantConfig::Method::kFp8Block;
  const std::string fmt = r.StringOr("fmt", "e4m3");
  if (!r.status().ok()) return r.status();
  if (fmt != "e4m3") {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantization config (fp8): fmt \"", fmt, "\" is not supported (expected \"e4m3\")"));
  }
  const std::string act = r.StringOr("activation_scheme", "dynamic");
  if (!r.status().ok()) return r.status();
  if (act != "dynamic") {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantization config (fp8): activation_scheme \"", act,
        "\" is not supported (expected \"dynamic\"; static activation scales are not read)"));
  }
  if (!qc.contains("weight_block_size")) {
    return absl::InvalidArgumentError(
        "quantization config (fp8): missing \"weight_block_size\" (per-tensor FP8 is not "
        "supported; DeepSeek's releases use [128, 128])");
  }
  const json& b = qc["weight_block_size"];
  if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
      b[0].get<int>() <= 0 || b[1].get<int>() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantization config (fp8): \"weight_block_size\" must be two positive integers, found ",
        b.dump()));
  }
  q.weight_block_size = {b[0].get<int>(), b[1].get<int>()};
  return absl::OkStatus();
}

// compressed-tensors (neuralmagic/compressed-tensors, quantization/quant_config.py and
// quant_args.py): {"quant_method": "compressed-tensors", "format": "pack-quantized",
// "quantization_status": "compressed", "config_groups": {"group_0": {"targets": ["Linear"],
// "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
// "symmetric": true, "dynamic": false, "actorder": null}, "input_activations": null}},
// "ignore": [...]}. Accepted: weight-only INT4 groups, symmetric, every group the same scheme
// (format: kernels/linear/int4_group_ref.h).
absl::Status ParseCompressedTensors(const json& qc, QuantConfig& q) {
  const std::string where = "quantization config (compressed-tensors)";
  Reader r(qc, where);
  const std::string format = r.StringOr("format", "");
  const std::string status = r.StringOr("quantization_status", "compressed");
  if (!r.status().ok()) return r.status();
  auto fail = [&](const std::string& msg) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", msg));
  };
  if (format != "pack-quantized") {
    return fail(absl::StrCat("format \"", format,
                             "\" is not supported (mlaserve reads \"pack-quantized\" INT4)"));
  }
  if (status != "compressed") {
    return fail(absl::StrCat("quantization_status \"", status,
                             "\" is not supported (expected \"compressed\": packed weights)"));
  }
  if (!qc.contains("config_groups") || !qc["config_groups"].is_object() ||
      qc["config_groups"].empty()) {
    return fail("missing \"config_groups\" (an object of quantization schemes)");
  }
  bool first = true;
  for (const auto& [name, group] : qc["config_groups"].items()) {
    const std::string gw = absl::StrCat("config_groups.", name);
    if (!group.is_object()) return fail(absl::StrCat(gw, " is not an object"));
    if (group.contains("format") && group["format"].is_string() &&
        group["format"].get<std::string>() != "pack-quantized") {
      return fail(absl::StrCat(gw, ".format \"", group["format"].get<std::string>(),
                               "\" is not supported (expected \"pack-quantized\")"));
    }
    for (const char* act : {"input_activations", "output_activations"}) {
      if (group.contains(act) && !group[act].is_null()) {
        return fail(absl::StrCat(gw, ".", act,
                                 " is set: activation quantization is not supported (mlaserve "
                                 "reads weight-only INT4)"));
      }
    }
    if (!group.contains("weights") || !group["weights"].is_object()) {
      return fail(absl::StrCat(gw, ".weights is missing or not an object"));
    }
    const json& w = group["weights"];
    Reader wr(w, absl::StrCat(where, ": ", gw, ".weights"));
    const int bits = wr.Int("num_bits");
    const std::string type = wr.StringOr("type", "int");
    const std::string strategy = wr.StringOr("strategy", "");
    const int gsize = wr.IntOr("group_size", 0);
    const bool symmetric = wr.BoolOr("symmetric", true);
    const bool dynamic = wr.BoolOr("dynamic", false);
    if (!wr.status().ok()) return wr.status();
    if (bits != 4) {
      return fail(absl::StrCat(gw, ".weights.num_bits ", bits, " is not supported (expected 4)"));
    }
    if (type != "int") {
      return fail(absl::StrCat(gw, ".weights.type \"", type,
                               "\" is not supported (expected \"int\")"));
    }
    if (strategy != "group") {
      return fail(absl::StrCat(gw, ".weights.strategy \"", strategy,
                               "\" is not supported (expected \"group\")"));
    }
    if (gsize <= 0) {
      return fail(absl::StrCat(gw, ".weights.group_size must be positive, found ", gsize));
    }
    if (!symmetric) {
      return fail(absl::StrCat(gw, ".weights.symmetric is false: zero points "
                                   "(weight_zero_point) are not supported"));
    }
    if (dynamic) return fail(absl::StrCat(gw, ".weights.dynamic is true (expected false)"));
    if (w.contains("actorder") && !w["actorder"].is_null()) {
      return fail(absl::StrCat(gw, ".weights.actorder is set: weight_g_idx column orders are "
                                   "not supported"));
    }
    if (!first && gsize != q.group_size) {
      return fail(absl::StrCat(gw, ".weights.group_size ", gsize, " differs from another group's ",
                               q.group_size, " (one scheme for every group is supported)"));
    }
    q.group_size = gsize;
    first = false;
  }
  q.method = QuantConfig::Method::kInt4Group;
  q.symmetric = true;
  if (qc.contains("ignore") && !qc["ignore"].is_null()) {
    if (!qc["ignore"].is_array()) return fail("\"ignore\" is not a list of module names");
    for (const auto& m : qc["ignore"]) {
      if (!m.is_string()) {
        return fail(absl::StrCat("\"ignore\" entry ", m.dump(), " is not a string"));
      }
      const std::string entry = m.get<std::string>();
      if (entry.rfind("re:", 0) == 0) {
        try {
          std::regex check(entry.substr(3));
        } catch (const std::regex_error&) {
          return fail(absl::StrCat("\"ignore\" entry \"", entry,
                                   "\" is not a valid regular expression"));
        }
      }
      q.exclude_modules.push_back(entry);
    }
  }
  return absl::OkStatus();
}

absl::Status ParseQuant(const json& root, const json& text, const json* hf_quant, QuantConfig& q) {
  // hf_quant_config.json: {"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8",
  //  "group_size": 16, "exclude_modules": [...]}}; newer exports: config.json
  //  "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": [...]}.
  const json* qc = nullptr;
  if (hf_quant != nullptr && hf_quant->contains("quantization")) {
    qc = &(*hf_quant)["quantization"];
  } else if (text.contains("quantization_config")) {
    qc = &text["quantization_config"];
  } else if (root.contains("quantization_config")) {
    qc = &root["quantization_config"];
  }
  if (qc == nullptr || qc->is_null()) return absl::OkStatus();
  if (!qc->is_object()) return absl::InvalidArgumentError("quantization config is not an object");
  Reader r(*qc, "quantization config");
  const std::string method = r.StringOr("quant_method", "modelopt");
  std::string algo = r.StringOr("quant_algo", "");
  if (method == "fp8") return ParseFp8Block(*qc, q);
  if (method == "compressed-tensors") return ParseCompressedTensors(*qc, q);
  if (method != "modelopt") {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantization method \"", method,
        "\" is not supported (mlaserve loads BF16, ModelOpt NVFP4, compressed-tensors INT4 "
        "pack-quantized and DeepSeek FP8 block-quantized checkpoints)"));
  }
  if (algo == "NVFP4") {
    q.method = QuantConfig::Method::kNvfp4;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "quant_algo \"", algo, "\" is not supported (mlaserve loads NVFP4 checkpoints)"));
  }
  q.group_size = r.IntOr("group_size", 16);
  if (q.group_size != 16) {
    return absl::InvalidArgumentError(absl::StrCat("NVFP4 group_size ", q.group_size, " (expected 16)"));
  }
  const std::string kv = r.StringOr("kv_cache_quant_algo", "");
  q.kv_cache_fp8 = kv == "FP8";
  for (const char* key : {"exclude_modules", "ignore"}) {
    if (qc->contains(key) && (*qc)[key].is_array()) {
      for (const auto& m : (*qc)[key]) {
        if (m.is_string()) q.exclude_modules.push_back(m.get<std::string>());
      }
    }
  }
  return r.status();
}

}  // namespace

bool QuantConfig::IsExcluded(const std::string& module) const {
  if (method == Method::kInt4Group) {
    for (const auto& entry : exclude_modules) {
      if (entry.rfind("re:", 0) == 0) {
        // Python's re.match: anchored at the start only.
        if (std::regex_search(module, std::regex(entry.substr(3)),
                              std::regex_constants::match_continuous)) {
          return true;
        }
      } else if (entry == module) {
        return true;
      }
    }
    return false;
  }
  for (const auto& pattern : exclude_modules) {
    if (WildcardMatch(pattern, module)) return true;
  }
  return false;
}

double ModelConfig::SoftmaxScale() const {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (rope.yarn && rope.mscale_all_dim != 0) {
    const double m = YarnMscale(rope.factor, rope.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

double ModelConfig::RopeAttentionScaling() const {
  if (!rope.yarn) return 1.0;
  if (rope.attention_factor) return *rope.attention_factor;
  if (rope.mscale != 0 && rope.mscale_all_dim != 0) {
    return YarnMscale(rope.factor, rope.mscale) / YarnMscale(rope.factor, rope.mscale_all_dim);
  }
  return YarnMscale(rope.factor, 1.0);
}

std::vector<float> ModelConfig::RopeInvFreq() const {
  // transformers modeling_rope_utils: default and _compute_yarn_parameters. pos_freqs is computed
  // in fp32 there (base ** (arange(0, dim, 2) / dim)); we follow its float steps.
  const int dim = qk_rope_head_dim;
  const int half = dim / 2;
  std::vector<float> inv(half);
  std::vector<float> pos_freqs(half);
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    pos_freqs[i] = std::pow(static_cast<float>(rope.theta), exponent);
  }
  if (!rope.yarn) {
    for (int i = 0; i < half; ++i) inv[i] = 1.0f / pos_freqs[i];
    return inv;
  }
  const double base = rope.theta;
  auto correction_dim = [&](double rotations) {
    return (dim * std::log(rope.original_max_position_embeddings / (rotations * 2 * M_PI))) /
           (2 * std::log(base));
  };
  double low = correction_dim(rope.beta_fast);
  double high = correction_dim(rope.beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // transformers: prevent singularity
  for (int i = 0; i < half; ++i) {
    const float extrapolation = 1.0f / pos_freqs[i];
    const float interpolation = 1.0f / (static_cast<float>(rope.factor) * pos_freqs[i]);
    float ramp = (static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low);
    ramp = std::clamp(ramp, 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    inv[i] = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  return inv;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const json& root, const json* hf_quant) {
  if (!root.is_object()) return absl::InvalidArgumentError("config.json is not a JSON object");
  ModelConfig c;
  std::string arch;
  if (root.contains("architectures") && root["architectures"].is_array() &&
      !root["architectures"].empty() && root["architectures"][0].is_string()) {
    arch = root["architectures"][0].get<std::string>();
  }
  c.architecture = arch;
  // json::value() throws on a field of another type: a non-string model_type is an error.
  for (const json* j : {&root, root.contains("text_config") ? &root["text_config"] : &root}) {
    if (j->is_object() && j->contains("model_type") && !(*j)["model_type"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: \"model_type\" is not a string: ",
                                                     (*j)["model_type"].dump()));
    }
  }
  c.model_type = root.value("model_type", "");
  const json* text = &root;
  if (root.contains("text_config") && root["text_config"].is_object()) {
    // Kimi-K2.5 (and other multimodal wrappers): the language model's config is nested, and its
    // tensors carry the "language_model." prefix.
    text = &root["text_config"];
    c.tensor_prefix = "language_model.";
  }
  const std::string text_type = text->value("model_type", c.model_type);
  const bool v2 = arch == "DeepseekV2ForCausalLM" || text_type == "deepseek_v2";
  const bool v3 = arch == "DeepseekV3ForCausalLM" || text_type == "deepseek_v3" ||
                  text_type == "kimi_k2" || arch == "KimiK25ForConditionalGeneration";
  if (!v2 && !v3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: unsupported architecture \"", arch, "\" (model_type \"", c.model_type,
        "\"); mlaserve runs DeepseekV3ForCausalLM, DeepseekV2ForCausalLM, Kimi-K2 and Kimi-K2.5"));
  }
  Reader r(*text, c.tensor_prefix.empty() ? "config.json" : "config.json text_config");
  c.vocab_size = r.Int("vocab_size");
  c.hidden_size = r.Int("hidden_size");
  c.intermediate_size = r.Int("intermediate_size");
  c.num_hidden_layers = r.Int("num_hidden_layers");
  c.num_attention_heads = r.Int("num_attention_heads");
  c.kv_lora_rank = r.Int("kv_lora_rank");
  c.q_lora_rank = r.IntOr("q_lora_rank", 0);
  c.qk_nope_head_dim = r.Int("qk_nope_head_dim");
  c.qk_rope_head_dim = r.Int("qk_rope_head_dim");
  c.v_head_dim = r.Int("v_head_dim");
  c.rms_norm_eps = static_cast<float>(r.NumberOr("rms_norm_eps", 1e-6));
  c.max_position_embeddings = r.IntOr("max_position_embeddings", 4096);
  c.tie_word_embeddings = r.BoolOr("tie_word_embeddings", false);
  c.attention_bias = r.BoolOr("attention_bias", false);
  c.n_routed_experts = r.IntOr("n_routed_experts", 0);
  if (c.n_routed_experts > 0) {
    c.moe_intermediate_size = r.Int("moe_intermediate_size");
    c.num_experts_per_tok = r.Int("num_experts_per_tok");
  }
  c.n_shared_experts = r.IntOr("n_shared_experts", 0);
  c.n_group = r.IntOr("n_group", 1);
  c.topk_group = r.IntOr("topk_group", 1);
  c.norm_topk_prob = r.BoolOr("norm_topk_prob", !v2);
  c.routed_scaling_factor = static_cast<float>(r.NumberOr("routed_scaling_factor", 1.0));
  c.first_k_dense_replace = r.IntOr("first_k_dense_replace", 0);
  c.moe_layer_freq = r.IntOr("moe_layer_freq", 1);
  const std::string scoring = r.StringOr("scoring_func", v2 ? "softmax" : "sigmoid");
  if (scoring != "softmax" && scoring != "sigmoid") {
    r.Fail(absl::StrCat("scoring_func \"", scoring, "\" is not softmax or sigmoid"));
  }
  c.softmax_scoring = scoring == "softmax";
  const std::string topk_method = r.StringOr("topk_method", v2 ? "greedy" : "noaux_tc");
  c.has_score_correction_bias = topk_method == "noaux_tc";
  if (topk_method == "greedy") c.n_group = c.topk_group = 1;  // V2 "greedy": no group limit
  c.bos_token_id = r.IntOr("bos_token_id", -1);
  if (text->contains("eos_token_id")) {
    const json& e = (*text)["eos_token_id"];
    if (e.is_number_integer()) c.eos_token_ids.push_back(e.get<int>());
    if (e.is_array()) {
      for (const auto& x : e) {
        if (x.is_number_integer()) c.eos_token_ids.push_back(x.get<int>());
      }
    }
  }
  if (!r.status().ok()) return r.status();
  if (auto s = ParseRope(*text, r, c.rope, c.max_position_embeddings); !s.ok()) return s;
  if (!r.status().ok()) return r.status();
  if (auto s = ParseQuant(root, *text, hf_quant, c.quant); !s.ok()) return s;

  // Shape checks that the model code relies on.
  auto positive = [&](int v, const char* name) -> absl::Status {
    if (v <= 0) return absl::InvalidArgumentError(absl::StrCat("config.json: ", name, " must be positive, found ", v));
    return absl::OkStatus();
  };
  // And bounded: every size below is allocated from (RoPE tables, norms, the CPU model), so a
  // corrupt value must be an error, not a multi-gigabyte allocation (fuzz/model_config_fuzzer
  // found qk_rope_head_dim 481119564 taking 1.9 GB in RopeInvFreq). The bounds sit far above
  // every DeepSeek-V3-architecture model (vocab 163,840; hidden 7,168; 61 layers; 128 heads).
  constexpr int kMaxVocab = 1 << 24, kMaxDim = 1 << 20, kMaxLayers = 1 << 12;
  for (auto [v, name, most] : std::initializer_list<std::tuple<int, const char*, int>>{
           {c.vocab_size, "vocab_size", kMaxVocab},
           {c.hidden_size, "hidden_size", kMaxDim},
           {c.intermediate_size, "intermediate_size", kMaxDim},
           {c.num_hidden_layers, "num_hidden_layers", kMaxLayers},
           {c.num_attention_heads, "num_attention_heads", kMaxLayers},
           {c.kv_lora_rank, "kv_lora_rank", kMaxDim},
           {c.qk_nope_head_dim, "qk_nope_head_dim", kMaxDim},
           {c.qk_rope_head_dim, "qk_rope_head_dim", kMaxDim},
           {c.v_head_dim, "v_head_dim", kMaxDim}}) {
    if (auto s = positive(v, name); !s.ok()) return s;
    if (v > most) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: ", name, " ", v, " exceeds ", most, " (a corrupt config?)"));
    }
  }
  // The optional sizes (0 where absent): not negative, and bounded as above.
  for (auto [v, name, most] : std::initializer_list<std::tuple<int, const char*, int>>{
           {c.q_lora_rank, "q_lora_rank", kMaxDim},
           {c.n_routed_experts, "n_routed_experts", kMaxDim},
           {c.moe_intermediate_size, "moe_intermediate_size", kMaxDim},
           {c.n_shared_experts, "n_shared_experts", kMaxLayers}}) {
    if (v < 0 || v > most) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: ", name, " ", v, " is outside 0..", most));
    }
  }
  if (c.qk_rope_head_dim % 2 != 0) return absl::InvalidArgumentError("config.json: qk_rope_head_dim must be even");
  if (c.n_routed_experts > 0) {
    if (c.n_group <= 0 || c.n_routed_experts % c.n_group != 0) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: n_routed_experts ", c.n_routed_experts,
                                                     " is not divisible by n_group ", c.n_group));
    }
    if (c.topk_group <= 0 || c.topk_group > c.n_group) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: topk_group ", c.topk_group,
                                                     " must be in 1..n_group (", c.n_group, ")"));
    }
    if (c.num_experts_per_tok <= 0 ||
        c.num_experts_per_tok > c.topk_group * (c.n_routed_experts / c.n_group)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: num_experts_per_tok ", c.num_experts_per_tok,
          " exceeds the experts of the selected groups"));
    }
    if (c.n_group > 1 && c.n_routed_experts / c.n_group < 2 && !c.softmax_scoring) {
      return absl::InvalidArgumentError("config.json: grouped routing needs at least 2 experts per group");
    }
  }
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& folder) {
  namespace fs = std::filesystem;
  const fs::path config_path = fs::path(folder) / "config.json";
  std::ifstream in(config_path);
  if (!in) return absl::NotFoundError(absl::StrCat(config_path.string(), ": cannot open (is ", folder, " a model folder?)"));
  json config = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(config_path.string(), ": not valid JSON"));
  json quant;
  const fs::path quant_path = fs::path(folder) / "hf_quant_config.json";
  bool has_quant = false;
  if (fs::exists(quant_path)) {
    std::ifstream qin(quant_path);
    quant = json::parse(qin, nullptr, /*allow_exceptions=*/false);
    if (quant.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(quant_path.string(), ": not valid JSON"));
    has_quant = true;
  }
  auto c = ParseModelConfig(config, has_quant ? &quant : nullptr);
  if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat(folder, ": ", c.status().message()));
  return c;
}

}  // namespace mlaserve
