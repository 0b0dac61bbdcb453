// Every op of the CUDA backend against the CPU backend (the oracle), table-driven over many
// shapes, in the spirit of llama.cpp's test-backend-ops (GPU-BACKEND.md). Label gpu; skips
// where no GPU is present.
//
// Both backends get the same inputs: random values rounded to bf16 first (the GPU's activation
// dtype), so any difference is the GPU's arithmetic. Comparison: NaN fails; then the normalised
// squared error NMSE = sum (gpu - cpu)^2 / sum cpu^2 under a per-op bound:
//  - one bf16 rounding of the output (GatherRows to bf16, RmsNorm, SiluMul, Rope): relative
//    error <= 2^-8 per element, so NMSE <= 2^-16 = 1.5e-5; bound 2e-5. Exact ops (Columns,
//    LogitsRows, Embed into fp32, KvWrite's cache bytes, router ids) are compared exactly.
//  - GEMMs (bf16 in, fp32 accumulate, bf16 out): the output rounding plus summation order,
//    NMSE ~ 1e-6..1e-5; bound 5e-5. fp32-out GEMMs (router logits, lm_head): bound 1e-8 is too
//    tight for cuBLAS's split-k orders at k = 7168, so 1e-6.
//  - attention (q absorbed to bf16, P rounded to bf16 for P.V, latent output bf16, expanded
//    through bf16 W_vb, output bf16; prefill: keys decompressed through kv_b to bf16 first):
//    four to five bf16 roundings in sequence, NMSE ~ 5 x 1.5e-5; bound 2e-4.
//  - routed experts (h rounded to bf16 between the GEMMs, output bf16): bound 1e-4.
#include "worker/backend/cuda_ops.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/mla/kv_cache_format.h"
#include "kernels/mla/mla_kv_prep.h"
#include "kernels/moe/nvfp4_ref.h"
#include "tests/kernels/device_buffer.h"
#include "worker/backend/cpu_ops.h"

namespace mlaserve {
namespace {

std::vector<float> RandomBf16(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = Bf16ToFloat(FloatToBf16(d(rng)));
  return v;
}

Tensor HostF32(const std::vector<float>& v, std::vector<int64_t> shape) {
  Tensor t = Tensor::Host(DType::kF32, std::move(shape));
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}

Tensor HostBf16(const std::vector<float>& v, std::vector<int64_t> shape) {
  Tensor t = Tensor::Host(DType::kBF16, std::move(shape));
  for (size_t i = 0; i < v.size(); ++i) t.data<uint16_t>()[i] = FloatToBf16(v[i]);
  return t;
}

double Nmse(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  double num = 0, den = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (std::isnan(gpu[i])) return INFINITY;
    num += (double(gpu[i]) - cpu[i]) * (double(gpu[i]) - cpu[i]);
    den += double(cpu[i]) * cpu[i];
  }
  return den == 0 ? num : num / den;
}

// One MLA case of CudaOpsTest::RunMlaCase.
struct MlaOpsCase {
  int heads, nope, v;
  KvCacheFormat format;
  std::vector<std::pair<int, int>> seqs;  // (context, new tokens)
};

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";
    auto g = CudaOps::Create();
    ASSERT_TRUE(g.ok()) << g.status();
    gpu_ = std::move(*g);
  }

  // A device tensor of activation values (bf16 on the GPU); the CPU one is fp32 of the same
  // (bf16-representable) values.
  Tensor GpuAct(const std::vector<float>& v, std::vector<int64_t> shape,
                DType dtype = DType::kBF16) {
    auto t = gpu_->Upload(dtype == DType::kBF16 ? HostBf16(v, shape) : HostF32(v, shape));
    EXPECT_TRUE(t.ok()) << t.status();
    return *t;
  }
  std::vector<float> Download(const Tensor& t) {
    std::vector<float> out(t.numel());
    if (t.dtype() == DType::kF32) {
      EXPECT_TRUE(gpu_->CopyToHost(t, out.data()).ok());
    } else if (t.dtype() == DType::kBF16) {
      std::vector<uint16_t> b(t.numel());
      absl::Status s = gpu_->CopyToHost(t, b.data());
      EXPECT_TRUE(s.ok()) << s;
      for (size_t i = 0; i < b.size(); ++i) out[i] = Bf16ToFloat(b[i]);
    } else if (t.dtype() == DType::kI32) {
      std::vector<int32_t> b(t.numel());
      EXPECT_TRUE(gpu_->CopyToHost(t, b.data()).ok());
      for (size_t i = 0; i < b.size(); ++i) out[i] = static_cast<float>(b[i]);
    }
    return out;
  }
  static std::vector<float> Values(const Tensor& cpu) {
    if (cpu.dtype() == DType::kI32) {
      std::vector<float> v(cpu.numel());
      for (int64_t i = 0; i < cpu.numel(); ++i) v[i] = static_cast<float>(cpu.data<int32_t>()[i]);
      return v;
    }
    return std::vector<float>(cpu.data<float>(), cpu.data<float>() + cpu.numel());
  }
  void ExpectClose(const Tensor& g, const Tensor& c, double bound, const std::string& what) {
    const std::vector<float> gv = Download(g), cv = Values(c);
    ASSERT_EQ(gv.size(), cv.size()) << what;
    const double e = Nmse(gv, cv);
    std::printf("[cuda_ops] %-60s nmse %.3g (bound %.1g)\n", what.c_str(), e, bound);
    EXPECT_LE(e, bound) << what;
  }
  // `c`: a CPU tensor, or a second GPU tensor (two GPU paths that must agree bit for bit).
  void ExpectExact(const Tensor& g, const Tensor& c, const std::string& what) {
    const std::vector<float> gv = Download(g),
                             cv = c.device() == Device::kCuda ? Download(c) : Values(c);
    ASSERT_EQ(gv.size(), cv.size()) << what;
    size_t bad = 0;
    for (size_t i = 0; i < cv.size(); ++i) bad += !(gv[i] == cv[i]);
    std::printf("[cuda_ops] %-60s %zu of %zu differ\n", what.c_str(), bad, cv.size());
    EXPECT_EQ(bad, 0u) << what;
  }

  // A step of sequences (context_len, new tokens) with shuffled block tables in a pool of
  // `blocks` blocks.
  StepLayout Layout(const std::vector<std::pair<int, int>>& seqs, int blocks, std::mt19937& rng,
                    int vocab = 1000) {
    StepLayoutOptions o;
    o.vocab_size = vocab;
    o.num_blocks = blocks;
    o.num_slots = int64_t{blocks} * kKvBlockTokens;
    auto l = BuildStepLayout(Batch(seqs, blocks, rng, vocab), o);
    EXPECT_TRUE(l.ok()) << l.status();
    return *l;
  }
  static StepBatch Batch(const std::vector<std::pair<int, int>>& seqs, int blocks,
                         std::mt19937& rng, int vocab) {
    StepBatch b;
    std::vector<int32_t> free(blocks);
    std::iota(free.begin(), free.end(), 0);
    std::shuffle(free.begin(), free.end(), rng);
    size_t next = 0;
    std::uniform_int_distribution<int> id(0, vocab - 1);
    for (auto [ctx, n] : seqs) {
      SequenceSlice s;
      s.token_begin = static_cast<int>(b.tokens.size());
      s.num_tokens = n;
      s.context_len = ctx;
      const int need = (ctx + n + kKvBlockTokens - 1) / kKvBlockTokens;
      for (int i = 0; i < need; ++i) s.block_table.push_back(free.at(next++));
      for (int i = 0; i < n; ++i) {
        const int pos = ctx + i;
        b.tokens.push_back(id(rng));
        b.positions.push_back(pos);
        b.slots.push_back(int64_t{s.block_table[pos / kKvBlockTokens]} * kKvBlockTokens +
                          pos % kKvBlockTokens);
      }
      b.logits_rows.push_back(static_cast<int32_t>(b.tokens.size()) - 1);
      b.seqs.push_back(std::move(s));
    }
    return b;
  }

  // A host pool of `blocks` cache blocks holding every sequence's cached prefix (context_len
  // rows) of random bf16-representable latent and RoPE values, encoded in `format` (fp8 scale
  // 0.5) at the slots of the sequence's block table.
  static Tensor CachedPrefixes(const StepLayout& L, KvCacheFormat format, int blocks,
                               std::mt19937& rng) {
    const size_t row = KvCacheBytesPerToken(format);
    Tensor pool = Tensor::Host(DType::kU8, {blocks, kKvBlockTokens, int64_t(row)});
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> lat(kMlaLatentDim), rope(kMlaRopeDim);
    for (const SequenceSlice& s : L.seqs) {
      for (int j = 0; j < s.context_len; ++j) {
        for (float& x : lat) x = Bf16ToFloat(FloatToBf16(d(rng)));
        for (float& x : rope) x = Bf16ToFloat(FloatToBf16(d(rng)));
        const int64_t slot =
            int64_t{s.block_table[j / kKvBlockTokens]} * kKvBlockTokens + j % kKvBlockTokens;
        KvCacheEncodeRow(format, lat.data(), rope.data(), 0.5f, pool.data<uint8_t>() + slot * row);
      }
    }
    return pool;
  }

  void RunMlaCase(const MlaOpsCase& c, std::mt19937& rng, double bound, const std::string& what);

  std::unique_ptr<CudaOps> gpu_;
  CpuOps cpu_{2};
};

TEST_F(CudaOpsTest, EmbedRmsNormAddRmsNormSiluColumnsRows) {
  std::mt19937 rng(1);
  for (int hidden : {64, 96, 512, 7168}) {
    const StepLayout L = Layout({{0, 7}, {5, 1}, {0, 130}}, 16, rng);
    const int64_t T = L.num_tokens;
    StepTensors cs, gs;
    ASSERT_TRUE(cpu_.BeginStep(L, &cs).ok());
    ASSERT_TRUE(gpu_->BeginStep(L, &gs).ok());
    const std::string tag = "hidden " + std::to_string(hidden);
    // Vocab-parallel embedding: this rank holds ids [300, 800).
    const auto table = RandomBf16(500 * size_t(hidden), rng);
    auto ct = cpu_.Upload(HostBf16(table, {500, hidden}));
    Tensor gt = GpuAct(table, {500, hidden});
    Tensor cx = cpu_.Activation({T, hidden}, DType::kF32);
    Tensor gx = gpu_->Activation({T, hidden}, DType::kF32);
    cpu_.Embed(*ct, 300, cs, cx);
    gpu_->Embed(gt, 300, gs, gx);
    ExpectExact(gx, cx, "Embed " + tag);
    // RmsNorm of the fp32 residual and of a bf16 activation.
    const auto w = RandomBf16(hidden, rng);
    auto cw = cpu_.Upload(HostF32(w, {hidden}));
    auto gw = gpu_->Upload(HostF32(w, {hidden}));
    Tensor ch = cpu_.Activation({T, hidden}), gh = gpu_->Activation({T, hidden});
    cpu_.RmsNorm(cx, *cw, 1e-6f, ch);
    gpu_->RmsNorm(gx, *gw, 1e-6f, gh);
    ExpectClose(gh, ch, 2e-5, "RmsNorm fp32 in " + tag);
    const auto d = RandomBf16(T * hidden, rng);
    Tensor cd = cpu_.Activation({T, hidden});
    std::copy(d.begin(), d.end(), cd.data<float>());
    Tensor gd = GpuAct(d, {T, hidden});
    cpu_.AddRmsNorm(cd, cx, *cw, 1e-6f, ch);
    gpu_->AddRmsNorm(gd, gx, *gw, 1e-6f, gh);
    ExpectExact(gx, cx, "AddRmsNorm residual " + tag);
    ExpectClose(gh, ch, 2e-5, "AddRmsNorm out " + tag);
    Tensor cn = cpu_.Activation({T, hidden}), gn = gpu_->Activation({T, hidden});
    cpu_.RmsNorm(cd, *cw, 1e-6f, cn);
    gpu_->RmsNorm(gd, *gw, 1e-6f, gn);
    ExpectClose(gn, cn, 2e-5, "RmsNorm bf16 in " + tag);
    // SiluMul, Columns, LogitsRows.
    Tensor cs2 = cpu_.Activation({T, hidden}), gs2 = gpu_->Activation({T, hidden});
    cpu_.SiluMul(cd, cn, cs2);
    gpu_->SiluMul(gd, gn, gs2);
    ExpectClose(gs2, cs2, 2e-5, "SiluMul " + tag);
    Tensor cc = cpu_.Activation({T, 16}), gc = gpu_->Activation({T, 16});
    cpu_.Columns(cd, hidden - 16, cc);
    gpu_->Columns(gd, hidden - 16, gc);
    ExpectExact(gc, cc, "Columns " + tag);
    const int64_t R = static_cast<int64_t>(L.logits_rows.size());
    Tensor cr = cpu_.Activation({R, hidden}), gr = gpu_->Activation({R, hidden});
    cpu_.LogitsRows(cd, cs, cr);
    gpu_->LogitsRows(gd, gs, gr);
    ExpectExact(gr, cr, "LogitsRows " + tag);
  }
}

TEST_F(CudaOpsTest, LinearBf16AndNvfp4) {
  std::mt19937 rng(2);
  struct Case {
    int m, n, k;
    bool nvfp4;
    DType out;
  };
  for (const Case& c : std::vector<Case>{{1, 24, 64, false, DType::kBF16},
                                         {7, 576, 7168, false, DType::kBF16},
                                         {257, 1536, 512, false, DType::kBF16},
                                         {3, 384, 7168, false, DType::kF32},
                                         {5, 4096, 512, true, DType::kBF16},
                                         {130, 96, 64, true, DType::kBF16},
                                         {2, 16384, 7168, false, DType::kF32}}) {
    const auto x = RandomBf16(size_t(c.m) * c.k, rng);
    const auto w = RandomBf16(size_t(c.n) * c.k, rng, 0.05f);
    LinearWeight host;
    host.out_features = c.n;
    host.in_features = c.k;
    if (c.nvfp4) {
      host.weight = Tensor::Host(DType::kU8, {c.n, c.k / 2});
      host.block_scale = Tensor::Host(DType::kF8E4M3, {c.n, c.k / 16});
      QuantizeNvfp4(w.data(), c.n, c.k, host.weight.data<uint8_t>(),
                    host.block_scale.data<uint8_t>(), &host.global_scale);
    } else {
      host.weight = HostBf16(w, {c.n, c.k});
    }
    auto cw = cpu_.UploadLinear(host);
    auto gw = gpu_->UploadLinear(host);
    ASSERT_TRUE(cw.ok() && gw.ok());
    StepLayout L;
    StepTensors st;
    ASSERT_TRUE(gpu_->BeginStep(L, &st).ok());
    Tensor cx = cpu_.Activation({c.m, c.k});
    std::copy(x.begin(), x.end(), cx.data<float>());
    Tensor gx = GpuAct(x, {c.m, c.k});
    Tensor co = cpu_.Activation({c.m, c.n}), go = gpu_->Activation({c.m, c.n}, c.out);
    cpu_.Linear(cx, *cw, co);
    gpu_->Linear(gx, *gw, go);
    ExpectClose(go, co, c.out == DType::kF32 ? 1e-6 : 5e-5,
                "Linear " + std::to_string(c.m) + "x" + std::to_string(c.n) + "x" +
                    std::to_string(c.k) + (c.nvfp4 ? " nvfp4" : " bf16") +
                    (c.out == DType::kF32 ? " ->f32" : ""));
  }
}

// AdjoinLinears and the merged products (SetMergedProjectionRows): the weights keep their values
// and shapes once side by side; Linears over them at 5-64 rows gives what the separate products
// give (the same bf16 products, an fp32 sum in another order: within the Linear test's bounds of
// the CPU reference), and does run merged (merged_projections counts it) only where every weight
// is adjoined, dense, and the rows are in range. The NVFP4 weight (held in bf16 with its global
// scale as alpha) checks that each weight's alpha reaches its own columns.
TEST_F(CudaOpsTest, LinearsOverAdjoinedWeights) {
  std::mt19937 rng(4);
  const int k = 1024;
  auto make = [&](int n, bool nvfp4) {
    const auto w = RandomBf16(size_t(n) * k, rng, 0.05f);
    LinearWeight host;
    host.out_features = n;
    host.in_features = k;
    if (nvfp4) {
      host.weight = Tensor::Host(DType::kU8, {n, k / 2});
      host.block_scale = Tensor::Host(DType::kF8E4M3, {n, k / 16});
      QuantizeNvfp4(w.data(), n, k, host.weight.data<uint8_t>(), host.block_scale.data<uint8_t>(),
                    &host.global_scale);
    } else {
      host.weight = HostBf16(w, {n, k});
    }
    return host;
  };
  const std::vector<LinearWeight> host = {make(192, false), make(72, true), make(37, false)};
  std::vector<LinearWeight> cw, gw;
  for (const LinearWeight& h : host) {
    auto c = cpu_.UploadLinear(h);
    auto g = gpu_->UploadLinear(h);
    ASSERT_TRUE(c.ok() && g.ok());
    cw.push_back(*c);
    gw.push_back(*g);
  }
  std::vector<std::vector<float>> before;
  for (const LinearWeight& w : gw) before.push_back(Download(w.weight));
  ASSERT_TRUE(gpu_->AdjoinLinears({&gw[0], &gw[1], &gw[2]}).ok());
  for (size_t i = 0; i < gw.size(); ++i) {
    EXPECT_EQ(gw[i].weight.dim(0), host[i].out_features);
    EXPECT_EQ(gw[i].weight.dim(1), k);
    EXPECT_EQ(Download(gw[i].weight), before[i]) << "weight " << i << " changed";
  }
  EXPECT_EQ(gw[1].weight.data<char>(), gw[0].weight.data<char>() + gw[0].weight.nbytes());
  EXPECT_EQ(gw[2].weight.data<char>(), gw[1].weight.data<char>() + gw[1].weight.nbytes());
  // A weight of another input width is not placed, nor are the ones beside it.
  LinearWeight other = *gpu_->UploadLinear(make(16, false));
  LinearWeight narrow = host[0];
  narrow.out_features = 16;
  narrow.in_features = k / 2;
  narrow.weight = HostBf16(RandomBf16(size_t(16) * (k / 2), rng, 0.05f), {16, k / 2});
  LinearWeight gn = *gpu_->UploadLinear(narrow);
  const void* other_at = other.weight.data<void>();
  ASSERT_TRUE(gpu_->AdjoinLinears({&other, &gn}).ok());
  EXPECT_EQ(other.weight.data<void>(), other_at);

  gpu_->SetMergedProjectionRows(64);
  for (const int m : {1, 4, 5, 8, 16, 33, 64, 65}) {
    const auto x = RandomBf16(size_t(m) * k, rng);
    StepLayout L;
    StepTensors st;
    ASSERT_TRUE(gpu_->BeginStep(L, &st).ok());
    Tensor cx = cpu_.Activation({m, k});
    std::copy(x.begin(), x.end(), cx.data<float>());
    Tensor gx = GpuAct(x, {m, k});
    std::vector<Tensor> co, go;
    for (size_t i = 0; i < gw.size(); ++i) {
      co.push_back(cpu_.Activation({m, gw[i].out_features}));
      cpu_.Linear(cx, cw[i], co.back());
      go.push_back(gpu_->Activation({m, gw[i].out_features}, i == 1 ? DType::kF32 : DType::kBF16));
    }
    const uint64_t merged_before = gpu_->merged_projections();
    gpu_->Linears(gx, {{&gw[0], &go[0]}, {&gw[1], &go[1]}, {&gw[2], &go[2]}});
    const bool merged = gpu_->merged_projections() == merged_before + 1;
    EXPECT_EQ(merged, m > 4 && m <= 64) << m << " rows";
    for (size_t i = 0; i < gw.size(); ++i) {
      ExpectClose(go[i], co[i], i == 1 ? 1e-6 : 5e-5,
                  "Linears " + std::to_string(m) + " rows, adjoined weight " + std::to_string(i) +
                      (merged ? " (merged)" : ""));
    }
    // Not side by side in this order: separate products.
    Tensor o0 = gpu_->Activation({m, gw[0].out_features}),
           o2 = gpu_->Activation({m, gw[2].out_features});
    const uint64_t before_swapped = gpu_->merged_projections();
    gpu_->Linears(gx, {{&gw[2], &o2}, {&gw[0], &o0}});
    EXPECT_EQ(gpu_->merged_projections(), before_swapped) << m << " rows";
    ExpectClose(o0, co[0], 5e-5, "Linears " + std::to_string(m) + " rows, out of order");
  }
  // The batch-invariant mode never merges.
  ASSERT_TRUE(gpu_->SetBatchInvariant(true).ok());
  {
    StepLayout L;
    StepTensors st;
    ASSERT_TRUE(gpu_->BeginStep(L, &st).ok());
    Tensor gx = GpuAct(RandomBf16(size_t(8) * k, rng), {8, k});
    Tensor a = gpu_->Activation({8, gw[0].out_features}), b = gpu_->Activation({8, 72});
    const uint64_t n0 = gpu_->merged_projections();
    gpu_->Linears(gx, {{&gw[0], &a}, {&gw[1], &b}});
    EXPECT_EQ(gpu_->merged_projections(), n0);
  }
  ASSERT_TRUE(gpu_->SetBatchInvariant(false).ok());
}

TEST_F(CudaOpsTest, Rope) {
  std::mt19937 rng(3);
  std::vector<float> inv(32);
  for (int i = 0; i < 32; ++i) inv[i] = std::pow(10000.0f, -2.0f * i / 64);
  auto ci = cpu_.Upload(HostF32(inv, {32}));
  auto gi = gpu_->Upload(HostF32(inv, {32}));
  for (bool interleaved : {false, true}) {
    for (int heads : {1, 16, 128}) {
      const StepLayout L = Layout({{0, 9}, {163800, 1}, {4000, 3}}, 2700, rng);
      StepTensors cs, gs;
      ASSERT_TRUE(cpu_.BeginStep(L, &cs).ok());
      ASSERT_TRUE(gpu_->BeginStep(L, &gs).ok());
      const int qk = 192;
      const auto x = RandomBf16(size_t(L.num_tokens) * heads * qk, rng);
      Tensor cx = cpu_.Activation({L.num_tokens, heads * qk});
      std::copy(x.begin(), x.end(), cx.data<float>());
      Tensor gx = GpuAct(x, {L.num_tokens, heads * qk});
      cpu_.Rope(cx, 128, heads, qk, 64, cs, *ci, 1.1f, interleaved);
      gpu_->Rope(gx, 128, heads, qk, 64, gs, *gi, 1.1f, interleaved);
      ExpectClose(gx, cx, 2e-5,
                  "Rope heads " + std::to_string(heads) + (interleaved ? " interleaved" : ""));
    }
  }
}

// MlaKvPrep fused (CudaOps::SetFusedMlaInput) against the CPU's five ops and against the GPU's
// own unfused ops: k_rope and the cache's rope are the same operations as the unfused GPU path
// (bit for bit); the latent's sum of squares adds in another order, so the latent is held to
// RmsNorm's bound against the CPU, and each decoded cache row to the format's rounding (bf16:
// 2e-5; one e4m3 step is 2^-3 relative, so an fp8 code that flips on a one-ulp latent difference
// moves NMSE by far less than the 2e-3 bound, which a wrong scale or misplaced row exceeds).
TEST_F(CudaOpsTest, MlaKvPrepFused) {
  std::mt19937 rng(31);
  std::vector<float> inv(32);
  for (int i = 0; i < 32; ++i) inv[i] = std::pow(10000.0f, -2.0f * i / 64);
  auto ci = cpu_.Upload(HostF32(inv, {32}));
  auto gi = gpu_->Upload(HostF32(inv, {32}));
  const auto norm_w = RandomBf16(kMlaLatentDim, rng, 0.5f);
  auto cw = cpu_.Upload(HostF32(norm_w, {kMlaLatentDim}));
  auto gw = gpu_->Upload(HostF32(norm_w, {kMlaLatentDim}));
  for (const KvCacheFormat format :
       {KvCacheFormat::kBf16, KvCacheFormat::kFp8, KvCacheFormat::kFp8Tiled}) {
    for (const bool interleaved : {false, true}) {
      // Positions up to 40k (RoPE's accuracy at large angles), shuffled block tables.
      const int blocks = 700;
      const StepLayout L = Layout({{0, 9}, {40000, 1}, {700, 3}, {5, 64}}, blocks, rng);
      const std::string tag = std::string(KvCacheFormatName(format)) +
                              (interleaved ? " interleaved" : "");
      const size_t row = KvCacheBytesPerToken(format);
      Tensor pool = Tensor::Host(DType::kU8, {blocks, kKvBlockTokens, int64_t(row)});
      std::memset(pool.data<uint8_t>(), 0, pool.nbytes());
      KvCacheLayer ck{pool, format, 0.5f};
      KvCacheLayer gk_fused{*gpu_->Upload(pool), format, 0.5f};
      KvCacheLayer gk_plain{*gpu_->Upload(pool), format, 0.5f};
      StepTensors cs, gs;
      ASSERT_TRUE(cpu_.BeginStep(L, &cs).ok());
      ASSERT_TRUE(gpu_->BeginStep(L, &gs).ok());
      const int64_t T = L.num_tokens;
      const auto kv = RandomBf16(T * (kMlaLatentDim + kMlaRopeDim), rng, 2.0f);
      Tensor ckv = HostF32(kv, {T, kMlaLatentDim + kMlaRopeDim});
      Tensor gkv = GpuAct(kv, {T, kMlaLatentDim + kMlaRopeDim});
      Tensor cl = cpu_.Activation({T, kMlaLatentDim}), cr = cpu_.Activation({T, kMlaRopeDim});
      Tensor gl = gpu_->Activation({T, kMlaLatentDim}), gr = gpu_->Activation({T, kMlaRopeDim});
      Tensor pl = gpu_->Activation({T, kMlaLatentDim}), pr = gpu_->Activation({T, kMlaRopeDim});
      cpu_.MlaKvPrep(ckv, *cw, 1e-6f, cs, *ci, 1.1f, interleaved, ck, cl, cr);
      gpu_->SetFusedMlaInput(false);
      gpu_->MlaKvPrep(gkv, *gw, 1e-6f, gs, *gi, 1.1f, interleaved, gk_plain, pl, pr);
      gpu_->SetFusedMlaInput(true);
      gpu_->MlaKvPrep(gkv, *gw, 1e-6f, gs, *gi, 1.1f, interleaved, gk_fused, gl, gr);
      gpu_->SetFusedMlaInput(false);
      ASSERT_TRUE(gpu_->Synchronize().ok()) << tag;
      ExpectClose(gl, cl, 2e-5, "MlaKvPrep latent " + tag);
      ExpectClose(gr, cr, 2e-5, "MlaKvPrep k_rope " + tag);
      ExpectExact(gr, pr, "MlaKvPrep k_rope fused = unfused " + tag);
      // Every written row, decoded, against the CPU's.
      std::vector<uint8_t> fused(pool.nbytes());
      ASSERT_TRUE(gpu_->CopyToHost(gk_fused.pool, fused.data()).ok());
      std::vector<float> got, want;
      std::vector<float> a(576), b(576);
      for (const int64_t slot : L.slots) {
        if (slot < 0) continue;
        KvCacheDecodeRow(format, fused.data() + slot * row, 0.5f, a.data());
        KvCacheDecodeRow(format, ck.pool.data<uint8_t>() + slot * row, 0.5f, b.data());
        got.insert(got.end(), a.begin(), a.end());
        want.insert(want.end(), b.begin(), b.end());
      }
      const double e = Nmse(got, want);
      const double bound = format == KvCacheFormat::kBf16 ? 2e-5 : 2e-3;
      std::printf("[cuda_ops] %-60s nmse %.3g (bound %.1g)\n",
                  ("MlaKvPrep cache rows " + tag).c_str(), e, bound);
      EXPECT_LE(e, bound) << tag;
      EXPECT_FALSE(got.empty()) << tag;
    }
  }
}

// q's absorption inside the fused MLA input kernel (CudaOps::SetMlaAbsorbFusion; decode steps of
// at most 4 rows; more rows leave q_abs empty): q_abs's 512 latent dims of every head against a double-precision sum of the
// same bf16 inputs (one bf16 rounding, NMSE ~1e-6; a wrong head, column or row is O(1): bound
// 1e-5); q itself (its RoPE dims rotated, its nope dims read only) bit-identical to the path
// without the absorption; MlaDecode given the absorbed q against MlaDecode absorbing q itself
// through cuBLASLt (the same bf16 values up to fp32 summation order: bound 1e-5). A step with a
// prefill row leaves q_abs empty.
TEST_F(CudaOpsTest, MlaInputPrepAbsorbsQ) {
  std::mt19937 rng(37);
  std::vector<float> inv(32);
  for (int i = 0; i < 32; ++i) inv[i] = std::pow(10000.0f, -2.0f * i / 64);
  auto gi = gpu_->Upload(HostF32(inv, {32}));
  const auto norm_w = RandomBf16(kMlaLatentDim, rng, 0.5f);
  auto gw = gpu_->Upload(HostF32(norm_w, {kMlaLatentDim}));
  struct Case {
    int heads, nope;
    KvCacheFormat format;
    std::vector<std::pair<int, int>> seqs;  // (context, new tokens)
  };
  const std::vector<Case> cases = {
      {8, 128, KvCacheFormat::kBf16, {{1000, 1}}},
      {8, 128, KvCacheFormat::kFp8Tiled, {{70, 1}, {3000, 1}, {5, 1}}},
      {16, 64, KvCacheFormat::kFp8, {{100, 2}, {1200, 2}}},
      {4, 16, KvCacheFormat::kBf16, {{10, 1}, {20, 1}}},
      {8, 128, KvCacheFormat::kBf16,
       {{70, 1}, {3000, 1}, {5, 1}, {200, 1}, {64, 1}, {1, 1}, {900, 1}, {33, 1}}},
  };
  for (const Case& c : cases) {
    const int blocks = 256, qk = c.nope + kMlaRopeDim, v_dim = 128;
    const StepLayout L = Layout(c.seqs, blocks, rng);
    const std::string tag = std::to_string(c.heads) + " heads, nope " + std::to_string(c.nope) +
                            ", " + std::to_string(L.num_tokens) + " rows " +
                            std::string(KvCacheFormatName(c.format));
    const Tensor pool = CachedPrefixes(L, c.format, blocks, rng);
    KvCacheLayer ga{*gpu_->Upload(pool), c.format, 0.5f}, gb{*gpu_->Upload(pool), c.format, 0.5f};
    StepTensors gs;
    ASSERT_TRUE(gpu_->BeginStep(L, &gs).ok());
    const int64_t T = L.num_tokens;
    const auto kv = RandomBf16(T * (kMlaLatentDim + kMlaRopeDim), rng, 2.0f);
    const auto q = RandomBf16(T * c.heads * qk, rng);
    const auto kb = RandomBf16(size_t(c.heads) * c.nope * kMlaLatentDim, rng, 0.04f);
    const auto vb = RandomBf16(size_t(c.heads) * v_dim * kMlaLatentDim, rng, 0.04f);
    Tensor gkv = GpuAct(kv, {T, kMlaLatentDim + kMlaRopeDim});
    Tensor qa = GpuAct(q, {T, c.heads * qk}), qb = GpuAct(q, {T, c.heads * qk});
    Tensor gkb = GpuAct(kb, {c.heads, c.nope, kMlaLatentDim});
    Tensor gvb = GpuAct(vb, {c.heads, v_dim, kMlaLatentDim});
    Tensor la = gpu_->Activation({T, kMlaLatentDim}), ra = gpu_->Activation({T, kMlaRopeDim});
    Tensor lb = gpu_->Activation({T, kMlaLatentDim}), rb = gpu_->Activation({T, kMlaRopeDim});
    Tensor abs_a, abs_b;
    gpu_->SetMlaAbsorbFusion(true);
    gpu_->MlaInputPrep(gkv, *gw, 1e-6f, gs, *gi, 1.0f, false, ga, la, ra, qa, c.nope, c.heads, qk,
                       gkb, abs_a);
    gpu_->SetMlaAbsorbFusion(false);
    gpu_->MlaInputPrep(gkv, *gw, 1e-6f, gs, *gi, 1.0f, false, gb, lb, rb, qb, c.nope, c.heads, qk,
                       gkb, abs_b);
    ASSERT_TRUE(gpu_->Synchronize().ok()) << tag;
    ASSERT_TRUE(abs_b.empty()) << tag;
    if (T > kMlaPrepAbsorbMaxRows) {  // cuBLASLt's absorption in MlaDecode
      EXPECT_TRUE(abs_a.empty()) << tag;
      continue;
    }
    ASSERT_FALSE(abs_a.empty()) << tag;
    ExpectExact(qa, qb, "MlaInputPrep q with and without the absorption " + tag);
    // The reference: q's nope dims (not touched by the RoPE) times W_kb in double.
    const std::vector<float> got = Download(abs_a);
    std::vector<float> g512, want;
    for (int64_t r = 0; r < T; ++r) {
      for (int h = 0; h < c.heads; ++h) {
        const float* qn = q.data() + (r * c.heads + h) * qk;
        for (int n = 0; n < kMlaLatentDim; ++n) {
          double acc = 0;
          for (int k = 0; k < c.nope; ++k) {
            acc += double(qn[k]) * kb[(size_t(h) * c.nope + k) * kMlaLatentDim + n];
          }
          want.push_back(float(acc));
          g512.push_back(got[(r * c.heads + h) * kMlaQkDim + n]);
        }
      }
    }
    const double e = Nmse(g512, want);
    std::printf("[cuda_ops] %-60s nmse %.3g (bound 1e-05)\n", ("absorbed q " + tag).c_str(), e);
    EXPECT_LE(e, 1e-5) << tag;
    MlaShape shape{c.heads, c.nope, kMlaRopeDim, v_dim, kMlaLatentDim,
                   1.0f / std::sqrt(float(qk))};
    Tensor oa = gpu_->Activation({T, c.heads * v_dim}), ob = gpu_->Activation({T, c.heads * v_dim});
    for (size_t g = 0; g < L.decode.size(); ++g) {
      gpu_->MlaDecode(shape, qa, gkb, gvb, ga, gs, int(g), oa, abs_a);
      gpu_->MlaDecode(shape, qb, gkb, gvb, gb, gs, int(g), ob, Tensor());
    }
    ASSERT_TRUE(gpu_->Synchronize().ok()) << tag;
    const double eo = Nmse(Download(oa), Download(ob));
    std::printf("[cuda_ops] %-60s nmse %.3g (bound 1e-05)\n",
                ("MlaDecode, q absorbed in the prep vs by cuBLASLt " + tag).c_str(), eo);
    EXPECT_LE(eo, 1e-5) << tag;
  }
  // A step with a prefill row: no absorption (MlaDecode absorbs its own rows).
  const StepLayout L = Layout({{0, 3}, {100, 1}}, 64, rng);
  StepTensors gs;
  ASSERT_TRUE(gpu_->BeginStep(L, &gs).ok());
  const int64_t T = L.num_tokens;
  Tensor pool = *gpu_->Upload(Tensor::Host(DType::kU8, {64, kKvBlockTokens, 1152}));
  KvCacheLayer gk{pool, KvCacheFormat::kBf16, 1.0f};
  Tensor gkv = GpuAct(RandomBf16(T * 576, rng), {T, 576});
  Tensor q = GpuAct(RandomBf16(T * 8 * 192, rng), {T, 8 * 192});
  Tensor gkb = GpuAct(RandomBf16(8 * 128 * 512, rng), {8, 128, 512});
  Tensor l = gpu_->Activation({T, 512}), r = gpu_->Activation({T, 64}), absorbed;
  gpu_->SetMlaAbsorbFusion(true);
  gpu_->MlaInputPrep(gkv, *gw, 1e-6f, gs, *gi, 1.0f, false, gk, l, r, q, 128, 8, 192, gkb,
                     absorbed);
  ASSERT_TRUE(gpu_->Synchronize().ok());
  EXPECT_TRUE(absorbed.empty());
}

// KvWrite, then MlaPrefill and MlaDecode on a cache whose prefix was written by both backends
// from the same values; the GPU's output against the CPU's (NMSE at most `bound`).
void CudaOpsTest::RunMlaCase(const MlaOpsCase& c, std::mt19937& rng, double bound,
                             const std::string& what) {
  const int blocks = 256;
  const StepLayout L = Layout(c.seqs, blocks, rng);
  const std::string tag = what + " " + std::to_string(c.heads) + " heads " +
                          std::to_string(c.nope) + "/" + std::to_string(c.v) + " " +
                          std::string(KvCacheFormatName(c.format));
  // The cached prefixes: random rows encoded on the host into one pool for both backends.
  Tensor pool = CachedPrefixes(L, c.format, blocks, rng);
  KvCacheLayer ck{pool, c.format, 0.5f};
  KvCacheLayer gk{*gpu_->Upload(pool), c.format, 0.5f};
  StepTensors cs, gs;
  ASSERT_TRUE(cpu_.BeginStep(L, &cs).ok());
  ASSERT_TRUE(gpu_->BeginStep(L, &gs).ok());
  const int64_t T = L.num_tokens;
  const int qk = c.nope + 64;
  const auto lat = RandomBf16(T * kMlaLatentDim, rng), kr = RandomBf16(T * kMlaRopeDim, rng);
  const auto q = RandomBf16(T * c.heads * qk, rng);
  Tensor cl = HostF32(lat, {T, kMlaLatentDim}), ckr = HostF32(kr, {T, kMlaRopeDim});
  Tensor gl = GpuAct(lat, {T, kMlaLatentDim}), gkr = GpuAct(kr, {T, kMlaRopeDim});
  Tensor cq = HostF32(q, {T, c.heads * qk});
  Tensor gq = GpuAct(q, {T, c.heads * qk});
  cpu_.KvWrite(cl, ckr, cs, ck);
  gpu_->KvWrite(gl, gkr, gs, gk);
  {
    std::vector<uint8_t> gb(pool.nbytes());
    ASSERT_TRUE(gpu_->CopyToHost(gk.pool, gb.data()).ok());
    EXPECT_EQ(std::memcmp(gb.data(), ck.pool.data<uint8_t>(), gb.size()), 0)
        << "KvWrite bytes differ " << tag;
  }
  // kv_b [heads * (nope + v), 512] and its absorbed halves (bf16 values on both sides).
  const auto kvb = RandomBf16(size_t(c.heads) * (c.nope + c.v) * kMlaLatentDim, rng, 0.04f);
  LinearWeight hkvb;
  hkvb.out_features = c.heads * (c.nope + c.v);
  hkvb.in_features = kMlaLatentDim;
  hkvb.weight = HostBf16(kvb, {hkvb.out_features, kMlaLatentDim});
  auto ckvb = cpu_.UploadLinear(hkvb);
  auto gkvb = gpu_->UploadLinear(hkvb);
  std::vector<float> kb(size_t(c.heads) * c.nope * kMlaLatentDim),
      vb(size_t(c.heads) * c.v * kMlaLatentDim);
  for (int h = 0; h < c.heads; ++h) {
    const float* src = kvb.data() + size_t(h) * (c.nope + c.v) * kMlaLatentDim;
    std::copy(src, src + c.nope * kMlaLatentDim, kb.begin() + size_t(h) * c.nope * kMlaLatentDim);
    std::copy(src + c.nope * kMlaLatentDim, src + (c.nope + c.v) * kMlaLatentDim,
              vb.begin() + size_t(h) * c.v * kMlaLatentDim);
  }
  Tensor ckb = HostF32(kb, {c.heads, c.nope, kMlaLatentDim});
  Tensor cvb = HostF32(vb, {c.heads, c.v, kMlaLatentDim});
  Tensor gkb = GpuAct(kb, {c.heads, c.nope, kMlaLatentDim});
  Tensor gvb = GpuAct(vb, {c.heads, c.v, kMlaLatentDim});
  MlaShape shape{c.heads, c.nope, 64, c.v, kMlaLatentDim, 1.0f / std::sqrt(float(qk))};
  Tensor co = cpu_.Activation({T, c.heads * c.v}), go = gpu_->Activation({T, c.heads * c.v});
  cpu_.MlaPrefill(shape, cq, cl, ckr, *ckvb, ck, cs, co);
  gpu_->MlaPrefill(shape, gq, gl, gkr, *gkvb, gk, gs, go);
  for (size_t g = 0; g < L.decode.size(); ++g) {
    cpu_.MlaDecode(shape, cq, ckb, cvb, ck, cs, int(g), co, Tensor());
    gpu_->MlaDecode(shape, gq, gkb, gvb, gk, gs, int(g), go, Tensor());
  }
  ExpectClose(go, co, bound, tag);
}

// The exact form (the 16-head x 4-token steps have 64 query rows, where the fp8 formats would
// otherwise take the e4m3 tensor-core kernel: MlaDecodeOnFp8TensorCores below tests that one).
TEST_F(CudaOpsTest, MlaPrefillAndDecode) {
  gpu_->SetMlaFp8TensorCores(false);
  std::mt19937 rng(4);
  const std::vector<MlaOpsCase> cases = {
      {4, 16, 16, KvCacheFormat::kBf16, {{0, 9}, {0, 1}, {70, 1}, {5, 2}, {130, 4}}},
      {8, 32, 32, KvCacheFormat::kFp8Tiled, {{0, 33}, {200, 1}, {64, 3}, {700, 17}}},
      {16, 128, 128, KvCacheFormat::kBf16, {{0, 257}, {5000, 1}, {129, 1}, {1000, 64}}},
      {16, 128, 128, KvCacheFormat::kFp8, {{0, 64}, {3000, 1}, {3000, 2}, {400, 100}}},
      {16, 128, 128, KvCacheFormat::kFp8Tiled, {{0, 1}, {63, 1}, {64, 4}, {4113, 31}}},
      {128, 128, 128, KvCacheFormat::kBf16, {{0, 40}, {2000, 1}, {777, 1}}},
      {1, 128, 128, KvCacheFormat::kFp8Tiled, {{0, 100}, {1500, 1}}},
  };
  for (const MlaOpsCase& c : cases) RunMlaCase(c, rng, 2e-4, "MLA prefill+decode");
}

// The fp8 formats' decode at 64+ query rows on SM90 runs on e4m3 tensor cores (the default;
// CudaOps::SetMlaFp8TensorCores), whose arithmetic the CPU backend emulates with
// set_mla_fp8_mma_emulation(kQkPv): q rounded to e4m3 with a row scale, P rounded to e4m3 after
// x256. Every decode group here has 64+ rows (heads x s_q), so both backends take that form in
// every call (the emulation applies to every row count; rows < 64 keep the exact kernel).
// Bound: mla_decode_gpu_test bounds the kernel's latent output against the emulation at a
// whole-tensor relative error of 0.1 (its P roundings may differ from the emulation's where a
// split piece's running max differs from the whole block's; independent e4m3 roundings give
// ~0.04); the absorbed v projection sums 512 such latent values with random bf16 weights, which
// keeps the relative RMS error, so NMSE <= 0.1^2 = 1e-2: a wrong layout, group or scale reads
// ~1 (measured on the H100, session 35: 1.8e-4 to 8.2e-4). (The exact form lies within that bound
// as well: mla_decode_gpu_test's element-wise bound is what tells the forms apart.) On GPUs other
// than SM90 (no e4m3 wgmma) the plan keeps the exact kernel, and the test compares against the
// exact CPU form.
TEST_F(CudaOpsTest, MlaDecodeOnFp8TensorCores) {
  gpu_->SetMlaFp8TensorCores(true);
  int dev = 0, major = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), cudaSuccess);
  const bool tensor_cores = major == 9;
  if (tensor_cores) cpu_.set_mla_fp8_mma_emulation(MlaFp8MmaEmulation::kQkPv);
  std::mt19937 rng(9);
  const std::vector<MlaOpsCase> cases = {
      {64, 128, 128, KvCacheFormat::kFp8, {{3000, 1}, {64, 1}, {129, 1}, {4113, 1}, {1, 1}}},
      {64, 128, 128, KvCacheFormat::kFp8Tiled, {{2000, 1}, {63, 1}, {777, 1}}},
      {128, 128, 128, KvCacheFormat::kFp8, {{1500, 1}, {65, 1}}},
      {128, 128, 128, KvCacheFormat::kFp8Tiled, {{300, 2}, {5000, 2}}},
      {16, 128, 128, KvCacheFormat::kFp8, {{1000, 4}, {63, 4}, {128, 4}}},
      {32, 128, 128, KvCacheFormat::kFp8Tiled, {{500, 2}, {65, 2}, {3000, 2}}},
  };
  for (const MlaOpsCase& c : cases) RunMlaCase(c, rng, 1e-2, "MLA decode fp8 tensor cores");
  cpu_.set_mla_fp8_mma_emulation(MlaFp8MmaEmulation::kNone);
}

// Decode context parallelism's three ops (MlaAbsorb, MlaAttend, MlaMergeExpand) for N ranks of
// one group, run one rank after the other on this GPU: the all-gather of q_abs and the all-to-all
// of the partials between them are done on the host (what NCCL's collectives produce). Each op
// against the CPU backend's on the same inputs (the GPU's partials are bf16, the CPU's fp32: the
// attention bound), lse exactly where a rank has no keys (-inf) and within 1e-2 elsewhere (bf16
// q_abs moves a score by ~2^-9 of its size, ~1e-3 here), and the merged output against MlaDecode
// over the whole cache on one rank (the same attention, unsplit). Contexts include tokens whose
// keys are all on one rank (the other ranks' attend_lens 0: the kernel's empty sequences).
TEST_F(CudaOpsTest, DcpAttentionMatchesCpuAndOneRank) {
  std::mt19937 rng(23);
  struct Case {
    std::vector<int> heads;  // each rank's heads (the slots: the largest)
    KvCacheFormat format;
    std::vector<std::pair<int, int>> seqs;  // (context, new tokens)
  };
  const std::vector<Case> cases = {
      {{4, 4}, KvCacheFormat::kBf16, {{0, 3}, {5, 1}, {70, 1}, {130, 1}, {1000, 1}}},
      {{4, 3}, KvCacheFormat::kFp8, {{63, 1}, {64, 1}, {2000, 1}, {0, 1}}},
      {{8, 8, 8, 8}, KvCacheFormat::kFp8Tiled, {{10, 1}, {300, 1}, {5000, 1}, {129, 2}}},
      {{16, 16, 16}, KvCacheFormat::kBf16, {{200, 1}, {4100, 1}, {1, 1}}},
  };
  const int nope = 128, v = 128, qk = nope + kMlaRopeDim, blocks = 512;
  for (const Case& c : cases) {
    const int N = static_cast<int>(c.heads.size());
    const int slots = *std::max_element(c.heads.begin(), c.heads.end());
    const int all_heads = std::accumulate(c.heads.begin(), c.heads.end(), 0);
    const std::string tag = std::to_string(N) + " ranks x " + std::to_string(slots) + " slots " +
                            std::string(KvCacheFormatName(c.format));
    const StepBatch batch = Batch(c.seqs, blocks, rng, 1000);
    const int64_t T = static_cast<int64_t>(batch.tokens.size());
    // Every token's keys (positions 0..its own) in one global pool; rank r's pool holds global
    // block g (g % N == r) as its block g / N.
    StepLayoutOptions one;
    one.vocab_size = 1000;
    one.num_blocks = blocks;
    one.num_slots = int64_t{blocks} * kKvBlockTokens;
    one.per_token_attention = true;
    auto whole = BuildStepLayout(batch, one);
    ASSERT_TRUE(whole.ok()) << whole.status();
    const size_t row = KvCacheBytesPerToken(c.format);
    Tensor pool = Tensor::Host(DType::kU8, {blocks, kKvBlockTokens, int64_t(row)});
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> lat(kMlaLatentDim), rope(kMlaRopeDim);
    for (const SequenceSlice& s : batch.seqs) {
      for (int j = 0; j < s.context_len + s.num_tokens; ++j) {
        for (float& x : lat) x = Bf16ToFloat(FloatToBf16(nd(rng)));
        for (float& x : rope) x = Bf16ToFloat(FloatToBf16(nd(rng)));
        const int64_t slot =
            int64_t{s.block_table[j / kKvBlockTokens]} * kKvBlockTokens + j % kKvBlockTokens;
        KvCacheEncodeRow(c.format, lat.data(), rope.data(), 0.5f,
                         pool.data<uint8_t>() + slot * row);
      }
    }
    const int local_blocks = (blocks + N - 1) / N;
    const size_t block_bytes = size_t{kKvBlockTokens} * row;
    std::vector<Tensor> rank_pools;
    std::vector<StepLayout> layouts;
    for (int r = 0; r < N; ++r) {
      Tensor p = Tensor::Host(DType::kU8, {local_blocks, kKvBlockTokens, int64_t(row)});
      std::memset(p.data<uint8_t>(), 0, p.nbytes());
      for (int g = r; g < blocks; g += N) {
        std::memcpy(p.data<uint8_t>() + size_t(g / N) * block_bytes,
                    pool.data<uint8_t>() + size_t(g) * block_bytes, block_bytes);
      }
      rank_pools.push_back(std::move(p));
      StepLayoutOptions o = one;
      o.per_token_attention = false;
      o.dcp_size = N;
      o.dcp_rank = r;
      auto l = BuildStepLayout(batch, o);
      ASSERT_TRUE(l.ok()) << l.status();
      layouts.push_back(*std::move(l));
    }
    // Every head's q and its W_kb / W_vb (bf16 values); rank r holds heads [first[r], + heads).
    const auto q = RandomBf16(size_t(T) * all_heads * qk, rng);
    const auto kb = RandomBf16(size_t(all_heads) * nope * kMlaLatentDim, rng, 0.04f);
    const auto vb = RandomBf16(size_t(all_heads) * v * kMlaLatentDim, rng, 0.04f);
    const float scale = 1.0f / std::sqrt(float(qk));
    std::vector<int> first(N, 0);
    for (int r = 1; r < N; ++r) first[r] = first[r - 1] + c.heads[r - 1];
    const auto heads_of = [&](const std::vector<float>& x, int r, size_t per_head) {
      return std::vector<float>(x.begin() + first[r] * per_head,
                                x.begin() + (first[r] + c.heads[r]) * per_head);
    };
    const auto q_of = [&](int r) {  // [T, heads_r * qk]
      std::vector<float> out;
      for (int64_t t = 0; t < T; ++t) {
        const float* row0 = q.data() + (size_t(t) * all_heads + first[r]) * qk;
        out.insert(out.end(), row0, row0 + size_t(c.heads[r]) * qk);
      }
      return out;
    };
    // 1. MlaAbsorb on every rank; q_all = the ranks' q_abs in rank order.
    std::vector<float> cpu_q_all, gpu_q_all;
    for (int r = 0; r < N; ++r) {
      const MlaShape shape{c.heads[r], nope, kMlaRopeDim, v, kMlaLatentDim, scale};
      const DcpShape d{N, r, slots};
      const auto qr = q_of(r);
      const auto kbr = heads_of(kb, r, size_t(nope) * kMlaLatentDim);
      Tensor cq_abs = cpu_.Activation({T, slots, kMlaQkDim});
      Tensor gq_abs = gpu_->Activation({T, slots, kMlaQkDim});
      cpu_.MlaAbsorb(shape, d, HostF32(qr, {T, c.heads[r] * qk}),
                     HostF32(kbr, {c.heads[r], nope, kMlaLatentDim}), cq_abs);
      gpu_->MlaAbsorb(shape, d, GpuAct(qr, {T, c.heads[r] * qk}),
                      GpuAct(kbr, {c.heads[r], nope, kMlaLatentDim}), gq_abs);
      ASSERT_TRUE(gpu_->Synchronize().ok()) << tag;
      ExpectClose(gq_abs, cq_abs, 5e-5, "DCP MlaAbsorb rank " + std::to_string(r) + " " + tag);
      const auto cv = Values(cq_abs), gv = Download(gq_abs);
      cpu_q_all.insert(cpu_q_all.end(), cv.begin(), cv.end());
      gpu_q_all.insert(gpu_q_all.end(), gv.begin(), gv.end());
    }
    // 2. MlaAttend on every rank (its cache, its layout); its partials by destination rank.
    std::vector<std::vector<float>> cpu_lat(N), gpu_lat(N), cpu_lse(N), gpu_lse(N);
    for (int r = 0; r < N; ++r) {
      const MlaShape shape{c.heads[r], nope, kMlaRopeDim, v, kMlaLatentDim, scale};
      const DcpShape d{N, r, slots};
      const StepLayout& L = layouts[r];
      KvCacheLayer ck{rank_pools[r], c.format, 0.5f};
      KvCacheLayer gk{*gpu_->Upload(rank_pools[r]), c.format, 0.5f};
      StepTensors cs, gs;
      ASSERT_TRUE(cpu_.BeginStep(L, &cs).ok());
      ASSERT_TRUE(gpu_->BeginStep(L, &gs).ok());
      Tensor cl = cpu_.Activation({N, T, slots, kMlaLatentDim});
      Tensor gl = gpu_->Activation({N, T, slots, kMlaLatentDim});
      Tensor cls = cpu_.Activation({N, T, slots}, DType::kF32);
      Tensor gls = gpu_->Activation({N, T, slots}, DType::kF32);
      Tensor gq_all = GpuAct(gpu_q_all, {N, T, slots, kMlaQkDim});
      for (size_t g = 0; g < L.decode.size(); ++g) {
        cpu_.MlaAttend(shape, d, HostF32(cpu_q_all, {N, T, slots, kMlaQkDim}), ck, cs, int(g), cl,
                       cls);
        gpu_->MlaAttend(shape, d, gq_all, gk, gs, int(g), gl, gls);
      }
      ASSERT_TRUE(gpu_->Synchronize().ok()) << tag;
      const std::string what = "DCP MlaAttend rank " + std::to_string(r) + " " + tag;
      ExpectClose(gl, cl, 2e-4, what);
      const auto cv = Values(cls), gv = Download(gls);
      int bad = 0, empty = 0;
      for (size_t i = 0; i < cv.size(); ++i) {
        empty += std::isinf(cv[i]);
        const bool ok = cv[i] == gv[i] || std::fabs(cv[i] - gv[i]) <= 1e-2f;
        if (!ok && bad++ < 5)
          ADD_FAILURE() << what << ": lse " << i << " " << gv[i] << " vs " << cv[i];
      }
      std::printf("[cuda_ops] %-60s lse: %d differ, %d keyless rows\n", what.c_str(), bad, empty);
      cpu_lat[r] = Values(cl);
      gpu_lat[r] = Download(gl);
      cpu_lse[r] = cv;
      gpu_lse[r] = gv;
    }
    // The all-to-all: rank r receives chunk r (its head slots) of every rank's partials.
    const auto exchange = [&](const std::vector<std::vector<float>>& part, int r) {
      std::vector<float> out;
      for (int src = 0; src < N; ++src) {
        const size_t chunk = part[src].size() / N;
        out.insert(out.end(), part[src].begin() + r * chunk, part[src].begin() + (r + 1) * chunk);
      }
      return out;
    };
    // 3. MlaMergeExpand on every rank, against the CPU's and against one rank's MlaDecode.
    StepTensors ws;
    ASSERT_TRUE(cpu_.BeginStep(*whole, &ws).ok());
    KvCacheLayer wk{pool, c.format, 0.5f};
    const MlaShape all_shape{all_heads, nope, kMlaRopeDim, v, kMlaLatentDim, scale};
    Tensor ref = cpu_.Activation({T, all_heads * v});
    for (size_t g = 0; g < whole->decode.size(); ++g) {
      cpu_.MlaDecode(all_shape, HostF32(q, {T, all_heads * qk}),
                     HostF32(kb, {all_heads, nope, kMlaLatentDim}),
                     HostF32(vb, {all_heads, v, kMlaLatentDim}), wk, ws, int(g), ref, Tensor());
    }
    for (int r = 0; r < N; ++r) {
      const MlaShape shape{c.heads[r], nope, kMlaRopeDim, v, kMlaLatentDim, scale};
      const DcpShape d{N, r, slots};
      const auto vbr = heads_of(vb, r, size_t(v) * kMlaLatentDim);
      Tensor co = cpu_.Activation({T, c.heads[r] * v});
      Tensor go = gpu_->Activation({T, c.heads[r] * v});
      cpu_.MlaMergeExpand(shape, d, HostF32(exchange(cpu_lat, r), {N, T, slots, kMlaLatentDim}),
                          HostF32(exchange(cpu_lse, r), {N, T, slots}),
                          HostF32(vbr, {c.heads[r], v, kMlaLatentDim}), co);
      gpu_->MlaMergeExpand(shape, d, GpuAct(exchange(gpu_lat, r), {N, T, slots, kMlaLatentDim}),
                           GpuAct(exchange(gpu_lse, r), {N, T, slots}, DType::kF32),
                           GpuAct(vbr, {c.heads[r], v, kMlaLatentDim}), go);
      ASSERT_TRUE(gpu_->Synchronize().ok()) << tag;
      ExpectClose(go, co, 2e-4, "DCP MlaMergeExpand rank " + std::to_string(r) + " " + tag);
      // The whole-cache reference's columns of this rank's heads.
      std::vector<float> mine;
      const auto rv = Values(ref);
      for (int64_t t = 0; t < T; ++t) {
        const float* row0 = rv.data() + (size_t(t) * all_heads + first[r]) * v;
        mine.insert(mine.end(), row0, row0 + size_t(c.heads[r]) * v);
      }
      ExpectClose(go, HostF32(mine, {T, c.heads[r] * v}), 2e-4,
                  "DCP rank " + std::to_string(r) + " vs one rank's MlaDecode " + tag);
    }
  }
}

// A compressed-tensors INT4 projection as the loader hands routed experts over
// (LinearWeight::int4_*): w's columns quantized symmetrically per 32 (scale = bf16(amax / 7),
// q = round(w / scale) clamped to [-8, 7], nibble q + 8), placed at columns [col0, col0 + cols)
// of a checkpoint tensor src_cols wide whose other columns are zero.
void QuantizeInt4(const std::vector<float>& w, int rows, int cols, int src_cols, int col0,
                  LinearWeight* lw) {
  const int words = (src_cols + 7) / 8, groups = (src_cols + 31) / 32;
  lw->out_features = rows;
  lw->in_features = cols;
  lw->int4_packed = Tensor::Host(DType::kI32, {rows, words});
  lw->int4_scale = Tensor::Host(DType::kBF16, {rows, groups});
  lw->int4_in = src_cols;
  lw->int4_col0 = col0;
  lw->int4_group = 32;
  auto* packed = lw->int4_packed.data<int32_t>();
  auto* scale = lw->int4_scale.data<uint16_t>();
  std::fill(packed, packed + static_cast<size_t>(rows) * words, static_cast<int32_t>(0x88888888u));
  std::fill(scale, scale + static_cast<size_t>(rows) * groups, 0);
  for (int r = 0; r < rows; ++r) {
    for (int g0 = 0; g0 < cols; g0 += 32) {
      float amax = 0;
      for (int c = g0; c < std::min(cols, g0 + 32); ++c)
        amax = std::max(amax, std::fabs(w[r * cols + c]));
      const uint16_t sb = FloatToBf16(amax > 0 ? amax / 7.0f : 1.0f);
      scale[static_cast<size_t>(r) * groups + (col0 + g0) / 32] = sb;
      for (int c = g0; c < std::min(cols, g0 + 32); ++c) {
        const int q =
            std::clamp(static_cast<int>(std::lround(w[r * cols + c] / Bf16ToFloat(sb))), -8, 7);
        const int col = col0 + c;
        uint32_t word = static_cast<uint32_t>(packed[static_cast<size_t>(r) * words + col / 8]);
        word =
            (word & ~(0xfu << (4 * (col % 8)))) | (static_cast<uint32_t>(q + 8) << (4 * (col % 8)));
        packed[static_cast<size_t>(r) * words + col / 8] = static_cast<int32_t>(word);
      }
    }
  }
}

// A DeepSeek FP8 block-128 projection as the loader hands routed experts over
// (LinearWeight::fp8_*): w placed at rows [row0, row0 + rows) and columns [col0, col0 + cols) of a
// checkpoint tensor [tensor_rows, tensor_cols] otherwise zero, quantized per 128 x 128 block
// (scale_inv = amax / 448, code = the nearest e4m3 of w / scale_inv); the window's codes and the
// tensor's whole scale grid.
void QuantizeFp8(const std::vector<float>& w, int rows, int cols, int tensor_rows, int tensor_cols,
                 int row0, int col0, LinearWeight* lw) {
  const int gr = (tensor_rows + 127) / 128, gc = (tensor_cols + 127) / 128;
  lw->out_features = rows;
  lw->in_features = cols;
  lw->fp8_codes = Tensor::Host(DType::kF8E4M3, {rows, cols});
  lw->fp8_scale_inv = Tensor::Host(DType::kF32, {gr, gc});
  lw->fp8_origin_row = row0;
  lw->fp8_origin_col = col0;
  lw->fp8_block_rows = lw->fp8_block_cols = 128;
  float* scale = lw->fp8_scale_inv.data<float>();
  std::vector<float> amax(static_cast<size_t>(gr) * gc, 0.0f);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      float& a = amax[static_cast<size_t>((row0 + r) / 128) * gc + (col0 + c) / 128];
      a = std::max(a, std::fabs(w[static_cast<size_t>(r) * cols + c]));
    }
  }
  for (size_t i = 0; i < amax.size(); ++i) scale[i] = amax[i] > 0 ? amax[i] / 448.0f : 1.0f;
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const float s = scale[static_cast<size_t>((row0 + r) / 128) * gc + (col0 + c) / 128];
      lw->fp8_codes.data<uint8_t>()[static_cast<size_t>(r) * cols + c] =
          FloatToE4m3(w[static_cast<size_t>(r) * cols + c] / s);
    }
  }
}

// Routed experts: BF16, NVFP4, INT4 and FP8 (kept packed on the GPU, dequantized exactly on the
// CPU: the GPU's weights bf16(q * s) or bf16(fp32(e4m3 * s)) add ~2e-6 to the NMSE, far under the
// bound).
TEST_F(CudaOpsTest, MoeRouteAndExperts) {
  std::mt19937 rng(5);
  enum Format { kBf16, kNvfp4, kInt4, kFp8 };
  struct Case {
    int tokens, hidden, inter, experts, top_k, n_group, topk_group, first, local;
    Format format;
    bool shared;
    // INT4 / FP8: down_proj as a tensor-parallel window of a wider tensor (FP8: gate / up also,
    // their rows [down_col0, + inter) of taller tensors)
    int down_col0 = 0;
  };
  for (const Case& c : std::vector<Case>{{1, 64, 24, 16, 4, 4, 2, 0, 16, kBf16, true},
                                         {7, 96, 32, 32, 8, 1, 1, 0, 32, kNvfp4, true},
                                         {257, 2048, 1408, 64, 6, 1, 1, 16, 32, kBf16, false},
                                         {33, 2048, 1408, 64, 6, 1, 1, 0, 64, kNvfp4, true},
                                         {1, 64, 24, 16, 4, 4, 2, 0, 16, kInt4, true},
                                         {7, 256, 128, 32, 8, 1, 1, 8, 16, kInt4, true, 128},
                                         {33, 2048, 1408, 64, 6, 1, 1, 0, 64, kInt4, false},
                                         {1, 64, 24, 16, 4, 4, 2, 0, 16, kFp8, true},
                                         {7, 256, 128, 32, 8, 1, 1, 8, 16, kFp8, true, 192},
                                         {33, 2048, 1408, 64, 6, 1, 1, 0, 64, kFp8, false}}) {
    const bool nvfp4 = c.format == kNvfp4;
    const std::string tag = std::to_string(c.tokens) + " tokens " + std::to_string(c.hidden) + "/" +
                            std::to_string(c.inter) +
                            (nvfp4               ? " nvfp4"
                             : c.format == kInt4 ? " int4"
                             : c.format == kFp8  ? " fp8"
                                                 : " bf16");
    StepLayout L;
    StepTensors gs;
    ASSERT_TRUE(gpu_->BeginStep(L, &gs).ok());
    MoeRouting r{c.experts, c.top_k, c.n_group, c.topk_group, false, true, 2.5f};
    const auto lg = RandomBf16(size_t(c.tokens) * c.experts, rng, 2.0f);
    std::vector<float> bias(c.experts);
    for (float& b : bias) b = std::uniform_real_distribution<float>(0.0f, 0.2f)(rng);
    Tensor clg = HostF32(lg, {c.tokens, c.experts});
    Tensor glg = GpuAct(lg, {c.tokens, c.experts}, DType::kF32);
    Tensor cb = HostF32(bias, {c.experts});
    Tensor gb = GpuAct(bias, {c.experts}, DType::kF32);
    Tensor cid = cpu_.Activation({c.tokens, c.top_k}, DType::kI32);
    Tensor cw = cpu_.Activation({c.tokens, c.top_k}, DType::kF32);
    Tensor gid = gpu_->Activation({c.tokens, c.top_k}, DType::kI32);
    Tensor gw = gpu_->Activation({c.tokens, c.top_k}, DType::kF32);
    cpu_.MoeRoute(r, clg, cb, cid, cw);
    gpu_->MoeRoute(r, glg, gb, gid, gw);
    ExpectExact(gid, cid, "MoeRoute ids " + tag);
    ExpectExact(gw, cw, "MoeRoute weights " + tag);
    std::vector<ExpertWeights> host(c.local);
    for (ExpertWeights& e : host) {
      for (auto [lw, rows, cols] : {std::tuple{&e.gate, c.inter, c.hidden},
                                    {&e.up, c.inter, c.hidden},
                                    {&e.down, c.hidden, c.inter}}) {
        const auto w = RandomBf16(size_t(rows) * cols, rng, 0.05f);
        lw->out_features = rows;
        lw->in_features = cols;
        if (c.format == kInt4) {
          const bool down = lw == &e.down;
          QuantizeInt4(w, rows, cols, down ? cols + 2 * c.down_col0 : cols, down ? c.down_col0 : 0,
                       lw);
        } else if (c.format == kFp8) {
          const int w0 = c.down_col0;
          const bool down = lw == &e.down;
          QuantizeFp8(w, rows, cols, down ? rows : rows + 2 * w0, down ? cols + 2 * w0 : cols,
                      down ? 0 : w0, down ? w0 : 0, lw);
        } else if (nvfp4) {
          lw->weight = Tensor::Host(DType::kU8, {rows, cols / 2});
          lw->block_scale = Tensor::Host(DType::kF8E4M3, {rows, cols / 16});
          QuantizeNvfp4(w.data(), rows, cols, lw->weight.data<uint8_t>(),
                        lw->block_scale.data<uint8_t>(), &lw->global_scale);
        } else {
          lw->weight = HostBf16(w, {rows, cols});
        }
      }
    }
    auto cex = cpu_.UploadExperts(c.first, c.experts, host);
    auto gex = gpu_->UploadExperts(c.first, c.experts, host);
    ASSERT_TRUE(cex.ok()) << cex.status();
    ASSERT_TRUE(gex.ok()) << gex.status();
    const auto x = RandomBf16(size_t(c.tokens) * c.hidden, rng);
    const auto sh = RandomBf16(size_t(c.tokens) * c.hidden, rng);
    Tensor cx = HostF32(x, {c.tokens, c.hidden}), gx = GpuAct(x, {c.tokens, c.hidden});
    Tensor csh, gsh;
    if (c.shared) {
      csh = HostF32(sh, {c.tokens, c.hidden});
      gsh = GpuAct(sh, {c.tokens, c.hidden});
    }
    Tensor co = cpu_.Activation({c.tokens, c.hidden}), go = gpu_->Activation({c.tokens, c.hidden});
    cpu_.MoeExperts(cx, cid, cw, *cex, csh, co);
    gpu_->MoeExperts(gx, gid, gw, *gex, gsh, go);
    ExpectClose(go, co, 1e-4, "MoeExperts " + tag);
  }
}

// DeepSeek FP8 projections (UploadLinear of an FP8 LinearWeight: dequantized to bf16 on the GPU,
// bf16(fp32(e4m3 * s))) against the CPU, which dequantizes exactly in fp32: the bf16 rounding
// adds ~3e-6 to the NMSE. Shapes of DeepSeek-R1 at 8 ranks (kv_a [576, 7168], q_b [3072, 1536]),
// one padded on both sides and a tensor-parallel window; an fp32 output. Then: the result is the
// BF16 weight's bit for bit (the same GEMM on the same bf16 values: the rounding is
// FloatToBf16's), and in the deterministic mode a row's bits do not depend on the batch.
TEST_F(CudaOpsTest, LinearFp8) {
  std::mt19937 rng(12);
  struct Case {
    int m, n, k;
    int row0 = 0, col0 = 0;  // the weight as a window of a larger tensor
    DType out = DType::kBF16;
  };
  for (const Case& c : std::vector<Case>{{1, 576, 7168},
                                         {7, 3072, 1536},
                                         {64, 100, 64},
                                         {100, 256, 512, 64, 128},
                                         {300, 576, 7168},
                                         {300, 100, 64},
                                         {3, 384, 512, 0, 0, DType::kF32}}) {
    const std::string tag = "Linear fp8 " + std::to_string(c.m) + "x" + std::to_string(c.n) + "x" +
                            std::to_string(c.k) + (c.row0 + c.col0 > 0 ? " window" : "") +
                            (c.out == DType::kF32 ? " ->f32" : "");
    const auto x = RandomBf16(size_t(c.m) * c.k, rng);
    const auto w = RandomBf16(size_t(c.n) * c.k, rng, 0.05f);
    LinearWeight host;
    QuantizeFp8(w, c.n, c.k, c.n + 2 * c.row0, c.k + 2 * c.col0, c.row0, c.col0, &host);
    auto cw = cpu_.UploadLinear(host);
    auto gw = gpu_->UploadLinear(host);
    ASSERT_TRUE(cw.ok()) << cw.status();
    ASSERT_TRUE(gw.ok()) << gw.status();
    // Held as bf16 on the GPU (CudaOps::UploadLinear: faster than its FP8 kernels there).
    EXPECT_TRUE(!gw->fp8() && gw->weight.dtype() == DType::kBF16) << tag;
    StepLayout L;
    StepTensors st;
    ASSERT_TRUE(gpu_->BeginStep(L, &st).ok());
    Tensor cx = cpu_.Activation({c.m, c.k});
    std::copy(x.begin(), x.end(), cx.data<float>());
    Tensor gx = GpuAct(x, {c.m, c.k});
    Tensor co = cpu_.Activation({c.m, c.n}), go = gpu_->Activation({c.m, c.n}, c.out);
    cpu_.Linear(cx, *cw, co);
    gpu_->Linear(gx, *gw, go);
    ExpectClose(go, co, c.out == DType::kF32 ? 2e-5 : 5e-5, tag);
    if (c.m > 256 && c.out == DType::kBF16) {
      // The same bf16 values as a BF16 weight (the CPU's fp32 weight rounded: exactly
      // bf16(fp32(e4m3 * s))).
      LinearWeight b;
      b.out_features = c.n;
      b.in_features = c.k;
      b.weight = Tensor::Host(DType::kBF16, {c.n, c.k});
      for (int64_t i = 0; i < b.weight.numel(); ++i) {
        b.weight.data<uint16_t>()[i] = FloatToBf16(cw->weight.data<float>()[i]);
      }
      auto gb = gpu_->UploadLinear(b);
      ASSERT_TRUE(gb.ok()) << gb.status();
      Tensor gob = gpu_->Activation({c.m, c.n});
      gpu_->Linear(gx, *gb, gob);
      ExpectExact(go, gob, tag + " vs bf16 weight");
    }
  }
  // Deterministic mode: row 0 alone and among 300 rows (the weight-only kernel at every m).
  ASSERT_TRUE(gpu_->SetBatchInvariant(true).ok());
  const int n = 576, k = 7168, m = 300;
  const auto x = RandomBf16(size_t(m) * k, rng);
  const auto w = RandomBf16(size_t(n) * k, rng, 0.05f);
  LinearWeight host;
  QuantizeFp8(w, n, k, n, k, 0, 0, &host);
  auto gw = gpu_->UploadLinear(host);
  ASSERT_TRUE(gw.ok()) << gw.status();
  StepLayout L;
  StepTensors st;
  ASSERT_TRUE(gpu_->BeginStep(L, &st).ok());
  Tensor gx = GpuAct(x, {m, k});
  Tensor gx1 = GpuAct(std::vector<float>(x.begin(), x.begin() + k), {1, k});
  Tensor go = gpu_->Activation({m, n}), go1 = gpu_->Activation({1, n});
  gpu_->Linear(gx, *gw, go);
  gpu_->Linear(gx1, *gw, go1);
  const std::vector<float> all = Download(go), one = Download(go1);
  EXPECT_TRUE(std::equal(one.begin(), one.end(), all.begin()))
      << "deterministic mode: row 0 differs between m = 1 and m = 300";
  ASSERT_TRUE(gpu_->SetBatchInvariant(false).ok());
}

TEST_F(CudaOpsTest, SampleMatchesCpu) {
  std::mt19937 rng(6);
  for (int vocab : {512, 163840}) {
    const int R = 24;
    StepLayout L;
    StepTensors gs;
    ASSERT_TRUE(gpu_->BeginStep(L, &gs).ok());
    const auto lg = RandomBf16(size_t(R) * vocab, rng, 3.0f);
    Tensor cl = HostF32(lg, {R, vocab});
    Tensor gl = GpuAct(lg, {R, vocab}, DType::kF32);
    std::vector<SequenceSampling> params(R);
    std::vector<std::vector<int32_t>> hist(R);
    SamplingBatch b;
    for (int r = 0; r < R; ++r) {
      SequenceSampling& p = params[r];
      p.base.temperature = r % 3 == 0 ? 0.0f : (r % 3 == 1 ? 0.7f : 1.3f);
      p.base.top_k = r % 4 == 0 ? 0 : 40;
      p.base.top_p = r % 5 == 0 ? 0.9f : 1.0f;
      p.base.min_p = r % 7 == 0 ? 0.05f : 0.0f;
      p.base.seed = 1000 + r;
      p.repetition_penalty = r % 2 ? 1.2f : 1.0f;
      p.presence_penalty = r % 6 == 1 ? 0.5f : 0.0f;
      p.frequency_penalty = r % 6 == 2 ? 0.3f : 0.0f;
      p.min_tokens = r % 8 == 0 ? 10 : 0;
      p.eos_ids = {1, 2};
      p.top_logprobs = r % 4 == 2 ? 5 : 0;
      p.want_logprobs = true;
      for (int i = 0; i < 40; ++i)
        hist[r].push_back(std::uniform_int_distribution<int>(0, vocab - 1)(rng));
      b.rows.push_back({&params[r], &hist[r], 25, 15 + r % 3});
    }
    std::vector<SampledOutput> co, go;
    ASSERT_TRUE(cpu_.Sample(cl, b, &co).ok());
    absl::Status s = gpu_->Sample(gl, b, &go);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(go.size(), co.size());
    int diff = 0;
    for (int r = 0; r < R; ++r) {
      diff += go[r].token != co[r].token;
      EXPECT_NEAR(go[r].logprob, co[r].logprob, 1e-4) << "row " << r;
      ASSERT_EQ(go[r].top.size(), co[r].top.size()) << "row " << r;
      for (size_t j = 0; j < co[r].top.size(); ++j)
        EXPECT_EQ(go[r].top[j].first, co[r].top[j].first);
    }
    std::printf("[cuda_ops] Sample vocab %d: %d of %d tokens differ\n", vocab, diff, R);
    EXPECT_EQ(diff, 0);
  }
}

// A failing op reports itself with its name and shapes at the next synchronisation, and later
// ops are skipped rather than run on garbage.
TEST_F(CudaOpsTest, ErrorsNameTheOp) {
  StepLayout L;
  StepTensors gs;
  ASSERT_TRUE(gpu_->BeginStep(L, &gs).ok());
  Tensor x = gpu_->Activation({3, 7});
  LinearWeight w;
  w.out_features = 5;
  w.in_features = 7;
  w.weight = *gpu_->Allocate(DType::kBF16, {5, 7});
  MlaShape shape{3, 7, 64, 9, 512, 1.0f};  // qk_nope 7 has no prefill kernel
  StepLayout P;
  std::mt19937 rng(7);
  P = Layout({{0, 3}}, 4, rng);
  ASSERT_TRUE(gpu_->BeginStep(P, &gs).ok());
  Tensor q = gpu_->Activation({3, 3 * 71});
  Tensor lat = gpu_->Activation({3, 512}), kr = gpu_->Activation({3, 64});
  Tensor out = gpu_->Activation({3, 27});
  LinearWeight kvb;
  kvb.out_features = 3 * 16;
  kvb.in_features = 512;
  kvb.weight = *gpu_->Allocate(DType::kBF16, {48, 512});
  KvCacheLayer cache{*gpu_->Allocate(DType::kU8, {4, 64, 1152}), KvCacheFormat::kBf16, 1.0f};
  gpu_->MlaPrefill(shape, q, lat, kr, kvb, cache, gs, out);
  absl::Status s = gpu_->Synchronize();
  EXPECT_FALSE(s.ok());
  std::printf("[cuda_ops] error message: %s\n", std::string(s.message()).c_str());
  EXPECT_NE(s.message().find("MlaPrefill"), std::string::npos) << s;
}

}  // namespace
}  // namespace mlaserve
