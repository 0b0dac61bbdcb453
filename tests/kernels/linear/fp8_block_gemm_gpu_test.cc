// The FP8 block-128 GEMM (kernels/linear/fp8_block_gemm.h) against a host reference (label gpu;
// skips without an SM90 GPU).
//
// 1. Activation quantization is checked bit for bit: the host computes s = amax / 448 in fp32
//    and FloatToE4m3(x / s) (round to nearest even, saturating), the rule the kernel follows.
// 2. The product is compared with the fp64 sum over the quantized operands,
//    ref[r][c] = sum_k (e4m3(xq) * s_x) * (e4m3(w) * s_w). Bound per element:
//      |gpu - ref| <= 2^-8 |ref| + 2^-9 sum_k |terms|
//    2^-8: the bf16 output's rounding (half an ulp is 2^-9; one more for the fp32 scaling
//    multiply cuBLAS applies per block). 2^-9 sum|terms|: Hopper's FP8 tensor cores add the
//    products of one 128-deep block with fewer than fp32's mantissa bits before the block's
//    partial sum is scaled and promoted to fp32 (the reason DeepSeek chose 128-blocks);
//    measured errors sit well inside (printed).
#include <cmath>
#include <cstring>
#include <cstdio>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/linear/fp8_block_gemm.h"
#include "tests/kernels/device_buffer.h"

namespace mlaserve {
namespace {

struct Shape {
  int64_t m, n, k;
};

class Fp8BlockGemmTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";
    if (!Fp8BlockGemm::Supported(0)) GTEST_SKIP() << "the block-scaled FP8 modes need SM90";
  }
};

TEST_P(Fp8BlockGemmTest, MatchesTheHostReference) {
  const auto [m, n, k] = GetParam();
  const int64_t kb = k / 128, nb = (n + 127) / 128;
  std::mt19937 rng(static_cast<uint32_t>(m * 131 + n * 7 + k));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(-6.0f, 2.0f);
  // x: bf16 with a different magnitude in every 128-column group (so the scales matter), and an
  // all-zero group in row 0 (s = 1).
  std::vector<uint16_t> x(m * k);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < kb; ++g) {
      const float mag = std::exp2(uni(rng));
      for (int64_t c = 0; c < 128; ++c) {
        const float v = (r == 0 && g == 1) ? 0.0f : normal(rng) * mag;
        x[r * k + g * 128 + c] = FloatToBf16(v);
      }
    }
  }
  std::vector<uint8_t> w(n * k);
  for (auto& b : w) b = FloatToE4m3(normal(rng) * 64.0f);
  std::vector<float> ws(nb * kb);
  for (auto& s : ws) s = std::exp2(uni(rng) - 6.0f);

  // Host quantization of x.
  std::vector<uint8_t> xq_ref(m * k);
  std::vector<float> xs_ref(kb * m);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < kb; ++g) {
      float amax = 0.0f;
      for (int64_t c = 0; c < 128; ++c) amax = std::max(amax, std::abs(Bf16ToFloat(x[r * k + g * 128 + c])));
      const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
      xs_ref[g * m + r] = s;
      for (int64_t c = 0; c < 128; ++c) xq_ref[r * k + g * 128 + c] = FloatToE4m3(Bf16ToFloat(x[r * k + g * 128 + c]) / s);
    }
  }

  DeviceBuffer<uint16_t> dx(x.size()), dout(m * n);
  DeviceBuffer<uint8_t> dw(w.size()), dscratch(Fp8BlockGemm::ScratchBytes(m, n, k));
  DeviceBuffer<float> dws(ws.size());
  ASSERT_EQ(dx.Upload(x), cudaSuccess);
  ASSERT_EQ(dw.Upload(w), cudaSuccess);
  ASSERT_EQ(dws.Upload(ws), cudaSuccess);
  CUDA_OK(dout.Poison());
  auto gemm = Fp8BlockGemm::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  Fp8BlockGemm::Args a;
  a.m = m;
  a.n = n;
  a.k = k;
  a.x = dx.ptr;
  a.x_stride = k;
  a.w = dw.ptr;
  a.w_scale = dws.ptr;
  a.out = dout.ptr;
  a.out_stride = n;
  a.scratch = dscratch.ptr;
  const absl::Status st = (*gemm)->Run(a, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_OK(cudaDeviceSynchronize());

  {
    // The scratch holds the codes [mp, k] then (256-byte aligned) the scales [k/128, mp].
    const int64_t mp = (m + Fp8BlockGemm::kRowMultiple - 1) / Fp8BlockGemm::kRowMultiple *
                       Fp8BlockGemm::kRowMultiple;
    const std::vector<uint8_t> scratch = dscratch.Download();
    const std::vector<uint8_t> codes(scratch.begin(), scratch.begin() + m * k);
    EXPECT_EQ(codes, xq_ref) << "activation codes";
    const size_t scale_at = (static_cast<size_t>(mp * k) + 255) / 256 * 256;
    std::vector<float> scales(kb * m);
    for (int64_t g = 0; g < kb; ++g) {
      std::memcpy(&scales[g * m], scratch.data() + scale_at + (g * mp) * 4, m * 4);
    }
    EXPECT_EQ(scales, xs_ref) << "activation scales";
  }

  const std::vector<uint16_t> out = dout.Download();
  double worst = 0;  // max |gpu - ref| / bound
  double worst_rel = 0;
  int bad = 0;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      double ref = 0, mass = 0;
      for (int64_t i = 0; i < k; ++i) {
        const double t = double(E4m3ToFloat(xq_ref[r * k + i])) * xs_ref[(i / 128) * m + r] *
                         double(E4m3ToFloat(w[c * k + i])) * ws[(c / 128) * kb + i / 128];
        ref += t;
        mass += std::abs(t);
      }
      const double got = Bf16ToFloat(out[r * n + c]);
      const double bound = std::ldexp(std::abs(ref), -8) + std::ldexp(mass, -9) + 1e-30;
      const double e = std::abs(got - ref);
      worst = std::max(worst, e / bound);
      worst_rel = std::max(worst_rel, e / (mass + 1e-30));
      if (!(e <= bound) && bad++ < 5) {
        ADD_FAILURE() << "row " << r << " col " << c << ": gpu " << got << " ref " << ref
                      << " bound " << bound;
      }
    }
  }
  std::printf("[fp8_block] m %lld n %lld k %lld: max error %.3f of the bound, %.3g of sum|terms|\n",
              static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
              worst, worst_rel);
  EXPECT_EQ(bad, 0);
}

// DeepSeek-V3/R1 projections at 8-way TP (q_a, kv_a with its 576 rows, q_b, kv_b, o_proj, the
// dense gate_up) at decode and prefill row counts.
INSTANTIATE_TEST_SUITE_P(Shapes, Fp8BlockGemmTest,
                         ::testing::Values(Shape{1, 576, 7168}, Shape{3, 1536, 7168},
                                           Shape{64, 3072, 1536}, Shape{17, 4096, 512},
                                           Shape{33, 7168, 2048}, Shape{256, 640, 512},
                                           Shape{129, 1024, 7168}));

TEST(Fp8BlockGemmErrors, RejectsKNotAMultipleOf512) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  auto gemm = Fp8BlockGemm::Create(0);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  Fp8BlockGemm::Args a;
  a.m = 1;
  a.n = 128;
  a.k = 2304;
  a.x_stride = 2304;
  a.out_stride = 128;
  const absl::Status st = (*gemm)->Run(a, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("multiple of 512"), std::string::npos) << st;
}

}  // namespace
}  // namespace mlaserve
