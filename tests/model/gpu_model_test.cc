// The whole model on the CUDA backend against the CPU backend (label gpu; skips without a GPU),
// on every fixture of tests/fixtures/models, on dsv3-tiny with its routed experts in
// compressed-tensors INT4 and on dsv3-tiny in DeepSeek's FP8 block-128 layout (every projection
// but embed, lm_head and the router; both written at test time by quantized_checkpoint_writer.h;
// the GPU keeps the routed experts packed, INT4 / FP8, and the other FP8 projections in FP8 but
// kv_b, which it rounds to bf16; the CPU dequantizes all exactly), both with a bf16 KV cache:
// prefill logits at
// every position of the golden prompts, chunked prefill against whole prefill on the GPU, and a
// 32-token greedy continuation through token-by-token decode.
//
// Tolerance, measured rather than guessed: the GPU keeps activations in bf16 (relative rounding
// 2^-9 at each of ~15 ops per layer) where the CPU keeps fp32, and these random tiny MoE models
// amplify small differences through routing near-ties (transformers itself, switching only its
// KV cache to bf16, moves dsv3-tiny's prompt-2 logits by 4.5% relative L2 and its greedy
// continuation diverges at step 6; golden bf16kv_* fields). So each test first measures the same
// sensitivity on the CPU: the drift D between the CPU with a lossless f32 cache and with a bf16
// cache (one bf16 rounding per cached value), both prefilling in chunks of 5 so that the cache is
// read. The GPU, rounding every activation, must stay
// within max(0.05, 3 D) relative L2 of the CPU (bf16 cache), with a logit cosine >= 0.99 (top-1
// agreement is printed, not asserted: over 64 positions of a model with routing near-ties it
// moves by several positions between any two roundings, the CPU's own bf16-vs-f32 included). Greedy
// decode (teacher-forced with the CPU's tokens, all 32 steps run) must pick the CPU's token at
// every step whose CPU top-2 margin exceeds twice the step's largest logit difference; steps inside
// that band are near-ties for either backend and are counted.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/kernels/device_buffer.h"
#include "tests/model/determinism_checks.h"
#include "tests/model/golden_fixture.h"
#include "tests/model/quantized_checkpoint_writer.h"
#include "tests/model/thread_group_communicator.h"
#include "tests/model/zero_peer_communicator.h"
#include "worker/backend/cpu_ops.h"
#include "worker/backend/cuda_ops.h"
#include "worker/model/local_session.h"

namespace mlaserve {
namespace {

struct Agreement {
  double rel_l2 = 0, cosine = 0, max_abs = 0;
  double top1 = 0;  // fraction of rows with the same argmax
};

Agreement Compare(const std::vector<float>& gpu, const std::vector<float>& cpu, int vocab) {
  Agreement a;
  double num = 0, den = 0, dot = 0, gg = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double d = double(gpu[i]) - cpu[i];
    num += d * d;
    den += double(cpu[i]) * cpu[i];
    dot += double(gpu[i]) * cpu[i];
    gg += double(gpu[i]) * gpu[i];
    a.max_abs = std::max(a.max_abs, std::abs(d));
  }
  a.rel_l2 = std::sqrt(num / den);
  a.cosine = dot / std::sqrt(den * gg);
  const size_t rows = cpu.size() / vocab;
  int same = 0;
  for (size_t r = 0; r < rows; ++r) {
    auto g = std::max_element(gpu.begin() + r * vocab, gpu.begin() + (r + 1) * vocab);
    auto c = std::max_element(cpu.begin() + r * vocab, cpu.begin() + (r + 1) * vocab);
    same += (g - gpu.begin()) == (c - cpu.begin());
  }
  a.top1 = rows ? double(same) / rows : 1.0;
  return a;
}

// The CPU's top-2 margin of one logits row.
double Margin(const float* row, int vocab) {
  float a = -INFINITY, b = -INFINITY;
  for (int i = 0; i < vocab; ++i) {
    if (row[i] > a) {
      b = a;
      a = row[i];
    } else if (row[i] > b) {
      b = row[i];
    }
  }
  return a - b;
}

// A fixture's folder; "dsv3-tiny-int4" is dsv3-tiny with compressed-tensors INT4 routed experts
// (group 32, symmetric) and "dsv3-tiny-fp8" dsv3-tiny in DeepSeek's FP8 block-128 layout, each
// written once per process into a temporary folder with dsv3-tiny's golden prompts beside it, and
// removed at exit.
std::string ModelDir(const std::string& name) {
  using quantized_fixture::Layout;
  if (name != "dsv3-tiny-int4" && name != "dsv3-tiny-fp8") return FixtureDir(name);
  struct Written {
    std::filesystem::path dir;
    explicit Written(Layout layout) {
      const std::filesystem::path tmp = std::filesystem::temp_directory_path();
      const std::string tag =
          std::string(layout == Layout::kInt4 ? "int4_" : "fp8_") + std::to_string(::getpid());
      dir = tmp / ("mlaserve_gpu_model_" + tag);
      const std::filesystem::path deq = tmp / ("mlaserve_gpu_model_deq_" + tag);
      for (const auto& d : {dir, deq}) {
        std::filesystem::remove_all(d);
        std::filesystem::create_directories(d);
      }
      quantized_fixture::WriteFolders(layout, dir, deq);
      std::filesystem::copy_file(
          std::filesystem::path(FixtureDir("dsv3-tiny")) / "golden.safetensors",
          dir / "golden.safetensors");
      std::filesystem::remove_all(deq);
    }
    ~Written() { std::filesystem::remove_all(dir); }
  };
  if (name == "dsv3-tiny-int4") {
    static const Written int4(Layout::kInt4);
    return int4.dir.string();
  }
  static const Written fp8(Layout::kFp8);
  return fp8.dir.string();
}

// The folder the CPU side of the GPU-vs-CPU tests loads: the fixture itself, or for an INT4 or
// FP8 checkpoint its BF16 twin (quantized_fixture::WriteBf16Twin: the values the GPU computes
// with, dequantized and rounded once to bf16), written once per process and removed at exit. The
// GPU holds such weights at 2^-9 relative rounding that the CPU backend (exact fp32
// dequantization) does not have; on the random tiny models that rounding alone moves logits by
// about as much as the bound allows (dsv3-tiny-fp8, every projection FP8: GPU vs the exact CPU
// rel 0.127 against a bound of 0.123 on prompt 2, measured 2026-12-01), so comparing against the
// exact CPU would test the rounding, not the kernels. golden_test checks the CPU on the quantized
// folder itself against transformers.
std::string CpuDir(const std::string& name, const std::string& dir) {
  if (!std::filesystem::exists(std::filesystem::path(dir) / "config.json")) return dir;
  std::ifstream in(std::filesystem::path(dir) / "config.json");
  const auto config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.contains("quantization_config")) return dir;
  const std::string method = config["quantization_config"].value("quant_method", "");
  if (method != "fp8" && method != "compressed-tensors") return dir;
  struct Twin {
    std::filesystem::path dir;
    ~Twin() { std::filesystem::remove_all(dir); }
  };
  static std::map<std::string, std::unique_ptr<Twin>> twins;
  auto& t = twins[name];
  if (!t) {
    t = std::make_unique<Twin>();
    std::string tag = name;
    for (char& c : tag) {
      if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
    }
    t->dir = std::filesystem::temp_directory_path() /
             ("mlaserve_gpu_model_twin_" + tag + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(t->dir);
    quantized_fixture::WriteBf16Twin(dir, t->dir);
  }
  return t->dir.string();
}

// The prompt, then 16 greedy decode steps (a's argmax fed to both): every logit bit-identical.
void ExpectPrefillAndDecodeBitIdentical(LocalSession& a_session, LocalSession& b_session,
                                        const std::vector<int32_t>& prompt) {
  auto a = a_session.Feed(prompt, false);
  auto b = b_session.Feed(prompt, false);
  for (int step = 0; step <= 16; ++step) {
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(a->size(), b->size());
    size_t differ = 0;
    for (size_t i = 0; i < a->size(); ++i) differ += (*a)[i] != (*b)[i];
    ASSERT_EQ(differ, 0u) << "step " << step << " (0: the prefill)";
    const int32_t next = int32_t(std::max_element(a->begin(), a->end()) - a->begin());
    a = a_session.Feed({next}, false);
    b = b_session.Feed({next}, false);
  }
}

class GpuModelTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";
    dir_ = ModelDir(GetParam());
    ASSERT_FALSE(HasFatalFailure()) << "writing " << GetParam();
    golden_ = std::make_unique<Golden>(dir_);
    ASSERT_TRUE(golden_->ok()) << dir_;
    auto g = CudaOps::Create();
    ASSERT_TRUE(g.ok()) << g.status();
    gpu_ops_ = std::move(*g);
    ModelOptions o;
    o.kv_format = KvCacheFormat::kBf16;
    o.num_kv_blocks = 8;
    const std::string cpu_dir = CpuDir(GetParam(), dir_);
    ASSERT_FALSE(HasFatalFailure()) << "writing the bf16 twin of " << GetParam();
    auto c = DeepseekV3Model::Load(cpu_dir, o, cpu_ops_, comm_);
    ASSERT_TRUE(c.ok()) << c.status();
    cpu_ = std::move(*c);
    ModelOptions f = o;
    f.kv_format = KvCacheFormat::kF32;
    auto c32 = DeepseekV3Model::Load(cpu_dir, f, cpu_ops_, comm_);
    ASSERT_TRUE(c32.ok()) << c32.status();
    cpu_f32kv_ = std::move(*c32);
    auto m = DeepseekV3Model::Load(dir_, o, *gpu_ops_, comm_);
    ASSERT_TRUE(m.ok()) << m.status();
    gpu_ = std::move(*m);
  }
  // Teacher-forced greedy decode, 32 steps: the GPU picks the CPU's token at every step but at
  // near-ties (CPU margin <= twice the largest logit difference).
  void GreedyDecodeAgainstCpu(const char* what) {
    const int vocab = cpu_->config().vocab_size;
    const auto prompt = golden_->Get<int32_t>("p2.ids");
    LocalSession cs(*cpu_), gs(*gpu_);
    auto cl = cs.Feed(prompt, false);
    auto gl = gs.Feed(prompt, false);
    ASSERT_TRUE(cl.ok() && gl.ok());
    double worst = 0;
    int same = 0, near_ties = 0;
    for (int step = 0; step < 32; ++step) {
      const int32_t c = int32_t(std::max_element(cl->begin(), cl->end()) - cl->begin());
      const int32_t g = int32_t(std::max_element(gl->begin(), gl->end()) - gl->begin());
      double err = 0;
      for (int i = 0; i < vocab; ++i) err = std::max(err, double(std::abs((*gl)[i] - (*cl)[i])));
      worst = std::max(worst, err);
      const double margin = Margin(cl->data(), vocab);
      if (c == g) {
        ++same;
      } else if (margin <= 2 * err) {
        ++near_ties;
      } else {
        ADD_FAILURE() << GetParam() << " greedy step " << step << ": CPU " << c << ", GPU " << g
                      << " (CPU margin " << margin << ", max logit difference " << err << ")";
      }
      // Both continue with the CPU's token (decode through the absorbed path over the cache).
      cl = cs.Feed({c}, false);
      gl = gs.Feed({c}, false);
      ASSERT_TRUE(cl.ok()) << cl.status();
      ASSERT_TRUE(gl.ok()) << gl.status();
    }
    std::printf(
        "[gpu_model] %s greedy (teacher-forced%s): %d of 32 steps pick the CPU's token, %d "
        "near-ties, max logit difference %.3g\n",
        GetParam(), what, same, near_ties, worst);
  }
  // A CudaOps switch against its other setting: gpu_ops_ (set by the caller) against a second
  // CudaOps that `plain` sets, each with the model in a bf16 cache, through a prefill and 16
  // decode steps of prompt p2 (ExpectPrefillAndDecodeBitIdentical).
  void ExpectBitIdenticalTo(const std::function<void(CudaOps&)>& plain, const char* what) {
    auto g = CudaOps::Create();
    ASSERT_TRUE(g.ok()) << g.status();
    std::unique_ptr<CudaOps> ops = std::move(*g);
    plain(*ops);
    ModelOptions o;
    o.kv_format = KvCacheFormat::kBf16;
    o.num_kv_blocks = 8;
    auto m = DeepseekV3Model::Load(dir_, o, *ops, comm_);
    ASSERT_TRUE(m.ok()) << m.status();
    const auto prompt = golden_->Get<int32_t>("p2.ids");
    LocalSession fused(*gpu_), other(**m);
    ExpectPrefillAndDecodeBitIdentical(fused, other, prompt);
    std::printf("[gpu_model] %s %s: prefill and 16 decode steps bit-identical\n", GetParam(), what);
  }
  std::string dir_;
  std::unique_ptr<Golden> golden_;
  CpuOps cpu_ops_{2};
  std::unique_ptr<CudaOps> gpu_ops_;
  SingleRankCommunicator comm_;
  std::unique_ptr<DeepseekV3Model> cpu_, gpu_, cpu_f32kv_;
};

TEST_P(GpuModelTest, PrefillAndChunkedPrefillMatchCpu) {
  const int vocab = cpu_->config().vocab_size;
  for (int p = 0; p < 3; ++p) {
    const auto ids = golden_->Get<int32_t>("p" + std::to_string(p) + ".ids");
    LocalSession cs(*cpu_), gs(*gpu_), fs(*cpu_f32kv_);
    auto cl = cs.Feed(ids, true);
    auto gl = gs.Feed(ids, true);
    auto fl = fs.Feed(ids, true);
    ASSERT_TRUE(cl.ok()) << cl.status();
    ASSERT_TRUE(gl.ok()) << gl.status();
    ASSERT_TRUE(fl.ok()) << fl.status();
    const Agreement a = Compare(*gl, *cl, vocab);
    // The sensitivity probe must read the cache: chunks of 5 read every earlier chunk back, in
    // bf16 from one CPU model and losslessly from the other.
    cs.Reset();
    fs.Reset();
    auto cc = cs.Feed(ids, true, /*chunk=*/5);
    auto fc = fs.Feed(ids, true, /*chunk=*/5);
    ASSERT_TRUE(cc.ok() && fc.ok());
    const Agreement drift = Compare(*cc, *fc, vocab);
    const double bound = std::max(0.05, 3 * drift.rel_l2);
    gs.Reset();
    auto gc = gs.Feed(ids, true, /*chunk=*/5);
    ASSERT_TRUE(gc.ok()) << gc.status();
    const Agreement ac = Compare(*gc, *cl, vocab);
    std::printf(
        "[gpu_model] %s prompt %d (%zu tokens): CPU bf16-vs-f32 KV drift rel %.3g top1 %.3f | "
        "GPU prefill rel %.3g cos %.5f top1 %.3f max %.3g | chunked(5) rel %.3g top1 %.3f "
        "(bound %.3g)\n",
        GetParam(), p, ids.size(), drift.rel_l2, drift.top1, a.rel_l2, a.cosine, a.top1, a.max_abs,
        ac.rel_l2, ac.top1, bound);
    EXPECT_LE(a.rel_l2, bound);
    EXPECT_GE(a.cosine, 0.99);
    EXPECT_LE(ac.rel_l2, bound);
  }
}

TEST_P(GpuModelTest, GreedyDecodeMatchesCpu) { GreedyDecodeAgainstCpu(""); }

// The same with CudaOps::SetFusedPrologues (the q_a norm with q_b and the shared expert's SiLU
// with its down projection, one skinny kernel each at decode).
TEST_P(GpuModelTest, GreedyDecodeWithFusedProloguesMatchesCpu) {
  gpu_ops_->SetFusedPrologues(true);
  GreedyDecodeAgainstCpu(", fused prologues");
}

// And with CudaOps::SetProgrammaticSmallKernels and SetProgrammaticDispatch off (norms, RoPE,
// the MLA input, SiLU, the route kernel and the experts' dispatch launched plainly; programmatic
// is the default), the shared expert in line (SetSharedExpertOverlap off; a side stream is the
// default) and the prologues fused.
TEST_P(GpuModelTest, GreedyDecodeWithoutProgrammaticSmallKernelsMatchesCpu) {
  gpu_ops_->SetProgrammaticSmallKernels(false);
  gpu_ops_->SetProgrammaticDispatch(false);
  gpu_ops_->SetSharedExpertOverlap(false);
  gpu_ops_->SetFusedPrologues(true);
  GreedyDecodeAgainstCpu(", plain small kernels, fused prologues");
}

// CudaOps::SetMlaQFusion (q's RoPE inside the fused MLA input kernel, and the decode kernel
// reading q's rotated RoPE dims from q's rows): the same logits, bit for bit, as the separate
// RoPE kernel and the copy into the absorbed q, through a prefill and 16 decode steps (q's
// absorption by cuBLASLt in both: the fused one needs the q fusion, and sums in another order).
TEST_P(GpuModelTest, MlaQFusionIsBitIdenticalToSeparateOps) {
  gpu_ops_->SetMlaAbsorbFusion(false);
  ExpectBitIdenticalTo([](CudaOps& ops) { ops.SetMlaQFusion(false); }, "MLA q fusion");
}

// CudaOps::SetMoeRouteSplit and SetMoeRouteDispatchFusion (the router a block a token, and fused
// with the routed experts' dispatch where it has at most 256 assignments) against the one-warp
// router and the dispatch's own launch: the same ids, weights and rows by construction, so the
// prefill (two launches: too many assignments, or a grouped router) and 16 decode steps (one
// kernel where the fixture's router is a one-group sigmoid one) are bit-identical.
TEST_P(GpuModelTest, MoeRouteDispatchFusionIsBitIdentical) {
  gpu_ops_->SetMoeRouteSplit(true);
  gpu_ops_->SetMoeRouteDispatchFusion(true);
  ExpectBitIdenticalTo(
      [](CudaOps& ops) {
        ops.SetMoeRouteSplit(false);
        ops.SetMoeRouteDispatchFusion(false);
      },
      "MoE router + dispatch fusion");
}

// CudaOps::SetMoeFewExpertLayer (a 1-4 token step's routed experts as one fused launch where the
// few-expert kernel runs: kernels/moe/moe_few_expert_layer.h) against the four launches: the same
// bits by construction, so the prefill (not fused: too many tokens) and 16 decode steps are
// bit-identical. On BF16 experts neither path applies and the test holds trivially.
TEST_P(GpuModelTest, MoeFewExpertLayerIsBitIdentical) {
  gpu_ops_->SetMoeFewExpertLayer(true);
  ExpectBitIdenticalTo([](CudaOps& ops) { ops.SetMoeFewExpertLayer(false); },
                       "MoE few-expert layer fused");
}

// CudaOps::SetMlaAbsorbFusion (q absorbed inside the fused MLA input kernel at decode steps of up
// to 4 rows) against q absorbed by cuBLASLt in the MLA decode: the prefill bit-identical (it
// does not absorb there), then 16 decode steps fed the same tokens, logits within relative L2
// 0.05. The two sum each absorbed element's products in different fp32 orders, so a bf16
// rounding of q_abs flips now and then (a 2^-8 relative step in an element), and through the
// cache those flips compound over layers and steps: measured on the H200, 0 on six fixtures, and
// 1.2e-3 to 1.2e-2 on kimi-tiny(-nvfp4) and tiny-en(-int4), whose logits move 0.04 already when
// the CPU rounds its cache to bf16 instead of fp32 (PrefillAndChunkedPrefillMatchCpu's drift,
// whose floor of 0.05 this bound shares). cuda_ops_test's MlaInputPrepAbsorbsQ holds the op
// itself to its rounding.
TEST_P(GpuModelTest, MlaAbsorbFusionMatchesCublasAbsorb) {
  auto g = CudaOps::Create();
  ASSERT_TRUE(g.ok()) << g.status();
  std::unique_ptr<CudaOps> ops = std::move(*g);
  ops->SetMlaAbsorbFusion(false);
  gpu_ops_->SetMlaAbsorbFusion(true);
  ModelOptions o;
  o.kv_format = KvCacheFormat::kBf16;
  o.num_kv_blocks = 8;
  auto m = DeepseekV3Model::Load(dir_, o, *ops, comm_);
  ASSERT_TRUE(m.ok()) << m.status();
  const int vocab = gpu_->config().vocab_size;
  const auto prompt = golden_->Get<int32_t>("p2.ids");
  LocalSession fused(*gpu_), plain(**m);
  auto a = fused.Feed(prompt, false);
  auto b = plain.Feed(prompt, false);
  double worst = 0;
  for (int step = 0; step <= 16; ++step) {
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(a->size(), b->size());
    if (step == 0) {
      size_t differ = 0;
      for (size_t i = 0; i < a->size(); ++i) differ += (*a)[i] != (*b)[i];
      ASSERT_EQ(differ, 0u) << "the prefill";
    } else {
      const Agreement ag = Compare(*a, *b, vocab);
      worst = std::max(worst, ag.rel_l2);
      ASSERT_LE(ag.rel_l2, 0.05) << "decode step " << step;
    }
    const int32_t next = int32_t(std::max_element(a->begin(), a->end()) - a->begin());
    a = fused.Feed({next}, false);
    b = plain.Feed({next}, false);
  }
  std::printf("[gpu_model] %s MLA absorb fusion: 16 decode steps, worst logits rel L2 %.3g\n",
              GetParam(), worst);
}

// A sequence of the hand-made steps below: its block table and the tokens it has cached.
struct TestSeq {
  std::vector<int32_t> table;
  int len = 0;
};

// One step feeding toks[i] to seqs[i] (logits for each one's last token); their lengths grow.
StepBatch StepOf(const std::vector<std::vector<int32_t>>& toks, std::vector<TestSeq>& seqs) {
  StepBatch b;
  for (size_t i = 0; i < toks.size(); ++i) {
    SequenceSlice sl;
    sl.token_begin = static_cast<int>(b.tokens.size());
    sl.num_tokens = static_cast<int>(toks[i].size());
    sl.context_len = seqs[i].len;
    sl.block_table = seqs[i].table;
    for (size_t t = 0; t < toks[i].size(); ++t) {
      const int pos = seqs[i].len + static_cast<int>(t);
      b.tokens.push_back(toks[i][t]);
      b.positions.push_back(pos);
      b.slots.push_back(int64_t{sl.block_table[pos / kKvBlockTokens]} * kKvBlockTokens +
                        pos % kKvBlockTokens);
    }
    b.logits_rows.push_back(static_cast<int32_t>(b.tokens.size()) - 1);
    b.seqs.push_back(std::move(sl));
    seqs[i].len += static_cast<int>(toks[i].size());
  }
  return b;
}

// Decode steps replayed as CUDA graphs give the same logits, bit for bit, as the same steps run
// eagerly: one sequence (bucket 1), and three sequences of different lengths (bucket 4: one
// padding sequence), through the eager first step, the capture and the replays, and a prefill
// step in between that grows the scratch (the graphs are then captured again).
TEST_P(GpuModelTest, GraphReplayMatchesEager) {
  auto g = CudaOps::Create();
  ASSERT_TRUE(g.ok()) << g.status();
  std::unique_ptr<CudaOps> graph_ops = std::move(*g);
  ModelOptions o;
  o.kv_format = KvCacheFormat::kBf16;
  o.num_kv_blocks = 8;
  o.graphs = true;
  auto m = DeepseekV3Model::Load(dir_, o, *graph_ops, comm_);
  ASSERT_TRUE(m.ok()) << m.status();
  DeepseekV3Model& graphed = **m;
  const auto prompt = golden_->Get<int32_t>("p1.ids");
  // Three sequences: blocks [0,2), [2,4), [4,6) of the pool, prompts of 3 lengths.
  std::vector<TestSeq> seqs(3);
  for (int i = 0; i < 3; ++i) seqs[i].table = {2 * i, 2 * i + 1};
  for (int n : {1, 3}) {
    std::vector<TestSeq> a(seqs.begin(), seqs.begin() + n), b = a;
    std::vector<std::vector<int32_t>> first;
    for (int i = 0; i < n; ++i)
      first.push_back(std::vector<int32_t>(prompt.begin(), prompt.begin() + 20 + 9 * i));
    std::vector<float> la, lb;
    ASSERT_TRUE(graphed.Forward(StepOf(first, a), &la).ok());
    ASSERT_TRUE(gpu_->Forward(StepOf(first, b), &lb).ok());
    const int vocab = gpu_->config().vocab_size;
    for (int s = 0; s < 8; ++s) {
      if (s == 4) {
        // A prefill of another sequence (blocks 6 and 7) between decode steps: more scratch
        // than a decode step, so the arena grows and the graphs are captured again.
        std::vector<TestSeq> extra_a(1), extra_b(1);
        extra_a[0].table = extra_b[0].table = {6, 7};
        std::vector<std::vector<int32_t>> p100 = {std::vector<int32_t>(100, 7)};
        std::vector<float> ignore;
        ASSERT_TRUE(graphed.Forward(StepOf(p100, extra_a), &ignore).ok());
        ASSERT_TRUE(gpu_->Forward(StepOf(p100, extra_b), &ignore).ok());
      }
      std::vector<std::vector<int32_t>> next;
      for (int i = 0; i < n; ++i) {
        const float* row = lb.data() + static_cast<size_t>(i) * vocab;
        next.push_back({int32_t(std::max_element(row, row + vocab) - row)});
      }
      ASSERT_TRUE(graphed.Forward(StepOf(next, a), &la).ok()) << "step " << s;
      ASSERT_TRUE(gpu_->Forward(StepOf(next, b), &lb).ok()) << "step " << s;
      ASSERT_EQ(la.size(), lb.size());
      size_t differ = 0;
      for (size_t i = 0; i < la.size(); ++i) differ += la[i] != lb[i];
      EXPECT_EQ(differ, 0u) << n << " sequences, decode step " << s;
    }
    std::printf("[gpu_model] %s graphs: %d sequence(s), 8 decode steps bit-identical to eager\n",
                GetParam(), n);
  }
}

// The decode steps of a multi-rank model replayed as CUDA graphs (ModelOptions::multi_rank_graphs,
// the path NCCL ranks take; issue 22) give the same logits, bit for bit, as the same steps run
// eagerly: rank 0 of a two-rank world on one GPU whose collectives are capturable copies
// (ZeroPeerCommunicator: the peer contributes zeros), so the graphs hold the step's all-reduces
// and the vocab-parallel gather. Without multi_rank_graphs no graph is captured.
TEST_P(GpuModelTest, MultiRankGraphReplayMatchesEager) {
  const auto prompt = golden_->Get<int32_t>("p1.ids");
  struct Rank {
    std::unique_ptr<CudaOps> ops;
    std::unique_ptr<ZeroPeerCommunicator> comm;
    std::unique_ptr<DeepseekV3Model> model;
  };
  auto make = [&](bool graphs, bool multi_rank) {
    Rank r;
    auto g = CudaOps::Create();
    EXPECT_TRUE(g.ok()) << g.status();
    if (!g.ok()) return r;
    r.ops = std::move(*g);
    r.comm = std::make_unique<ZeroPeerCommunicator>(r.ops->stream());
    ModelOptions o;
    o.kv_format = KvCacheFormat::kBf16;
    o.num_kv_blocks = 8;
    o.graphs = graphs;
    o.multi_rank_graphs = multi_rank;
    auto m = DeepseekV3Model::Load(dir_, o, *r.ops, *r.comm);
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok()) r.model = std::move(*m);
    return r;
  };
  Rank graphed = make(true, true), eager = make(false, false), gated = make(true, false);
  ASSERT_TRUE(graphed.model && eager.model && gated.model);
  const int vocab = graphed.model->config().vocab_size;
  // Three sequences of different prompt lengths in blocks [0,2), [2,4), [4,6).
  std::vector<TestSeq> seqs(3);
  for (int i = 0; i < 3; ++i) seqs[i].table = {2 * i, 2 * i + 1};
  std::vector<std::vector<int32_t>> first;
  for (int i = 0; i < 3; ++i) {
    first.push_back(std::vector<int32_t>(prompt.begin(), prompt.begin() + 20 + 9 * i));
  }
  std::vector<TestSeq> sa = seqs, sb = seqs, sc = seqs;
  std::vector<float> la, lb, lc;
  ASSERT_TRUE(graphed.model->Forward(StepOf(first, sa), &la).ok());
  ASSERT_TRUE(eager.model->Forward(StepOf(first, sb), &lb).ok());
  ASSERT_TRUE(gated.model->Forward(StepOf(first, sc), &lc).ok());
  for (int s = 0; s < 8; ++s) {
    std::vector<std::vector<int32_t>> next;
    for (int i = 0; i < 3; ++i) {
      const float* row = lb.data() + static_cast<size_t>(i) * vocab;
      next.push_back({int32_t(std::max_element(row, row + vocab) - row)});
    }
    ASSERT_TRUE(graphed.model->Forward(StepOf(next, sa), &la).ok()) << "step " << s;
    ASSERT_TRUE(eager.model->Forward(StepOf(next, sb), &lb).ok()) << "step " << s;
    ASSERT_TRUE(gated.model->Forward(StepOf(next, sc), &lc).ok()) << "step " << s;
    ASSERT_EQ(la.size(), lb.size());
    size_t differ = 0, differ_gated = 0;
    for (size_t i = 0; i < la.size(); ++i) {
      differ += la[i] != lb[i];
      differ_gated += lc[i] != lb[i];
    }
    EXPECT_EQ(differ, 0u) << "decode step " << s;
    EXPECT_EQ(differ_gated, 0u) << "decode step " << s;
  }
  EXPECT_GT(graphed.model->captured_graphs(), 0);
  EXPECT_EQ(gated.model->captured_graphs(), 0);
  std::printf(
      "[gpu_model] %s two-rank graphs: 8 decode steps of 3 sequences bit-identical to "
      "eager (%d graph(s))\n",
      GetParam(), graphed.model->captured_graphs());
}

// The deterministic mode on the GPU (issue 23): bit-identical logits alone, recomputed (whole and
// chunked prefill) and in mixed batches (tests/model/determinism_checks.h), with graphs on (so
// the padded, replayed decode steps are covered too). The default mode is run beside it and how
// often it differs is printed (cuBLASLt's choice by row count, the balanced split-KV, prefill's
// own attention kernel).
TEST_P(GpuModelTest, DeterministicModeIsBatchInvariant) {
  const auto prompt = golden_->Get<int32_t>("p2.ids");
  const auto other = golden_->Get<int32_t>("p1.ids");
  for (bool deterministic : {true, false}) {
    auto g = CudaOps::Create();
    ASSERT_TRUE(g.ok()) << g.status();
    std::unique_ptr<CudaOps> ops = std::move(*g);
    ModelOptions o;
    o.kv_format = KvCacheFormat::kBf16;
    o.num_kv_blocks = 20;
    o.graphs = true;
    o.deterministic = deterministic;
    auto m = DeepseekV3Model::Load(dir_, o, *ops, comm_);
    ASSERT_TRUE(m.ok()) << m.status();
    const determinism::Report r = determinism::Check(**m, prompt, other, 24);
    std::printf("[gpu_model] %s %s: %s\n", GetParam(), deterministic ? "deterministic" : "default",
                r.Describe().c_str());
    if (deterministic) determinism::ExpectNoneDiffer(r);
  }
}

// Decode context parallelism on the GPU (issue 22): two ranks of one DCP group (heads, experts
// and the cache split between them) in two threads on this GPU, each with its own CudaOps,
// collectives through ThreadGroupCommunicator (host-staged; NCCL refuses two ranks on one GPU),
// against one rank holding the whole cache with the same per-token attention (the deterministic
// mode). Both keep activations in bf16 and differ by where the partial sums round (o_proj and the
// experts' rank sums, the merged attention partials), as the GPU and the CPU differ by rounding:
// so the GPU-vs-CPU bound, max(0.05, 3 D) relative L2 of the logits with D the CPU's own
// bf16-vs-f32 KV drift, and cosine >= 0.99, for prompts fed whole and in chunks of 5 (every
// chunk reads the cache back); then 32 teacher-forced greedy steps that pick the one rank's token
// but at near-ties. Both DCP ranks hold the same logits (the lm_head's all-gather), bit for bit.
TEST_P(GpuModelTest, DcpOverTwoRanksMatchesOneRank) {
  constexpr int kRanks = 2;
  const int vocab = gpu_->config().vocab_size;
  auto g = CudaOps::Create();
  ASSERT_TRUE(g.ok()) << g.status();
  std::unique_ptr<CudaOps> alone_ops = std::move(*g);
  ModelOptions o;
  o.kv_format = KvCacheFormat::kBf16;
  o.num_kv_blocks = 8;
  ModelOptions one = o;
  one.num_kv_blocks = o.num_kv_blocks * kRanks;
  one.deterministic = true;
  auto alone = DeepseekV3Model::Load(dir_, one, *alone_ops, comm_);
  ASSERT_TRUE(alone.ok()) << alone.status();

  // The reference: every prompt whole and chunked, then the greedy tokens of prompt 2.
  std::vector<std::vector<float>> want;
  LocalSession ref(**alone);
  for (int p = 0; p < 3; ++p) {
    for (int chunk : {0, 5}) {
      ref.Reset();
      auto l = ref.Feed(golden_->Get<int32_t>("p" + std::to_string(p) + ".ids"), true, chunk);
      ASSERT_TRUE(l.ok()) << l.status();
      want.push_back(*std::move(l));
    }
  }
  const auto prompt = golden_->Get<int32_t>("p2.ids");
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> want_steps;
  ref.Reset();
  auto step = ref.Feed(prompt, false);
  for (int i = 0; i < 32 && step.ok(); ++i) {
    want_steps.push_back(*step);
    tokens.push_back(int32_t(std::max_element(step->begin(), step->end()) - step->begin()));
    step = ref.Feed({tokens.back()}, false);
  }
  ASSERT_TRUE(step.ok()) << step.status();

  // The DCP group: the same calls on both ranks, in their threads.
  ThreadGroup group(kRanks);
  std::vector<std::vector<std::vector<float>>> got(kRanks), got_steps(kRanks);
  std::vector<absl::Status> status(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto made = CudaOps::Create();
      if (!made.ok()) {
        status[r] = made.status();
        return;
      }
      std::unique_ptr<CudaOps> ops = std::move(*made);
      ThreadGroupCommunicator comm(group, r, ops->stream());
      ModelOptions d = o;
      d.dcp = kRanks;
      auto m = DeepseekV3Model::Load(dir_, d, *ops, comm);
      if (!m.ok()) {
        status[r] = m.status();
        return;
      }
      LocalSession s(**m);
      for (int p = 0; p < 3; ++p) {
        for (int chunk : {0, 5}) {
          s.Reset();
          auto l = s.Feed(golden_->Get<int32_t>("p" + std::to_string(p) + ".ids"), true, chunk);
          if (!l.ok()) {
            status[r] = l.status();
            return;
          }
          got[r].push_back(*std::move(l));
        }
      }
      s.Reset();
      auto l = s.Feed(prompt, false);
      for (size_t i = 0; i < tokens.size() && l.ok(); ++i) {
        got_steps[r].push_back(*l);
        l = s.Feed({tokens[i]}, false);
      }
      status[r] = l.status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  ASSERT_EQ(got[0].size(), want.size());
  ASSERT_EQ(got_steps[0].size(), want_steps.size());
  EXPECT_EQ(got[0], got[1]) << "the two ranks' logits differ";
  EXPECT_EQ(got_steps[0], got_steps[1]) << "the two ranks' decode logits differ";

  for (int p = 0; p < 3; ++p) {
    // The CPU's own sensitivity to the cache's rounding (PrefillAndChunkedPrefillMatchCpu's).
    const auto ids = golden_->Get<int32_t>("p" + std::to_string(p) + ".ids");
    LocalSession cs(*cpu_), fs(*cpu_f32kv_);
    auto cc = cs.Feed(ids, true, 5);
    auto fc = fs.Feed(ids, true, 5);
    ASSERT_TRUE(cc.ok() && fc.ok());
    const double bound = std::max(0.05, 3 * Compare(*cc, *fc, vocab).rel_l2);
    for (int c = 0; c < 2; ++c) {
      const Agreement a = Compare(got[0][2 * p + c], want[2 * p + c], vocab);
      std::printf(
          "[gpu_model] %s DCP x%d prompt %d %s: against one rank rel %.3g cos %.5f top1 %.3f "
          "max %.3g (bound %.3g)\n",
          GetParam(), kRanks, p, c == 0 ? "whole" : "chunks of 5", a.rel_l2, a.cosine, a.top1,
          a.max_abs, bound);
      EXPECT_LE(a.rel_l2, bound) << "prompt " << p << (c == 0 ? " whole" : " chunked");
      EXPECT_GE(a.cosine, 0.99) << "prompt " << p << (c == 0 ? " whole" : " chunked");
    }
  }
  int same = 0, near_ties = 0;
  double worst = 0;
  for (size_t i = 0; i < want_steps.size(); ++i) {
    const std::vector<float>& a = got_steps[0][i];
    const std::vector<float>& b = want_steps[i];
    double err = 0;
    for (int v = 0; v < vocab; ++v) err = std::max(err, double(std::abs(a[v] - b[v])));
    worst = std::max(worst, err);
    const int32_t pick = int32_t(std::max_element(a.begin(), a.end()) - a.begin());
    if (pick == tokens[i]) {
      ++same;
    } else if (Margin(b.data(), vocab) <= 2 * err) {
      ++near_ties;
    } else {
      ADD_FAILURE() << GetParam() << " DCP greedy step " << i << ": " << pick << ", one rank "
                    << tokens[i] << " (margin " << Margin(b.data(), vocab) << ", max logit "
                    << "difference " << err << ")";
    }
  }
  std::printf(
      "[gpu_model] %s DCP x%d greedy (teacher-forced): %d of %zu steps pick one rank's token, %d "
      "near-ties, max logit difference %.3g\n",
      GetParam(), kRanks, same, want_steps.size(), near_ties, worst);
}

// The INT4 folder's routed experts are held packed on the GPU (not dequantized to bf16): 4 bits +
// a bf16 scale per 32 weights of the kernels' padded shapes (multiples of 128), and the layer's
// two counters.
TEST(GpuModelInt4Test, ExpertsStayPackedOnTheGpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  const std::string dir = ModelDir("dsv3-tiny-int4");
  ASSERT_FALSE(HasFatalFailure());
  auto g = CudaOps::Create();
  ASSERT_TRUE(g.ok()) << g.status();
  SingleRankCommunicator comm;
  ModelOptions o;
  o.num_kv_blocks = 4;
  auto m = DeepseekV3Model::Load(dir, o, **g, comm);
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config();
  auto pad = [](int x) { return (x + 127) / 128 * 128; };
  int moe_layers = 0;
  for (int i = 0; i < c.num_hidden_layers; ++i) moe_layers += c.IsMoeLayer(i);
  const size_t weights = static_cast<size_t>(moe_layers) * c.n_routed_experts * 3 *
                         pad(c.hidden_size) * pad(c.moe_intermediate_size);
  // Plus each layer's two int counters of the fused few-expert layer (moe_experts.h).
  EXPECT_EQ((*m)->expert_bytes(), weights / 2 + weights / 16 + moe_layers * 2 * sizeof(int));
  std::printf("[gpu_model] dsv3-tiny-int4: routed experts hold %zu bytes on the GPU (bf16: %zu)\n",
              (*m)->expert_bytes(), weights * 2);
}

// The FP8 folder's routed experts are held in FP8 on the GPU (not dequantized to bf16): 1 byte + an
// fp32 scale per 8 x 64 weights of the kernels' padded shapes (multiples of 128), and the layer's
// two counters.
TEST(GpuModelFp8Test, ExpertsStayFp8OnTheGpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  const std::string dir = ModelDir("dsv3-tiny-fp8");
  ASSERT_FALSE(HasFatalFailure());
  auto g = CudaOps::Create();
  ASSERT_TRUE(g.ok()) << g.status();
  SingleRankCommunicator comm;
  ModelOptions o;
  o.num_kv_blocks = 4;
  auto m = DeepseekV3Model::Load(dir, o, **g, comm);
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config();
  ASSERT_EQ(c.quant.method, QuantConfig::Method::kFp8Block);
  auto pad = [](int x) { return (x + 127) / 128 * 128; };
  int moe_layers = 0;
  for (int i = 0; i < c.num_hidden_layers; ++i) moe_layers += c.IsMoeLayer(i);
  const size_t weights = static_cast<size_t>(moe_layers) * c.n_routed_experts * 3 *
                         pad(c.hidden_size) * pad(c.moe_intermediate_size);
  EXPECT_EQ((*m)->expert_bytes(), weights + weights / 128 + moe_layers * 2 * sizeof(int));
  std::printf("[gpu_model] dsv3-tiny-fp8: routed experts hold %zu bytes on the GPU (bf16: %zu)\n",
              (*m)->expert_bytes(), weights * 2);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuModelTest,
                         ::testing::Values("dsv3-tiny", "kimi-tiny", "kimi-tiny-nvfp4",
                                           "noqlora-tiny", "dsv3-tiny-int4", "dsv3-tiny-fp8",
                                           "models/tiny-en", "models/tiny-en-nvfp4", "tiny-en-fp8",
                                           "tiny-en-int4"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return n;
                         });

}  // namespace
}  // namespace mlaserve
