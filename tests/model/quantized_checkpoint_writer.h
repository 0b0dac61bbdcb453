// Writes the two quantized layouts issue 21 loads (compressed-tensors INT4 pack-quantized: routed
// experts, group 32, symmetric; DeepSeek FP8 block-128: every projection but embed, lm_head and
// the router) from the dsv3-tiny BF16 fixture, with a quantizer and packer written from the
// format descriptions (kernels/linear/int4_group_ref.h, fp8_block_ref.h), independent of the
// loader's unpacking; and the same weights, dequantized here by their bit fields, as F32 into a
// plain folder. Used by quantized_checkpoint_test (CPU) and gpu_model_test (the INT4 folder on
// the GPU). WriteBf16Twin: any INT4 or FP8 folder as the BF16 checkpoint holding the values the
// CUDA backend computes with (gpu_model_test's CPU side).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "kernels/linear/fp8_block_ref.h"
#include "kernels/linear/int4_group_ref.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/golden_fixture.h"

namespace mlaserve::quantized_fixture {

namespace fs = std::filesystem;
using json = nlohmann::json;

inline bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}
inline bool EndsWith(const std::string& s, const std::string& end) {
  return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
}

// bf16 and e4m3 decoded from their bit fields (not with common/dtype.h).
inline float Bf16Bits(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t ToBf16Truncated(float f) {  // any bf16 near amax / 7 will do as a scale
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}
inline float E4m3Bits(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int e = (b >> 3) & 0xf, m = b & 7;
  if (e == 0) return sign * std::ldexp(m / 8.0f, -6);
  return sign * std::ldexp(1.0f + m / 8.0f, e - 7);
}
// Nearest e4m3 code of |x| <= 448 by search over the 127 non-negative finite codes.
inline uint8_t ToE4m3(float x) {
  uint8_t best = 0;
  for (int c = 0; c < 0x7f; ++c) {
    if (std::fabs(E4m3Bits(c) - std::fabs(x)) < std::fabs(E4m3Bits(best) - std::fabs(x))) best = c;
  }
  return static_cast<uint8_t>(best | (x < 0 ? 0x80 : 0));
}

// Tensors to write, owning their bytes.
struct Folder {
  std::vector<TensorToWrite> tensors;
  std::deque<std::vector<uint8_t>> store;
  template <class T>
  void Add(const std::string& name, DType dtype, std::vector<int64_t> shape,
           const std::vector<T>& v) {
    store.emplace_back(reinterpret_cast<const uint8_t*>(v.data()),
                       reinterpret_cast<const uint8_t*>(v.data()) + v.size() * sizeof(T));
    tensors.push_back({name, dtype, std::move(shape), store.back()});
  }
  void Write(const fs::path& dir, const json& config) {
    std::ofstream(dir / "config.json") << config.dump(2);
    ASSERT_TRUE(WriteSafetensors((dir / "model.safetensors").string(), tensors).ok());
  }
};

enum class Layout { kInt4, kFp8 };

// Which 2-D weights each layout quantizes (Kimi: routed experts; DeepSeek: all but embed,
// lm_head, router).
inline bool Quantized(Layout layout, const std::string& name) {
  if (!EndsWith(name, ".weight")) return false;
  if (layout == Layout::kInt4) return Contains(name, ".mlp.experts.");
  return name != "model.embed_tokens.weight" && name != "lm_head.weight" &&
         !EndsWith(name, ".mlp.gate.weight");
}

constexpr int kGroup = 32;   // Kimi's group_size
constexpr int kBlock = 128;  // DeepSeek's weight_block_size

inline json Int4Config() {
  return {{"quant_method", "compressed-tensors"},
          {"format", "pack-quantized"},
          {"quantization_status", "compressed"},
          {"config_groups",
           {{"group_0",
             {{"targets", {"Linear"}},
              {"input_activations", nullptr},
              {"output_activations", nullptr},
              {"weights",
               {{"num_bits", 4},
                {"type", "int"},
                {"strategy", "group"},
                {"group_size", kGroup},
                {"symmetric", true},
                {"dynamic", false},
                {"actorder", nullptr},
                {"observer", "minmax"}}}}}}},
          {"ignore",
           {"lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"}}};
}
inline json Fp8Config() {
  return {{"quant_method", "fp8"},
          {"fmt", "e4m3"},
          {"weight_block_size", {kBlock, kBlock}},
          {"activation_scheme", "dynamic"}};
}

// Writes `layout`'s quantized folder and the dequantized F32 twin. `edit` may change the quantized
// tensors (malformed cases) before writing.
inline void WriteFolders(Layout layout, const fs::path& quant_dir, const fs::path& deq_dir,
                         const std::function<void(Folder&)>& edit = {}) {
  const fs::path src = FixtureDir("dsv3-tiny");
  auto ckpt = Checkpoint::Open(src.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  Folder quant, deq;
  for (const std::string& n : ckpt->Names()) {
    auto t = ckpt->Get(n);
    ASSERT_TRUE(t.ok());
    if (!Quantized(layout, n) || t->info->shape.size() != 2) {
      quant.tensors.push_back({n, t->info->dtype, t->info->shape, t->bytes});
      deq.tensors.push_back({n, t->info->dtype, t->info->shape, t->bytes});
      continue;
    }
    ASSERT_EQ(t->info->dtype, DType::kBF16) << n;
    const int64_t rows = t->info->shape[0], cols = t->info->shape[1];
    std::vector<float> w(rows * cols), d(rows * cols);
    for (int64_t i = 0; i < rows * cols; ++i) {
      uint16_t b;
      std::memcpy(&b, t->bytes.data() + 2 * i, 2);
      w[i] = Bf16Bits(b);
    }
    const std::string module = n.substr(0, n.size() - 7);
    if (layout == Layout::kInt4) {
      // Symmetric: scale = amax / 7 (as bf16), q = clamp(round(w / scale), -8, 7); nibble q + 8,
      // column c at bits 4 * (c % 8) of word c / 8.
      const int64_t groups = (cols + kGroup - 1) / kGroup, words = (cols + 7) / 8;
      std::vector<uint16_t> scale(rows * groups);
      std::vector<int32_t> packed(rows * words, 0);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
          float amax = 0;
          for (int64_t c = g * kGroup; c < std::min(cols, (g + 1) * kGroup); ++c)
            amax = std::max(amax, std::fabs(w[r * cols + c]));
          uint16_t s = ToBf16Truncated(amax > 0 ? amax / 7.0f : 1.0f);
          scale[r * groups + g] = s;
          for (int64_t c = g * kGroup; c < std::min(cols, (g + 1) * kGroup); ++c) {
            const int q =
                std::clamp(static_cast<int>(std::lround(w[r * cols + c] / Bf16Bits(s))), -8, 7);
            uint32_t word = static_cast<uint32_t>(packed[r * words + c / 8]);
            word |= static_cast<uint32_t>(q + 8) << (4 * (c % 8));
            packed[r * words + c / 8] = static_cast<int32_t>(word);
            d[r * cols + c] = static_cast<float>(q) * Bf16Bits(s);
          }
        }
      }
      quant.Add(module + ".weight_packed", DType::kI32, {rows, words}, packed);
      quant.Add(module + ".weight_scale", DType::kBF16, {rows, groups}, scale);
      quant.Add(module + ".weight_shape", DType::kI32, {2},
                std::vector<int32_t>{static_cast<int32_t>(rows), static_cast<int32_t>(cols)});
    } else {
      // Per 128x128 block: scale_inv = amax / 448, code = nearest e4m3 of w / scale_inv.
      const int64_t br = (rows + kBlock - 1) / kBlock, bc = (cols + kBlock - 1) / kBlock;
      std::vector<float> scale(br * bc);
      std::vector<uint8_t> codes(rows * cols);
      for (int64_t i = 0; i < br; ++i) {
        for (int64_t j = 0; j < bc; ++j) {
          float amax = 0;
          for (int64_t r = i * kBlock; r < std::min(rows, (i + 1) * kBlock); ++r)
            for (int64_t c = j * kBlock; c < std::min(cols, (j + 1) * kBlock); ++c)
              amax = std::max(amax, std::fabs(w[r * cols + c]));
          const float s = amax > 0 ? amax / 448.0f : 1.0f;
          scale[i * bc + j] = s;
          for (int64_t r = i * kBlock; r < std::min(rows, (i + 1) * kBlock); ++r) {
            for (int64_t c = j * kBlock; c < std::min(cols, (j + 1) * kBlock); ++c) {
              codes[r * cols + c] = ToE4m3(w[r * cols + c] / s);
              d[r * cols + c] = E4m3Bits(codes[r * cols + c]) * s;
            }
          }
        }
      }
      quant.Add(n, DType::kF8E4M3, {rows, cols}, codes);
      quant.Add(module + ".weight_scale_inv", DType::kF32, {br, bc}, scale);
    }
    deq.Add(n, DType::kF32, {rows, cols}, d);
  }
  if (layout == Layout::kFp8) {
    // DeepSeek's MTP layer (here layer 3 = num_hidden_layers) is in the checkpoint and ignored:
    // tensors no loader could read prove it is never touched.
    quant.Add("model.layers.3.eh_proj.weight", DType::kU8, {3}, std::vector<uint8_t>{1, 2, 3});
    quant.Add("model.layers.3.self_attn.kv_b_proj.weight_scale_inv", DType::kU8, {1},
              std::vector<uint8_t>{0});
  }
  if (edit) edit(quant);
  std::ifstream in(src / "config.json");
  json config = json::parse(in);
  deq.Write(deq_dir, config);
  config["quantization_config"] = layout == Layout::kInt4 ? Int4Config() : Fp8Config();
  quant.Write(quant_dir, config);
}

// `quant_dir` (compressed-tensors INT4 or DeepSeek FP8) as a plain BF16 checkpoint in `twin_dir`
// holding the weights the CUDA backend computes with: every quantized module dequantized in fp32
// (the loader's references, kernels/linear/*_ref.h) and rounded once to bf16 (round to nearest
// even), which is what the GPU holds or forms in registers: bf16(q * s) for INT4, bf16(fp32(e4m3
// * s)) for FP8, kv_b included (worker/model/deepseek_v3.cc, HostLinear's comment). The CPU
// backend on this twin is the GPU's model with exact arithmetic, so a GPU-vs-CPU comparison on it
// measures the GPU's kernels, not the weight rounding that the GPU design adds (the CPU on the
// quantized folder itself is exact against transformers: golden_test).
inline void WriteBf16Twin(const fs::path& quant_dir, const fs::path& twin_dir) {
  auto ckpt = Checkpoint::Open(quant_dir.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  std::ifstream in(quant_dir / "config.json");
  json config = json::parse(in);
  ASSERT_TRUE(config.contains("quantization_config")) << quant_dir;
  const json q = config["quantization_config"];
  config.erase("quantization_config");
  const bool fp8 = q.value("quant_method", "") == "fp8";
  const int block_rows = fp8 ? q["weight_block_size"][0].get<int>() : 0;
  const int block_cols = fp8 ? q["weight_block_size"][1].get<int>() : 0;
  const int group =
      fp8 ? 0 : q["config_groups"].begin().value()["weights"]["group_size"].get<int>();
  Folder twin;
  auto add_bf16 = [&](const std::string& name, int64_t rows, int64_t cols,
                      const std::vector<float>& v) {
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = FloatToBf16(v[i]);
    twin.Add(name, DType::kBF16, {rows, cols}, b);
  };
  for (const std::string& n : ckpt->Names()) {
    auto t = ckpt->Get(n);
    ASSERT_TRUE(t.ok()) << t.status();
    const TensorInfo& info = *t->info;
    if (EndsWith(n, ".weight_scale_inv") || EndsWith(n, ".weight_shape")) continue;
    if (!fp8 && EndsWith(n, ".weight_scale")) continue;
    if (!fp8 && EndsWith(n, ".weight_packed")) {
      const std::string module = n.substr(0, n.size() - std::string(".weight_packed").size());
      auto scale = ckpt->Get(module + ".weight_scale");
      auto shape = ckpt->Get(module + ".weight_shape");
      ASSERT_TRUE(scale.ok() && shape.ok()) << module;
      int32_t dims[2];
      std::memcpy(dims, shape->bytes.data(), sizeof(dims));
      std::vector<float> s(scale->info->NumElements());
      ASSERT_TRUE(DecodeFloats(scale->info->dtype, scale->bytes.data(), s.size(), s.data()));
      std::vector<float> w(static_cast<size_t>(dims[0]) * dims[1]);
      DequantizeInt4Group({reinterpret_cast<const int32_t*>(t->bytes.data()), s.data(), dims[0],
                           dims[1], group},
                          0, dims[0], 0, dims[1], w.data());
      add_bf16(module + ".weight", dims[0], dims[1], w);
      continue;
    }
    if (fp8 && info.dtype == DType::kF8E4M3 && EndsWith(n, ".weight") && info.shape.size() == 2) {
      const std::string module = n.substr(0, n.size() - std::string(".weight").size());
      auto scale = ckpt->Get(module + ".weight_scale_inv");
      ASSERT_TRUE(scale.ok()) << module;
      const int64_t rows = info.shape[0], cols = info.shape[1];
      std::vector<float> w(static_cast<size_t>(rows * cols));
      Fp8BlockTensor ft;
      ft.weight = t->bytes.data();
      ft.scale_inv = reinterpret_cast<const float*>(scale->bytes.data());
      ft.rows = rows;
      ft.cols = cols;
      ft.block_rows = block_rows;
      ft.block_cols = block_cols;
      DequantizeFp8Block(ft, 0, rows, 0, cols, w.data());
      add_bf16(n, rows, cols, w);
      continue;
    }
    twin.tensors.push_back({n, info.dtype, info.shape, t->bytes});
  }
  fs::create_directories(twin_dir);
  twin.Write(twin_dir, config);
}

}  // namespace mlaserve::quantized_fixture
