// GPU MLA decode and cache write (kernels/mla/mla_decode.h) against the CPU reference
// (kernels/mla/mla_decode_ref.h), which dequantizes the same cache bytes.
//
// Error bound of the decode output, per element:
//   |o_gpu - o_ref| <= 2^-7 * max|v| + 2^-7 * |o_ref| + 1e-6
// Why: q and the dequantized K/V are exact in the MMA inputs (bf16 q; f16 q times a power of
// two for the fp8 caches; e4m3 is exact in f16; fp8's per-layer scale is applied in fp32, the
// fp8_tiled tile scales as powers of two), S is accumulated in fp32 (relative error ~1e-6 over
// 576 terms), and split sequences' partial outputs are fp32, so the roundings that matter are
// (a) the softmax weights P rounded to bf16 (bf16 cache) or f16 (fp8 caches) for the P.V
// product (relative 2^-9 at most: the output moves by at most ~2^-9 * max|v|) and (b) the final
// bf16 output (2^-9 * |o|). The bound is four times each.
// LSE (natural log): |lse_gpu - lse_ref| <= 4e-3 + 1e-5 * |lse_ref| (the sums are fp32 over
// unrounded weights, ~1e-6; the margin covers fp32 exp2 approximations).
//
// A variant on e4m3 tensor cores (MlaDecodeVariantFp8Mma) is compared with the reference's
// emulation of that form (MlaFp8MmaEmulation::kQkPv): q rounded to e4m3 by the same rule, the
// same cache bytes, ~22-bit tensor-core sums promoted every 128 dims (the summation order inside
// a group differs: ~2^-13 of a group's largest term, below the LSE bound). What differs is where
// P is rounded to e4m3: the kernel shifts P by the running max of its 32-token tiles (and of its
// piece of a split sequence), the emulation by that of 64-token blocks, so a token's two
// roundings may differ by up to 2^-3 of its weight: |o_gpu - o_ref| <= 2^-3 * max|v| +
// 2^-7 * |o_ref| + 1e-6 per element. The whole-tensor relative error of independent e4m3
// roundings is ~0.04 (RMS of 2^-4..2^-5 / sqrt(3), twice); the bound is 0.1. A V^T token out of
// place, a wrong group or scale moves it to ~1.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/mla/kv_cache_format.h"
#include "kernels/mla/mla_decode.h"
#include "kernels/mla/mla_decode_ref.h"
#include "tests/kernels/device_buffer.h"

namespace mlaserve {
namespace {

// Latent with one magnitude per 128-value tile (so fp8_tiled scales differ), rope separately.
void RandomRow(std::mt19937& rng, float* latent, float* rope) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp_dist(-3, 2);
  for (int t = 0; t < kFp8TilesPerRow; ++t) {
    const float mag = std::ldexp(1.0f, exp_dist(rng));
    for (int i = 0; i < kFp8TileDim; ++i) latent[t * kFp8TileDim + i] = normal(rng) * mag;
  }
  for (int i = 0; i < kMlaRopeDim; ++i) rope[i] = normal(rng);
}

struct DecodeCase {
  KvCacheFormat format;
  int heads, s_q;
  std::vector<int32_t> lens;
  int variant = -1;        // -1: the launcher's choice.
  int max_workers = 0;     // 0: no cap.
  bool invariant = false;  // the batch-invariant schedule (for the longest sequence's length)
  // q's RoPE dims from a separate buffer (MlaDecodeParams::q_rope) laid out as the model's q
  // rows [.., 192] (nope 128, rope 64); q's own columns 512..575 then hold NaN.
  bool separate_rope = false;
  // On a stream of its own with the combine launched programmatically (the split kernel's tail
  // overlapping the combine's launch; MlaDecodeParams::programmatic_combine).
  bool programmatic = false;
  int min_share = 0;  // MlaDecodeParams::min_share (0: the default)
  int combine_row_warps = -1;  // MlaDecodeParams::combine_row_warps (-1: the default rule)
  int kv_tma_l2 = 1;           // MlaDecodeParams::kv_tma_l2 (1: the default)
  bool one_step_rows = false;   // q row r is zero outside dims 32 (r % 18) .. + 31
};

std::string Name(const DecodeCase& c) {
  std::string s =
      std::string(KvCacheFormatName(c.format)) + " heads=" + std::to_string(c.heads) +
      " s_q=" + std::to_string(c.s_q) + " variant=" + MlaDecodeVariantName(c.variant) +
      " max_workers=" + std::to_string(c.max_workers) + (c.invariant ? " invariant" : "") +
      (c.separate_rope ? " separate_rope" : "") + (c.programmatic ? " programmatic" : "") +
      (c.min_share > 0 ? " min_share=" + std::to_string(c.min_share) : "") +
      (c.combine_row_warps >= 0 ? " combine_row_warps=" + std::to_string(c.combine_row_warps)
                                : "") +
      (c.kv_tma_l2 != 1 ? " kv_tma_l2=" + std::to_string(c.kv_tma_l2) : "") + " lens=";
  for (size_t i = 0; i < c.lens.size() && i < 6; ++i) s += std::to_string(c.lens[i]) + ",";
  if (c.lens.size() > 6) s += "... (" + std::to_string(c.lens.size()) + ")";
  return s;
}

void RunDecodeCase(const DecodeCase& c, uint32_t seed) {
  SCOPED_TRACE(Name(c));
  std::mt19937 rng(seed);
  const int batch = static_cast<int>(c.lens.size());
  const size_t row_bytes = KvCacheBytesPerToken(c.format);
  const float kv_scale = 0.0625f * 1.37f;  // Not a power of two: exercises the fp32 scaling.
  const float softmax_scale = 1.4f / std::sqrt(576.0f);

  // Paged pool: shuffled physical blocks, spare blocks, unused slots filled with 0xff (NaN in
  // every format) so that reading past a sequence end would poison the result.
  int max_blocks = 1, used_blocks = 0;
  for (int32_t l : c.lens) {
    max_blocks = std::max(max_blocks, (l + 63) / 64);
    used_blocks += (l + 63) / 64;
  }
  const int num_blocks = used_blocks + 5;
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<uint8_t> pool(static_cast<size_t>(num_blocks) * 64 * row_bytes, 0xff);
  std::vector<int32_t> table(static_cast<size_t>(batch) * max_blocks, -1);
  int next = 0;
  std::vector<float> latent(kMlaLatentDim), rope(kMlaRopeDim);
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < c.lens[b]; ++t) {
      if (t % 64 == 0) table[static_cast<size_t>(b) * max_blocks + t / 64] = perm[next++];
      RandomRow(rng, latent.data(), rope.data());
      const int64_t slot =
          int64_t{table[static_cast<size_t>(b) * max_blocks + t / 64]} * 64 + t % 64;
      KvCacheEncodeRow(c.format, latent.data(), rope.data(), kv_scale,
                       pool.data() + slot * row_bytes);
    }
  }
  const int rows = c.s_q * c.heads;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> q_bf16(static_cast<size_t>(batch) * rows * kMlaQkDim);
  std::vector<float> q_f32(q_bf16.size());
  for (size_t i = 0; i < q_bf16.size(); ++i) {
    q_bf16[i] = FloatToBf16(normal(rng));
    // One 32-dim k-step a row (row r: dims 32 (r % 18) ..): a wrong step shows in its rows alone.
    const int qrow = static_cast<int>(i / kMlaQkDim % rows), dim = static_cast<int>(i % kMlaQkDim);
    if (c.one_step_rows && dim / 32 != qrow % (kMlaQkDim / 32)) q_bf16[i] = 0;
    q_f32[i] = Bf16ToFloat(q_bf16[i]);
  }

  const int invariant_len = c.invariant ? max_blocks * 64 : 0;
  auto plan =
      PlanMlaDecode(batch, c.s_q, c.heads, c.format, c.variant, c.max_workers, invariant_len);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // A variant on e4m3 tensor cores is held to the form it computes (the bound at the top).
  const bool fp8_mma = MlaDecodeVariantFp8Mma(plan->variant);

  std::vector<float> ref_out(static_cast<size_t>(batch) * rows * kMlaLatentDim);
  std::vector<float> ref_lse(static_cast<size_t>(batch) * rows);
  MlaDecodeRefParams rp{q_f32.data(),  pool.data(),    table.data(),  max_blocks, c.lens.data(),
                        batch,         c.s_q,          c.heads,       c.format,   kv_scale,
                        softmax_scale, ref_out.data(), ref_lse.data()};
  if (fp8_mma) rp.fp8_mma = MlaFp8MmaEmulation::kQkPv;
  MlaDecodeRef(rp);
  DeviceBuffer<uint8_t> d_pool(pool.size()), d_ws(plan->workspace_bytes);
  DeviceBuffer<int32_t> d_table(table.size()), d_lens(c.lens.size());
  DeviceBuffer<uint16_t> d_q(q_bf16.size()), d_out(ref_out.size());
  DeviceBuffer<float> d_lse(ref_lse.size());
  ASSERT_TRUE(d_pool.ptr && d_ws.ptr && d_table.ptr && d_lens.ptr && d_q.ptr && d_out.ptr &&
              d_lse.ptr);
  d_pool.Upload(pool);
  d_table.Upload(table);
  d_lens.Upload(c.lens);
  // The separate RoPE rows: stride 192, the values at columns 128..191, NaN elsewhere.
  constexpr int kRopeStride = 192, kRopeCol = 128;
  std::vector<uint16_t> q_rope;
  DeviceBuffer<uint16_t> d_rope(c.separate_rope ? q_bf16.size() / kMlaQkDim * kRopeStride : 0);
  if (c.separate_rope) {
    ASSERT_TRUE(d_rope.ptr);
    q_rope.assign(d_rope.count, 0xffff);
    std::vector<uint16_t> q_poisoned = q_bf16;
    for (size_t f = 0; f < q_bf16.size() / kMlaQkDim; ++f) {
      for (int d = 0; d < kMlaRopeDim; ++d) {
        q_rope[f * kRopeStride + kRopeCol + d] = q_bf16[f * kMlaQkDim + kMlaLatentDim + d];
        q_poisoned[f * kMlaQkDim + kMlaLatentDim + d] = 0xffff;
      }
    }
    d_rope.Upload(q_rope);
    d_q.Upload(q_poisoned);
  } else {
    d_q.Upload(q_bf16);
  }
  // Poison: NaN outputs and workspace, so an unwritten element fails the bound.
  CUDA_OK(cudaMemset(d_out.ptr, 0xff, d_out.count * 2));
  CUDA_OK(cudaMemset(d_lse.ptr, 0xff, d_lse.count * 4));
  CUDA_OK(cudaMemset(d_ws.ptr, 0xff, d_ws.count));

  MlaDecodeParams p;
  p.q = d_q.ptr;
  p.kv_pool = d_pool.ptr;
  p.block_table = d_table.ptr;
  p.max_blocks_per_seq = max_blocks;
  p.seq_lens = d_lens.ptr;
  p.batch = batch;
  p.s_q = c.s_q;
  p.heads = c.heads;
  p.format = c.format;
  p.kv_scale = kv_scale;
  p.softmax_scale = softmax_scale;
  p.out = d_out.ptr;
  p.lse = d_lse.ptr;
  p.workspace = d_ws.ptr;
  p.workspace_bytes = d_ws.count;
  p.variant = c.variant;
  p.max_workers = c.max_workers;
  p.invariant_max_seq_len = invariant_len;
  p.min_share = c.min_share;
  p.combine_row_warps = c.combine_row_warps;
  p.kv_tma_l2 = c.kv_tma_l2;
  if (c.separate_rope) {
    p.q_rope = d_rope.ptr + kRopeCol;
    p.q_rope_stride = kRopeStride;
  }
  cudaStream_t stream = nullptr;
  if (c.programmatic) {
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    p.programmatic_combine = true;
  }
  const absl::Status st = InvokeMlaDecode(p, stream);
  CUDA_OK(cudaDeviceSynchronize());
  if (stream != nullptr) CUDA_OK(cudaStreamDestroy(stream));
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<uint16_t> out = d_out.Download();
  const std::vector<float> lse = d_lse.Download();

  double err2 = 0, ref2 = 0;
  int bad = 0;
  for (int b = 0; b < batch; ++b) {
    // max |v| over the rows this sequence can see (all visible rows of the sequence).
    float vmax = 0.0f;
    std::vector<float> row(kMlaQkDim);
    for (int t = 0; t < c.lens[b]; ++t) {
      const int64_t slot =
          int64_t{table[static_cast<size_t>(b) * max_blocks + t / 64]} * 64 + t % 64;
      KvCacheDecodeRow(c.format, pool.data() + slot * row_bytes, kv_scale, row.data());
      for (int d = 0; d < kMlaLatentDim; ++d) vmax = std::max(vmax, std::fabs(row[d]));
    }
    for (int r = 0; r < rows; ++r) {
      const size_t rr = static_cast<size_t>(b) * rows + r;
      const float lse_tol = 4e-3f + 1e-5f * std::fabs(ref_lse[rr]);
      // Equal infinities (a row that sees no key: lse -inf) match; |inf - inf| is NaN.
      if (!(lse[rr] == ref_lse[rr] || std::fabs(lse[rr] - ref_lse[rr]) <= lse_tol) && bad++ < 5) {
        ADD_FAILURE() << "lse b=" << b << " row=" << r << ": " << lse[rr] << " vs " << ref_lse[rr];
      }
      for (int d = 0; d < kMlaLatentDim; ++d) {
        const float got = Bf16ToFloat(out[rr * kMlaLatentDim + d]);
        const float want = ref_out[rr * kMlaLatentDim + d];
        const float tol =
            std::ldexp(vmax, fp8_mma ? -3 : -7) + std::ldexp(std::fabs(want), -7) + 1e-6f;
        err2 += double(got - want) * (got - want);
        ref2 += double(want) * want;
        if (!(std::fabs(got - want) <= tol) && bad++ < 5) {
          ADD_FAILURE() << "out b=" << b << " row=" << r << " d=" << d << ": " << got << " vs "
                        << want << " (tol " << tol << ")";
        }
      }
    }
  }
  EXPECT_EQ(bad, 0);
  // Whole-tensor relative error: bf16 output rounding alone is ~2^-9 / sqrt(3) = 1.1e-3. The e4m3
  // form: see the top (the kernel's and the emulation's P roundings, ~0.04 when they differ).
  EXPECT_LT(std::sqrt(err2 / std::max(ref2, 1e-30)), fp8_mma ? 0.1 : 5e-3);
}

// Variants the variant loops below run: every one available for the format on this device, or only
// the one named by MLASERVE_MLA_TEST_VARIANT (a variant's name, MlaDecodeVariantName), so that one
// new kernel's cases can be run alone on a lent GPU.
bool RunVariant(int v, KvCacheFormat f) {
  if (!MlaDecodeVariantAvailable(v, f)) return false;
  const char* only = std::getenv("MLASERVE_MLA_TEST_VARIANT");
  return only == nullptr || *only == '\0' || MlaDecodeVariantName(v) == only;
}

constexpr KvCacheFormat kFormats[] = {KvCacheFormat::kBf16, KvCacheFormat::kFp8,
                                      KvCacheFormat::kFp8Tiled};

TEST(MlaDecodeGpuTest, Small) {  // Also the compute-sanitizer case.
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 1;
  for (KvCacheFormat f : kFormats) {
    for (int v = 0; v < MlaDecodeVariantCount(); ++v) {  // every loop shape under the sanitizer
      if (!RunVariant(v, f)) continue;                   // (the wgmma kernels need SM 9.0)
      RunDecodeCase({f, 16, 2, {2, 63, 65, 130}, v}, seed++);
    }
  }
  RunDecodeCase({KvCacheFormat::kFp8Tiled, 40, 1, {70, 3}}, seed++);
  RunDecodeCase({KvCacheFormat::kFp8, 16, 1, {3000}}, seed++);  // split, wide combine (16 rows)
}

TEST(MlaDecodeGpuTest, HeadsSqLengths) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 100;
  for (KvCacheFormat f : kFormats) {
    for (int heads : {1, 8, 16, 64, 128}) {
      for (int s_q = 1; s_q <= 4; ++s_q) {
        RunDecodeCase({f, heads, s_q, {1 + s_q, 63, 64, 65, 4096 + 17}}, seed++);
      }
    }
  }
}

TEST(MlaDecodeGpuTest, EveryVariant) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 200;
  for (KvCacheFormat f : kFormats) {
    for (int v = 0; v < MlaDecodeVariantCount(); ++v) {
      if (!RunVariant(v, f)) continue;
      RunDecodeCase({f, 64, 1, {300, 1000, 5}, v}, seed++);
      RunDecodeCase({f, 8, 3, {300, 1000, 5, 3000}, v}, seed++);
      RunDecodeCase({f, 16, 4, {9000}, v}, seed++);  // Batch 1: many pieces, 32-token tiles
                                                     // straddling 16-token shares.
    }
  }
}

// Every variant over head counts and query lengths (64-row blocks: padded rows at 1 and 40 heads,
// two row tiles at 128 heads x s_q 1, eight at 128 x 4), split and whole pieces.
TEST(MlaDecodeGpuTest, EveryVariantHeadsSq) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 500;
  for (KvCacheFormat f : kFormats) {
    for (int v = 0; v < MlaDecodeVariantCount(); ++v) {
      if (!RunVariant(v, f)) continue;
      for (int heads : {1, 40, 128}) {
        for (int s_q : {1, 4}) {
          RunDecodeCase({f, heads, s_q, {1 + s_q, 63, 65, 2048 + 17}, v}, seed++);
        }
      }
      RunDecodeCase({f, 128, 1, {9000}, v}, seed++);  // batch 1 split over every SM
    }
  }
}

// The variants on e4m3 tensor cores (MlaDecodeVariantFp8Mma) against the emulated form, beyond
// the cases every variant runs: head counts around the 64-row tile (1, 8, 40, 64, 65, 128), 1-4
// query tokens, lengths around 32 tokens and around one and two 64-token blocks (the e4m3
// kernel's tile), a sequence split over every SM, split pieces beside whole ones, a batch past the
// in-kernel schedule, and rows whose q is one k-step's 32 dims (a step's part of the scores alone).
TEST(MlaDecodeGpuTest, Fp8MmaVariants) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 3000;
  for (KvCacheFormat f : kFormats) {
    for (int v = 0; v < MlaDecodeVariantCount(); ++v) {
      if (!MlaDecodeVariantFp8Mma(v) || !RunVariant(v, f)) continue;
      for (int heads : {1, 8, 40, 64, 65, 128}) {
        for (int s_q : {1, 2, 4}) {
          RunDecodeCase({f, heads, s_q, {s_q, 31, 32, 33, 63, 64, 65, 127, 129, 4113}, v}, seed++);
        }
      }
      RunDecodeCase({f, 64, 1, {20000}, v}, seed++);
      RunDecodeCase({f, 128, 2, {3000, 17, 9000, 64}, v}, seed++);
      std::vector<int32_t> many(600);  // past the in-kernel schedule's 512 sequences
      for (int i = 0; i < 600; ++i) many[i] = 1 + (i * 37) % 97;
      RunDecodeCase({f, 64, 1, many, v}, seed++);
      DecodeCase one_step{f, 36, 1, {1, 1, 1, 1, 40}, v};  // each k-step's part of q.k alone
      one_step.one_step_rows = true;
      RunDecodeCase(one_step, seed++);
    }
  }
}

// Runs each case that cases(format, variant) returns, after set(case), for every format and
// every kernel variant available for it (seeds counted from `seed`).
template <class Cases, class Set>
void ForEveryVariant(uint32_t seed, const Cases& cases, const Set& set) {
  for (KvCacheFormat f : kFormats) {
    for (int v = 0; v < MlaDecodeVariantCount(); ++v) {
      if (!RunVariant(v, f)) continue;
      for (DecodeCase c : cases(f, v)) {
        set(c);
        RunDecodeCase(c, seed++);
      }
    }
  }
}

// q's RoPE dims read from the model's q rows (MlaDecodeParams::q_rope) by every variant, with
// NaN where a kernel reading q's own RoPE columns would find them: 16-row and 64-row blocks,
// 1-4 query tokens, split pieces.
TEST(MlaDecodeGpuTest, RopeFromSeparateRows) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  ForEveryVariant(
      600,
      [](KvCacheFormat f, int v) {
        return std::vector<DecodeCase>{{f, 8, 3, {70, 2000, 5}, v}, {f, 64, 1, {70, 2000, 5}, v}};
      },
      [](DecodeCase& c) { c.separate_rope = true; });
}

// The combine launched programmatically on a stream of its own, every variant and format: split
// and unsplit sequences, the wide (16-row) and the narrow combine, 64-row blocks.
TEST(MlaDecodeGpuTest, ProgrammaticCombine) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  ForEveryVariant(
      700,
      [](KvCacheFormat f, int v) {
        return std::vector<DecodeCase>{
            {f, 16, 2, {2, 63, 65, 3000}, v}, {f, 8, 1, {20000}, v}, {f, 64, 1, {5000, 17}, v}};
      },
      [](DecodeCase& c) { c.programmatic = true; });
}

// Both forms of the combine (MlaDecodeParams::combine_row_warps 0 and 1), every variant and
// format: rows of two or three partials among unsplit ones (the warp form's case), a row count
// that is not a multiple of the block's 8 warps (40 heads x 3), hundreds of partials a row (batch
// 1 x 9000 at 64 and 128 heads), and a call of 16 rows or fewer, which keeps the wide per-chunk
// form; then the default rule on a call it gives the warp form (16 sequences x 128 heads = 2,048
// rows).
TEST(MlaDecodeGpuTest, CombineForms) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  for (int form : {0, 1}) {
    ForEveryVariant(
        1100 + 50 * form,
        [](KvCacheFormat f, int v) {
          return std::vector<DecodeCase>{{f, 128, 1, {3000, 17, 5000, 64}, v},
                                         {f, 40, 3, {2000, 7, 65}, v},
                                         {f, 64, 1, {9000}, v},
                                         {f, 128, 1, {9000}, v},
                                         {f, 16, 1, {3000}, v}};
        },
        [form](DecodeCase& c) { c.combine_row_warps = form; });
  }
  ForEveryVariant(
      1190,
      [](KvCacheFormat f, int v) {
        return std::vector<DecodeCase>{
            {f,
             128,
             1,
             {3000, 17, 5000, 64, 700, 1, 2500, 129, 90, 4113, 64, 65, 300, 2, 1500, 800},
             v}};
      },
      [](DecodeCase&) {});
}

// The L2 hints of the TMA cache copies (MlaDecodeParams::kv_tma_l2), each setting but the default
// (every other test runs that), every variant and format (variants without TMA copies ignore
// them): full blocks copied by TMA beside a last, partly filled block, two row tiles, 1-4 query
// tokens. Out-of-range settings are refused (RejectsBadKnobs).
TEST(MlaDecodeGpuTest, KvTmaL2Hints) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  for (int hints : {0, 2, 3}) {
    ForEveryVariant(
        1200 + 100 * hints,
        [](KvCacheFormat f, int v) {
          return std::vector<DecodeCase>{{f, 128, 1, {3000, 17, 4096}, v},
                                         {f, 32, 4, {700, 129}, v}};
        },
        [hints](DecodeCase& c) { c.kv_tma_l2 = hints; });
  }
}

// Smaller minimum shares of the balanced split (MlaDecodeParams::min_share): more, shorter pieces
// (down to 16 tokens, inside one 32-token tile) and more partials per sequence for the combine.
TEST(MlaDecodeGpuTest, SmallShares) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  for (int share : {1, 2}) {
    ForEveryVariant(
        800 + 100 * share,
        [](KvCacheFormat f, int v) {
          return std::vector<DecodeCase>{
              {f, 8, 1, {1025}, v}, {f, 16, 2, {1025, 3000, 5}, v}, {f, 64, 1, {700, 90}, v}};
        },
        [share](DecodeCase& c) { c.min_share = share; });
  }
}

TEST(MlaDecodeGpuTest, SkewedAndLargeBatches) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 300;
  std::mt19937 rng(7);
  for (KvCacheFormat f : kFormats) {
    std::vector<int32_t> skewed(31, 257);
    skewed.insert(skewed.begin() + 9, 32768 + 5);  // One long sequence among short ones.
    RunDecodeCase({f, 16, 1, skewed}, seed++);
    std::vector<int32_t> many(200);
    for (int32_t& l : many) l = std::uniform_int_distribution<int>(2, 700)(rng);
    RunDecodeCase({f, 8, 2, many}, seed++);
    RunDecodeCase({f, 128, 1, {20000}}, seed++);  // Batch 1: split over every SM.
    RunDecodeCase({f, 16, 1, {30000}}, seed++);   // ... with the wide combine (16 rows).
    // Above kInlineScheduleMaxBatch (512) the schedule comes from its own kernel.
    std::vector<int32_t> huge(600);
    for (int32_t& l : huge) l = std::uniform_int_distribution<int>(1, 300)(rng);
    huge[17] = 9000;  // one long sequence split over many blocks
    RunDecodeCase({f, 8, 1, huge}, seed++);
    // A worker cap (SMs left to other kernels): each of 3 workers takes many whole sequences
    // and pieces of the long one.
    RunDecodeCase({f, 16, 2, skewed, -1, 3}, seed++);
    RunDecodeCase({f, 64, 1, {5000, 17, 700}, -1, 1}, seed++);
    // 64 rows from batch 16: bf16 takes the seesaw kernel there (kSeesaw64RowsMinBatch).
    RunDecodeCase({f, 64, 1, skewed}, seed++);
  }
}

// The SM120 variants (the two-blocks one, fp8 only; the e4m3 q.k one, fp8 and fp8_tiled) on
// either side of their in-kernel schedule limit (256 sequences; above it the schedule kernel
// runs), with a long sequence split among short ones; the formats a variant has no kernel for are
// refused with a clear error.
TEST(MlaDecodeGpuTest, Sm120VariantsAroundTheirScheduleLimit) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  struct Sm120Variant {
    std::string name;
    std::vector<KvCacheFormat> built, not_built;
  };
  const Sm120Variant variants[] = {
      {"sliced_tile32_sm120_fp8",
       {KvCacheFormat::kFp8},
       {KvCacheFormat::kBf16, KvCacheFormat::kFp8Tiled}},
      {"sliced_tile32_sm120_e4m3_qk",
       {KvCacheFormat::kFp8, KvCacheFormat::kFp8Tiled},
       {KvCacheFormat::kBf16}},
  };
  std::mt19937 rng(11);
  uint32_t seed = 900;
  for (const Sm120Variant& sv : variants) {
    int v = -1;
    for (int i = 0; i < MlaDecodeVariantCount(); ++i) {
      if (MlaDecodeVariantName(i) == sv.name) v = i;
    }
    ASSERT_GE(v, 0) << sv.name;
    for (KvCacheFormat f : sv.not_built) {
      EXPECT_FALSE(MlaDecodeVariantAvailable(v, f));
      absl::StatusOr<MlaDecodePlan> plan = PlanMlaDecode(4, 1, 16, f, v, 0, 0);
      ASSERT_FALSE(plan.ok());
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(plan.status().message().find(sv.name), std::string::npos);
    }
    for (KvCacheFormat f : sv.built) {
      ASSERT_TRUE(MlaDecodeVariantAvailable(v, f)) << sv.name;
      for (int batch : {256, 257}) {
        std::vector<int32_t> lens(batch);
        // At least 2 tokens: the s_q = 2 case's first query sees len - 1 of them.
        for (int32_t& l : lens) l = std::uniform_int_distribution<int>(2, 200)(rng);
        lens[batch - 3] = 5000;
        RunDecodeCase({f, 16, 1, lens, v}, seed++);
        RunDecodeCase({f, 8, 2, lens, v}, seed++);
      }
    }
  }
}

// The seesaw kernel in FlashMLA's order (bf16 only; SM 9.0) on either side of its in-kernel
// schedule limit (64 sequences: its P1 buffer takes the room of the larger schedule), with long
// sequences split among short ones, odd block counts and partly filled last blocks; the fp8
// formats are refused with a clear error.
TEST(MlaDecodeGpuTest, SeesawEarlyAroundItsScheduleLimit) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  int v = -1;
  for (int i = 0; i < MlaDecodeVariantCount(); ++i) {
    if (MlaDecodeVariantName(i) == "wgmma_rows64_seesaw_tma_early") v = i;
  }
  ASSERT_GE(v, 0);
  for (KvCacheFormat f : {KvCacheFormat::kFp8, KvCacheFormat::kFp8Tiled}) {
    EXPECT_FALSE(MlaDecodeVariantAvailable(v, f));
    absl::StatusOr<MlaDecodePlan> plan = PlanMlaDecode(4, 1, 128, f, v, 0, 0);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  }
  if (!MlaDecodeVariantAvailable(v, KvCacheFormat::kBf16)) GTEST_SKIP() << "not an SM 9.0 device";
  std::mt19937 rng(12);
  uint32_t seed = 950;
  for (int batch : {64, 65}) {
    std::vector<int32_t> lens(batch);
    for (int32_t& l : lens) l = std::uniform_int_distribution<int>(2, 300)(rng);
    lens[batch - 3] = 5000;
    lens[1] = 4113;
    RunDecodeCase({KvCacheFormat::kBf16, 128, 1, lens, v}, seed++);
    RunDecodeCase({KvCacheFormat::kBf16, 64, 2, lens, v}, seed++);
  }
}

// The batch-invariant schedule against the reference (same bound as every case above): pieces
// of 464 / 512 tokens, sequences of one piece, of exactly one piece's end (464, 465), of many.
TEST(MlaDecodeGpuTest, InvariantScheduleMatchesReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 400;
  for (KvCacheFormat f : kFormats) {
    RunDecodeCase({f, 16, 1, {1, 63, 464, 465, 976, 977, 3000}, -1, 0, true}, seed++);
    RunDecodeCase({f, 128, 1, {9000, 5}, -1, 0, true}, seed++);
    RunDecodeCase({f, 8, 2, {700, 2, 1500}, -1, 0, true}, seed++);
  }
}

// Batch invariance: with the invariant schedule a sequence's output bits are the same alone, in
// batches of other sequences (its position and the batch size changing, and the block-table
// width with them), and in a batch of 40. The default (balanced) schedule runs the same batches
// and its differences are printed, which shows the comparison can see them.
TEST(MlaDecodeGpuTest, InvariantScheduleDoesNotDependOnTheBatch) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(17);
  const std::vector<int32_t> lens = {3000, 1, 63, 464, 465, 977, 7000, 200};
  for (KvCacheFormat f : kFormats) {
    for (int heads : {16, 128}) {
      const size_t row_bytes = KvCacheBytesPerToken(f);
      const int S = static_cast<int>(lens.size());
      // Sequence i owns blocks [first_block[i], ...).
      std::vector<int> first_block(S + 1, 0);
      for (int i = 0; i < S; ++i) first_block[i + 1] = first_block[i] + (lens[i] + 63) / 64;
      std::vector<uint8_t> pool(static_cast<size_t>(first_block[S]) * 64 * row_bytes);
      std::vector<float> latent(kMlaLatentDim), rope(kMlaRopeDim);
      for (int i = 0; i < S; ++i) {
        for (int t = 0; t < lens[i]; ++t) {
          RandomRow(rng, latent.data(), rope.data());
          KvCacheEncodeRow(
              f, latent.data(), rope.data(), 0.05f,
              pool.data() + (static_cast<size_t>(first_block[i]) * 64 + t) * row_bytes);
        }
      }
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<uint16_t> q(static_cast<size_t>(S) * heads * kMlaQkDim);
      for (auto& v : q) v = FloatToBf16(normal(rng));
      DeviceBuffer<uint8_t> d_pool(pool.size());
      ASSERT_NE(d_pool.ptr, nullptr);
      CUDA_OK(d_pool.Upload(pool));
      // Runs the decode over sequences `ids`; returns each one's output rows, by id.
      auto run = [&](const std::vector<int>& ids, bool invariant) {
        const int B = static_cast<int>(ids.size());
        int width = 1;
        for (int id : ids) width = std::max(width, (lens[id] + 63) / 64);
        std::vector<int32_t> table(static_cast<size_t>(B) * width, 0), blens(B);
        std::vector<uint16_t> bq(static_cast<size_t>(B) * heads * kMlaQkDim);
        for (int b = 0; b < B; ++b) {
          const int id = ids[b];
          blens[b] = lens[id];
          for (int k = 0; k < (lens[id] + 63) / 64; ++k) table[b * width + k] = first_block[id] + k;
          std::copy(q.begin() + static_cast<size_t>(id) * heads * kMlaQkDim,
                    q.begin() + static_cast<size_t>(id + 1) * heads * kMlaQkDim,
                    bq.begin() + static_cast<size_t>(b) * heads * kMlaQkDim);
        }
        const int inv = invariant ? width * 64 : 0;
        auto plan = PlanMlaDecode(B, 1, heads, f, -1, 0, inv);
        EXPECT_TRUE(plan.ok()) << plan.status();
        DeviceBuffer<int32_t> d_table(table.size()), d_lens(blens.size());
        DeviceBuffer<uint16_t> d_q(bq.size()),
            d_out(static_cast<size_t>(B) * heads * kMlaLatentDim);
        DeviceBuffer<uint8_t> d_ws(plan.ok() ? plan->workspace_bytes : 1);
        d_table.Upload(table);
        d_lens.Upload(blens);
        d_q.Upload(bq);
        MlaDecodeParams p;
        p.q = d_q.ptr;
        p.kv_pool = d_pool.ptr;
        p.block_table = d_table.ptr;
        p.max_blocks_per_seq = width;
        p.seq_lens = d_lens.ptr;
        p.batch = B;
        p.heads = heads;
        p.format = f;
        p.kv_scale = 0.05f;
        p.softmax_scale = 0.07f;
        p.out = d_out.ptr;
        p.workspace = d_ws.ptr;
        p.workspace_bytes = d_ws.count;
        p.invariant_max_seq_len = inv;
        const absl::Status st = InvokeMlaDecode(p, nullptr);
        EXPECT_TRUE(st.ok()) << st;
        cudaDeviceSynchronize();
        const std::vector<uint16_t> out = d_out.Download();
        std::vector<std::vector<uint16_t>> by_id(S);
        for (int b = 0; b < B; ++b) {
          by_id[ids[b]].assign(out.begin() + static_cast<size_t>(b) * heads * kMlaLatentDim,
                               out.begin() + static_cast<size_t>(b + 1) * heads * kMlaLatentDim);
        }
        return by_id;
      };
      std::vector<std::vector<int>> batches = {
          {0, 1, 2, 3, 4, 5, 6, 7}, {7, 6, 5, 4, 3, 2, 1, 0}, {3, 0}, {5, 1, 0, 6}, {4, 2}};
      std::vector<int> forty;
      for (int i = 0; i < 40; ++i) forty.push_back((i * 5 + 3) % S);
      batches.push_back(forty);
      for (bool invariant : {true, false}) {
        // References: each sequence alone.
        std::vector<std::vector<uint16_t>> alone(S);
        for (int i = 0; i < S; ++i) alone[i] = run({i}, invariant)[i];
        int differ = 0, checked = 0;
        for (const auto& ids : batches) {
          const auto got = run(ids, invariant);
          for (int id : ids) {
            ++checked;
            differ += got[id] != alone[id];
          }
        }
        std::printf("[mla_decode] %s heads %d %s: %d of %d sequence outputs differ from alone\n",
                    std::string(KvCacheFormatName(f)).c_str(), heads,
                    invariant ? "invariant" : "balanced", differ, checked);
        if (invariant) EXPECT_EQ(differ, 0) << KvCacheFormatName(f) << " heads " << heads;
      }
    }
  }
}

TEST(MlaDecodeGpuTest, RejectsBadWorkerCap) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  const auto plan = PlanMlaDecode(4, 1, 16, KvCacheFormat::kFp8, -1, -1);
  EXPECT_FALSE(plan.ok());
  const auto capped = PlanMlaDecode(4, 1, 16, KvCacheFormat::kFp8, -1, 5);
  ASSERT_TRUE(capped.ok()) << capped.status();
  EXPECT_EQ(capped->num_workers, 5);
}

// Tuning knobs outside their ranges are refused before anything is launched.
TEST(MlaDecodeGpuTest, RejectsBadKnobs) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  const auto plan = PlanMlaDecode(2, 1, 16, KvCacheFormat::kBf16);
  ASSERT_TRUE(plan.ok()) << plan.status();
  DeviceBuffer<uint8_t> buf(plan->workspace_bytes + (1 << 20));
  ASSERT_TRUE(buf.ptr);
  MlaDecodeParams p;
  p.q = p.kv_pool = p.out = p.workspace = buf.ptr;
  p.block_table = p.seq_lens = reinterpret_cast<const int32_t*>(buf.ptr);
  p.max_blocks_per_seq = 1;
  p.batch = 2;
  p.s_q = 1;
  p.heads = 16;
  p.format = KvCacheFormat::kBf16;
  p.softmax_scale = 0.1f;
  p.workspace_bytes = plan->workspace_bytes;
  for (int bad : {-1, 4}) {
    p.kv_tma_l2 = bad;
    const absl::Status st = InvokeMlaDecode(p, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("kv_tma_l2"), std::string::npos) << st;
  }
  p.kv_tma_l2 = 1;
  for (int bad : {-2, 2}) {
    p.combine_row_warps = bad;
    const absl::Status st = InvokeMlaDecode(p, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("combine_row_warps"), std::string::npos) << st;
  }
  p.combine_row_warps = -1;
  p.min_share = 1025;
  const absl::Status st = InvokeMlaDecode(p, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("min_share"), std::string::npos) << st;
}

TEST(KvCacheWriteGpuTest, BytesMatchHostEncoder) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(11);
  const int n = 300, num_blocks = 8;
  for (KvCacheFormat f : kFormats) {
    SCOPED_TRACE(std::string(KvCacheFormatName(f)));
    const size_t row_bytes = KvCacheBytesPerToken(f);
    // Rows of bf16 values with tile magnitudes from 2^-20 to 2^10, some exact zero tiles, some
    // beyond the fp8 range of the per-layer scale (saturation).
    std::vector<uint16_t> latent(static_cast<size_t>(n) * kMlaLatentDim), rope(n * kMlaRopeDim);
    std::vector<float> latent_f(latent.size()), rope_f(rope.size());
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int> exp_dist(-20, 10);
    for (int r = 0; r < n; ++r) {
      for (int t = 0; t < kFp8TilesPerRow; ++t) {
        const float mag = (r + t) % 17 == 0 ? 0.0f : std::ldexp(1.0f, exp_dist(rng));
        for (int i = 0; i < kFp8TileDim; ++i) {
          const size_t k = static_cast<size_t>(r) * kMlaLatentDim + t * kFp8TileDim + i;
          latent[k] = FloatToBf16(normal(rng) * mag);
          latent_f[k] = Bf16ToFloat(latent[k]);
        }
      }
      for (int i = 0; i < kMlaRopeDim; ++i) {
        rope[r * kMlaRopeDim + i] = FloatToBf16(normal(rng) * 4.0f);
        rope_f[r * kMlaRopeDim + i] = Bf16ToFloat(rope[r * kMlaRopeDim + i]);
      }
    }
    std::vector<int64_t> slots(num_blocks * 64);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    slots.resize(n);
    for (int r = 0; r < n; r += 23) slots[r] = -1;  // Padding rows are skipped.
    std::vector<uint8_t> expect(static_cast<size_t>(num_blocks) * 64 * row_bytes, 0x5a);
    std::vector<int64_t> kept_slots;
    std::vector<float> kept_latent, kept_rope;
    for (int r = 0; r < n; ++r) {
      if (slots[r] < 0) continue;
      kept_slots.push_back(slots[r]);
      kept_latent.insert(kept_latent.end(), &latent_f[size_t(r) * 512],
                         &latent_f[size_t(r + 1) * 512]);
      kept_rope.insert(kept_rope.end(), &rope_f[size_t(r) * 64], &rope_f[size_t(r + 1) * 64]);
    }
    const float fp8_scale = 0.37f;
    KvCacheWriteRef(f, fp8_scale, kept_latent.data(), kept_rope.data(), kept_slots.data(),
                    static_cast<int>(kept_slots.size()), expect.data());

    DeviceBuffer<uint16_t> d_latent(latent.size()), d_rope(rope.size());
    DeviceBuffer<int64_t> d_slots(slots.size());
    DeviceBuffer<uint8_t> d_pool(expect.size());
    d_latent.Upload(latent);
    d_rope.Upload(rope);
    d_slots.Upload(slots);
    CUDA_OK(cudaMemset(d_pool.ptr, 0x5a, d_pool.count));
    KvCacheWriteParams p;
    p.format = f;
    p.fp8_scale = fp8_scale;
    p.latent = d_latent.ptr;
    p.rope = d_rope.ptr;
    p.slots = d_slots.ptr;
    p.n = n;
    p.kv_pool = d_pool.ptr;
    const absl::Status st = InvokeKvCacheWrite(p, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> got = d_pool.Download();
    size_t mismatches = 0, first = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != expect[i] && mismatches++ == 0) first = i;
    }
    EXPECT_EQ(mismatches, 0u) << "first at byte " << first << " (row " << first / row_bytes
                              << ", offset " << first % row_bytes << ")";
  }
}

}  // namespace
}  // namespace mlaserve
