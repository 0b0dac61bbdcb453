// Safetensors reader and writer: round trips, the tiny fixtures, and corrupt files (truncated,
// bit-flipped, hand-broken headers) that must give an error naming the file, never a crash.
#include "common/safetensors.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace mlaserve {
namespace {

namespace fs = std::filesystem;

std::string TempPath(const std::string& name) {
  return (fs::temp_directory_path() / ("mlaserve_st_" + std::to_string(::getpid()) + "_" + name)).string();
}

std::vector<uint8_t> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void WriteAll(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::string WriteHeaderOnly(const std::string& name, const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> bytes(8);
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(header.size() >> (8 * i));
  bytes.insert(bytes.end(), header.begin(), header.end());
  bytes.resize(bytes.size() + data_bytes, 0x11);
  const std::string path = TempPath(name);
  WriteAll(path, bytes);
  return path;
}

// A file with several dtypes, including the sub-byte ones.
std::string MakeSample() {
  static std::vector<uint8_t> a(2 * 3 * 2), b(4), c(5 * 4), d(3);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 7);
  for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<uint8_t>(255 - i);
  const std::string path = TempPath("sample.safetensors");
  auto status = WriteSafetensors(path,
                                 {{"w.bf16", DType::kBF16, {2, 3}, a},
                                  {"w.fp4", DType::kF4, {2, 4}, b},
                                  {"scale", DType::kF32, {5}, c},
                                  {"codes", DType::kF8E4M3, {3}, d}},
                                 {{"format", "pt"}});
  EXPECT_TRUE(status.ok()) << status;
  return path;
}

TEST(SafetensorsTest, RoundTrip) {
  const std::string path = MakeSample();
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), 4u);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  const TensorInfo* t = (*file)->Find("w.bf16");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::kBF16);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  auto data = (*file)->Data(*t);
  ASSERT_EQ(data.size(), 12u);
  for (size_t i = 0; i < data.size(); ++i) EXPECT_EQ(data[i], static_cast<uint8_t>(i * 7));
  EXPECT_EQ((*file)->Find("w.fp4")->end - (*file)->Find("w.fp4")->begin, 4u);
  fs::remove(path);
}

TEST(SafetensorsTest, WriterRejectsWrongByteCount) {
  std::vector<uint8_t> three(3);
  auto s = WriteSafetensors(TempPath("bad.safetensors"), {{"x", DType::kBF16, {2}, three}});
  EXPECT_FALSE(s.ok());
}

TEST(SafetensorsTest, OpensFixtureFolderWithIndexAndCheckedGet) {
  const std::string root = std::getenv("MLASERVE_SOURCE_DIR");
  auto ckpt = Checkpoint::Open(root + "/tests/fixtures/models/noqlora-tiny");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE(ckpt->Has("model.embed_tokens.weight"));
  EXPECT_TRUE(ckpt->Has("lm_head.weight"));
  EXPECT_FALSE(ckpt->Has("p0.logits"));  // golden.safetensors is not part of the model
  auto ok = ckpt->Get("model.embed_tokens.weight", DType::kBF16, {512, 64});
  EXPECT_TRUE(ok.ok()) << ok.status();
  auto bad = ckpt->Get("model.embed_tokens.weight", DType::kF8E4M3, {512, 64});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find(
                "tensor model.embed_tokens.weight: expected F8_E4M3 [512, 64], found BF16 [512, 64]"),
            std::string::npos)
      << bad.status();
  auto missing = ckpt->Get("model.layers.99.mlp.gate.weight");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

struct BadHeader {
  const char* name;
  std::string header;
  size_t data_bytes;
  const char* message;  // expected substring
};

TEST(SafetensorsTest, HandBrokenHeadersGiveClearErrors) {
  const std::vector<BadHeader> cases = {
      {"notjson", "{\"a\": [", 0, "not valid JSON"},
      {"array", "[1, 2]", 0, "not a JSON object"},
      {"dtype", R"({"t": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}})", 1, "tensor t: unknown safetensors dtype"},
      {"negshape", R"({"t": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}})", 1, "tensor t: shape"},
      {"size", R"({"t": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}})", 4, "needs 6 bytes"},
      {"past", R"({"t": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}})", 4, "run past the end"},
      {"reversed", R"({"t": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}})", 4, "reversed"},
      {"overlap", R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})", 6, "overlap"},
      {"hole", R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}})", 4, "hole"},
      {"trailing", R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})", 4, "trailing"},
      {"f4odd", R"({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}})", 2, "whole bytes"},
      {"meta", R"({"__metadata__": {"k": 1}})", 0, "not a string"},
      {"huge", R"({"a": {"dtype": "F64", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})", 8, "too large"},
  };
  for (const auto& c : cases) {
    const std::string path = WriteHeaderOnly(c.name, c.header, c.data_bytes);
    auto file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok()) << c.name;
    const std::string msg(file.status().message());
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.message), std::string::npos) << c.name << ": " << msg;
    fs::remove(path);
  }
  // A header length beyond the limit, and one beyond the file.
  std::vector<uint8_t> bytes(16, 0);
  bytes[7] = 0x10;
  const std::string huge = TempPath("hugelen");
  WriteAll(huge, bytes);
  EXPECT_NE(std::string(SafetensorsFile::Open(huge).status().message()).find("limit"), std::string::npos);
  bytes.assign(16, 0);
  bytes[0] = 200;
  WriteAll(huge, bytes);
  EXPECT_NE(std::string(SafetensorsFile::Open(huge).status().message()).find("truncated"), std::string::npos);
  fs::remove(huge);
}

// Fuzz-style: every truncation of a valid file must fail cleanly (the tensors no longer tile
// the data), and random bit flips must either fail cleanly or still give tensors inside the file.
TEST(SafetensorsTest, TruncatedAndBitFlippedFilesNeverCrash) {
  const std::string path = MakeSample();
  const std::vector<uint8_t> good = ReadAll(path);
  const std::string mutated = TempPath("mutated.safetensors");
  for (size_t len = 0; len < good.size(); ++len) {
    WriteAll(mutated, std::vector<uint8_t>(good.begin(), good.begin() + len));
    auto file = SafetensorsFile::Open(mutated);
    EXPECT_FALSE(file.ok()) << "truncated to " << len;
    if (!file.ok()) EXPECT_NE(std::string(file.status().message()).find(mutated), std::string::npos);
  }
  std::mt19937 rng(42);
  int accepted = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::vector<uint8_t> bytes = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      const size_t pos = rng() % bytes.size();
      bytes[pos] ^= static_cast<uint8_t>(1u << (rng() % 8));
    }
    WriteAll(mutated, bytes);
    auto file = SafetensorsFile::Open(mutated);
    if (file.ok()) {
      ++accepted;
      for (const auto& t : (*file)->tensors()) {
        auto data = (*file)->Data(t);
        ASSERT_LE(t.end, bytes.size());
        volatile uint8_t sink = 0;
        for (uint8_t b : data) sink = sink ^ b;  // reads every byte it claims: ASan would catch
      }
    }
  }
  // Flips in the data buffer leave a valid file; flips in the header mostly do not.
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, 3000);
  fs::remove(mutated);
  fs::remove(path);
}

}  // namespace
}  // namespace mlaserve
