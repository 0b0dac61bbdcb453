// Accuracy on a model that knows something (issue 18): the trained embedded model
// (models/tiny-en, BF16; models/tiny-en-nvfp4, its NVFP4-expert twin made by mlaserve-quantize)
// on Brown text it was not trained on (tests/fixtures/text: the held-out files of
// models/train/train_tiny_en.py), teacher-forced token by token so that every position's
// attention reads the paged cache in the format under test.
//
// Built twice: accuracy_test on the CPU backend, accuracy_gpu_test on the CUDA backend (skips
// without a GPU). Figures are printed for bench/RESULTS.md.
//
// Bounds and why:
//  - fp8 / fp8_tiled KV against bf16 KV (issue 18's thresholds): top-1 agreement >= 99% and
//    perplexity within 1%. e4m3 keeps 3 mantissa bits (relative error <= 2^-4 per cached value,
//    the rope part stays bf16 in fp8_tiled); averaged over 512 latent dims per score the logit
//    error is small against a trained model's top-1 margins.
//  - NVFP4 experts against BF16 experts (bf16 KV both): NVFP4 keeps ~2 significant bits per
//    weight with a per-16 scale (per-weight relative error up to 1/6 at the top of a block), on
//    the routed experts only (a third of this model's weights). Bounded at what the measurement
//    supports (see the comment at the bound).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "coordinator/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "tests/model/golden_fixture.h"
#include "worker/backend/cpu_ops.h"
#include "worker/model/local_session.h"
#ifdef MLASERVE_ACCURACY_GPU
#include "worker/backend/cuda_ops.h"
#endif

namespace mlaserve {
namespace {

constexpr int kWindow = 512;   // tokens per teacher-forced window (a fresh sequence each)
constexpr int kWindows = 16;  // 8,176 scored positions: the standard error of a 99% agreement is 0.11%

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Scores {
  std::vector<int32_t> top1;  // argmax at every scored position
  double nll = 0;             // summed negative log-likelihood of the next token
  int positions = 0;
  double Perplexity() const { return std::exp(nll / positions); }
};

class AccuracyTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef MLASERVE_ACCURACY_GPU
    auto g = CudaOps::Create();
    if (!g.ok()) GTEST_SKIP() << "no GPU: " << g.status();
    gpu_ops_ = std::move(*g);
    ops_ = gpu_ops_.get();
#else
    ops_ = &cpu_ops_;
#endif
    auto tok = Tokenizer::LoadFromModelDir(FixtureDir("models/tiny-en"));
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizer_ = std::move(*tok);
    const std::string chat = ReadText(FixtureDir("tests/fixtures/text/brown-heldout-chat.txt"));
    ASSERT_FALSE(chat.empty());
    ids_ = tokenizer_->Encode(chat, /*add_special_tokens=*/false);
    ASSERT_GE(ids_.size(), static_cast<size_t>(kWindow * kWindows));
  }

  // Scores of (model, format), computed once per test binary (the BF16 / bf16-KV reference is
  // used by two tests).
  // emulation: the attention's FP8 tensor-core form (CPU backend only; MlaFp8MmaEmulation).
  const Scores& Score(const std::string& model_dir, KvCacheFormat format,
                      MlaFp8MmaEmulation emulation = MlaFp8MmaEmulation::kNone) {
    static std::map<std::tuple<std::string, KvCacheFormat, MlaFp8MmaEmulation>, Scores> cache;
    const auto key = std::make_tuple(model_dir, format, emulation);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
#ifndef MLASERVE_ACCURACY_GPU
    cpu_ops_.set_mla_fp8_mma_emulation(emulation);
#endif
    Scores s = Compute(model_dir, format);
#ifndef MLASERVE_ACCURACY_GPU
    cpu_ops_.set_mla_fp8_mma_emulation(MlaFp8MmaEmulation::kNone);
#endif
    return cache[key] = std::move(s);
  }

  Scores Compute(const std::string& model_dir, KvCacheFormat format) {
    ModelOptions options;
    options.kv_format = format;
    options.num_kv_blocks = kWindow / kKvBlockTokens + 1;
    auto model = DeepseekV3Model::Load(FixtureDir(model_dir), options, *ops_, comm_);
    EXPECT_TRUE(model.ok()) << model.status();
    Scores s;
    if (!model.ok()) return s;
    const int vocab = (*model)->config().vocab_size;
    LocalSession session(**model);
    for (int w = 0; w < kWindows; ++w) {
      const std::vector<int32_t> window(ids_.begin() + w * kWindow,
                                        ids_.begin() + (w + 1) * kWindow);
      session.Reset();
      auto logits = session.Feed(window, /*all_logits=*/true, /*chunk=*/1);
      EXPECT_TRUE(logits.ok()) << logits.status();
      if (!logits.ok()) return s;
      for (int i = 0; i + 1 < kWindow; ++i) {
        const float* row = logits->data() + static_cast<size_t>(i) * vocab;
        const float top = *std::max_element(row, row + vocab);
        double sum = 0;
        for (int v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - top);
        s.nll += std::log(sum) + top - row[window[i + 1]];
        s.top1.push_back(static_cast<int32_t>(std::max_element(row, row + vocab) - row));
        ++s.positions;
      }
    }
    return s;
  }

  static double Agreement(const Scores& a, const Scores& b) {
    int same = 0;
    for (size_t i = 0; i < a.top1.size() && i < b.top1.size(); ++i) same += a.top1[i] == b.top1[i];
    return a.top1.empty() ? 0 : double(same) / a.top1.size();
  }

  CpuOps cpu_ops_{2};
#ifdef MLASERVE_ACCURACY_GPU
  std::unique_ptr<CudaOps> gpu_ops_;
#endif
  Ops* ops_ = nullptr;
  SingleRankCommunicator comm_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<int32_t> ids_;
};

#ifdef MLASERVE_ACCURACY_GPU
constexpr const char* kBackend = "cuda";
#else
constexpr const char* kBackend = "cpu";
#endif

// The trained tokenizer against Hugging Face tokenizers' ids for held-out prose (in the golden
// file, made on the GPU machine by models/train/train_tiny_en.py golden).
TEST_F(AccuracyTest, TokenizerMatchesHuggingFace) {
  Golden golden(FixtureDir("models/tiny-en"));
  ASSERT_TRUE(golden.ok());
  const auto want = golden.Get<int32_t>("heldout.ids");
  const std::string text = ReadText(FixtureDir("tests/fixtures/text/brown-heldout.txt"));
  EXPECT_EQ(tokenizer_->Encode(text, false), want);
  EXPECT_EQ(tokenizer_->Decode(want, false), text);
}

TEST_F(AccuracyTest, Fp8KvFormatsAgainstBf16Kv) {
  const Scores& ref = Score("models/tiny-en", KvCacheFormat::kBf16);
  ASSERT_GT(ref.positions, 0);
  std::printf("[accuracy] %s tiny-en bf16 KV: perplexity %.4f over %d held-out tokens\n", kBackend,
              ref.Perplexity(), ref.positions);
#ifndef MLASERVE_ACCURACY_GPU
  {
    // How much bf16 itself moves top-1 against the lossless cache (CPU only: the GPU kernels
    // take no f32 cache): the scale of what rounding a cache does to this model.
    const Scores& f32 = Score("models/tiny-en", KvCacheFormat::kF32);
    std::printf("[accuracy] cpu tiny-en bf16 KV against the lossless f32 cache: perplexity x%.5f, "
                "top-1 agreement %.4f\n",
                ref.Perplexity() / f32.Perplexity(), Agreement(ref, f32));
  }
#endif
  for (const KvCacheFormat format : {KvCacheFormat::kFp8, KvCacheFormat::kFp8Tiled}) {
    const Scores& s = Score("models/tiny-en", format);
    const double agree = Agreement(s, ref), ratio = s.Perplexity() / ref.Perplexity();
    std::printf("[accuracy] %s tiny-en %s KV: perplexity %.4f (x%.5f of bf16 KV), top-1 agreement "
                "with bf16 KV %.4f\n",
                kBackend, std::string(KvCacheFormatName(format)).c_str(), s.Perplexity(), ratio,
                agree);
    // Issue 18's thresholds: perplexity within 1%, top-1 agreement >= 99%. The shipped model
    // was trained aware of the formats (models/train/train_tiny_en.py --kv-formats, bench/
    // RESULTS.md "Session 16"); measured over 16 windows, 2026-12-05: CPU fp8 0.9919, fp8_tiled
    // 0.9950 (bf16 against the lossless f32 cache 0.9998); GPU (H200) fp8 0.9909, fp8_tiled
    // 0.9927, perplexity within 0.03% everywhere. The model trained without the formats read
    // fp8 0.9561, fp8_tiled 0.9883: a top-1 flips where the format's shift of the logit margin
    // beats the margin, and this training cuts that shift ~4x (0.105 -> 0.023 logit rms for
    // fp8, in-run). The bound is the issue's; the
    // standard error of a 99% agreement over 8,176 positions is 0.11%, and each backend's
    // summation order is fixed, so a run does not wander across it.
    EXPECT_GE(agree, 0.99) << KvCacheFormatName(format);
    EXPECT_LE(std::abs(ratio - 1), 0.01) << KvCacheFormatName(format);
  }
}

// Issue 15's question before an FP8 tensor-core MLA kernel is written: would attention over the
// fp8 caches on Hopper's e4m3 MMAs (q rounded to e4m3 with a scale a row, P to e4m3 a 64-token
// block, ~22-bit tensor-core sums promoted to fp32 every 128 dims or every block; the form
// MlaFp8MmaEmulation describes) keep issue 18's bounds? Emulated on the CPU backend.
TEST_F(AccuracyTest, Fp8TensorCoreFormAgainstBf16Kv) {
#ifdef MLASERVE_ACCURACY_GPU
  GTEST_SKIP() << "the FP8 tensor-core form is emulated by the CPU backend only";
#else
  const Scores& ref = Score("models/tiny-en", KvCacheFormat::kBf16);
  ASSERT_GT(ref.positions, 0);
  for (const KvCacheFormat format : {KvCacheFormat::kFp8, KvCacheFormat::kFp8Tiled}) {
    const Scores& exact = Score("models/tiny-en", format);
    for (const MlaFp8MmaEmulation e : {MlaFp8MmaEmulation::kQkPv}) {
      const Scores& s = Score("models/tiny-en", format, e);
      const double agree = Agreement(s, ref), ratio = s.Perplexity() / ref.Perplexity();
      std::printf(
          "[accuracy] cpu tiny-en %s KV, FP8 tensor-core %s: perplexity %.4f (x%.5f of "
          "bf16 KV), top-1 agreement with bf16 KV %.4f, with the exact %s form %.4f\n",
          std::string(KvCacheFormatName(format)).c_str(),
          e == MlaFp8MmaEmulation::kQk ? "q.k" : "q.k and P.V", s.Perplexity(), ratio, agree,
          std::string(KvCacheFormatName(format)).c_str(), Agreement(s, exact));
      EXPECT_GE(agree, 0.99) << KvCacheFormatName(format);
      EXPECT_LE(std::abs(ratio - 1), 0.01) << KvCacheFormatName(format);
    }
  }
#endif
}

TEST_F(AccuracyTest, Nvfp4ExpertsAgainstBf16) {
  const Scores& ref = Score("models/tiny-en", KvCacheFormat::kBf16);
  const Scores& q = Score("models/tiny-en-nvfp4", KvCacheFormat::kBf16);
  ASSERT_GT(ref.positions, 0);
  ASSERT_EQ(q.positions, ref.positions);
  const double agree = Agreement(q, ref), ratio = q.Perplexity() / ref.Perplexity();
  std::printf("[accuracy] %s tiny-en-nvfp4: perplexity %.4f (x%.5f of BF16's %.4f), top-1 "
              "agreement with BF16 %.4f\n",
              kBackend, q.Perplexity(), ratio, ref.Perplexity(), agree);
  // Measured 2026-12-05 over 16 windows on the shipped model: CPU perplexity x1.00886, top-1
  // agreement 0.9330; GPU x1.00889, 0.9329 (the model trained without the formats: x1.00158,
  // 0.9148). The expert rounding moves near-ties between two continuations (many in a model
  // this small) but not what the model knows. Bounds: perplexity at most 2%
  // worse, agreement >= 0.92 (the measurement less the spread a different summation order or
  // a retrained model gives: 0.915-0.933 over three trained models).
  EXPECT_GE(agree, 0.92);
  EXPECT_LE(ratio, 1.02);
}

}  // namespace
}  // namespace mlaserve
