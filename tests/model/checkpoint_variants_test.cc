// Checkpoint layouts and quantization metadata beyond the fixtures as written: the Kimi-K2.5
// layout (text_config + "language_model." prefix), FP8 KV scales exported with the checkpoint,
// and inconsistent NVFP4 metadata, built from the fixtures with our safetensors writer.
#include <filesystem>
#include <fstream>

#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/golden_fixture.h"
#include "worker/backend/cpu_ops.h"
#include "worker/model/local_session.h"

namespace mlaserve {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

fs::path TempDir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("mlaserve_ckpt_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// Rewrites every tensor of `src`'s model files into one file, renaming with `rename`.
void CopyTensors(const fs::path& src, const fs::path& dst_file,
                 const std::function<std::string(const std::string&)>& rename,
                 std::vector<TensorToWrite> extra = {}) {
  auto ckpt = Checkpoint::Open(src.string());
  ASSERT_TRUE(ckpt.ok());
  std::vector<TensorToWrite> out;
  for (const std::string& n : ckpt->Names()) {
    auto t = ckpt->Get(n);
    out.push_back({rename(n), t->info->dtype, t->info->shape, t->bytes});
  }
  for (auto& e : extra) out.push_back(std::move(e));
  ASSERT_TRUE(WriteSafetensors(dst_file.string(), out).ok());
}

std::vector<float> PrefillLogits(const std::string& dir, const std::vector<int32_t>& ids,
                                 ModelOptions options = {}) {
  CpuOps ops(2);
  SingleRankCommunicator comm;
  options.num_kv_blocks = 4;
  auto model = DeepseekV3Model::Load(dir, options, ops, comm);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return {};
  LocalSession s(**model);
  auto logits = s.Feed(ids, true);
  EXPECT_TRUE(logits.ok());
  return *logits;
}

TEST(CheckpointVariantsTest, KimiK25LayoutLoadsAndMatches) {
  const fs::path src = FixtureDir("kimi-tiny");
  const fs::path dst = TempDir("k25");
  std::ifstream in(src / "config.json");
  json text = json::parse(in);
  json config = {{"architectures", {"KimiK25ForConditionalGeneration"}}, {"model_type", "kimi_k25"},
                 {"text_config", text}, {"vision_config", {{"hidden_size", 16}}}};
  std::ofstream(dst / "config.json") << config.dump(2);
  CopyTensors(src, dst / "model.safetensors", [](const std::string& n) { return "language_model." + n; },
              {});
  Golden golden(src.string());
  const auto ids = golden.Get<int32_t>("p1.ids");
  const auto ref = golden.Get<float>("p1.logits");
  EXPECT_LE(CompareLogits(PrefillLogits(dst.string(), ids), ref).Relative(), 1e-4);
  fs::remove_all(dst);
}

TEST(CheckpointVariantsTest, Fp8KvScaleComesFromTheCheckpoint) {
  const fs::path src = FixtureDir("kimi-tiny");
  const fs::path dst = TempDir("kvscale");
  fs::copy_file(src / "config.json", dst / "config.json");
  fs::copy_file(src / "model.safetensors", dst / "model.safetensors");
  // A second model file with one k_scale per layer (ModelOpt's naming).
  std::vector<float> scales = {0.5f, 0.25f, 2.0f};
  std::vector<TensorToWrite> t;
  for (int l = 0; l < 3; ++l) {
    t.push_back({"model.layers." + std::to_string(l) + ".self_attn.k_scale", DType::kF32, {},
                 std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(&scales[l]), 4)});
  }
  ASSERT_TRUE(WriteSafetensors((dst / "model-kv-scales.safetensors").string(), t).ok());
  CpuOps ops(1);
  SingleRankCommunicator comm;
  ModelOptions options;
  options.kv_format = KvCacheFormat::kFp8;
  options.num_kv_blocks = 2;
  auto model = DeepseekV3Model::Load(dst.string(), options, ops, comm);
  ASSERT_TRUE(model.ok()) << model.status();
  for (int l = 0; l < 3; ++l) EXPECT_EQ((*model)->kv_fp8_scale(l), scales[l]);
  options.kv_format = KvCacheFormat::kBf16;
  auto plain = DeepseekV3Model::Load(src.string(), options, ops, comm);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->kv_fp8_scale(0), 1.0f);
  fs::remove_all(dst);
}

TEST(CheckpointVariantsTest, Nvfp4TensorOfAnExcludedModuleIsAClearError) {
  const fs::path src = FixtureDir("kimi-tiny-nvfp4");
  const fs::path dst = TempDir("excluded");
  for (const char* f : {"config.json", "model.safetensors", "hf_quant_config.json"}) fs::copy_file(src / f, dst / f);
  std::ifstream in(dst / "hf_quant_config.json");
  json q = json::parse(in);
  q["quantization"]["exclude_modules"].push_back("model.layers.1.mlp.experts.3.*");
  std::ofstream(dst / "hf_quant_config.json") << q.dump(2);
  CpuOps ops(1);
  SingleRankCommunicator comm;
  auto model = DeepseekV3Model::Load(dst.string(), {}, ops, comm);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(std::string(model.status().message()).find("model.layers.1.mlp.experts.3."), std::string::npos)
      << model.status();
  fs::remove_all(dst);
}

TEST(CheckpointVariantsTest, CorruptWeightFileIsAOneLineErrorNamingFileAndTensor) {
  const fs::path src = FixtureDir("dsv3-tiny");
  const fs::path dst = TempDir("corrupt");
  fs::copy_file(src / "config.json", dst / "config.json");
  // Truncate the weights: the last tensor's data runs past the end of the file.
  std::ifstream in(src / "model.safetensors", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  bytes.resize(bytes.size() - 1000);
  std::ofstream(dst / "model.safetensors", std::ios::binary) << bytes;
  CpuOps ops(1);
  SingleRankCommunicator comm;
  auto model = DeepseekV3Model::Load(dst.string(), {}, ops, comm);
  ASSERT_FALSE(model.ok());
  const std::string msg(model.status().message());
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tensor "), std::string::npos) << msg;
  fs::remove_all(dst);
}

}  // namespace
}  // namespace mlaserve
