// The model's small GPU ops and dense projections against their CPU references, on random data:
//   InvokeGatherRows  (kernels/embedding/embedding.h)  vs the CpuOps::Embed semantics (exact)
//   InvokeRmsNorm, InvokeAddRmsNorm (kernels/norm/rms_norm.h)  vs RmsNormRef
//   InvokeRope        (kernels/rope/rope.h)            vs RopeRef
//   InvokeSiluMul     (kernels/activation/silu_mul.h)  vs SiluMulRef
//   LinearGemm        (kernels/linear/linear.h)        vs LinearRef
// The references run in fp32 on the bf16 inputs widened exactly; GPU outputs are bf16 unless
// said otherwise. A bf16 value has 8 significant bits, so rounding v to bf16 moves it by at most
// half an ulp <= 2^-8 |v| (2^-9 of the top of v's binade); the tolerances below are
// that rounding plus the fp32 differences each op's comment derives. Every output buffer is
// filled with 0xFF bytes (bf16/fp32 NaN) first, so an element left unwritten fails, and padding
// columns between rows must still hold 0xFF afterwards.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/activation/silu_mul.h"
#include "kernels/activation/silu_mul_ref.h"
#include "kernels/embedding/embedding.h"
#include "kernels/linear/decode_gemm.h"
#include "kernels/linear/linear.h"
#include "kernels/linear/linear_ref.h"
#include "kernels/linear/split_columns.h"
#include "kernels/norm/rms_norm.h"
#include "kernels/norm/rms_norm_ref.h"
#include "kernels/rope/rope.h"
#include "kernels/rope/rope_ref.h"
#include "tests/kernels/device_buffer.h"

namespace mlaserve {
namespace {

#define STATUS_OK(expr)                                    \
  do {                                                     \
    const absl::Status status_ = (expr);                   \
    ASSERT_TRUE(status_.ok()) << #expr << ": " << status_; \
  } while (0)

// Fast random values: a 64-bit generator cut into four 16-bit fields (the big GEMM weights have
// 84M elements, too many for std::normal_distribution).
struct FastRandom {
  std::mt19937_64 gen;
  uint64_t bits = 0;
  int left = 0;
  explicit FastRandom(uint64_t seed) : gen(seed) {}
  // Uniform in [-scale, scale), rounded to bf16.
  uint16_t Bf16(float scale) {
    if (left == 0) {
      bits = gen();
      left = 4;
    }
    const float u = static_cast<float>(bits & 0xffff) / 32768.0f - 1.0f;
    bits >>= 16;
    --left;
    return FloatToBf16(u * scale);
  }
};

std::vector<uint16_t> RandomBf16(FastRandom& rng, size_t n, float scale) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = rng.Bf16(scale);
  return v;
}

std::vector<float> Widen(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = Bf16ToFloat(v[i]);
  return f;
}

// Mismatch bookkeeping: counts failures and keeps the first few for the message.
struct Mismatches {
  std::string what;
  int64_t count = 0;
  std::ostringstream first;
  explicit Mismatches(std::string w) : what(std::move(w)) {}
  void Add(int64_t row, int64_t col, double got, double want, double tol) {
    if (++count <= 8) {
      first << "\n  [" << row << ", " << col << "] got " << got << " want " << want << " (|diff| "
            << std::fabs(got - want) << " > tol " << tol << ")";
    }
  }
  // NaN-safe: a NaN got (unwritten, poison) always fails.
  void Check(int64_t row, int64_t col, double got, double want, double tol) {
    if (!(std::fabs(got - want) <= tol)) Add(row, col, got, want, tol);
  }
  void Expect() const {
    EXPECT_EQ(count, 0) << what << ": " << count << " mismatches" << first.str();
  }
};

constexpr uint16_t kBf16Poison = 0xffff;
constexpr double kBf16HalfUlp = 1.0 / 256;  // 2^-8 relative: the bound of one bf16 rounding

// Checks that out's padding columns [cols, stride) of every row still hold the poison bytes.
template <typename T>
void ExpectPaddingUntouched(const std::vector<T>& out, int64_t rows, int64_t cols, int64_t stride,
                            const std::string& what) {
  int64_t touched = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = cols; c < stride; ++c) {
      T poison;
      std::memset(&poison, 0xff, sizeof(T));
      if (std::memcmp(&out[r * stride + c], &poison, sizeof(T)) != 0) ++touched;
    }
  }
  EXPECT_EQ(touched, 0) << what << ": " << touched << " padding elements written";
}

// ---------------------------------------------------------------------------------------------
// GatherRows: exact. bf16 -> fp32 and bf16 -> bf16 are exact; fp32 -> bf16 must equal
// FloatToBf16 (round to nearest even) bit for bit.
struct GatherCase {
  DType src, out;
  int64_t src_rows;
  int cols, src_pad, out_pad, count;
  int64_t id_offset;
};

TEST(ElementwiseGpuTest, GatherRows) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  const GatherCase cases[] = {
      {DType::kBF16, DType::kF32, 1000, 7168, 0, 0, 257, 0},  // embedding, one rank
      {DType::kBF16, DType::kF32, 500, 7168, 0, 0, 7, 1000},  // vocab-parallel rank 2
      {DType::kBF16, DType::kF32, 300, 64, 8, 3, 1, 300},     // tiny hidden, one token
      {DType::kBF16, DType::kBF16, 257, 7168, 0, 16, 7, 0},   // logits rows
      {DType::kBF16, DType::kBF16, 33, 96, 5, 0, 64, 0},      // odd stride
      {DType::kF32, DType::kBF16, 40, 512, 4, 2, 100, 10},
      {DType::kF32, DType::kF32, 40, 16, 0, 1, 257, -5},
  };
  std::mt19937 gen(1);
  FastRandom rng(2);
  for (const GatherCase& c : cases) {
    const int64_t src_stride = c.cols + c.src_pad, out_stride = c.cols + c.out_pad;
    const size_t src_n = static_cast<size_t>(c.src_rows * src_stride);
    const std::vector<uint16_t> src_bf16 = RandomBf16(rng, src_n, 4.0f);
    std::vector<float> src_f32(src_n);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (auto& v : src_f32) v = normal(gen);  // not bf16-representable: exercises rounding
    // Ids cover this rank's rows and a margin outside on both sides (other ranks' rows).
    std::uniform_int_distribution<int64_t> id_dist(c.id_offset - 20, c.id_offset + c.src_rows + 19);
    std::vector<int32_t> ids(c.count);
    for (auto& id : ids) id = static_cast<int32_t>(id_dist(gen));
    ids[0] = static_cast<int32_t>(c.id_offset + c.src_rows - 1);               // last valid row
    if (c.count > 1) ids[1] = static_cast<int32_t>(c.id_offset + c.src_rows);  // first invalid

    const size_t esize = c.src == DType::kF32 ? 4 : 2, osize = c.out == DType::kF32 ? 4 : 2;
    DeviceBuffer<uint8_t> d_src(src_n * esize), d_out(c.count * out_stride * osize);
    DeviceBuffer<int32_t> d_ids(ids.size());
    ASSERT_NE(d_src.ptr, nullptr);
    ASSERT_NE(d_out.ptr, nullptr);
    ASSERT_NE(d_ids.ptr, nullptr);
    CUDA_OK(cudaMemcpy(d_src.ptr,
                       c.src == DType::kF32 ? static_cast<const void*>(src_f32.data())
                                            : static_cast<const void*>(src_bf16.data()),
                       src_n * esize, cudaMemcpyHostToDevice));
    CUDA_OK(d_ids.Upload(ids));
    CUDA_OK(d_out.Poison());
    GatherRowsParams p;
    p.src = d_src.ptr;
    p.src_dtype = c.src;
    p.src_rows = c.src_rows;
    p.src_stride = src_stride;
    p.cols = c.cols;
    p.ids = d_ids.ptr;
    p.count = c.count;
    p.id_offset = c.id_offset;
    p.out = d_out.ptr;
    p.out_dtype = c.out;
    p.out_stride = out_stride;
    STATUS_OK(InvokeGatherRows(p, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> raw = d_out.Download();

    Mismatches bad("GatherRows " + std::string(DTypeName(c.src)) + "->" +
                   std::string(DTypeName(c.out)) + " cols " + std::to_string(c.cols) + " count " +
                   std::to_string(c.count) + " id_offset " + std::to_string(c.id_offset));
    for (int i = 0; i < c.count; ++i) {
      const int64_t row = static_cast<int64_t>(ids[i]) - c.id_offset;
      const bool valid = row >= 0 && row < c.src_rows;
      for (int col = 0; col < c.cols; ++col) {
        float want = 0.0f;
        if (valid) {
          const size_t s = static_cast<size_t>(row * src_stride + col);
          want = c.src == DType::kF32 ? src_f32[s] : Bf16ToFloat(src_bf16[s]);
        }
        if (c.out == DType::kBF16) want = Bf16ToFloat(FloatToBf16(want));
        const size_t o = static_cast<size_t>(i * out_stride + col);
        float got;
        if (c.out == DType::kF32) {
          std::memcpy(&got, &raw[o * 4], 4);
        } else {
          uint16_t b;
          std::memcpy(&b, &raw[o * 2], 2);
          got = Bf16ToFloat(b);
        }
        bad.Check(i, col, got, want, 0.0);  // exact
      }
    }
    bad.Expect();
    // Padding: bytes [cols, stride) of every row.
    int64_t touched = 0;
    for (int i = 0; i < c.count; ++i) {
      for (size_t b = (i * out_stride + c.cols) * osize; b < (i + 1) * out_stride * osize; ++b) {
        if (raw[b] != 0xff) ++touched;
      }
    }
    EXPECT_EQ(touched, 0) << bad.what << ": padding bytes written";
  }
}

// ---------------------------------------------------------------------------------------------
// RmsNorm. The GPU's fp32 value differs from RmsNormRef's only in the sum of squares: each GPU
// thread adds up to ceil(7168 / 256) = 28 terms (the loop kernel) or 4 x 8 = 32 (the
// register-held rows of up to 8192, for dims that are multiples of 4 with aligned rows; 9000 is
// the loop kernel's again), then a tree over at most 256 threads adds 8 levels, so a
// term passes through at most 40 fp32 additions of positive values (relative error <= 36 * 2^-24
// < 2^-18.8 on the sum; the reference sums in double) and half that through the sqrt; the other
// operations (1 / sqrt, * x, * weight) are the same IEEE operations on both sides, each adding at
// most a relative 2^-24 where its input differs. Then the bf16 rounding (2^-8 |y|):
// |got - y_ref| <= (2^-8 + 2^-18) |y_ref|, plus 1e-30 for exact zeros.
struct NormCase {
  int64_t rows;
  int dim, x_pad, out_pad;
  DType x_dtype;
};

TEST(ElementwiseGpuTest, RmsNorm) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<NormCase> cases;
  for (const int64_t rows : {1, 7, 257}) {
    for (const int dim : {16, 64, 96, 512, 1536, 2048, 7168, 8192, 9000}) {
      cases.push_back({rows, dim, 0, 0, DType::kF32});
      cases.push_back({rows, dim, dim % 3 == 0 ? 5 : 8, 3, DType::kBF16});
      cases.push_back({rows, dim, 8, 4, DType::kBF16});  // aligned bf16 rows
      cases.push_back({rows, dim, 7, 0, DType::kF32});
    }
  }
  FastRandom rng(3);
  std::mt19937 gen(4);
  for (const NormCase& c : cases) {
    const int64_t x_stride = c.dim + c.x_pad, out_stride = c.dim + c.out_pad;
    // Rows with different magnitudes so that the per-row scale matters.
    std::vector<uint16_t> x_bf16 = RandomBf16(rng, c.rows * x_stride, 1.0f);
    std::vector<float> x_f32(c.rows * x_stride);
    std::uniform_real_distribution<float> mag(0.01f, 30.0f);
    for (int64_t r = 0; r < c.rows; ++r) {
      const float m = mag(gen);
      for (int64_t i = 0; i < x_stride; ++i) {
        x_f32[r * x_stride + i] = Bf16ToFloat(x_bf16[r * x_stride + i]) * m * 1.001f;
        x_bf16[r * x_stride + i] = FloatToBf16(x_f32[r * x_stride + i]);
      }
    }
    const std::vector<float> weight = Widen(RandomBf16(rng, c.dim, 2.0f));
    const float eps = 1e-6f;
    // Reference on the contiguous fp32 inputs the GPU sees.
    std::vector<float> xin(c.rows * c.dim), want(c.rows * c.dim);
    for (int64_t r = 0; r < c.rows; ++r) {
      for (int i = 0; i < c.dim; ++i) {
        xin[r * c.dim + i] = c.x_dtype == DType::kF32 ? x_f32[r * x_stride + i]
                                                      : Bf16ToFloat(x_bf16[r * x_stride + i]);
      }
    }
    RmsNormRef(xin.data(), weight.data(), c.rows, c.dim, eps, want.data());

    DeviceBuffer<float> d_xf(x_f32.size()), d_w(weight.size());
    DeviceBuffer<uint16_t> d_xb(x_bf16.size()), d_out(c.rows * out_stride);
    CUDA_OK(d_xf.Upload(x_f32));
    CUDA_OK(d_xb.Upload(x_bf16));
    CUDA_OK(d_w.Upload(weight));
    CUDA_OK(d_out.Poison());
    RmsNormParams p;
    p.rows = c.rows;
    p.dim = c.dim;
    p.eps = eps;
    p.x = c.x_dtype == DType::kF32 ? static_cast<const void*>(d_xf.ptr) : d_xb.ptr;
    p.x_dtype = c.x_dtype;
    p.x_stride = x_stride;
    p.weight = d_w.ptr;
    p.out = d_out.ptr;
    p.out_stride = out_stride;
    STATUS_OK(InvokeRmsNorm(p, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> out = d_out.Download();
    Mismatches bad("RmsNorm " + std::string(DTypeName(c.x_dtype)) + " rows " +
                   std::to_string(c.rows) + " dim " + std::to_string(c.dim) + " x_stride " +
                   std::to_string(x_stride) + " out_stride " + std::to_string(out_stride));
    for (int64_t r = 0; r < c.rows; ++r) {
      for (int i = 0; i < c.dim; ++i) {
        const double w = want[r * c.dim + i];
        bad.Check(r, i, Bf16ToFloat(out[r * out_stride + i]), w,
                  (kBf16HalfUlp + std::ldexp(1.0, -18)) * std::fabs(w) + 1e-30);
      }
    }
    bad.Expect();
    ExpectPaddingUntouched(out, c.rows, c.dim, out_stride, bad.what);
    // In place (the model normalizes q_a's output so): the same values.
    if (c.x_dtype == DType::kBF16 && x_stride == out_stride) {
      CUDA_OK(d_xb.Upload(x_bf16));
      p.x = d_xb.ptr;
      p.out = d_xb.ptr;
      STATUS_OK(InvokeRmsNorm(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint16_t> in_place = d_xb.Download();
      Mismatches bad_ip(bad.what + " in place");
      for (int64_t r = 0; r < c.rows; ++r) {
        for (int i = 0; i < c.dim; ++i) {
          bad_ip.Check(r, i, Bf16ToFloat(in_place[r * x_stride + i]),
                       Bf16ToFloat(out[r * out_stride + i]), 0.0);
        }
      }
      bad_ip.Expect();
    }
  }
}

// AddRmsNorm: the residual update is one fp32 addition, so it must match bit for bit; the norm
// output has RmsNorm's tolerance.
TEST(ElementwiseGpuTest, AddRmsNorm) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  FastRandom rng(5);
  std::mt19937 gen(6);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (const int64_t rows : {1, 7, 257}) {
    for (const int dim : {16, 64, 96, 512, 2048, 7168, 8192, 9000, 7170}) {
      std::vector<float> residual(rows * dim);
      for (auto& v : residual) v = normal(gen);
      const std::vector<uint16_t> delta = RandomBf16(rng, rows * dim, 3.0f);
      const std::vector<float> weight = Widen(RandomBf16(rng, dim, 2.0f));
      const float eps = 1e-5f;
      std::vector<float> sum(rows * dim), want(rows * dim);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] = residual[i] + Bf16ToFloat(delta[i]);
      RmsNormRef(sum.data(), weight.data(), rows, dim, eps, want.data());

      DeviceBuffer<float> d_res(residual.size()), d_w(weight.size());
      DeviceBuffer<uint16_t> d_delta(delta.size()), d_out(rows * dim);
      CUDA_OK(d_res.Upload(residual));
      CUDA_OK(d_delta.Upload(delta));
      CUDA_OK(d_w.Upload(weight));
      CUDA_OK(d_out.Poison());
      AddRmsNormParams p;
      p.rows = rows;
      p.dim = dim;
      p.eps = eps;
      p.residual = d_res.ptr;
      p.delta = d_delta.ptr;
      p.weight = d_w.ptr;
      p.out = d_out.ptr;
      STATUS_OK(InvokeAddRmsNorm(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> res_got = d_res.Download();
      const std::vector<uint16_t> out = d_out.Download();
      const std::string what =
          "AddRmsNorm rows " + std::to_string(rows) + " dim " + std::to_string(dim);
      Mismatches bad_res(what + " residual"), bad_out(what + " out");
      for (int64_t r = 0; r < rows; ++r) {
        for (int i = 0; i < dim; ++i) {
          const size_t k = r * dim + i;
          bad_res.Check(r, i, res_got[k], sum[k], 0.0);
          bad_out.Check(r, i, Bf16ToFloat(out[k]), want[k],
                        (kBf16HalfUlp + std::ldexp(1.0, -18)) * std::fabs(want[k]) + 1e-30);
        }
      }
      bad_res.Expect();
      bad_out.Expect();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Rope. The GPU repeats RopeRef's fp32 operations one by one (no FMA contraction), except that
// CUDA's cosf/sinf (2 ulp) and glibc's (< 1 ulp) may differ by 3 ulp = 3 * 2^-24 relative (the
// argument is the same fp32 number on both sides). So the fp32 results differ by at most about
// 2^-21 * scaling * (|x0| + |x1|) and then round to bf16: |got - y_ref| <= 2^-8 |y_ref| +
// 2^-20 * scaling * (|x0| + |x1|).
struct RopeCase {
  int64_t rows;
  int per_row;
  int dim;
  int64_t first_col, vec_stride, row_pad;
  bool interleaved;
  float scaling;
};

TEST(ElementwiseGpuTest, Rope) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<RopeCase> cases;
  for (const int64_t rows : {1, 7, 257}) {
    for (const bool il : {false, true}) {
      cases.push_back({rows, 128, 64, 128, 192, 0, il, 1.0f});  // q heads: nope 128 + rope 64
      cases.push_back({rows, 1, 64, 512, 64, 0, il, 1.2f});     // kv_a: latent 512 + rope 64
      cases.push_back({rows, 16, 16, 8, 40, 5, il, 0.75f});     // tiny model, padded rows
      cases.push_back({rows, 3, 128, 0, 130, 2, il, 1.0f});
      cases.push_back({rows, 1, 512, 3, 512, 1, il, 1.0f});  // widest supported
    }
  }
  FastRandom rng(7);
  std::mt19937 gen(8);
  for (const RopeCase& c : cases) {
    const int64_t row_stride = c.first_col + (c.per_row - 1) * c.vec_stride + c.dim + c.row_pad;
    const std::vector<uint16_t> x = RandomBf16(rng, c.rows * row_stride, 2.0f);
    std::vector<int32_t> positions(c.rows);
    std::uniform_int_distribution<int32_t> pos_dist(0, 163839);
    for (auto& p : positions) p = pos_dist(gen);
    positions[0] = 163839;  // the largest position the model serves
    if (c.rows > 1) positions[1] = 0;
    std::vector<float> inv_freq(c.dim / 2);
    for (int i = 0; i < c.dim / 2; ++i) {
      inv_freq[i] = 1.0f / std::pow(10000.0f, 2.0f * i / c.dim);
    }
    // Reference as CpuOps::Rope calls it: one row at a time, its per_row vectors sharing the
    // row's position.
    std::vector<float> want = Widen(x);
    for (int64_t r = 0; r < c.rows; ++r) {
      RopeRef(want.data() + r * row_stride + c.first_col, c.per_row, c.vec_stride, c.per_row,
              &positions[r], inv_freq.data(), c.dim, c.scaling, c.interleaved);
    }
    DeviceBuffer<uint16_t> d_x(x.size());
    DeviceBuffer<int32_t> d_pos(positions.size());
    DeviceBuffer<float> d_freq(inv_freq.size());
    CUDA_OK(d_x.Upload(x));
    CUDA_OK(d_pos.Upload(positions));
    CUDA_OK(d_freq.Upload(inv_freq));
    RopeParams p;
    p.x = d_x.ptr;
    p.rows = c.rows;
    p.row_stride = row_stride;
    p.first_col = c.first_col;
    p.per_row = c.per_row;
    p.vec_stride = c.vec_stride;
    p.dim = c.dim;
    p.positions = d_pos.ptr;
    p.inv_freq = d_freq.ptr;
    p.attention_scaling = c.scaling;
    p.interleaved = c.interleaved;
    STATUS_OK(InvokeRope(p, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = d_x.Download();
    Mismatches bad("Rope rows " + std::to_string(c.rows) + " per_row " + std::to_string(c.per_row) +
                   " dim " + std::to_string(c.dim) + " first_col " + std::to_string(c.first_col) +
                   " vec_stride " + std::to_string(c.vec_stride) +
                   (c.interleaved ? " interleaved" : " halves") + " scaling " +
                   std::to_string(c.scaling));
    const int half = c.dim / 2;
    for (int64_t r = 0; r < c.rows; ++r) {
      std::vector<bool> in_vec(row_stride, false);
      for (int j = 0; j < c.per_row; ++j) {
        const int64_t base = r * row_stride + c.first_col + j * c.vec_stride;
        for (int i = 0; i < c.dim; ++i) in_vec[c.first_col + j * c.vec_stride + i] = true;
        for (int i = 0; i < c.dim; ++i) {
          const int pair = i % half;
          const float x0 = Bf16ToFloat(x[base + (c.interleaved ? 2 * pair : pair)]);
          const float x1 = Bf16ToFloat(x[base + (c.interleaved ? 2 * pair + 1 : pair + half)]);
          const double w = want[base + i];
          const double tol = kBf16HalfUlp * std::fabs(w) +
                             std::ldexp(1.0, -20) * c.scaling * (std::fabs(x0) + std::fabs(x1));
          bad.Check(r, base - r * row_stride + i, Bf16ToFloat(got[base + i]), w, tol);
        }
      }
      // Everything outside the rotary vectors must be untouched (bit for bit).
      for (int64_t col = 0; col < row_stride; ++col) {
        if (!in_vec[col] && got[r * row_stride + col] != x[r * row_stride + col]) {
          bad.Add(r, col, Bf16ToFloat(got[r * row_stride + col]),
                  Bf16ToFloat(x[r * row_stride + col]), 0.0);
        }
      }
    }
    bad.Expect();
  }
}

// ---------------------------------------------------------------------------------------------
// SiluMul. fp32 differences: expf 2 ulp (CUDA) vs < 1 ulp (glibc), then one add, one division,
// one multiply, each correctly rounded on both sides: relative < 8 * 2^-24 = 2^-21 in all, then
// the bf16 rounding: |got - y_ref| <= (2^-8 + 2^-20) |y_ref| + 1e-30.
TEST(ElementwiseGpuTest, SiluMul) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  FastRandom rng(9);
  for (const int64_t rows : {1, 7, 257}) {
    for (const int cols : {16, 96, 1408, 2048, 18432}) {
      if (rows == 257 && cols == 18432) continue;  // 4.7M elements: enough covered elsewhere
      // gate and up are the two halves of one GEMM output row, padded: in_stride = 2 cols + 8.
      const int64_t in_stride = 2 * cols + 8, out_stride = cols + (cols % 3 == 0 ? 1 : 0);
      const std::vector<uint16_t> gate_up = RandomBf16(rng, rows * in_stride, 12.0f);
      std::vector<float> g(rows * cols), u(rows * cols), want(rows * cols);
      for (int64_t r = 0; r < rows; ++r) {
        for (int c = 0; c < cols; ++c) {
          g[r * cols + c] = Bf16ToFloat(gate_up[r * in_stride + c]);
          u[r * cols + c] = Bf16ToFloat(gate_up[r * in_stride + cols + c]);
        }
      }
      SiluMulRef(g.data(), u.data(), rows * cols, want.data());
      DeviceBuffer<uint16_t> d_in(gate_up.size()), d_out(rows * out_stride);
      CUDA_OK(d_in.Upload(gate_up));
      CUDA_OK(d_out.Poison());
      SiluMulParams p;
      p.rows = rows;
      p.cols = cols;
      p.gate = d_in.ptr;
      p.up = d_in.ptr + cols;
      p.in_stride = in_stride;
      p.out = d_out.ptr;
      p.out_stride = out_stride;
      STATUS_OK(InvokeSiluMul(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint16_t> out = d_out.Download();
      Mismatches bad("SiluMul rows " + std::to_string(rows) + " cols " + std::to_string(cols));
      for (int64_t r = 0; r < rows; ++r) {
        for (int c = 0; c < cols; ++c) {
          const double w = want[r * cols + c];
          bad.Check(r, c, Bf16ToFloat(out[r * out_stride + c]), w,
                    (kBf16HalfUlp + std::ldexp(1.0, -20)) * std::fabs(w) + 1e-30);
        }
      }
      bad.Expect();
      ExpectPaddingUntouched(out, rows, cols, out_stride, bad.what);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SplitColumns (the merged projection's epilogue): exact. out = alpha * src in fp32, then one
// round to nearest even for bf16 outputs (FloatToBf16); the host does the same fp32 multiply.
// Cases take the 16-byte path (every width and stride a multiple of 4) and the one-element path
// (Kimi's 1536 + 576 columns, then widths of 37 and 5), fp32 and bf16 outputs with padded
// strides (whose padding must stay untouched), 1-4 segments.
TEST(ElementwiseGpuTest, SplitColumns) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  struct Seg {
    int64_t cols;
    DType dtype;
    int pad;
    float alpha;
  };
  struct Case {
    int64_t rows;
    int src_pad;
    std::vector<Seg> segs;
  };
  const std::vector<Case> cases = {
      {64, 0, {{1536, DType::kBF16, 0, 1.0f}, {576, DType::kBF16, 0, 1.0f}}},
      {7, 4, {{256, DType::kBF16, 4, 0.37f}, {256, DType::kF32, 8, 1.0f}}},
      {5,
       1,
       {{37, DType::kBF16, 3, 1.5f}, {64, DType::kF32, 0, -2.0f}, {5, DType::kBF16, 1, 1.0f}}},
      {33,
       0,
       {{8, DType::kF32, 0, 1.0f},
        {12, DType::kBF16, 0, 0.5f},
        {4, DType::kBF16, 0, 3.0f},
        {16, DType::kF32, 4, 0.25f}}},
      {70000, 0, {{4, DType::kBF16, 0, 1.0f}, {4, DType::kF32, 0, 2.0f}}},  // rows past gridDim.y
  };
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 3.0f);
  for (const Case& c : cases) {
    int64_t total = 0;
    for (const Seg& g : c.segs) total += g.cols;
    const int64_t src_stride = total + c.src_pad;
    std::vector<float> src(c.rows * src_stride);
    for (float& v : src) v = d(rng);
    DeviceBuffer<float> d_src(src.size());
    CUDA_OK(cudaMemcpy(d_src.ptr, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
    std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> b16;
    std::vector<std::unique_ptr<DeviceBuffer<float>>> f32;
    SplitColumnsParams p;
    p.rows = c.rows;
    p.src = d_src.ptr;
    p.src_stride = src_stride;
    for (const Seg& g : c.segs) {
      SplitColumnsParams::Segment& s = p.seg[p.num_segments++];
      s.cols = g.cols;
      s.dtype = g.dtype;
      s.out_stride = g.cols + g.pad;
      s.alpha = g.alpha;
      if (g.dtype == DType::kBF16) {
        b16.push_back(std::make_unique<DeviceBuffer<uint16_t>>(c.rows * s.out_stride));
        CUDA_OK(b16.back()->Poison());
        s.out = b16.back()->ptr;
      } else {
        f32.push_back(std::make_unique<DeviceBuffer<float>>(c.rows * s.out_stride));
        CUDA_OK(f32.back()->Poison());
        s.out = f32.back()->ptr;
      }
    }
    STATUS_OK(InvokeSplitColumns(p, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    size_t i16 = 0, i32 = 0;
    int64_t col0 = 0;
    for (size_t si = 0; si < c.segs.size(); ++si) {
      const Seg& g = c.segs[si];
      const int64_t stride = g.cols + g.pad;
      Mismatches bad("SplitColumns rows " + std::to_string(c.rows) + " segment " +
                     std::to_string(si));
      if (g.dtype == DType::kBF16) {
        const std::vector<uint16_t> out = b16[i16++]->Download();
        for (int64_t r = 0; r < c.rows; ++r) {
          for (int64_t j = 0; j < g.cols; ++j) {
            const uint16_t want = FloatToBf16(g.alpha * src[r * src_stride + col0 + j]);
            if (out[r * stride + j] != want) {
              bad.Add(r, j, Bf16ToFloat(out[r * stride + j]), Bf16ToFloat(want), 0);
            }
          }
        }
        ExpectPaddingUntouched(out, c.rows, g.cols, stride, bad.what);
      } else {
        const std::vector<float> out = f32[i32++]->Download();
        for (int64_t r = 0; r < c.rows; ++r) {
          for (int64_t j = 0; j < g.cols; ++j) {
            const float want = g.alpha * src[r * src_stride + col0 + j];
            if (std::memcmp(&out[r * stride + j], &want, 4) != 0) {
              bad.Add(r, j, out[r * stride + j], want, 0);
            }
          }
        }
        ExpectPaddingUntouched(out, c.rows, g.cols, stride, bad.what);
      }
      bad.Expect();
      col0 += g.cols;
    }
  }
  // Bad arguments: an error, nothing launched.
  SplitColumnsParams bad;
  bad.rows = 1;
  EXPECT_FALSE(InvokeSplitColumns(bad, nullptr).ok());
}

// ---------------------------------------------------------------------------------------------
// Dense GEMMs (LinearGemm, the decode GEMM). Both sides multiply the same bf16 values exactly (a
// bf16 product is exact in fp32) and sum k products in fp32 in different orders; any fp32 summation
// order of k terms is within k * 2^-24 * S of the exact sum, where S = sum_i |x_i w_i|
// (recursive-summation bound), so reference and GPU differ by at most e = 2 k 2^-24 alpha S (+
// alpha's one rounding, 2^-24 |y|). A bf16 output adds its rounding: |got - y_ref| <= 2^-8 (|y_ref|
// + e) + e. A wrong element (bad index, stride, transpose, missing alpha) is off by O(|y|) ~ S /
// sqrt(k), far above e for k <= 7168 (e / S <= 8.6e-4, 1 / sqrt(7168) = 1.2e-2). GemmReference
// computes y_ref (want) and S (sabs) from x [m, x_stride] and w [n, k] on the host;
// ExpectGemmOutput checks the device's output rows (out_stride elements of out_dtype) against them
// and that the padding past n is untouched (0xff poison).
struct GemmReference {
  std::vector<float> want, sabs;
};
GemmReference ComputeGemmReference(const std::vector<uint16_t>& x, const std::vector<uint16_t>& w,
                                   int64_t m, int64_t n, int64_t k, int64_t x_stride, int threads) {
  std::vector<float> xin(m * k), xabs(m * k);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < k; ++i) {
      xin[r * k + i] = Bf16ToFloat(x[r * x_stride + i]);
      xabs[r * k + i] = std::fabs(xin[r * k + i]);
    }
  }
  std::vector<uint16_t> wabs(w);
  for (auto& b : wabs) b &= 0x7fff;
  LinearRefWeight ref_w;
  ref_w.out_features = static_cast<int>(n);
  ref_w.in_features = static_cast<int>(k);
  ref_w.bf16 = w.data();
  GemmReference ref;
  ref.want.resize(m * n);
  ref.sabs.resize(m * n);
  LinearRef(xin.data(), m, ref_w, ref.want.data(), threads);
  ref_w.bf16 = wabs.data();
  LinearRef(xabs.data(), m, ref_w, ref.sabs.data(), threads);
  return ref;
}
void ExpectGemmOutput(const std::vector<uint8_t>& raw, const GemmReference& ref, int64_t m,
                      int64_t n, int64_t k, float alpha, DType out_dtype, int64_t out_stride,
                      const std::string& what) {
  const size_t osize = out_dtype == DType::kF32 ? 4 : 2;
  Mismatches bad(what);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      const double y = static_cast<double>(alpha) * ref.want[r * n + j];
      const double e = 2.0 * k * std::ldexp(1.0, -24) * alpha * ref.sabs[r * n + j] +
                       std::ldexp(1.0, -24) * std::fabs(y) + 1e-30;
      const size_t o = static_cast<size_t>(r * out_stride + j);
      double got;
      double tol = e;
      if (out_dtype == DType::kF32) {
        float f;
        std::memcpy(&f, &raw[o * 4], 4);
        got = f;
      } else {
        uint16_t b;
        std::memcpy(&b, &raw[o * 2], 2);
        got = Bf16ToFloat(b);
        tol = kBf16HalfUlp * (std::fabs(y) + e) + e;
      }
      bad.Check(r, j, got, y, tol);
    }
  }
  bad.Expect();
  int64_t touched = 0;
  for (int64_t r = 0; r < m; ++r) {
    for (size_t b = (r * out_stride + n) * osize; b < (r + 1) * out_stride * osize; ++b) {
      if (raw[b] != 0xff) ++touched;
    }
  }
  EXPECT_EQ(touched, 0) << what << ": padding bytes written";
}

// ---------------------------------------------------------------------------------------------
// The split-K decode GEMM called directly (no cuBLASLt in the test, so that compute-sanitizer's
// racecheck, under which cuBLASLt's kernels fail to launch, can run it): every n-tile count, K
// split by the workspace given (none, one slice's worth, plenty), fp32 and bf16 outputs, padded x
// and output rows, programmatic launches. Bound: LinearGemm's below (fp32 sums of exact products in
// another order, one bf16 rounding).
TEST(ElementwiseGpuTest, DecodeGemmDirect) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  struct Case {
    int m, n, k, x_pad, out_pad;
    DType out;
    float alpha;
    size_t workspace;  // bytes
  };
  constexpr size_t kPlenty = 32u << 20;
  const Case cases[] = {
      {5, 576, 7168, 0, 0, DType::kBF16, 1.0f, kPlenty},
      {8, 1536, 7168, 8, 3, DType::kF32, 0.37f, kPlenty},
      {16, 40, 128, 0, 0, DType::kBF16, 1.0f, kPlenty},
      {33, 2112, 1024, 16, 0, DType::kBF16, 2.5f, 0},              // no split
      {64, 576, 7168, 0, 0, DType::kF32, 1.0f, 2 * 64 * 576 * 4},  // a split of 2 at most
      {64, 7168, 256, 0, 5, DType::kBF16, 1.0f, kPlenty},
  };
  FastRandom rng(12);
  DeviceBuffer<uint8_t> d_ws(kPlenty);
  ASSERT_NE(d_ws.ptr, nullptr);
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const Case& c : cases) {
    const int64_t x_stride = c.k + c.x_pad, out_stride = c.n + c.out_pad;
    const std::vector<uint16_t> x = RandomBf16(rng, c.m * x_stride, 1.0f);
    const std::vector<uint16_t> w = RandomBf16(rng, int64_t{c.n} * c.k, 1.0f / std::sqrt(c.k));
    const GemmReference ref = ComputeGemmReference(x, w, c.m, c.n, c.k, x_stride, 2);
    const size_t osize = c.out == DType::kF32 ? 4 : 2;
    DeviceBuffer<uint16_t> d_x(x.size()), d_w(w.size());
    DeviceBuffer<uint8_t> d_out(c.m * out_stride * osize);
    CUDA_OK(d_x.Upload(x));
    CUDA_OK(d_w.Upload(w));
    CUDA_OK(d_out.Poison());
    DecodeGemmArgs a;
    a.m = c.m;
    a.n = c.n;
    a.k = c.k;
    a.x = d_x.ptr;
    a.x_stride = x_stride;
    a.w = d_w.ptr;
    a.alpha = c.alpha;
    a.out = d_out.ptr;
    a.out_dtype = c.out;
    a.out_stride = out_stride;
    a.workspace = c.workspace > 0 ? d_ws.ptr : nullptr;
    a.workspace_bytes = c.workspace;
    a.sm_count = sms;
    a.programmatic = true;
    ASSERT_TRUE(DecodeGemmSupports(a));
    CUDA_OK(InvokeDecodeGemm(a, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<uint8_t> raw = d_out.Download();
    const std::string what = "DecodeGemm m " + std::to_string(c.m) + " n " + std::to_string(c.n) +
                             " k " + std::to_string(c.k) + " workspace " +
                             std::to_string(c.workspace);
    ExpectGemmOutput(raw, ref, c.m, c.n, c.k, c.alpha, c.out, out_stride, what);
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

// ---------------------------------------------------------------------------------------------
// LinearGemm: the bound of GemmReference / ExpectGemmOutput above.
struct GemmCase {
  int64_t m, n, k;
  int x_pad, out_pad;
  DType out_dtype;
  float alpha;
};

TEST(ElementwiseGpuTest, LinearGemm) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<LinearGemm>> gemm = LinearGemm::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  const GemmCase cases[] = {
      {1, 24, 96, 0, 0, DType::kBF16, 1.0f},
      {1, 96, 24, 0, 0, DType::kF32, 0.37f},
      {7, 24, 24, 3, 1, DType::kBF16, 1.0f},     // odd strides: 2-byte aligned rows
      {7, 576, 7168, 0, 0, DType::kBF16, 1.0f},  // kv_a_proj_with_mqa shape
      {64, 512, 576, 8, 8, DType::kF32, 1.0f},
      {300, 96, 512, 0, 0, DType::kBF16, 0.0123f},
      {257, 7168, 96, 0, 0, DType::kF32, 1.0f},
      {300, 576, 96, 5, 3, DType::kBF16, 2.5f},
      {1, 7168, 512, 0, 0, DType::kBF16, 1.0f},
      {13, 512, 7168, 0, 2, DType::kF32, 0.5f},
      {1, 7168, 7168, 0, 0, DType::kBF16, 0.37f},
      {100, 24, 7168, 1, 0, DType::kBF16, 1.0f},
      {1, 163840, 512, 0, 0, DType::kBF16, 1.0f},  // lm_head-like n, one token
      {3, 163840, 96, 0, 8, DType::kF32, 1.0f},
      // The skinny kernels (m <= 4, 16-byte rows): Kimi-K2.5's rank-0-of-8 decode projections
      // (q_a + kv_a rows, q_b, o_proj, shared gate, router, shared down, lm_head slice), K split
      // 1, 2 and 4 ways; then rows that are not 16-byte aligned (cuBLASLt's path).
      {2, 2112, 7168, 0, 0, DType::kBF16, 1.0f},
      {3, 1536, 1536, 8, 0, DType::kF32, 0.37f},
      {4, 7168, 1024, 0, 5, DType::kBF16, 1.0f},
      {1, 256, 7168, 0, 0, DType::kBF16, 2.5f},
      {4, 384, 7168, 16, 0, DType::kF32, 1.0f},
      {2, 7168, 256, 0, 0, DType::kBF16, 1.0f},
      {1, 20480, 7168, 0, 0, DType::kF32, 1.0f},
      {3, 7, 40, 0, 0, DType::kBF16, 1.0f},
      {4, 24, 24, 3, 1, DType::kBF16, 1.0f},
      {2, 96, 100, 0, 0, DType::kF32, 1.0f},
      // 5-16 rows: the skinny kernels' tensor-core variant in the second pass (one and two
      // n-tiles; n not a multiple of 16; K split 1, 2 and 4 ways), cuBLASLt in the first; k not
      // a multiple of 32 stays on cuBLASLt in both.
      {5, 2112, 7168, 0, 0, DType::kBF16, 1.0f},
      {6, 1536, 1536, 8, 0, DType::kF32, 0.37f},
      {7, 7168, 1024, 0, 5, DType::kBF16, 1.0f},
      {8, 256, 7168, 0, 0, DType::kBF16, 2.5f},
      {8, 7168, 256, 0, 3, DType::kF32, 1.0f},
      {12, 40, 7168, 8, 0, DType::kBF16, 1.0f},
      {16, 1536, 1536, 0, 0, DType::kBF16, 1.0f},
      {13, 7, 64, 0, 2, DType::kF32, 1.0f},
      {9, 96, 40, 0, 0, DType::kBF16, 1.0f},
      // 5-64 rows: the split-K decode GEMM in the third pass (k a multiple of 64; one, two, four
      // and eight n-tiles; n not a multiple of 64; x rows padded; K split many ways and not at
      // all), cuBLASLt in the first two; x rows not 16-byte aligned stay on cuBLASLt.
      {24, 2112, 7168, 0, 0, DType::kBF16, 1.0f},
      {64, 1536, 7168, 8, 0, DType::kBF16, 0.37f},
      {33, 576, 7168, 0, 3, DType::kF32, 1.0f},
      {48, 7168, 1024, 16, 0, DType::kBF16, 1.0f},
      {64, 7168, 256, 0, 0, DType::kF32, 2.5f},
      {17, 40, 128, 0, 1, DType::kBF16, 1.0f},
      {5, 384, 7168, 0, 0, DType::kF32, 1.0f},
      {63, 20480, 7168, 0, 0, DType::kBF16, 1.0f},
      {40, 1536, 1536, 3, 0, DType::kBF16, 1.0f},
  };
  FastRandom rng(10);
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  // Three times: as configured by default, with 5-16 rows on the skinny tensor-core variant, and
  // with 5-64 rows on the split-K decode GEMM.
  for (const int pass : {0, 1, 2}) {
    const int mma_rows = pass == 1 ? kSkinnyMmaMaxRows : 0;
    (*gemm)->SetSkinnyTensorCoreRows(mma_rows);
    (*gemm)->SetDecodeGemmRows(pass == 2 ? kDecodeGemmMaxRows : 0);
    for (const GemmCase& c : cases) {
      const int64_t x_stride = c.k + c.x_pad, out_stride = c.n + c.out_pad;
      const std::vector<uint16_t> x = RandomBf16(rng, c.m * x_stride, 1.0f);
      const std::vector<uint16_t> w = RandomBf16(rng, c.n * c.k, 1.0f / std::sqrt(c.k));
      const GemmReference ref = ComputeGemmReference(x, w, c.m, c.n, c.k, x_stride, threads);
      const size_t osize = c.out_dtype == DType::kF32 ? 4 : 2;
      DeviceBuffer<uint16_t> d_x(x.size()), d_w(w.size());
      DeviceBuffer<uint8_t> d_out(c.m * out_stride * osize);
      ASSERT_NE(d_w.ptr, nullptr);
      CUDA_OK(d_x.Upload(x));
      CUDA_OK(d_w.Upload(w));
      LinearGemm::Args a;
      a.m = c.m;
      a.n = c.n;
      a.k = c.k;
      a.x = d_x.ptr;
      a.x_stride = x_stride;
      a.w = d_w.ptr;
      a.alpha = c.alpha;
      a.out = d_out.ptr;
      a.out_dtype = c.out_dtype;
      a.out_stride = out_stride;
      const std::string what =
          "LinearGemm m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " +
          std::to_string(c.k) + " x_stride " + std::to_string(x_stride) + " out_stride " +
          std::to_string(out_stride) + " " + std::string(DTypeName(c.out_dtype)) + " alpha " +
          std::to_string(c.alpha) + " pass " + std::to_string(pass);
      // Twice: the second run must reuse the cached plan and give the same result.
      for (int run = 0; run < 2; ++run) {
        CUDA_OK(d_out.Poison());
        const size_t plans_before = (*gemm)->CachedPlans();
        STATUS_OK((*gemm)->Run(a, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        if (run == 1) EXPECT_EQ((*gemm)->CachedPlans(), plans_before) << what;
        const std::vector<uint8_t> raw = d_out.Download();
        ExpectGemmOutput(raw, ref, c.m, c.n, c.k, c.alpha, c.out_dtype, out_stride,
                         what + " run " + std::to_string(run));
      }
    }
  }
  (*gemm)->SetSkinnyTensorCoreRows(0);
  (*gemm)->SetDecodeGemmRows(0);
  // m = 0: a no-op that leaves the output alone.
  DeviceBuffer<uint16_t> d_out(16);
  CUDA_OK(d_out.Poison());
  LinearGemm::Args a;
  a.m = 0;
  a.n = 16;
  a.k = 16;
  a.x = d_out.ptr;
  a.x_stride = 16;
  a.w = d_out.ptr;
  a.out = d_out.ptr;
  a.out_stride = 16;
  STATUS_OK((*gemm)->Run(a, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  for (const uint16_t v : d_out.Download()) EXPECT_EQ(v, kBf16Poison);
}

// Strided-batch LinearGemm (MLA's per-head absorb with W as [k, n], and expand with W as [n, k])
// against LinearRef per batch entry, with the tolerance of the LinearGemm test above.
TEST(ElementwiseGpuTest, LinearGemmStridedBatch) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<LinearGemm>> gemm = LinearGemm::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  struct Case {
    int64_t m, n, k;
    int heads;
    bool w_kn;
  };
  // m rows x heads; x rows hold heads * k (stride), out rows heads * n.
  const Case cases[] = {{1, 512, 128, 16, true}, {37, 512, 128, 8, true}, {5, 128, 512, 16, false},
                        {64, 128, 512, 3, false}, {2, 512, 16, 4, true},  {9, 16, 512, 4, false},
                        // m 1..4: expand on the skinny kernels, absorb (W [k, n]) on cuBLASLt
                        {4, 512, 128, 8, true},   {3, 128, 512, 8, false}, {1, 128, 512, 64, false},
                        {3, 264, 40, 2, true},    {2, 16, 512, 4, false}};
  FastRandom rng(11);
  for (const Case& c : cases) {
    const int64_t x_row = c.heads * c.k + 64, out_row = c.heads * c.n;  // x rows padded (q_rope)
    const std::vector<uint16_t> x = RandomBf16(rng, c.m * x_row, 1.0f);
    const std::vector<uint16_t> w = RandomBf16(rng, c.heads * c.n * c.k, 1.0f / std::sqrt(c.k));
    DeviceBuffer<uint16_t> d_x(x.size()), d_w(w.size()), d_out(c.m * out_row);
    CUDA_OK(d_x.Upload(x));
    CUDA_OK(d_w.Upload(w));
    CUDA_OK(d_out.Poison());
    LinearGemm::Args a;
    a.m = c.m;
    a.n = c.n;
    a.k = c.k;
    a.x = d_x.ptr;
    a.x_stride = x_row;
    a.w = d_w.ptr;
    a.w_kn = c.w_kn;
    a.out = d_out.ptr;
    a.out_stride = out_row;
    a.batch = c.heads;
    a.x_batch_stride = c.k;
    a.w_batch_stride = c.n * c.k;
    a.out_batch_stride = c.n;
    STATUS_OK((*gemm)->Run(a, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = d_out.Download();
    const std::string what = "batched m " + std::to_string(c.m) + " n " + std::to_string(c.n) +
                             " k " + std::to_string(c.k) + (c.w_kn ? " W[k,n]" : " W[n,k]");
    Mismatches bad(what);
    for (int h = 0; h < c.heads; ++h) {
      // This head's weight as [n, k] for LinearRef.
      std::vector<uint16_t> wh(c.n * c.k), wabs(c.n * c.k);
      for (int64_t j = 0; j < c.n; ++j) {
        for (int64_t i = 0; i < c.k; ++i) {
          const uint16_t v = c.w_kn ? w[h * c.n * c.k + i * c.n + j] : w[h * c.n * c.k + j * c.k + i];
          wh[j * c.k + i] = v;
          wabs[j * c.k + i] = v & 0x7fff;
        }
      }
      std::vector<float> xin(c.m * c.k), xabs(c.m * c.k);
      for (int64_t r = 0; r < c.m; ++r) {
        for (int64_t i = 0; i < c.k; ++i) {
          xin[r * c.k + i] = Bf16ToFloat(x[r * x_row + h * c.k + i]);
          xabs[r * c.k + i] = std::fabs(xin[r * c.k + i]);
        }
      }
      LinearRefWeight rw;
      rw.out_features = static_cast<int>(c.n);
      rw.in_features = static_cast<int>(c.k);
      rw.bf16 = wh.data();
      std::vector<float> want(c.m * c.n), sabs(c.m * c.n);
      LinearRef(xin.data(), c.m, rw, want.data(), 1);
      rw.bf16 = wabs.data();
      LinearRef(xabs.data(), c.m, rw, sabs.data(), 1);
      for (int64_t r = 0; r < c.m; ++r) {
        for (int64_t j = 0; j < c.n; ++j) {
          const double y = want[r * c.n + j];
          const double e = 2.0 * c.k * std::ldexp(1.0, -24) * sabs[r * c.n + j] + 1e-30;
          bad.Check(r, h * c.n + j, Bf16ToFloat(got[r * out_row + h * c.n + j]), y,
                    kBf16HalfUlp * (std::fabs(y) + e) + e);
        }
      }
    }
    bad.Expect();
  }
}

// RunShared: several weights over one x (q_a + kv_a; gate + up + router) in one skinny launch
// for m <= 4 (m <= 16 with the tensor-core variant on: the second pass), and one Run each past
// that (m = 5 by default) or for 5 weights; each output against LinearRef
// with the LinearGemm test's tolerance, its padding untouched.
TEST(ElementwiseGpuTest, LinearGemmRunShared) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<LinearGemm>> gemm = LinearGemm::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  struct Out {
    int64_t n;
    DType dtype;
    float alpha;
  };
  struct Case {
    int64_t m, k;
    std::vector<Out> outs;
  };
  const Case cases[] = {
      {1, 7168, {{1536, DType::kBF16, 1.0f}, {576, DType::kBF16, 0.5f}}},
      {4, 7168, {{1536, DType::kBF16, 1.0f}, {576, DType::kBF16, 1.0f}}},
      {2, 7168, {{256, DType::kBF16, 1.0f}, {256, DType::kBF16, 1.0f}, {384, DType::kF32, 1.0f}}},
      {3, 512, {{8, DType::kF32, 2.0f}, {24, DType::kBF16, 1.0f}, {40, DType::kBF16, 1.0f},
                {16, DType::kF32, 1.0f}}},
      {5, 7168, {{256, DType::kBF16, 1.0f}, {384, DType::kF32, 1.0f}}},  // Run each (by default)
      // The tensor-core variant (second pass): one launch for 5-16 rows.
      {8, 7168, {{1536, DType::kBF16, 1.0f}, {576, DType::kBF16, 0.5f}}},
      {16, 7168, {{256, DType::kBF16, 1.0f}, {256, DType::kBF16, 1.0f}, {384, DType::kF32, 1.0f}}},
      {2, 96, {{8, DType::kBF16, 1.0f}, {8, DType::kBF16, 1.0f}, {8, DType::kBF16, 1.0f},
               {8, DType::kBF16, 1.0f}, {8, DType::kF32, 1.0f}}},  // 5 weights: Run each
  };
  FastRandom rng(12);
  for (const int mma_rows : {0, kSkinnyMmaMaxRows}) {
    (*gemm)->SetSkinnyTensorCoreRows(mma_rows);
    for (const Case& c : cases) {
      const std::vector<uint16_t> x = RandomBf16(rng, c.m * c.k, 1.0f);
      std::vector<float> xin(x.size()), xabs(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        xin[i] = Bf16ToFloat(x[i]);
        xabs[i] = std::fabs(xin[i]);
      }
      DeviceBuffer<uint16_t> d_x(x.size());
      CUDA_OK(d_x.Upload(x));
      std::vector<std::vector<uint16_t>> ws;
      std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> d_ws;
      std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> d_outs;
      std::vector<LinearGemm::Args> list;
      for (const Out& o : c.outs) {
        ws.push_back(RandomBf16(rng, o.n * c.k, 1.0f / std::sqrt(c.k)));
        d_ws.push_back(std::make_unique<DeviceBuffer<uint16_t>>(ws.back().size()));
        CUDA_OK(d_ws.back()->Upload(ws.back()));
        const int64_t stride = o.n + 3;  // padding that must stay untouched
        d_outs.push_back(std::make_unique<DeviceBuffer<uint8_t>>(c.m * stride *
                                                                 (o.dtype == DType::kF32 ? 4 : 2)));
        CUDA_OK(d_outs.back()->Poison());
        LinearGemm::Args a;
        a.m = c.m;
        a.n = o.n;
        a.k = c.k;
        a.x = d_x.ptr;
        a.x_stride = c.k;
        a.w = d_ws.back()->ptr;
        a.alpha = o.alpha;
        a.out = d_outs.back()->ptr;
        a.out_dtype = o.dtype;
        a.out_stride = stride;
        list.push_back(a);
      }
      STATUS_OK((*gemm)->RunShared(list.data(), static_cast<int>(list.size()), nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      for (size_t i = 0; i < c.outs.size(); ++i) {
        const Out& o = c.outs[i];
        std::vector<uint16_t> wabs(ws[i]);
        for (auto& b : wabs) b &= 0x7fff;
        LinearRefWeight rw;
        rw.out_features = static_cast<int>(o.n);
        rw.in_features = static_cast<int>(c.k);
        rw.bf16 = ws[i].data();
        std::vector<float> want(c.m * o.n), sabs(c.m * o.n);
        LinearRef(xin.data(), c.m, rw, want.data(), 1);
        rw.bf16 = wabs.data();
        LinearRef(xabs.data(), c.m, rw, sabs.data(), 1);
        const std::vector<uint8_t> raw = d_outs[i]->Download();
        const int64_t stride = list[i].out_stride;
        Mismatches bad("RunShared m " + std::to_string(c.m) + " k " + std::to_string(c.k) +
                       " weight " + std::to_string(i) + " of " + std::to_string(c.outs.size()) +
                       " mma_rows " + std::to_string(mma_rows));
        int64_t touched = 0;
        for (int64_t r = 0; r < c.m; ++r) {
          for (int64_t j = 0; j < stride; ++j) {
            const size_t e = static_cast<size_t>(r * stride + j);
            if (j >= o.n) {
              const size_t bytes = o.dtype == DType::kF32 ? 4 : 2;
              for (size_t b = e * bytes; b < (e + 1) * bytes; ++b) touched += raw[b] != 0xff;
              continue;
            }
            const double y = static_cast<double>(o.alpha) * want[r * o.n + j];
            const double err = 2.0 * c.k * std::ldexp(1.0, -24) * o.alpha * sabs[r * o.n + j] +
                               std::ldexp(1.0, -24) * std::fabs(y) + 1e-30;
            if (o.dtype == DType::kF32) {
              float f;
              std::memcpy(&f, &raw[e * 4], 4);
              bad.Check(r, j, f, y, err);
            } else {
              uint16_t b;
              std::memcpy(&b, &raw[e * 2], 2);
              bad.Check(r, j, Bf16ToFloat(b), y, kBf16HalfUlp * (std::fabs(y) + err) + err);
            }
          }
        }
        bad.Expect();
        EXPECT_EQ(touched, 0) << bad.what << ": padding bytes written";
      }
    }
  }
}

// Programmatic skinny launches (LinearGemm::SetProgrammaticLaunch): a decode-like chain on a
// non-blocking stream -- RmsNorm, then three projections each reading the previous one's output
// (the last through RunShared) -- must give the bits of the same chain launched plainly, every
// time, with every intermediate poisoned (NaN) before each run: a projection that read its input
// before its predecessor finished would see the poison or stale values.
TEST(ElementwiseGpuTest, LinearGemmProgrammaticChain) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<LinearGemm>> gemm = LinearGemm::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  FastRandom rng(13);
  for (const int m : {1, 3, 4}) {
    const int64_t h = 7168, n1 = 2112, n2 = 7168, n3a = 512, n3b = 384;
    const std::vector<uint16_t> x = RandomBf16(rng, m * h, 1.0f);
    const std::vector<float> norm_w = Widen(RandomBf16(rng, h, 1.0f));
    const std::vector<uint16_t> w1 = RandomBf16(rng, n1 * h, 1.0f / std::sqrt(h));
    const std::vector<uint16_t> w2 = RandomBf16(rng, n2 * n1, 1.0f / std::sqrt(n1));
    const std::vector<uint16_t> w3a = RandomBf16(rng, n3a * n2, 1.0f / std::sqrt(n2));
    const std::vector<uint16_t> w3b = RandomBf16(rng, n3b * n2, 1.0f / std::sqrt(n2));
    DeviceBuffer<uint16_t> d_x(x.size()), d_h(m * h), d_w1(w1.size()), d_w2(w2.size()),
        d_w3a(w3a.size()), d_w3b(w3b.size()), d_y1(m * n1), d_y2(m * n2), d_y3a(m * n3a);
    DeviceBuffer<float> d_nw(norm_w.size()), d_y3b(m * n3b);
    CUDA_OK(d_x.Upload(x));
    CUDA_OK(d_nw.Upload(norm_w));
    CUDA_OK(d_w1.Upload(w1));
    CUDA_OK(d_w2.Upload(w2));
    CUDA_OK(d_w3a.Upload(w3a));
    CUDA_OK(d_w3b.Upload(w3b));
    auto args = [&](const void* in, int64_t k, const void* w, int64_t n, void* out, DType dt) {
      LinearGemm::Args a;
      a.m = m;
      a.n = n;
      a.k = k;
      a.x = in;
      a.x_stride = k;
      a.w = w;
      a.out = out;
      a.out_dtype = dt;
      a.out_stride = n;
      return a;
    };
    std::vector<uint16_t> got_bf16;
    std::vector<float> got_f32;
    auto run = [&](bool programmatic) {
      (*gemm)->SetProgrammaticLaunch(programmatic);
      CUDA_OK(d_h.Poison());
      CUDA_OK(d_y1.Poison());
      CUDA_OK(d_y2.Poison());
      CUDA_OK(d_y3a.Poison());
      CUDA_OK(d_y3b.Poison());
      RmsNormParams p;
      p.rows = m;
      p.dim = static_cast<int>(h);
      p.x = d_x.ptr;
      p.x_dtype = DType::kBF16;
      p.x_stride = h;
      p.weight = d_nw.ptr;
      p.out = d_h.ptr;
      p.out_stride = h;
      STATUS_OK(InvokeRmsNorm(p, stream));
      STATUS_OK((*gemm)->Run(args(d_h.ptr, h, d_w1.ptr, n1, d_y1.ptr, DType::kBF16), stream));
      STATUS_OK((*gemm)->Run(args(d_y1.ptr, n1, d_w2.ptr, n2, d_y2.ptr, DType::kBF16), stream));
      const LinearGemm::Args shared[2] = {
          args(d_y2.ptr, n2, d_w3a.ptr, n3a, d_y3a.ptr, DType::kBF16),
          args(d_y2.ptr, n2, d_w3b.ptr, n3b, d_y3b.ptr, DType::kF32)};
      STATUS_OK((*gemm)->RunShared(shared, 2, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      got_bf16 = d_y3a.Download();
      got_f32 = d_y3b.Download();
    };
    run(false);
    const std::vector<uint16_t> plain_bf16 = got_bf16;
    const std::vector<float> plain_f32 = got_f32;
    size_t non_finite = 0;
    for (const uint16_t v : plain_bf16) non_finite += !std::isfinite(Bf16ToFloat(v));
    for (const float v : plain_f32) non_finite += !std::isfinite(v);
    EXPECT_EQ(non_finite, 0u) << "m " << m << ": the plain chain left unwritten outputs";
    for (int rep = 0; rep < 20; ++rep) {
      run(true);
      EXPECT_EQ(got_bf16, plain_bf16) << "m " << m << " rep " << rep << ": bf16 output differs";
      ASSERT_EQ(got_f32.size(), plain_f32.size());
      EXPECT_EQ(std::memcmp(got_f32.data(), plain_f32.data(), got_f32.size() * 4), 0)
          << "m " << m << " rep " << rep << ": fp32 output differs";
    }
  }
  (*gemm)->SetProgrammaticLaunch(false);
  CUDA_OK(cudaStreamDestroy(stream));
}

// The bf16 rows ids[i] of src [rows, cols] copied to out [count, cols] by a GatherRows kernel
// on `stream`: a kernel predecessor for the programmatic-launch tests below.
absl::Status GatherBf16Rows(const uint16_t* src, int64_t rows, int cols, const int32_t* ids,
                            int count, uint16_t* out, cudaStream_t stream) {
  GatherRowsParams g;
  g.src = src;
  g.src_dtype = DType::kBF16;
  g.src_rows = rows;
  g.src_stride = cols;
  g.cols = cols;
  g.ids = ids;
  g.count = count;
  g.out = out;
  g.out_dtype = DType::kBF16;
  g.out_stride = cols;
  return InvokeGatherRows(g, stream);
}

// Programmatic launches of the small kernels (RmsNormParams::programmatic and the like): a
// chain on a non-blocking stream -- GatherRows (plain) -> RmsNorm -> RoPE on its output ->
// SiLU(it) * x -> AddRmsNorm with that as the delta -- with every intermediate poisoned (NaN)
// and the residual re-uploaded before each run, must give the bits of the same chain launched
// plainly, every time: a kernel that read its input before its predecessor finished would see
// the poison or stale values.
TEST(ElementwiseGpuTest, SmallKernelsProgrammaticChain) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  FastRandom rng(15);
  for (const int m : {1, 4, 33}) {
    const int dim = 7168, rope_dim = 64;
    const std::vector<uint16_t> table = RandomBf16(rng, m * dim, 2.0f);
    const std::vector<float> norm_w = Widen(RandomBf16(rng, dim, 1.0f));
    std::vector<float> residual(m * dim);
    for (auto& v : residual) v = Bf16ToFloat(rng.Bf16(4.0f));
    std::vector<int32_t> ids(m), positions(m);
    for (int i = 0; i < m; ++i) {
      ids[i] = m - 1 - i;
      positions[i] = 17 * i + 3;
    }
    std::vector<float> inv_freq(rope_dim / 2);
    for (int i = 0; i < rope_dim / 2; ++i) {
      inv_freq[i] = 1.0f / std::pow(10000.0f, 2.0f * i / rope_dim);
    }
    DeviceBuffer<uint16_t> d_table(table.size()), d_x(m * dim), d_n(m * dim), d_s(m * dim),
        d_h(m * dim);
    DeviceBuffer<float> d_nw(dim), d_res(m * dim), d_inv(inv_freq.size());
    DeviceBuffer<int32_t> d_ids(m), d_pos(m);
    CUDA_OK(d_table.Upload(table));
    CUDA_OK(d_nw.Upload(norm_w));
    CUDA_OK(d_ids.Upload(ids));
    CUDA_OK(d_pos.Upload(positions));
    CUDA_OK(d_inv.Upload(inv_freq));
    std::vector<uint16_t> got_h;
    std::vector<float> got_res;
    auto run = [&](bool programmatic) {
      CUDA_OK(d_x.Poison());
      CUDA_OK(d_n.Poison());
      CUDA_OK(d_s.Poison());
      CUDA_OK(d_h.Poison());
      CUDA_OK(d_res.Upload(residual));
      STATUS_OK(GatherBf16Rows(d_table.ptr, m, dim, d_ids.ptr, m, d_x.ptr, stream));
      RmsNormParams n;
      n.rows = m;
      n.dim = dim;
      n.x = d_x.ptr;
      n.x_dtype = DType::kBF16;
      n.x_stride = dim;
      n.weight = d_nw.ptr;
      n.out = d_n.ptr;
      n.out_stride = dim;
      n.programmatic = programmatic;
      STATUS_OK(InvokeRmsNorm(n, stream));
      RopeParams r;
      r.x = d_n.ptr;
      r.rows = m;
      r.row_stride = dim;
      r.first_col = 128;
      r.per_row = 8;
      r.vec_stride = 192;
      r.dim = rope_dim;
      r.positions = d_pos.ptr;
      r.inv_freq = d_inv.ptr;
      r.interleaved = true;
      r.programmatic = programmatic;
      STATUS_OK(InvokeRope(r, stream));
      SiluMulParams sm;
      sm.rows = m;
      sm.cols = dim;
      sm.gate = d_n.ptr;
      sm.up = d_x.ptr;
      sm.in_stride = dim;
      sm.out = d_s.ptr;
      sm.out_stride = dim;
      sm.programmatic = programmatic;
      STATUS_OK(InvokeSiluMul(sm, stream));
      AddRmsNormParams a;
      a.rows = m;
      a.dim = dim;
      a.residual = d_res.ptr;
      a.delta = d_s.ptr;
      a.weight = d_nw.ptr;
      a.out = d_h.ptr;
      a.programmatic = programmatic;
      STATUS_OK(InvokeAddRmsNorm(a, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      got_h = d_h.Download();
      got_res = d_res.Download();
    };
    run(false);
    const std::vector<uint16_t> plain_h = got_h;
    const std::vector<float> plain_res = got_res;
    size_t non_finite = 0;
    for (const uint16_t v : plain_h) non_finite += !std::isfinite(Bf16ToFloat(v));
    EXPECT_EQ(non_finite, 0u) << "m " << m << ": the plain chain left unwritten outputs";
    for (int rep = 0; rep < 20; ++rep) {
      run(true);
      EXPECT_EQ(got_h, plain_h) << "m " << m << " rep " << rep << ": h differs";
      ASSERT_EQ(got_res.size(), plain_res.size());
      EXPECT_EQ(std::memcmp(got_res.data(), plain_res.data(), got_res.size() * 4), 0)
          << "m " << m << " rep " << rep << ": residual differs";
    }
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

// RunWithPrologue (skinny_gemm.h's SkinnyPrologue): the op that makes a projection's input
// fused into the skinny projection. Inputs come from a GatherRows kernel on the same
// non-blocking stream, with the buffers poisoned before each run, and every case runs launched
// plainly and programmatically (the prologue reads x, and the RMSNorm one all of it, only after
// the wait); both must give the same bits, and match the reference:
//   kSiluMul: the transformed rows are InvokeSiluMul's output bit for bit (the same arithmetic),
//     so the reference is LinearRef over InvokeSiluMul's bf16 output, with the LinearGemm test's
//     tolerance (e = 2 k 2^-24 S).
//   kRmsNorm: the fused inverse norm is an fp32 sum of squares in another order than
//     RmsNormRef's: a lane adds k / 128 squares in sequence, then 5 butterfly levels and 3 warp
//     sums (k = 7168: 64 additions, a relative 2^-18 on the sum at worst, half that on the
//     inverse square root), and three more roundings follow, so the normalized element before
//     its bf16 rounding is within 2^-18 of the exact one, relative; delta = 2^-16 is 4x that.
//     Reference rows: bf16 of the exact (double) normalized values; where the interval
//     x_exact (1 +- delta) holds a bf16 rounding boundary, either neighbour is right, and the
//     tolerance of output j adds |hi - lo| |w_ji| for such elements (a few per thousand rows
//     here); then e and the output's rounding. A wrong index or a missed norm is off by O(|y|).
// m = 5, the invariant mode and a misaligned up fall back (false, nothing enqueued).
TEST(ElementwiseGpuTest, LinearGemmPrologues) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<LinearGemm>> gemm = LinearGemm::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Case {
    SkinnyPrologue kind;
    int64_t m, n, k;
    DType out_dtype;
  };
  const Case cases[] = {
      {SkinnyPrologue::kRmsNorm, 1, 1536, 1536, DType::kBF16},  // Kimi's q_a norm + q_b
      {SkinnyPrologue::kRmsNorm, 4, 1536, 1536, DType::kBF16},
      {SkinnyPrologue::kRmsNorm, 3, 40, 7168, DType::kF32},
      {SkinnyPrologue::kSiluMul, 1, 7168, 256, DType::kBF16},  // the shared expert's down
      {SkinnyPrologue::kSiluMul, 2, 7168, 2048, DType::kBF16},
      {SkinnyPrologue::kSiluMul, 4, 24, 18432, DType::kF32},
  };
  FastRandom rng(14);
  for (const Case& c : cases) {
    const bool norm = c.kind == SkinnyPrologue::kRmsNorm;
    const std::string what = std::string(norm ? "RmsNorm" : "SiluMul") + " m " +
                             std::to_string(c.m) + " n " + std::to_string(c.n) + " k " +
                             std::to_string(c.k);
    // Sources: x (or gate) and up as rows 0..m-1 and m..2m-1 of one table.
    const std::vector<uint16_t> table = RandomBf16(rng, 2 * c.m * c.k, norm ? 3.0f : 6.0f);
    std::vector<float> norm_w(c.k);
    for (auto& v : norm_w) v = 0.5f + std::fabs(Bf16ToFloat(rng.Bf16(1.0f)));
    const std::vector<uint16_t> w = RandomBf16(rng, c.n * c.k, 1.0f / std::sqrt(c.k));
    std::vector<int32_t> ids(2 * c.m);
    for (int i = 0; i < 2 * c.m; ++i) ids[i] = i;
    DeviceBuffer<uint16_t> d_table(table.size()), d_in(2 * c.m * c.k), d_w(w.size()),
        d_act(c.m * c.k);
    DeviceBuffer<float> d_nw(norm_w.size());
    DeviceBuffer<int32_t> d_ids(ids.size());
    const size_t out_bytes = c.out_dtype == DType::kF32 ? 4 : 2;
    DeviceBuffer<uint8_t> d_out(c.m * c.n * out_bytes);
    CUDA_OK(d_table.Upload(table));
    CUDA_OK(d_nw.Upload(norm_w));
    CUDA_OK(d_w.Upload(w));
    CUDA_OK(d_ids.Upload(ids));
    LinearGemm::Args a;
    a.m = c.m;
    a.n = c.n;
    a.k = c.k;
    a.x = d_in.ptr;
    a.x_stride = c.k;
    a.w = d_w.ptr;
    a.out = d_out.ptr;
    a.out_dtype = c.out_dtype;
    a.out_stride = c.n;
    SkinnyPrologueArgs pro;
    pro.kind = c.kind;
    pro.norm_weight = d_nw.ptr;
    pro.eps = 1e-6f;
    pro.up = d_in.ptr + c.m * c.k;
    pro.up_stride = c.k;
    std::vector<uint8_t> got;
    auto run = [&](bool programmatic) {
      (*gemm)->SetProgrammaticLaunch(programmatic);
      CUDA_OK(d_in.Poison());
      CUDA_OK(d_out.Poison());
      STATUS_OK(GatherBf16Rows(d_table.ptr, 2 * c.m, static_cast<int>(c.k), d_ids.ptr,
                               static_cast<int>(2 * c.m), d_in.ptr, stream));
      absl::StatusOr<bool> ran = (*gemm)->RunWithPrologue(a, pro, stream);
      ASSERT_TRUE(ran.ok()) << what << ": " << ran.status();
      ASSERT_TRUE(*ran) << what << ": the skinny kernel did not take it";
      CUDA_OK(cudaStreamSynchronize(stream));
      got = d_out.Download();
    };
    run(false);
    const std::vector<uint8_t> plain = got;
    for (int rep = 0; rep < 5; ++rep) {
      run(true);
      EXPECT_EQ(got, plain) << what << " rep " << rep << ": programmatic launch differs";
    }
    (*gemm)->SetProgrammaticLaunch(false);

    // The reference rows.
    std::vector<float> xr(c.m * c.k);
    std::vector<double> amb(c.m * c.k, 0.0);  // |hi - lo| where either rounding is right
    if (norm) {
      const double delta = std::ldexp(1.0, -16);
      for (int64_t r = 0; r < c.m; ++r) {
        double sq = 0.0;
        for (int64_t i = 0; i < c.k; ++i) {
          const double v = Bf16ToFloat(table[r * c.k + i]);
          sq += v * v;
        }
        const double inv = 1.0 / std::sqrt(sq / c.k + 1e-6);
        for (int64_t i = 0; i < c.k; ++i) {
          const double e = norm_w[i] * (Bf16ToFloat(table[r * c.k + i]) * inv);
          const float lo = Bf16ToFloat(FloatToBf16(static_cast<float>(e * (1 - delta))));
          const float hi = Bf16ToFloat(FloatToBf16(static_cast<float>(e * (1 + delta))));
          xr[r * c.k + i] = Bf16ToFloat(FloatToBf16(static_cast<float>(e)));
          if (lo != hi) amb[r * c.k + i] = std::fabs(static_cast<double>(hi) - lo);
        }
      }
    } else {
      SiluMulParams sp;
      sp.rows = c.m;
      sp.cols = static_cast<int>(c.k);
      sp.gate = d_table.ptr;
      sp.up = d_table.ptr + c.m * c.k;
      sp.in_stride = c.k;
      sp.out = d_act.ptr;
      sp.out_stride = c.k;
      STATUS_OK(InvokeSiluMul(sp, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      xr = Widen(d_act.Download());
    }
    Mismatches bad("RunWithPrologue " + what);
    int64_t ambiguous = 0;
    for (const double v : amb) ambiguous += v > 0;
    for (int64_t r = 0; r < c.m; ++r) {
      for (int64_t j = 0; j < c.n; ++j) {
        double y = 0.0, sabs = 0.0, extra = 0.0;
        for (int64_t i = 0; i < c.k; ++i) {
          const double wv = Bf16ToFloat(w[j * c.k + i]);
          y += xr[r * c.k + i] * wv;
          sabs += std::fabs(xr[r * c.k + i] * wv);
          extra += amb[r * c.k + i] * std::fabs(wv);
        }
        const double err = 2.0 * c.k * std::ldexp(1.0, -24) * sabs + extra + 1e-30;
        const size_t e = static_cast<size_t>(r * c.n + j);
        if (c.out_dtype == DType::kF32) {
          float f;
          std::memcpy(&f, &plain[e * 4], 4);
          bad.Check(r, j, f, y, err);
        } else {
          uint16_t b;
          std::memcpy(&b, &plain[e * 2], 2);
          bad.Check(r, j, Bf16ToFloat(b), y, kBf16HalfUlp * (std::fabs(y) + err) + err);
        }
      }
    }
    std::printf("[linear] prologue %s: %lld of %lld normalized elements at a rounding boundary\n",
                what.c_str(), static_cast<long long>(ambiguous),
                static_cast<long long>(c.m * c.k));
    bad.Expect();
  }

  // Fallbacks: nothing enqueued, false returned.
  {
    DeviceBuffer<uint16_t> d_x(8 * 64), d_w(16 * 64), d_out(8 * 16);
    DeviceBuffer<float> d_nw(64);
    LinearGemm::Args a;
    a.n = 16;
    a.k = 64;
    a.x = d_x.ptr;
    a.x_stride = 64;
    a.w = d_w.ptr;
    a.out = d_out.ptr;
    a.out_stride = 16;
    SkinnyPrologueArgs pro;
    pro.kind = SkinnyPrologue::kSiluMul;
    pro.up = d_x.ptr + 4 * 64;
    pro.up_stride = 64;
    a.m = 5;
    absl::StatusOr<bool> ran = (*gemm)->RunWithPrologue(a, pro, stream);
    ASSERT_TRUE(ran.ok());
    EXPECT_FALSE(*ran) << "m 5";
    a.m = 2;
    pro.up = d_x.ptr + 4 * 64 + 1;  // not 16-byte aligned
    ran = (*gemm)->RunWithPrologue(a, pro, stream);
    ASSERT_TRUE(ran.ok());
    EXPECT_FALSE(*ran) << "misaligned up";
    pro.up = d_x.ptr + 4 * 64;
    (*gemm)->SetBatchInvariant(true);
    ran = (*gemm)->RunWithPrologue(a, pro, stream);
    ASSERT_TRUE(ran.ok());
    EXPECT_FALSE(*ran) << "invariant mode";
    (*gemm)->SetBatchInvariant(false);
    ran = (*gemm)->RunWithPrologue(a, pro, stream);
    ASSERT_TRUE(ran.ok());
    EXPECT_TRUE(*ran) << "aligned, m 2";
    CUDA_OK(cudaStreamSynchronize(stream));
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

// Batch invariance (the deterministic mode): with SetBatchInvariant, a row's output bits do not
// depend on how many rows the call has nor on the row's position among them. Each shape runs
// once over all M rows (the reference), then over windows [s, s + m) of the same x for many m
// and s; every output row must equal the reference's row bit for bit. The default mode is run
// the same way and its differing rows printed (cuBLASLt picks tiles and split-K by m), to show
// the check can see a difference. Shapes: the projections of DeepSeek-V3/Kimi (and a vocab
// slice as lm_head), router logits in fp32, and the strided-batch MLA absorb.
TEST(ElementwiseGpuTest, LinearGemmBatchInvariant) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  struct Case {
    int64_t n, k;
    DType out;
    int heads;  // > 1: strided batch over heads (x rows heads * k, W [k, n] per head)
  };
  const Case cases[] = {{7168, 2048, DType::kBF16, 1}, {2048, 7168, DType::kBF16, 1},
                        {576, 7168, DType::kBF16, 1},  {1536, 7168, DType::kBF16, 1},
                        {3072, 1536, DType::kBF16, 1}, {256, 7168, DType::kF32, 1},
                        {20480, 7168, DType::kF32, 1}, {512, 128, DType::kBF16, 16},
                        {96, 24, DType::kBF16, 1}};
  const int64_t M = 300;
  const int64_t ms[] = {1, 2, 3, 5, 8, 16, 31, 64, 65, 100, 128, 200, 256, 299};
  FastRandom rng(12);
  for (bool invariant : {true, false}) {
    absl::StatusOr<std::unique_ptr<LinearGemm>> gemm = LinearGemm::Create();
    ASSERT_TRUE(gemm.ok()) << gemm.status();
    (*gemm)->SetBatchInvariant(invariant);
    for (const Case& c : cases) {
      const int64_t x_row = c.heads * c.k, out_row = c.heads * c.n;
      const size_t osize = c.out == DType::kF32 ? 4 : 2;
      const std::vector<uint16_t> x = RandomBf16(rng, M * x_row, 1.0f);
      const std::vector<uint16_t> w =
          RandomBf16(rng, c.heads * c.n * c.k, 1.0f / std::sqrt(c.k));
      DeviceBuffer<uint16_t> d_x(x.size()), d_w(w.size());
      DeviceBuffer<uint8_t> d_ref(M * out_row * osize), d_out(M * out_row * osize);
      ASSERT_NE(d_w.ptr, nullptr);
      CUDA_OK(d_x.Upload(x));
      CUDA_OK(d_w.Upload(w));
      auto run = [&](int64_t first, int64_t m, void* out) {
        LinearGemm::Args a;
        a.m = m;
        a.n = c.n;
        a.k = c.k;
        a.x = d_x.ptr + first * x_row;
        a.x_stride = x_row;
        a.w = d_w.ptr;
        a.w_kn = c.heads > 1;
        a.out = static_cast<uint8_t*>(out) + first * out_row * osize;
        a.out_dtype = c.out;
        a.out_stride = out_row;
        a.batch = c.heads;
        a.x_batch_stride = c.k;
        a.w_batch_stride = c.n * c.k;
        a.out_batch_stride = c.n;
        return (*gemm)->Run(a, nullptr);
      };
      STATUS_OK(run(0, M, d_ref.ptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint8_t> ref = d_ref.Download();
      int differ = 0, checked = 0;
      for (int64_t m : ms) {
        for (int64_t first : {int64_t{0}, (M - m) / 2, M - m}) {
          CUDA_OK(d_out.Poison());
          STATUS_OK(run(first, m, d_out.ptr));
          CUDA_OK(cudaDeviceSynchronize());
          const std::vector<uint8_t> got = d_out.Download();
          for (int64_t r = first; r < first + m; ++r) {
            ++checked;
            differ += std::memcmp(got.data() + r * out_row * osize,
                                  ref.data() + r * out_row * osize, out_row * osize) != 0;
          }
        }
      }
      const std::string what = std::string(invariant ? "invariant" : "default") + " n " +
                               std::to_string(c.n) + " k " + std::to_string(c.k) + " heads " +
                               std::to_string(c.heads) + " " + std::string(DTypeName(c.out));
      std::printf("[linear] %s: %d of %d rows differ from the %lld-row call\n", what.c_str(),
                  differ, checked, static_cast<long long>(M));
      if (invariant) EXPECT_EQ(differ, 0) << what;
    }
  }
}

// Bad arguments are errors, not launches.
TEST(ElementwiseGpuTest, RejectsBadArguments) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  DeviceBuffer<uint16_t> buf(1024);
  RopeParams rope;
  rope.x = buf.ptr;
  rope.rows = 2;
  rope.row_stride = 64;
  rope.dim = 64;
  rope.per_row = 2;
  rope.vec_stride = 32;  // overlapping vectors
  rope.positions = reinterpret_cast<const int32_t*>(buf.ptr);
  rope.inv_freq = reinterpret_cast<const float*>(buf.ptr);
  EXPECT_FALSE(InvokeRope(rope, nullptr).ok());
  rope.dim = 63;
  EXPECT_FALSE(InvokeRope(rope, nullptr).ok());
  RmsNormParams norm;
  norm.rows = 1;
  norm.dim = 64;
  norm.x = buf.ptr;
  norm.x_dtype = DType::kF16;
  norm.x_stride = 64;
  norm.weight = reinterpret_cast<const float*>(buf.ptr);
  norm.out = buf.ptr;
  norm.out_stride = 64;
  EXPECT_FALSE(InvokeRmsNorm(norm, nullptr).ok());
  SiluMulParams silu;
  silu.rows = 1;
  silu.cols = 64;
  silu.gate = silu.up = silu.out = buf.ptr;
  silu.in_stride = 32;  // < cols
  silu.out_stride = 64;
  EXPECT_FALSE(InvokeSiluMul(silu, nullptr).ok());
  GatherRowsParams gather;
  gather.src = buf.ptr;
  gather.src_dtype = DType::kF8E4M3;
  gather.src_rows = 1;
  gather.src_stride = gather.out_stride = 16;
  gather.cols = 16;
  gather.ids = reinterpret_cast<const int32_t*>(buf.ptr);
  gather.count = 1;
  gather.out = buf.ptr;
  EXPECT_FALSE(InvokeGatherRows(gather, nullptr).ok());
}

}  // namespace
}  // namespace mlaserve
