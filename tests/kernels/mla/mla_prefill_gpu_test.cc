// GPU MLA chunked prefill (kernels/mla/mla_prefill.h) against the CPU reference
// (kernels/mla/mla_prefill_ref.h) fed the same bf16 inputs, and the prefill key gather against
// KvCacheDecodeRow.
//
// Attention error bound, per output element (query row i, head h, dim d):
//   |o_gpu - o_ref| <= 2^-7 * a + 2^-7 * |o_ref| + 1e-6,   a = sum_j p_j |v_j,d|
// where p_j are the reference's softmax weights of that row; a comes from a second reference
// run with |v| in place of v (same scores, so the same weights). Why: q, k and v are the same
// bf16 values on both sides (exact in the mma inputs). The roundings that matter are (a) P
// rounded to bf16 for the P.V product: each weight moves by at most 2^-9 of itself (RNE, 8-bit
// significand) and the row sum l uses the unrounded P, so o moves by at most 2^-9 * a; (b) the
// bf16 output, 2^-9 * |o|. The rest is far smaller: S accumulated in fp32 over <= 192 terms of
// |q k| ~ 0.64 each, times a scale <= 5 / sqrt(192), is off by < 192 * 2^-24 * 123 * 0.36 ~ 5e-4
// in the exponent (relative 2^-11 on a weight, below 2^-9 and inside the margin); exp2.approx
// ~2^-22 relative; fp32 sums over <= 5300 keys ~3e-4 relative worst case. The bound is four
// times (a) + (b). The whole-tensor relative RMS error is also checked: bf16 output rounding
// alone is ~2^-9 / sqrt(3) = 1.1e-3.
//
// Gather: exact equality of the bf16 bits (the GPU decodes with IEEE fp32 multiplies and RNE).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/kernels/device_buffer.h"
#include "kernels/mla/kv_cache_format.h"
#include "kernels/mla/mla_prefill.h"
#include "kernels/mla/mla_prefill_ref.h"

namespace mlaserve {
namespace {

// Random bf16 values ~ N(0, sigma^2): bits for the GPU, the same values in fp32 for the reference.
void RandomBf16(std::mt19937& rng, size_t n, float sigma, std::vector<uint16_t>& bits,
                std::vector<float>& values) {
  std::normal_distribution<float> normal(0.0f, sigma);
  bits.resize(n);
  values.resize(n);
  for (size_t i = 0; i < n; ++i) {
    bits[i] = FloatToBf16(normal(rng));
    values[i] = Bf16ToFloat(bits[i]);
  }
}

struct PrefillCase {
  int heads, nope, v;
  std::vector<int32_t> ctx, n;  // Per sequence: cached prefix tokens, new tokens.
  float scale_mult = 1.3f;      // softmax_scale = scale_mult / sqrt(qk dims).
};

std::string Name(const PrefillCase& c) {
  std::string s = "heads=" + std::to_string(c.heads) + " nope=" + std::to_string(c.nope) +
                  " v=" + std::to_string(c.v) + " scale_mult=" + std::to_string(c.scale_mult) +
                  " (ctx,n)=";
  for (size_t i = 0; i < c.n.size() && i < 8; ++i) {
    s += "(" + std::to_string(c.ctx[i]) + "," + std::to_string(c.n[i]) + ")";
  }
  if (c.n.size() > 8) s += "... (" + std::to_string(c.n.size()) + " seqs)";
  return s;
}

void RunPrefillCase(const PrefillCase& c, uint32_t seed) {
  SCOPED_TRACE(Name(c));
  std::mt19937 rng(seed);
  const int num_seqs = static_cast<int>(c.n.size());
  const int qk = c.nope + 64, cols = c.nope + c.v;
  std::vector<int32_t> q_begin{0}, kv_begin{0};
  int max_q_len = 0;
  for (int s = 0; s < num_seqs; ++s) {
    q_begin.push_back(q_begin.back() + c.n[s]);
    kv_begin.push_back(kv_begin.back() + c.ctx[s] + c.n[s]);
    max_q_len = std::max(max_q_len, c.n[s]);
  }
  const int total_q = q_begin.back(), total_kv = kv_begin.back();
  std::vector<uint16_t> q_bits, kv_bits, rope_bits;
  std::vector<float> q_f, kv_f, rope_f;
  RandomBf16(rng, size_t(total_q) * c.heads * qk, 1.0f, q_bits, q_f);
  RandomBf16(rng, size_t(total_kv) * c.heads * cols, 1.0f, kv_bits, kv_f);
  RandomBf16(rng, size_t(total_kv) * 64, 1.0f, rope_bits, rope_f);
  const float softmax_scale = c.scale_mult / std::sqrt(static_cast<float>(qk));

  std::vector<float> ref(size_t(total_q) * c.heads * c.v), ref_abs(ref.size());
  MlaPrefillRef(num_seqs, c.heads, c.nope, 64, c.v, q_f.data(), kv_f.data(), rope_f.data(),
                q_begin.data(), kv_begin.data(), c.ctx.data(), softmax_scale, ref.data());
  {  // sum_j p_j |v_j|: the same keys (same weights) with |v| as values.
    std::vector<float> kv_abs = kv_f;
    for (size_t r = 0; r < size_t(total_kv) * c.heads; ++r) {
      for (int d = 0; d < c.v; ++d)
        kv_abs[r * cols + c.nope + d] = std::fabs(kv_abs[r * cols + c.nope + d]);
    }
    MlaPrefillRef(num_seqs, c.heads, c.nope, 64, c.v, q_f.data(), kv_abs.data(), rope_f.data(),
                  q_begin.data(), kv_begin.data(), c.ctx.data(), softmax_scale, ref_abs.data());
  }

  DeviceBuffer<uint16_t> d_q(q_bits.size()), d_kv(kv_bits.size()), d_rope(rope_bits.size()),
      d_out(ref.size());
  DeviceBuffer<int32_t> d_qb(q_begin.size()), d_kvb(kv_begin.size()), d_ctx(c.ctx.size());
  ASSERT_TRUE(d_q.ptr && d_kv.ptr && d_rope.ptr && d_out.ptr && d_qb.ptr && d_kvb.ptr && d_ctx.ptr);
  d_q.Upload(q_bits);
  d_kv.Upload(kv_bits);
  d_rope.Upload(rope_bits);
  d_qb.Upload(q_begin);
  d_kvb.Upload(kv_begin);
  d_ctx.Upload(c.ctx);
  CUDA_OK(cudaMemset(d_out.ptr, 0xff, d_out.count * 2));  // NaN: unwritten outputs fail.

  MlaPrefillParams p;
  p.num_seqs = num_seqs;
  p.heads = c.heads;
  p.qk_nope = c.nope;
  p.qk_rope = 64;
  p.v_dim = c.v;
  p.q = d_q.ptr;
  p.kv = d_kv.ptr;
  p.k_rope = d_rope.ptr;
  p.q_begin = d_qb.ptr;
  p.kv_begin = d_kvb.ptr;
  p.context_lens = d_ctx.ptr;
  p.total_q = total_q;
  p.max_q_len = max_q_len;
  p.softmax_scale = softmax_scale;
  p.out = d_out.ptr;
  const absl::Status st = InvokeMlaPrefill(p, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> out = d_out.Download();

  double err2 = 0, ref2 = 0, worst_ratio = 0, worst_err = 0;
  std::string worst_at = "-";
  int bad = 0;
  for (int s = 0; s < num_seqs; ++s) {
    for (int h = 0; h < c.heads; ++h) {
      for (int i = 0; i < c.n[s]; ++i) {
        const size_t row = (size_t(q_begin[s] + i) * c.heads + h) * c.v;
        for (int d = 0; d < c.v; ++d) {
          const float got = Bf16ToFloat(out[row + d]);
          const float want = ref[row + d];
          const float tol =
              std::ldexp(ref_abs[row + d], -7) + std::ldexp(std::fabs(want), -7) + 1e-6f;
          const float err = std::fabs(got - want);
          err2 += double(got - want) * (got - want);
          ref2 += double(want) * want;
          if (!(err <= tol)) {  // NaN-safe.
            if (bad++ < 5) {
              ADD_FAILURE() << "seq " << s << " query " << i << " (ctx " << c.ctx[s] << ") head "
                            << h << " d " << d << ": " << got << " vs " << want << " (tol " << tol
                            << ")";
            }
            worst_ratio = INFINITY;
          } else if (err / tol > worst_ratio) {
            worst_ratio = err / tol;
          }
          if (!(err <= worst_err)) {
            worst_err = err;
            worst_at = "seq " + std::to_string(s) + " query " + std::to_string(i) + " head " +
                       std::to_string(h) + " d " + std::to_string(d);
          }
        }
      }
    }
  }
  const double rel_rms = std::sqrt(err2 / std::max(ref2, 1e-30));
  std::printf("[prefill] %s: max|err| %.3g at %s, worst err/tol %.3g, rel rms %.3g, %d bad\n",
              Name(c).c_str(), worst_err, worst_at.c_str(), worst_ratio, rel_rms, bad);
  EXPECT_EQ(bad, 0);
  EXPECT_LT(rel_rms, 5e-3);
}

struct Dims {
  int nope, v;
};
constexpr Dims kDims[] = {{16, 16}, {32, 32}, {64, 64}, {128, 128}, {128, 64}};

TEST(MlaPrefillGpuTest, SmallEveryDims) {  // Also the compute-sanitizer case.
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 1;
  for (const Dims& d : kDims) {
    RunPrefillCase({2, d.nope, d.v, {0, 3, 0}, {1, 7, 70}}, seed++);
  }
}

TEST(MlaPrefillGpuTest, HeadsDimsAndLengths) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 100;
  for (const Dims& d : kDims) {
    for (int heads : {1, 4, 16}) {
      // Several sequences of different lengths in one call: no prefix and 1, 7, 64, 257 new
      // tokens; prefixes that end inside, at the end of and past a 64-key tile.
      RunPrefillCase({heads, d.nope, d.v, {0, 0, 0, 70, 0, 64, 129}, {1, 7, 64, 257, 65, 63, 2}},
                     seed++);
    }
  }
}

TEST(MlaPrefillGpuTest, ManyHeads) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 200;
  for (const Dims& d : kDims) {
    RunPrefillCase({128, d.nope, d.v, {0, 100, 5}, {64, 33, 1}}, seed++);
  }
}

TEST(MlaPrefillGpuTest, LongPrefixes) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 300;
  RunPrefillCase({2, 128, 128, {5000, 1234, 0}, {257, 7, 1}}, seed++);
  RunPrefillCase({1, 128, 64, {4999, 3}, {64, 130}}, seed++);
  RunPrefillCase({1, 64, 64, {5000}, {1}}, seed++);
  RunPrefillCase({3, 16, 16, {4097, 2000}, {200, 64}}, seed++);
}

TEST(MlaPrefillGpuTest, ManySequencesAndEmptyOnes) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  PrefillCase c{8, 64, 64, {}, {}};
  for (int s = 0; s < 40; ++s) {
    c.ctx.push_back(std::uniform_int_distribution<int>(0, 300)(rng));
    c.n.push_back(std::uniform_int_distribution<int>(1, 100)(rng));
  }
  c.n[3] = 0;  // A sequence with a prefix and no new tokens (nothing to write).
  c.ctx[10] = 0;
  c.n[10] = 0;  // An empty sequence.
  RunPrefillCase(c, 400);
}

TEST(MlaPrefillGpuTest, PeakySoftmax) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  // Score std ~ 5: the running max moves a lot between tiles (rescaling path).
  RunPrefillCase({4, 128, 128, {300, 0}, {100, 200}, 5.0f}, 500);
  RunPrefillCase({4, 32, 32, {300, 0}, {100, 200}, 5.0f}, 501);
}

TEST(MlaPrefillGpuTest, InconsistentLengthsGiveNaN) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  // kv_begin[1] - kv_begin[0] = 10 but context 4 + 5 new = 9: the kernel writes NaN, not wild
  // reads.
  const std::vector<int32_t> q_begin{0, 5}, kv_begin{0, 10}, ctx{4};
  const int heads = 2, nope = 16, v = 16;
  DeviceBuffer<uint16_t> d_q(5 * heads * 80), d_kv(10 * heads * 32), d_rope(10 * 64),
      d_out(5 * heads * v);
  DeviceBuffer<int32_t> d_qb(2), d_kvb(2), d_ctx(1);
  ASSERT_TRUE(d_q.ptr && d_kv.ptr && d_rope.ptr && d_out.ptr && d_qb.ptr && d_kvb.ptr && d_ctx.ptr);
  CUDA_OK(cudaMemset(d_q.ptr, 0, d_q.count * 2));
  CUDA_OK(cudaMemset(d_kv.ptr, 0, d_kv.count * 2));
  CUDA_OK(cudaMemset(d_rope.ptr, 0, d_rope.count * 2));
  CUDA_OK(cudaMemset(d_out.ptr, 0, d_out.count * 2));  // zeros: the NaNs must come from the kernel
  d_qb.Upload(q_begin);
  d_kvb.Upload(kv_begin);
  d_ctx.Upload(ctx);
  MlaPrefillParams p;
  p.num_seqs = 1;
  p.heads = heads;
  p.qk_nope = nope;
  p.v_dim = v;
  p.q = d_q.ptr;
  p.kv = d_kv.ptr;
  p.k_rope = d_rope.ptr;
  p.q_begin = d_qb.ptr;
  p.kv_begin = d_kvb.ptr;
  p.context_lens = d_ctx.ptr;
  p.total_q = 5;
  p.max_q_len = 5;
  p.softmax_scale = 0.1f;
  p.out = d_out.ptr;
  ASSERT_TRUE(InvokeMlaPrefill(p, nullptr).ok());
  CUDA_OK(cudaDeviceSynchronize());
  for (uint16_t b : d_out.Download()) ASSERT_TRUE(std::isnan(Bf16ToFloat(b)));
}

TEST(MlaPrefillGpuTest, RejectsUnsupportedShapes) {
  // Argument checks run before any CUDA call: no GPU needed.
  MlaPrefillParams p;
  p.num_seqs = 1;
  p.heads = 4;
  p.qk_nope = 96;
  p.v_dim = 96;
  absl::Status st = InvokeMlaPrefill(p, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("qk_nope 96, v_dim 96"), std::string::npos) << st;
  p.qk_nope = p.v_dim = 64;
  p.qk_rope = 32;
  EXPECT_EQ(InvokeMlaPrefill(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.qk_rope = 64;
  p.heads = 129;
  EXPECT_EQ(InvokeMlaPrefill(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  MlaPrefillGatherParams g;
  g.format = KvCacheFormat::kF32;
  g.num_seqs = 1;
  g.total_kv = 1;
  int32_t dummy[4];
  alignas(16) uint16_t rows[1024];  // aligned, so only the format can be what is rejected
  g.kv_pool = rows;
  g.block_table = g.context_lens = g.q_begin = g.kv_begin = dummy;
  g.new_latent = g.new_rope = g.out_latent = g.out_rope = rows;
  st = InvokeMlaPrefillGather(g, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("f32"), std::string::npos) << st;
}

// Latent with one magnitude per 128-value tile (so fp8_tiled scales differ), rope separately.
void RandomCacheRow(std::mt19937& rng, float* latent, float* rope) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp_dist(-6, 4);
  for (int t = 0; t < kFp8TilesPerRow; ++t) {
    const float mag = std::ldexp(1.0f, exp_dist(rng));
    for (int i = 0; i < kFp8TileDim; ++i) latent[t * kFp8TileDim + i] = normal(rng) * mag;
  }
  for (int i = 0; i < kMlaRopeDim; ++i) rope[i] = normal(rng);
}

TEST(MlaPrefillGatherGpuTest, MatchesDecodeRowEveryFormat) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  // Prefixes of 0, 1, 63, 64, 65 (block boundaries), 300 and 5000 tokens; 0..64 new tokens.
  const std::vector<int32_t> ctx{0, 1, 63, 64, 65, 300, 5000, 0};
  const std::vector<int32_t> n_new{3, 0, 1, 64, 2, 17, 5, 0};
  const int num_seqs = static_cast<int>(ctx.size());
  std::vector<int32_t> q_begin{0}, kv_begin{0};
  int max_blocks = 1, used_blocks = 0;
  for (int s = 0; s < num_seqs; ++s) {
    q_begin.push_back(q_begin.back() + n_new[s]);
    kv_begin.push_back(kv_begin.back() + ctx[s] + n_new[s]);
    max_blocks = std::max(max_blocks, (ctx[s] + 63) / 64);
    used_blocks += (ctx[s] + 63) / 64;
  }
  const int total_q = q_begin.back(), total_kv = kv_begin.back();
  uint32_t seed = 11;
  for (KvCacheFormat f : {KvCacheFormat::kBf16, KvCacheFormat::kFp8, KvCacheFormat::kFp8Tiled}) {
    SCOPED_TRACE(std::string(KvCacheFormatName(f)));
    std::mt19937 rng(seed++);
    const size_t row_bytes = KvCacheBytesPerToken(f);
    const float fp8_scale = 0.37f;  // Not a power of two: the product is rounded twice.
    // Paged pool with shuffled blocks and spare blocks; unused slots 0xff (NaN in every format).
    const int num_blocks = used_blocks + 3;
    std::vector<int32_t> perm(num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<uint8_t> pool(size_t(num_blocks) * 64 * row_bytes, 0xff);
    std::vector<int32_t> table(size_t(num_seqs) * max_blocks, -1);
    // Expected rows [total_kv, 576] as bf16 bits.
    std::vector<uint16_t> expect(size_t(total_kv) * kMlaQkDim);
    // New tokens' activations: one [total_q, 576] buffer, latent at 0 and rope at 512 (as the
    // kv_a projection's output), so the strides are 576.
    std::vector<uint16_t> act_bits;
    std::vector<float> act_f;
    RandomBf16(rng, size_t(std::max(total_q, 1)) * kMlaQkDim, 1.0f, act_bits, act_f);
    int next = 0;
    std::vector<float> latent(kMlaLatentDim), rope(kMlaRopeDim), dec(kMlaQkDim);
    for (int s = 0; s < num_seqs; ++s) {
      for (int t = 0; t < ctx[s] + n_new[s]; ++t) {
        uint16_t* e = &expect[(size_t(kv_begin[s]) + t) * kMlaQkDim];
        if (t < ctx[s]) {
          if (t % 64 == 0) table[size_t(s) * max_blocks + t / 64] = perm[next++];
          RandomCacheRow(rng, latent.data(), rope.data());
          const int64_t slot = int64_t{table[size_t(s) * max_blocks + t / 64]} * 64 + t % 64;
          uint8_t* dst = pool.data() + slot * row_bytes;
          KvCacheEncodeRow(f, latent.data(), rope.data(), fp8_scale, dst);
          KvCacheDecodeRow(f, dst, fp8_scale, dec.data());
          for (int d = 0; d < kMlaQkDim; ++d) e[d] = FloatToBf16(dec[d]);
        } else {
          std::memcpy(e, &act_bits[(size_t(q_begin[s]) + t - ctx[s]) * kMlaQkDim],
                      kMlaQkDim * sizeof(uint16_t));
        }
      }
    }
    DeviceBuffer<uint8_t> d_pool(pool.size());
    DeviceBuffer<int32_t> d_table(table.size()), d_ctx(ctx.size()), d_qb(q_begin.size()),
        d_kvb(kv_begin.size());
    DeviceBuffer<uint16_t> d_act(act_bits.size()), d_lat(size_t(total_kv) * kMlaLatentDim),
        d_rope(size_t(total_kv) * kMlaRopeDim);
    ASSERT_TRUE(d_pool.ptr && d_table.ptr && d_ctx.ptr && d_qb.ptr && d_kvb.ptr && d_act.ptr &&
                d_lat.ptr && d_rope.ptr);
    d_pool.Upload(pool);
    d_table.Upload(table);
    d_ctx.Upload(ctx);
    d_qb.Upload(q_begin);
    d_kvb.Upload(kv_begin);
    d_act.Upload(act_bits);
    CUDA_OK(cudaMemset(d_lat.ptr, 0xff, d_lat.count * 2));
    CUDA_OK(cudaMemset(d_rope.ptr, 0xff, d_rope.count * 2));
    MlaPrefillGatherParams g;
    g.format = f;
    g.fp8_scale = fp8_scale;
    g.kv_pool = d_pool.ptr;
    g.block_table = d_table.ptr;
    g.max_blocks_per_seq = max_blocks;
    g.context_lens = d_ctx.ptr;
    g.q_begin = d_qb.ptr;
    g.kv_begin = d_kvb.ptr;
    g.new_latent = d_act.ptr;
    g.latent_stride = kMlaQkDim;
    g.new_rope = d_act.ptr + kMlaLatentDim;
    g.rope_stride = kMlaQkDim;
    g.num_seqs = num_seqs;
    g.total_kv = total_kv;
    g.out_latent = d_lat.ptr;
    g.out_rope = d_rope.ptr;
    const absl::Status st = InvokeMlaPrefillGather(g, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got_lat = d_lat.Download(), got_rope = d_rope.Download();
    size_t mismatches = 0;
    for (int r = 0; r < total_kv; ++r) {
      for (int d = 0; d < kMlaQkDim; ++d) {
        const uint16_t got = d < kMlaLatentDim
                                 ? got_lat[size_t(r) * kMlaLatentDim + d]
                                 : got_rope[size_t(r) * kMlaRopeDim + d - kMlaLatentDim];
        const uint16_t want = expect[size_t(r) * kMlaQkDim + d];
        if (got != want && mismatches++ < 5) {
          ADD_FAILURE() << "row " << r << " dim " << d << ": got bf16 0x" << std::hex << got << " ("
                        << Bf16ToFloat(got) << ") want 0x" << want << " (" << Bf16ToFloat(want)
                        << ")" << std::dec;
        }
      }
    }
    std::printf("[gather] %s: %d rows, %zu mismatching values\n",
                std::string(KvCacheFormatName(f)).c_str(), total_kv, mismatches);
    EXPECT_EQ(mismatches, 0u);
  }
}

}  // namespace
}  // namespace mlaserve
