#include "worker/model/nvfp4_quantizer.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "kernels/moe/nvfp4_ref.h"
#include "nlohmann/json.hpp"

namespace mlaserve {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// "model.layers.7.mlp.experts.3.down_proj" for a routed expert's weight, else "".
std::string ExpertModule(const std::string& name, const std::string& prefix) {
  if (!absl::EndsWith(name, ".weight")) return "";
  const std::string module = name.substr(0, name.size() - 7);
  if (module.find(".mlp.experts.") == std::string::npos) return "";
  if (!module.starts_with(prefix)) return "";
  return module;
}

absl::StatusOr<json> ReadJson(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  json j = json::parse(in, nullptr, false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not valid JSON"));
  return j;
}

absl::Status WriteJson(const fs::path& path, const json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) return absl::DataLossError(absl::StrCat(path.string(), ": write failed"));
  return absl::OkStatus();
}

std::vector<float> ToFloat(const TensorInfo& info, std::span<const uint8_t> bytes) {
  std::vector<float> out(info.NumElements());
  DecodeFloats(info.dtype, bytes.data(), out.size(), out.data());
  return out;
}

}  // namespace

absl::Status QuantizeCheckpointToNvfp4(const std::string& in_dir, const std::string& out_dir,
                                       const QuantizeOptions& options) {
  auto config_json = ReadJson(fs::path(in_dir) / "config.json");
  if (!config_json.ok()) return config_json.status();
  auto config = ParseModelConfig(*config_json);
  if (!config.ok()) return absl::Status(config.status().code(), absl::StrCat(in_dir, ": ", config.status().message()));
  if (config->quant.method != QuantConfig::Method::kNone) {
    return absl::InvalidArgumentError(absl::StrCat(in_dir, ": already quantized; give a BF16 or FP32 checkpoint"));
  }
  std::error_code ec;
  if (fs::equivalent(in_dir, out_dir, ec)) return absl::InvalidArgumentError("--out must differ from --in");
  fs::create_directories(out_dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat(out_dir, ": cannot create: ", ec.message()));

  QuantConfig qc;
  qc.exclude_modules = options.exclude_modules;
  // Which source files hold which tensors: mirror them, shard for shard.
  std::map<std::string, std::vector<std::string>> file_tensors;  // file name -> tensor names
  const fs::path index_path = fs::path(in_dir) / "model.safetensors.index.json";
  if (fs::exists(index_path)) {
    auto index = ReadJson(index_path);
    if (!index.ok()) return index.status();
    for (auto it = (*index)["weight_map"].begin(); it != (*index)["weight_map"].end(); ++it) {
      file_tensors[it.value().get<std::string>()].push_back(it.key());
    }
  } else {
    for (const auto& e : fs::directory_iterator(in_dir)) {
      const std::string n = e.path().filename().string();
      if (e.path().extension() == ".safetensors" && n.rfind("model", 0) == 0) file_tensors[n] = {};
    }
  }
  if (file_tensors.empty()) return absl::NotFoundError(absl::StrCat(in_dir, ": no model safetensors files"));

  size_t total = 0, done = 0;
  std::vector<std::unique_ptr<SafetensorsFile>> inputs;
  for (auto& [file, names] : file_tensors) {
    auto f = SafetensorsFile::Open((fs::path(in_dir) / file).string());
    if (!f.ok()) return f.status();
    total += (*f)->tensors().size();
    inputs.push_back(std::move(*f));
  }
  json weight_map = json::object();
  size_t file_index = 0;
  for (auto& [file, names] : file_tensors) {
    SafetensorsFile& in = *inputs[file_index++];
    // Tensors in offset order, so that the input is read front to back.
    std::vector<const TensorInfo*> order;
    for (const auto& t : in.tensors()) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
    SafetensorsStreamWriter writer((fs::path(out_dir) / file).string());
    std::map<std::string, std::string> meta = in.metadata();
    meta["format"] = "pt";
    writer.SetMetadata(meta);
    auto quantize = [&](const TensorInfo& t) {
      const std::string module = ExpertModule(t.name, config->tensor_prefix);
      if (module.empty() || t.shape.size() != 2 || t.shape[1] % kNvfp4BlockSize != 0) return false;
      if (t.dtype != DType::kBF16 && t.dtype != DType::kF32 && t.dtype != DType::kF16) return false;
      return !qc.IsExcluded(module.substr(config->tensor_prefix.size()));
    };
    for (const TensorInfo* t : order) {
      if (quantize(*t)) {
        const std::string module = t->name.substr(0, t->name.size() - 7);
        if (auto s = writer.Declare(t->name, DType::kU8, {t->shape[0], t->shape[1] / 2}); !s.ok()) return s;
        if (auto s = writer.Declare(module + ".weight_scale", DType::kF8E4M3, {t->shape[0], t->shape[1] / 16}); !s.ok()) return s;
        if (auto s = writer.Declare(module + ".weight_scale_2", DType::kF32, {}); !s.ok()) return s;
        weight_map[module + ".weight_scale"] = file;
        weight_map[module + ".weight_scale_2"] = file;
      } else {
        if (auto s = writer.Declare(t->name, t->dtype, t->shape); !s.ok()) return s;
      }
      weight_map[t->name] = file;
    }
    if (auto s = writer.Begin(); !s.ok()) return s;
    for (const TensorInfo* t : order) {
      const bool q = quantize(*t);
      if (q) {
        const int rows = static_cast<int>(t->shape[0]), cols = static_cast<int>(t->shape[1]);
        const std::vector<float> w = ToFloat(*t, in.Data(*t));
        std::vector<uint8_t> packed(static_cast<size_t>(rows) * cols / 2, 0), scale(static_cast<size_t>(rows) * cols / 16);
        float global = 0.0f;
        QuantizeNvfp4(w.data(), rows, cols, packed.data(), scale.data(), &global);
        uint8_t g[4];
        std::memcpy(g, &global, 4);
        if (auto s = writer.Append(packed); !s.ok()) return s;
        if (auto s = writer.Append(scale); !s.ok()) return s;
        if (auto s = writer.Append(std::span<const uint8_t>(g, 4)); !s.ok()) return s;
      } else {
        if (auto s = writer.Append(in.Data(*t)); !s.ok()) return s;
      }
      ++done;
      if (options.progress) options.progress({t->name, done, total, q});
    }
    if (auto s = writer.Finish(); !s.ok()) return s;
  }
  if (fs::exists(index_path)) {
    auto index = ReadJson(index_path);
    (*index)["weight_map"] = weight_map;
    if (auto s = WriteJson(fs::path(out_dir) / "model.safetensors.index.json", *index); !s.ok()) return s;
  }
  // Configuration: hf_quant_config.json as ModelOpt writes it, and quantization_config in
  // config.json as newer exports do; tokenizer and generation files copied.
  json hf_quant = {{"producer", {{"name", "mlaserve-quantize"}, {"version", "0.1.0"}}},
                   {"quantization", {{"quant_algo", "NVFP4"}, {"kv_cache_quant_algo", nullptr},
                                     {"group_size", 16}, {"exclude_modules", options.exclude_modules}}}};
  if (auto s = WriteJson(fs::path(out_dir) / "hf_quant_config.json", hf_quant); !s.ok()) return s;
  json out_config = *config_json;
  json qcfg = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}, {"group_size", 16},
               {"ignore", options.exclude_modules}};
  if (out_config.contains("text_config")) {
    out_config["text_config"]["quantization_config"] = qcfg;
  } else {
    out_config["quantization_config"] = qcfg;
  }
  if (auto s = WriteJson(fs::path(out_dir) / "config.json", out_config); !s.ok()) return s;
  for (const char* extra : {"generation_config.json", "tokenizer.json", "tokenizer_config.json",
                            "tiktoken.model", "special_tokens_map.json", "chat_template.jinja"}) {
    const fs::path src = fs::path(in_dir) / extra;
    if (fs::exists(src)) fs::copy_file(src, fs::path(out_dir) / extra, fs::copy_options::overwrite_existing, ec);
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
