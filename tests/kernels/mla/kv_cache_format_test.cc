// Cache row encode/decode bounds (kernels/mla/kv_cache_format.h) and the CPU decode reference
// (kernels/mla/mla_decode_ref.h) against a dense softmax computed here in double.
#include "kernels/mla/kv_cache_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/mla/mla_decode_ref.h"

namespace mlaserve {
namespace {

TEST(KvCacheFormatTest, NamesAndSizes) {
  for (KvCacheFormat f : {KvCacheFormat::kBf16, KvCacheFormat::kFp8, KvCacheFormat::kFp8Tiled}) {
    auto parsed = ParseKvCacheFormat(KvCacheFormatName(f));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, f);
  }
  EXPECT_FALSE(ParseKvCacheFormat("fp8_e4m3").ok());
  EXPECT_EQ(KvCacheBytesPerToken(KvCacheFormat::kBf16), 1152u);
  EXPECT_EQ(KvCacheBytesPerToken(KvCacheFormat::kFp8), 576u);
  EXPECT_EQ(KvCacheBytesPerToken(KvCacheFormat::kFp8Tiled), 656u);
}

TEST(KvCacheFormatTest, TileScaleRule) {
  // 2^ceil(log2(max(amax / 448, 1e-4))) (FlashMLA tests/quant.py).
  EXPECT_EQ(Fp8TiledTileScale(448.0f), 1.0f);
  EXPECT_EQ(Fp8TiledTileScale(449.0f), 2.0f);
  EXPECT_EQ(Fp8TiledTileScale(224.0f), 0.5f);
  EXPECT_EQ(Fp8TiledTileScale(0.0f), std::ldexp(1.0f, -13));  // 1e-4 -> 2^-13 = 1.22e-4.
  EXPECT_EQ(Fp8TiledTileScale(3.0f * 448.0f), 4.0f);
}

// Values spread over several orders of magnitude, with some tiles much smaller than others.
void RandomRow(std::mt19937& rng, float* latent, float* rope) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp_dist(-12, 4);
  for (int t = 0; t < kFp8TilesPerRow; ++t) {
    const float mag = std::ldexp(1.0f, exp_dist(rng));
    for (int i = 0; i < kFp8TileDim; ++i) latent[t * kFp8TileDim + i] = normal(rng) * mag;
  }
  for (int i = 0; i < kMlaRopeDim; ++i) rope[i] = normal(rng) * 3.0f;
}

TEST(KvCacheFormatTest, RoundTripBounds) {
  std::mt19937 rng(1234);
  float latent[kMlaLatentDim], rope[kMlaRopeDim], out[kMlaQkDim];
  uint8_t row[1152];
  for (int iter = 0; iter < 200; ++iter) {
    RandomRow(rng, latent, rope);
    // bf16: RNE with 8 significant bits, relative error <= 2^-8.
    KvCacheEncodeRow(KvCacheFormat::kBf16, latent, rope, 1.0f, row);
    KvCacheDecodeRow(KvCacheFormat::kBf16, row, 1.0f, out);
    for (int d = 0; d < kMlaQkDim; ++d) {
      const float x = d < kMlaLatentDim ? latent[d] : rope[d - kMlaLatentDim];
      ASSERT_LE(std::fabs(out[d] - x), std::ldexp(std::fabs(x), -8)) << d;
    }
    // fp8 with a per-layer scale: e4m3 has 4 significant bits (relative error <= 2^-4) for
    // |x / s| >= 2^-6, and absolute error <= 2^-10 (half the smallest subnormal 2^-9) below.
    // |x / s| <= 448 here, so nothing saturates.
    const float s = 0.25f;
    KvCacheEncodeRow(KvCacheFormat::kFp8, latent, rope, s, row);
    KvCacheDecodeRow(KvCacheFormat::kFp8, row, s, out);
    for (int d = 0; d < kMlaQkDim; ++d) {
      const float x = d < kMlaLatentDim ? latent[d] : rope[d - kMlaLatentDim];
      ASSERT_LE(std::fabs(x / s), 448.0f);
      const double bound = std::max(std::ldexp(std::fabs(x), -4), std::ldexp(s, -10)) * 1.000001;
      ASSERT_LE(std::fabs(out[d] - x), bound) << d;
    }
    // fp8_tiled: the same e4m3 bound with the tile's own scale; rope as bf16.
    KvCacheEncodeRow(KvCacheFormat::kFp8Tiled, latent, rope, 0.0f, row);
    KvCacheDecodeRow(KvCacheFormat::kFp8Tiled, row, 0.0f, out);
    float scales[kFp8TilesPerRow];
    std::memcpy(scales, row + kFp8TiledScaleOffset, sizeof(scales));
    for (int t = 0; t < kFp8TilesPerRow; ++t) {
      float amax = 0.0f;
      for (int i = 0; i < kFp8TileDim; ++i) {
        amax = std::max(amax, std::fabs(latent[t * kFp8TileDim + i]));
      }
      int e;
      ASSERT_EQ(std::frexp(scales[t], &e), 0.5f) << "tile scale must be a power of two";
      ASSERT_GE(scales[t], amax / 448.0f);
      ASSERT_LT(scales[t], 2.0f * std::max(amax / 448.0f, 1e-4f));
    }
    for (int d = 0; d < kMlaLatentDim; ++d) {
      const float st = scales[d / kFp8TileDim];
      const double bound =
          std::max(std::ldexp(std::fabs(latent[d]), -4), std::ldexp(st, -10)) * 1.000001;
      ASSERT_LE(std::fabs(out[d] - latent[d]), bound) << d;
    }
    for (int d = 0; d < kMlaRopeDim; ++d) {
      ASSERT_LE(std::fabs(out[kMlaLatentDim + d] - rope[d]), std::ldexp(std::fabs(rope[d]), -8));
    }
  }
}

TEST(KvCacheFormatTest, Fp8SaturatesInsteadOfOverflowing) {
  float latent[kMlaLatentDim] = {}, rope[kMlaRopeDim] = {}, out[kMlaQkDim];
  latent[0] = 1000.0f;
  latent[1] = -1e30f;
  uint8_t row[576];
  KvCacheEncodeRow(KvCacheFormat::kFp8, latent, rope, 1.0f, row);
  KvCacheDecodeRow(KvCacheFormat::kFp8, row, 1.0f, out);
  EXPECT_EQ(out[0], 448.0f);
  EXPECT_EQ(out[1], -448.0f);
}

// Paged pool with a random, non-contiguous block table for each sequence.
struct PagedCache {
  std::vector<uint8_t> pool;
  std::vector<int32_t> block_table;
  int max_blocks_per_seq;
  std::vector<std::vector<float>> dense;  // Per sequence: [len, 576], the decoded rows.
};

PagedCache MakeCache(std::mt19937& rng, KvCacheFormat format, float kv_scale,
                     const std::vector<int32_t>& lens) {
  PagedCache c;
  const int batch = static_cast<int>(lens.size());
  c.max_blocks_per_seq = 1;
  int total_blocks = 0;
  for (int32_t l : lens) {
    const int nb = (l + kKvBlockTokens - 1) / kKvBlockTokens;
    c.max_blocks_per_seq = std::max(c.max_blocks_per_seq, nb);
    total_blocks += nb;
  }
  const int num_blocks = total_blocks + 7;  // Some blocks belong to no sequence.
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const size_t row_bytes = KvCacheBytesPerToken(format);
  c.pool.assign(static_cast<size_t>(num_blocks) * kKvBlockTokens * row_bytes, 0xee);
  c.block_table.assign(static_cast<size_t>(batch) * c.max_blocks_per_seq, -1);
  int next = 0;
  float latent[kMlaLatentDim], rope[kMlaRopeDim];
  for (int b = 0; b < batch; ++b) {
    c.dense.emplace_back(static_cast<size_t>(lens[b]) * kMlaQkDim);
    for (int t = 0; t < lens[b]; ++t) {
      if (t % kKvBlockTokens == 0) c.block_table[b * c.max_blocks_per_seq + t / 64] = perm[next++];
      RandomRow(rng, latent, rope);
      for (float& x : latent) x = std::clamp(x, -1.0f, 1.0f) * 2.0f;
      const int64_t slot =
          int64_t{c.block_table[b * c.max_blocks_per_seq + t / 64]} * kKvBlockTokens + t % 64;
      KvCacheWriteRef(format, kv_scale, latent, rope, &slot, 1, c.pool.data());
      float* d = &c.dense[b][static_cast<size_t>(t) * kMlaQkDim];
      if (format == KvCacheFormat::kBf16) {
        // Independent of the decoder: the encoder's bf16 rounding, applied here directly.
        for (int i = 0; i < kMlaLatentDim; ++i) d[i] = Bf16ToFloat(FloatToBf16(latent[i]));
        for (int i = 0; i < kMlaRopeDim; ++i) d[512 + i] = Bf16ToFloat(FloatToBf16(rope[i]));
      } else {
        KvCacheDecodeRow(format, c.pool.data() + slot * row_bytes, kv_scale, d);
      }
    }
  }
  return c;
}

TEST(MlaDecodeRefTest, MatchesDenseSoftmax) {
  std::mt19937 rng(99);
  const std::vector<int32_t> lens = {1, 63, 64, 65, 200};
  for (KvCacheFormat format :
       {KvCacheFormat::kBf16, KvCacheFormat::kFp8, KvCacheFormat::kFp8Tiled}) {
    for (int s_q : {1, 3}) {
      const int heads = 3, batch = static_cast<int>(lens.size());
      const float kv_scale = 0.02f, softmax_scale = 0.0417f;
      std::vector<int32_t> seq_lens = lens;
      for (int32_t& l : seq_lens) l = std::max(l, s_q);
      PagedCache c = MakeCache(rng, format, kv_scale, seq_lens);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> q(static_cast<size_t>(batch) * s_q * heads * kMlaQkDim);
      for (float& x : q) x = normal(rng);
      std::vector<float> out(static_cast<size_t>(batch) * s_q * heads * kMlaLatentDim, NAN);
      std::vector<float> lse(static_cast<size_t>(batch) * s_q * heads, NAN);
      MlaDecodeRefParams p{q.data(),
                           c.pool.data(),
                           c.block_table.data(),
                           c.max_blocks_per_seq,
                           seq_lens.data(),
                           batch,
                           s_q,
                           heads,
                           format,
                           kv_scale,
                           softmax_scale,
                           out.data(),
                           lse.data()};
      MlaDecodeRef(p);
      for (int b = 0; b < batch; ++b) {
        for (int i = 0; i < s_q; ++i) {
          for (int h = 0; h < heads; ++h) {
            const size_t r = (static_cast<size_t>(b) * s_q + i) * heads + h;
            const int visible = seq_lens[b] - s_q + i + 1;
            std::vector<double> s(visible);
            double mx = -INFINITY;
            for (int t = 0; t < visible; ++t) {
              double dot = 0;
              for (int d = 0; d < kMlaQkDim; ++d) {
                dot += double{q[r * kMlaQkDim + d]} * c.dense[b][size_t(t) * kMlaQkDim + d];
              }
              s[t] = dot * softmax_scale;
              mx = std::max(mx, s[t]);
            }
            double z = 0;
            for (double v : s) z += std::exp(v - mx);
            ASSERT_NEAR(lse[r], mx + std::log(z), 1e-5 * (1 + std::fabs(mx)));
            for (int d = 0; d < kMlaLatentDim; ++d) {
              double o = 0;
              for (int t = 0; t < visible; ++t) {
                o += std::exp(s[t] - mx) / z * c.dense[b][size_t(t) * kMlaQkDim + d];
              }
              // Both sides are double internally; the output is rounded to fp32 once.
              ASSERT_NEAR(out[r * kMlaLatentDim + d], o, 1e-6 * (1 + std::fabs(o)))
                  << KvCacheFormatName(format) << " b=" << b << " i=" << i << " d=" << d;
            }
          }
        }
      }
    }
  }
}

TEST(MlaDecodeRefTest, WriteRefPlacesRowsAtSlots) {
  std::mt19937 rng(5);
  const KvCacheFormat format = KvCacheFormat::kFp8Tiled;
  const size_t row_bytes = KvCacheBytesPerToken(format);
  std::vector<uint8_t> pool(3 * 64 * row_bytes, 0);
  std::vector<float> latent(2 * kMlaLatentDim), rope(2 * kMlaRopeDim);
  RandomRow(rng, latent.data(), rope.data());
  RandomRow(rng, latent.data() + kMlaLatentDim, rope.data() + kMlaRopeDim);
  const int64_t slots[2] = {2 * 64 + 5, 0 * 64 + 63};
  KvCacheWriteRef(format, 1.0f, latent.data(), rope.data(), slots, 2, pool.data());
  for (int r = 0; r < 2; ++r) {
    std::vector<uint8_t> expect(row_bytes);
    KvCacheEncodeRow(format, &latent[r * kMlaLatentDim], &rope[r * kMlaRopeDim], 1.0f,
                     expect.data());
    EXPECT_EQ(0, std::memcmp(expect.data(), pool.data() + slots[r] * row_bytes, row_bytes));
  }
  // Untouched rows stay zero.
  EXPECT_TRUE(std::all_of(pool.begin() + row_bytes, pool.begin() + 2 * row_bytes,
                          [](uint8_t x) { return x == 0; }));
}

// The emulated FP8 tensor-core form (MlaFp8MmaEmulation; accuracy studies and the oracle of a
// future e4m3-MMA kernel). Cases whose arithmetic the form keeps exact, one whose truncation is
// known, and the distance to the exact form on random data.
MlaDecodeRefParams OneSequence(const float* q, const PagedCache& c, const int32_t* len, int heads,
                               KvCacheFormat format, float kv_scale, float softmax_scale,
                               float* out, float* lse, MlaFp8MmaEmulation e) {
  MlaDecodeRefParams p{q,
                       c.pool.data(),
                       c.block_table.data(),
                       c.max_blocks_per_seq,
                       len,
                       1,
                       1,
                       heads,
                       format,
                       kv_scale,
                       softmax_scale,
                       out,
                       lse,
                       e};
  return p;
}

// A row of integer cache values (exact in e4m3) into slot t of sequence 0.
void WriteIntegerRow(PagedCache& c, KvCacheFormat format, int t, const float* latent,
                     const float* rope) {
  const int64_t slot = int64_t{c.block_table[t / kKvBlockTokens]} * kKvBlockTokens + t % 64;
  KvCacheWriteRef(format, 1.0f, latent, rope, &slot, 1, c.pool.data());
}

TEST(MlaDecodeRefTest, Fp8MmaFormExactWhereItsArithmeticIs) {
  // q in {-1, 0, 1} (its row scale 2^-8 makes it +-256 in e4m3, exact) and cache values
  // integers in [-4, 4] (exact in e4m3; fp8_tiled's tile scale is then a power of two, its RoPE
  // dims bf16): every product and k-step sum is a multiple of the step's quantum, so the emulated
  // scores equal the exact ones and, with one token, lse is the score itself.
  std::mt19937 rng(31);
  for (KvCacheFormat format : {KvCacheFormat::kFp8, KvCacheFormat::kFp8Tiled}) {
    const int32_t len = 1;
    PagedCache c = MakeCache(rng, format, 1.0f, {len});
    float latent[kMlaLatentDim], rope[kMlaRopeDim];
    std::uniform_int_distribution<int> small(-4, 4), tri(-1, 1);
    for (float& x : latent) x = static_cast<float>(small(rng));
    for (float& x : rope) x = static_cast<float>(small(rng));
    latent[0] = 4.0f;  // the tile scales: 4 / 448 rounded up to a power of two
    latent[128] = latent[256] = latent[384] = 4.0f;
    WriteIntegerRow(c, format, 0, latent, rope);
    std::vector<float> dense(kMlaQkDim);
    KvCacheDecodeRow(format,
                     c.pool.data() + size_t(c.block_table[0]) * 64 * KvCacheBytesPerToken(format),
                     1.0f, dense.data());
    std::vector<float> q(kMlaQkDim);
    for (float& x : q) x = static_cast<float>(tri(rng));
    q[0] = 1.0f;
    double exact = 0;
    for (int d = 0; d < kMlaQkDim; ++d) exact += double{q[d]} * dense[d];
    for (MlaFp8MmaEmulation e : {MlaFp8MmaEmulation::kQk, MlaFp8MmaEmulation::kQkPv}) {
      std::vector<float> out(kMlaLatentDim), lse(1);
      MlaDecodeRef(
          OneSequence(q.data(), c, &len, 1, format, 1.0f, 0.5f, out.data(), lse.data(), e));
      EXPECT_FLOAT_EQ(lse[0], static_cast<float>(0.5 * exact)) << KvCacheFormatName(format);
      // One token: P = 1 (exact in e4m3 after x256) and the output is its value row.
      for (int d = 0; d < kMlaLatentDim; ++d) ASSERT_FLOAT_EQ(out[d], dense[d]) << d;
    }
  }
}

TEST(MlaDecodeRefTest, Fp8MmaFormTruncatesAsModelled) {
  // One large product beside 31 small ones in a k-step: q_0 = 1 (256 in e4m3: the row scale is
  // 2^-8, the smallest power of two >= 1 / 448), q_1..31 = 2^-14 (2^-6 in e4m3, the smallest
  // normal), every cache value 1. The step's largest term is 256, so its quantum is 2^(8 - 13) =
  // 2^-5 and the 2^-6 products are truncated away: the group sums to 256, the score to 1 (the
  // exact q.k adds 31 x 2^-14). Dims 32..575 are 0.
  std::mt19937 rng(32);
  const KvCacheFormat format = KvCacheFormat::kFp8;
  const int32_t len = 1;
  PagedCache c = MakeCache(rng, format, 1.0f, {len});
  float latent[kMlaLatentDim], rope[kMlaRopeDim];
  std::fill(latent, latent + kMlaLatentDim, 1.0f);
  std::fill(rope, rope + kMlaRopeDim, 1.0f);
  WriteIntegerRow(c, format, 0, latent, rope);
  std::vector<float> q(kMlaQkDim, 0.0f);
  q[0] = 1.0f;
  for (int d = 1; d < 32; ++d) q[d] = std::ldexp(1.0f, -14);
  std::vector<float> out(kMlaLatentDim), lse(1);
  MlaDecodeRef(OneSequence(q.data(), c, &len, 1, format, 1.0f, 1.0f, out.data(), lse.data(),
                           MlaFp8MmaEmulation::kQk));
  EXPECT_FLOAT_EQ(lse[0], 1.0f);
  MlaDecodeRef(OneSequence(q.data(), c, &len, 1, format, 1.0f, 1.0f, out.data(), lse.data(),
                           MlaFp8MmaEmulation::kNone));
  EXPECT_NEAR(lse[0], 1.0 + 31.0 * std::ldexp(1.0, -14), 1e-6);
}

TEST(MlaDecodeRefTest, Fp8MmaFormNearTheExactOne) {
  // Random q and cache (the dense test's data), 200 tokens (four P.V blocks). The form's scores
  // move by at most softmax_scale x (2^-4 + 2^-12) x sum |q_d k_d| (q's e4m3 rounding, relative
  // 2^-4 a value, and the truncation, 2^-13 of each step's largest term per term, well inside
  // 2^-12 of the sum), so lse moves by at most that much; the output by a few percent of the
  // values' range (P rounded to e4m3: relative 2^-4 a weight). The bf16 cache ignores the setting.
  std::mt19937 rng(33);
  const std::vector<int32_t> lens = {200};
  const int heads = 4;
  const float kv_scale = 0.02f, softmax_scale = 0.0417f;
  for (KvCacheFormat format :
       {KvCacheFormat::kBf16, KvCacheFormat::kFp8, KvCacheFormat::kFp8Tiled}) {
    PagedCache c = MakeCache(rng, format, kv_scale, lens);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(heads) * kMlaQkDim);
    for (float& x : q) x = normal(rng);
    std::vector<float> out0(heads * kMlaLatentDim), lse0(heads);
    MlaDecodeRef(OneSequence(q.data(), c, &lens[0], heads, format, kv_scale, softmax_scale,
                             out0.data(), lse0.data(), MlaFp8MmaEmulation::kNone));
    float vmax = 0;
    for (float x : c.dense[0]) vmax = std::max(vmax, std::fabs(x));
    for (MlaFp8MmaEmulation e : {MlaFp8MmaEmulation::kQk, MlaFp8MmaEmulation::kQkPv}) {
      std::vector<float> out(heads * kMlaLatentDim), lse(heads);
      MlaDecodeRef(OneSequence(q.data(), c, &lens[0], heads, format, kv_scale, softmax_scale,
                               out.data(), lse.data(), e));
      if (format == KvCacheFormat::kBf16) {
        EXPECT_EQ(out, out0);
        EXPECT_EQ(lse, lse0);
        continue;
      }
      double max_dout = 0;
      bool moved = false;
      for (int h = 0; h < heads; ++h) {
        double bound = 0;
        for (int t = 0; t < lens[0]; ++t) {
          double abs_dot = 0;
          for (int d = 0; d < kMlaQkDim; ++d) {
            abs_dot += std::fabs(double{q[h * kMlaQkDim + d]} * c.dense[0][t * kMlaQkDim + d]);
          }
          bound = std::max(bound, softmax_scale * (1.0 / 16 + 1.0 / 4096) * abs_dot);
        }
        EXPECT_LE(std::fabs(lse[h] - lse0[h]), bound + 1e-5) << KvCacheFormatName(format);
        moved |= lse[h] != lse0[h];
        for (int d = 0; d < kMlaLatentDim; ++d) {
          max_dout =
              std::max(max_dout,
                       double{std::fabs(out[h * kMlaLatentDim + d] - out0[h * kMlaLatentDim + d])});
        }
      }
      EXPECT_TRUE(moved) << "the emulation changed nothing: " << KvCacheFormatName(format);
      EXPECT_LE(max_dout, 0.05 * vmax) << KvCacheFormatName(format);
    }
  }
}

}  // namespace
}  // namespace mlaserve
