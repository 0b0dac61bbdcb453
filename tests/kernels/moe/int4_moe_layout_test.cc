// The INT4 expert layout of the GPU grouped GEMM (kernels/moe/int4_moe_layout.h) on the CPU:
// every element of the rearranged projection, decoded with the kernel's own bit expression,
// equals the compressed-tensors dequantization (DequantizeInt4Group, kernels/linear) exactly;
// padding is zero; the fragment positions are checked against the PTX ISA's mma.m16n8k16 A layout
// written out by hand here; shape rules and non-finite scales are errors.
#include "kernels/moe/int4_moe_layout.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/linear/int4_group_ref.h"

namespace mlaserve {
namespace {

// A random pack-quantized tensor [rows, src_cols]: every nibble value, zero nibbles past the last
// column (as compressed-tensors pads), bf16 scales spread over 2^-20 .. 2^3 with one group in 16
// zero, some negative.
struct Packed {
  int rows, src_cols, group;
  std::vector<int32_t> packed;
  std::vector<uint16_t> scale;
  std::vector<float> scale_f32;
};

Packed RandomPacked(int rows, int src_cols, int group, uint32_t seed) {
  std::mt19937 rng(seed);
  Packed p{rows, src_cols, group};
  const int words = (src_cols + 7) / 8, groups = (src_cols + group - 1) / group;
  p.packed.resize(static_cast<size_t>(rows) * words);
  for (int r = 0; r < rows; ++r) {
    for (int w = 0; w < words; ++w) {
      uint32_t v = 0;
      for (int k = 0; k < 8; ++k) {
        if (8 * w + k < src_cols) {
          v |= (rng() & 0xfu) << (4 * k);
        }
      }
      p.packed[static_cast<size_t>(r) * words + w] = static_cast<int32_t>(v);
    }
  }
  p.scale.resize(static_cast<size_t>(rows) * groups);
  for (auto& s : p.scale) {
    const uint32_t r = rng();
    const float v = std::ldexp(1.0f + (r & 127) / 128.0f, -20 + static_cast<int>((r >> 8) % 24));
    s = (r >> 16) % 16 == 0 ? 0 : FloatToBf16((r >> 20) % 8 == 0 ? -v : v);
  }
  for (uint16_t s : p.scale) {
    p.scale_f32.push_back(Bf16ToFloat(s));
  }
  return p;
}

Int4SourceRows Source(const Packed& p, int col0, int cols) {
  return {p.packed.data(), p.scale.data(), p.rows, p.src_cols, p.group, col0, cols};
}

// Columns [col0, col0 + cols) of every row, dequantized by the project's reference.
std::vector<float> Reference(const Packed& p, int col0, int cols) {
  std::vector<float> out(static_cast<size_t>(p.rows) * cols);
  DequantizeInt4Group({p.packed.data(), p.scale_f32.data(), p.rows, p.src_cols, p.group}, 0, p.rows,
                      col0, cols, out.data());
  return out;
}

struct Case {
  int rows, src_cols, group, col0, cols, rows_p, cols_p;
};

TEST(Int4LayoutTest, RelayoutMatchesTheReferenceExactly) {
  const Case cases[] = {
      {16, 64, 32, 0, 64, 16, 64},       // one tile, no padding
      {24, 90, 32, 0, 90, 32, 128},      // partial word, partial group, rows and columns padded
      {64, 24, 32, 0, 24, 128, 128},     // dsv3-tiny's down_proj [64, 24]: one partial group
      {48, 256, 32, 64, 128, 48, 128},   // a tensor-parallel slice of the columns
      {32, 512, 128, 32, 160, 32, 192},  // group 128: each 32-column slot repeats its group's scale
      {16, 192, 64, 96, 96, 16, 128},    // group 64, slice starting mid-group
  };
  uint32_t seed = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "rows " << c.rows << " src_cols " << c.src_cols << " group " << c.group
                 << " cols [" << c.col0 << ", " << c.col0 + c.cols << ") padded " << c.rows_p << "x"
                 << c.cols_p);
    const Packed p = RandomPacked(c.rows, c.src_cols, c.group, ++seed);
    std::vector<uint8_t> codes(Int4TiledCodeBytes(c.rows_p, c.cols_p), 0x5a);
    std::vector<uint8_t> scales(Int4TiledScaleBytes(c.rows_p, c.cols_p), 0x5a);
    ASSERT_TRUE(
        RelayoutInt4(Source(p, c.col0, c.cols), c.rows_p, c.cols_p, codes.data(), scales.data())
            .ok());
    std::vector<float> tiled(static_cast<size_t>(c.rows_p) * c.cols_p);
    DequantizeTiledInt4(codes.data(), scales.data(), c.rows_p, c.cols_p, tiled.data());
    const std::vector<float> ref = Reference(p, c.col0, c.cols);
    int mismatches = 0, nonzero_pad = 0;
    for (int r = 0; r < c.rows_p; ++r) {
      for (int col = 0; col < c.cols_p; ++col) {
        const float got = tiled[static_cast<size_t>(r) * c.cols_p + col];
        if (r < c.rows && col < c.cols) {
          // Bit for bit (the sign of zero included).
          mismatches += std::bit_cast<uint32_t>(got) !=
                        std::bit_cast<uint32_t>(ref[static_cast<size_t>(r) * c.cols + col]);
        } else {
          nonzero_pad += got != 0.0f;
        }
      }
    }
    EXPECT_EQ(mismatches, 0);
    EXPECT_EQ(nonzero_pad, 0);
  }
}

TEST(Int4LayoutTest, GateUpInterleavesRowsByEight) {
  const int inter = 20, hidden = 96, inter_p = 24, hidden_p = 128;
  const Packed g = RandomPacked(inter, hidden, 32, 7), u = RandomPacked(inter, hidden, 32, 8);
  std::vector<uint8_t> codes(Int4TiledCodeBytes(2 * inter_p, hidden_p));
  std::vector<uint8_t> scales(Int4TiledScaleBytes(2 * inter_p, hidden_p));
  ASSERT_TRUE(RelayoutInt4GateUp(Source(g, 0, hidden), Source(u, 0, hidden), inter_p, hidden_p,
                                 codes.data(), scales.data())
                  .ok());
  std::vector<float> tiled(static_cast<size_t>(2) * inter_p * hidden_p);
  DequantizeTiledInt4(codes.data(), scales.data(), 2 * inter_p, hidden_p, tiled.data());
  const std::vector<float> gr = Reference(g, 0, hidden), ur = Reference(u, 0, hidden);
  for (int i = 0; i < inter_p; ++i) {
    const int row_g = 16 * (i / 8) + i % 8, row_u = row_g + 8;
    for (int c = 0; c < hidden_p; ++c) {
      const bool real = i < inter && c < hidden;
      ASSERT_EQ(tiled[row_g * hidden_p + c], real ? gr[i * hidden + c] : 0.0f) << i << " " << c;
      ASSERT_EQ(tiled[row_u * hidden_p + c], real ? ur[i * hidden + c] : 0.0f) << i << " " << c;
    }
  }
}

// The kernel's decode, register by register, against the PTX A-fragment layout written out here
// (not through mma_fragment_layout.h), with the kernel's scale selection (Int4ScalePair): lane
// 4g+t, word j; a0 = (W[g][2t], W[g][2t+1]),
// a1 = (W[g+8][2t], ..), a2 = (W[g][2t+8], ..), a3 = (W[g+8][2t+8], ..) of columns 16j..16j+15.
// Also the bf16 arithmetic the kernel relies on: the biased pair is 128 + u exactly, 128 + u - 136
// is q exactly, and both fit bf16's 8 significant bits.
TEST(Int4LayoutTest, KernelDecodeFollowsThePtxFragmentLayout) {
  for (uint32_t u = 0; u < 16; ++u) {
    const uint32_t pair = Int4BiasedPair(u | (u << 16), 0);
    EXPECT_EQ(Bf16ToFloat(static_cast<uint16_t>(pair & 0xffff)), 128.0f + u);
    EXPECT_EQ(Bf16ToFloat(static_cast<uint16_t>(pair >> 16)), 128.0f + u);
    EXPECT_EQ(FloatToBf16(128.0f + u - 136.0f), FloatToBf16(static_cast<float>(u) - 8.0f));
  }
  EXPECT_EQ(Bf16ToFloat(kInt4Bf16x2Bias & 0xffff), 136.0f);
  EXPECT_EQ(kInt4Bf16x2Bias >> 16, kInt4Bf16x2Bias & 0xffff);
  EXPECT_EQ(Bf16ToFloat(kInt4Bf16x2One & 0xffff), 1.0f);
  EXPECT_EQ(Bf16ToFloat(kInt4Bf16x2MinusBias & 0xffff), -136.0f);
  EXPECT_EQ(kInt4Bf16x2One >> 16, kInt4Bf16x2One & 0xffff);
  EXPECT_EQ(kInt4Bf16x2MinusBias >> 16, kInt4Bf16x2MinusBias & 0xffff);

  const Packed p = RandomPacked(16, 64, 32, 3);
  std::vector<uint8_t> codes(512), scales(64);
  ASSERT_TRUE(RelayoutInt4(Source(p, 0, 64), 16, 64, codes.data(), scales.data()).ok());
  auto nibble = [&](int row, int col) {
    return (static_cast<uint32_t>(p.packed[row * 8 + col / 8]) >> (4 * (col % 8))) & 0xfu;
  };
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int j = 0; j < 4; ++j) {
      const uint8_t* b = codes.data() + lane * 16 + j * 4;
      const uint32_t word = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
      const int rows[4] = {g, g + 8, g, g + 8};
      const int cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
      for (int r = 0; r < 4; ++r) {
        const uint32_t pair = Int4BiasedPair(word, r);
        for (int half = 0; half < 2; ++half) {
          const uint16_t bits = static_cast<uint16_t>(half ? pair >> 16 : pair & 0xffff);
          EXPECT_EQ(Bf16ToFloat(bits), 128.0f + nibble(rows[r], 16 * j + cols[r] + half))
              << "lane " << lane << " word " << j << " a" << r << " half " << half;
        }
      }
    }
    // The whole register as the kernel forms it: (biased pair - 136) * the scale pair that
    // Int4ScalePair selects from the lane's scale word of the block's group, rounded once to bf16:
    // bf16(q * s) of the fragment's element, s its row's scale (register a0 / a2: row g,
    // a1 / a3: row g + 8).
    const uint8_t* sb = scales.data() + g * 8;
    for (int j = 0; j < 4; ++j) {
      const uint8_t* b = codes.data() + lane * 16 + j * 4;
      const uint32_t word = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
      const uint8_t* sw = sb + (j < 2 ? 0 : 4);
      const uint32_t scale_word =
          sw[0] | (sw[1] << 8) | (sw[2] << 16) | (static_cast<uint32_t>(sw[3]) << 24);
      const int rows[4] = {g, g + 8, g, g + 8};
      const int cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
      for (int r = 0; r < 4; ++r) {
        const uint32_t pair = Int4BiasedPair(word, r);
        const uint32_t spair = Int4ScalePair(scale_word, r % 2 == 1);
        for (int half = 0; half < 2; ++half) {
          const float q =
              Bf16ToFloat(static_cast<uint16_t>(half ? pair >> 16 : pair & 0xffff)) - 136.0f;
          const float sc = Bf16ToFloat(static_cast<uint16_t>(half ? spair >> 16 : spair & 0xffff));
          const int row = rows[r], col = 16 * j + cols[r] + half;
          const float want = (static_cast<float>(nibble(row, col)) - 8.0f) *
                             Bf16ToFloat(p.scale[row * 2 + col / 32]);
          EXPECT_EQ(FloatToBf16(q * sc), FloatToBf16(want))
              << "lane " << lane << " word " << j << " a" << r << " half " << half;
        }
      }
    }
    // Scales: 8 bytes at 8 g: s(g, group 0), s(g + 8, group 0), s(g, 1), s(g + 8, 1).
    const uint8_t* s = scales.data() + g * 8;
    auto at = [&](int i) { return static_cast<uint16_t>(s[2 * i] | (s[2 * i + 1] << 8)); };
    EXPECT_EQ(at(0), p.scale[g * 2 + 0]);
    EXPECT_EQ(at(1), p.scale[(g + 8) * 2 + 0]);
    EXPECT_EQ(at(2), p.scale[g * 2 + 1]);
    EXPECT_EQ(at(3), p.scale[(g + 8) * 2 + 1]);
  }
}

TEST(Int4LayoutTest, OneRowByHand) {
  // Row 0 = q 0..7 then -8..-1 over columns 0..15 (nibbles q + 8), scale 0.5 for group 0, 2.0 for
  // group 1 (columns 32..63, all q = 1: nibble 9).
  std::vector<int32_t> packed(16 * 8, static_cast<int32_t>(0x88888888u));
  packed[0] = static_cast<int32_t>(0xfedcba98u);  // columns 0..7: q 0..7
  packed[1] = static_cast<int32_t>(0x76543210u);  // columns 8..15: q -8..-1
  for (int w = 4; w < 8; ++w) {
    packed[w] = static_cast<int32_t>(0x99999999u);
  }
  std::vector<uint16_t> scale(16 * 2, FloatToBf16(1.0f));
  scale[0] = FloatToBf16(0.5f);
  scale[1] = FloatToBf16(2.0f);
  std::vector<uint8_t> codes(512), sc(64);
  ASSERT_TRUE(RelayoutInt4({packed.data(), scale.data(), 16, 64, 32, 0, 64}, 16, 64, codes.data(),
                           sc.data())
                  .ok());
  std::vector<float> out(16 * 64);
  DequantizeTiledInt4(codes.data(), sc.data(), 16, 64, out.data());
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(out[c], 0.5f * c) << c;
  }
  for (int c = 8; c < 16; ++c) {
    EXPECT_EQ(out[c], 0.5f * (c - 16)) << c;
  }
  for (int c = 16; c < 32; ++c) {
    EXPECT_EQ(out[c], 0.0f) << c;
  }
  for (int c = 32; c < 64; ++c) {
    EXPECT_EQ(out[c], 2.0f) << c;
  }
  // Lane 0 word 0: a0 = columns (0, 1) -> nibbles 8, 9 at bits 0 and 16; a2 = columns (8, 9) ->
  // nibbles 0, 1 at bits 8 and 24; a1 / a3 are row 8 (q = 0: nibble 8) at bits 4, 20, 12, 28.
  const uint32_t w0 =
      codes[0] | (codes[1] << 8) | (codes[2] << 16) | (static_cast<uint32_t>(codes[3]) << 24);
  EXPECT_EQ(w0, 0x81898088u);
}

TEST(Int4LayoutTest, RejectsBadShapesAndScales) {
  const Packed p = RandomPacked(16, 128, 32, 5);
  std::vector<uint8_t> codes(Int4TiledCodeBytes(16, 128)), sc(Int4TiledScaleBytes(16, 128));
  EXPECT_TRUE(RelayoutInt4(Source(p, 0, 128), 16, 128, codes.data(), sc.data()).ok());
  // Padded shapes not on the tile grid, or smaller than the projection.
  EXPECT_FALSE(RelayoutInt4(Source(p, 0, 128), 8, 128, codes.data(), sc.data()).ok());
  EXPECT_FALSE(RelayoutInt4(Source(p, 0, 128), 16, 96, codes.data(), sc.data()).ok());
  EXPECT_FALSE(RelayoutInt4(Source(p, 0, 128), 16, 64, codes.data(), sc.data()).ok());
  // A column window past the tensor, or not on a 32-column slot.
  EXPECT_FALSE(RelayoutInt4(Source(p, 64, 128), 16, 128, codes.data(), sc.data()).ok());
  EXPECT_FALSE(RelayoutInt4(Source(p, 16, 64), 16, 64, codes.data(), sc.data()).ok());
  // Groups of 16 columns do not fit the 32-column scale slots.
  Packed g16 = RandomPacked(16, 128, 16, 6);
  const absl::Status st16 = RelayoutInt4(Source(g16, 0, 128), 16, 128, codes.data(), sc.data());
  EXPECT_FALSE(st16.ok());
  EXPECT_NE(std::string(st16.message()).find("group_size"), std::string::npos) << st16;
  // A NaN scale is named by row and group.
  Packed bad = p;
  bad.scale[3 * 4 + 2] = 0x7fc0;
  const absl::Status st = RelayoutInt4(Source(bad, 0, 128), 16, 128, codes.data(), sc.data());
  EXPECT_FALSE(st.ok());
  EXPECT_NE(std::string(st.message()).find("row 3, group 2"), std::string::npos) << st;
  // Gate and up of different shapes.
  const Packed q = RandomPacked(8, 128, 32, 9);
  EXPECT_FALSE(
      RelayoutInt4GateUp(Source(p, 0, 128), Source(q, 0, 128), 16, 128, codes.data(), sc.data())
          .ok());
}

}  // namespace
}  // namespace mlaserve
