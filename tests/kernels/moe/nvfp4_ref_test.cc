// NVFP4 dequantization, ModelOpt-style quantization and the GPU weight layout, against values
// worked out by hand from the format definition (DESIGN.md "Formats") and ModelOpt's rules.
#include "kernels/moe/nvfp4_ref.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/moe/nvfp4_moe_layout.h"

namespace mlaserve {
namespace {

TEST(Nvfp4RefTest, DequantizeHandValues) {
  // One row of 32 columns (two scale blocks).
  std::vector<uint8_t> packed(16, 0);
  packed[0] = 0x72;  // c0 = code 2 (1.0), c1 = code 7 (6.0)
  packed[1] = 0xf9;  // c2 = code 9 (-0.5), c3 = code 15 (-6.0)
  packed[8] = 0x5b;  // c16 = code 11 (-1.5), c17 = code 5 (3.0)
  const uint8_t scales[2] = {0x40 /*2.0*/, 0x01 /*2^-9, subnormal*/};
  std::vector<float> out(32, -1.0f);
  DequantizeNvfp4(packed.data(), scales, 0.5f, 1, 32, out.data());
  EXPECT_EQ(out[0], 1.0f);   // 1 * 2 * 0.5
  EXPECT_EQ(out[1], 6.0f);   // 6 * 2 * 0.5
  EXPECT_EQ(out[2], -0.5f);  // -0.5 * 2 * 0.5
  EXPECT_EQ(out[3], -6.0f);
  EXPECT_EQ(out[4], 0.0f);
  EXPECT_EQ(out[16], -1.5f * 0x1p-9f * 0.5f);
  EXPECT_EQ(out[17], 3.0f * 0x1p-9f * 0.5f);
  EXPECT_EQ(out[31], 0.0f);
}

TEST(Nvfp4RefTest, ModelOptE2m1RoundingTies) {
  // Bounds 0.25 0.75 1.25 1.75 2.5 3.5 5: ties go to the even code.
  EXPECT_EQ(ModelOptE2m1Code(0.25f), 0);  // 0 (code 0) vs 0.5 (code 1)
  EXPECT_EQ(ModelOptE2m1Code(0.2500001f), 1);
  EXPECT_EQ(ModelOptE2m1Code(0.75f), 2);  // 0.5 vs 1.0 -> 1.0
  EXPECT_EQ(ModelOptE2m1Code(1.25f), 2);  // 1.0 vs 1.5 -> 1.0
  EXPECT_EQ(ModelOptE2m1Code(1.75f), 4);  // 1.5 vs 2.0 -> 2.0
  EXPECT_EQ(ModelOptE2m1Code(2.5f), 4);   // 2 vs 3 -> 2
  EXPECT_EQ(ModelOptE2m1Code(3.5f), 6);   // 3 vs 4 -> 4
  EXPECT_EQ(ModelOptE2m1Code(5.0f), 6);   // 4 vs 6 -> 4
  EXPECT_EQ(ModelOptE2m1Code(5.01f), 7);
  EXPECT_EQ(ModelOptE2m1Code(100.0f), 7);  // saturates at 6
  EXPECT_EQ(ModelOptE2m1Code(-0.1f), 8);   // -0
  EXPECT_EQ(ModelOptE2m1Code(-2.9f), 8 | 5);
  EXPECT_EQ(ModelOptE2m1Code(0.0f), 0);
  // Agrees with the project's RNE conversion except for the sign of tiny negatives.
  for (float x = -7.0f; x <= 7.0f; x += 0.0625f) {
    const uint8_t a = ModelOptE2m1Code(x), b = FloatToE2m1(x);
    if ((a & 7) == 0 && (b & 7) == 0) continue;
    EXPECT_EQ(a, b) << x;
  }
}

TEST(Nvfp4RefTest, QuantizeHandValues) {
  // 1 row, 4 blocks. Global amax 2688 makes weight_scale_2 = 2688 / (6 * 448) = 1 exactly.
  std::vector<float> w(64, 0.0f);
  // Block 0: amax 2688 -> scale 448 (e4m3 0x7e); values / 448 are the e2m1 bounds.
  const float b0[16] = {2688, 336,  112,    560,   784, 1120,
                        1568, 2240, -44.8f, -1300, 0,   3000 /*> amax? no: clipped below*/,
                        1,    2,    3,      4};
  for (int i = 0; i < 16; ++i) w[i] = b0[i];
  w[11] = -2688;  // keep the amax at 2688
  // Block 1: amax 26 -> 26/6 = 4.333 -> e4m3 4.5 (0x49); 26 / 4.5 = 5.78 -> 6.
  w[16] = 26;
  w[17] = 9;  // 9 / 4.5 = 2 -> code 4
  // Block 2: all zero -> scale 1.0 (0x38), codes 0.
  // Block 3: amax 1e-6 -> scale 1.67e-7 clamped to 2^-9 (0x01); 1e-6 / 2^-9 = 5.1e-4 -> 0.
  w[48] = 1e-6f;
  std::vector<uint8_t> packed(32, 0xee), scale(4, 0xee);
  float gs = -1;
  QuantizeNvfp4(w.data(), 1, 64, packed.data(), scale.data(), &gs);
  EXPECT_EQ(gs, 1.0f);
  EXPECT_EQ(scale[0], 0x7e);
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(scale[1], 0x49);
  EXPECT_EQ(E4m3ToFloat(0x49), 4.5f);
  EXPECT_EQ(scale[2], 0x38);
  EXPECT_EQ(scale[3], 0x01);
  auto code = [&](int c) { return c % 2 == 0 ? (packed[c / 2] & 0xf) : (packed[c / 2] >> 4); };
  // 2688/448 = 6 -> 7; 336/448 = 0.75 -> 1.0 (2); 112/448 = 0.25 -> 0; 560/448 = 1.25 -> 1.0 (2);
  // 784/448 = 1.75 -> 2.0 (4); 1120/448 = 2.5 -> 2.0 (4); 1568/448 = 3.5 -> 4.0 (6);
  // 2240/448 = 5 -> 4.0 (6); -44.8/448 = -0.1 -> -0 (8); -1300/448 = -2.90 -> -3 (13);
  // 0 -> 0; -2688 -> -6 (15); 1/448, 2/448, 3/448, 4/448 -> 0.
  const int expect0[16] = {7, 2, 0, 2, 4, 4, 6, 6, 8, 13, 0, 15, 0, 0, 0, 0};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(code(i), expect0[i]) << i;
  EXPECT_EQ(code(16), 7);
  EXPECT_EQ(code(17), 4);
  for (int i = 18; i < 48; ++i) EXPECT_EQ(code(i), 0) << i;
  EXPECT_EQ(code(48), 0);
  // Round trip: the quantized tensor dequantizes to the nearest grid points chosen above.
  std::vector<float> back(64);
  DequantizeNvfp4(packed.data(), scale.data(), gs, 1, 64, back.data());
  EXPECT_EQ(back[0], 2688.0f);
  EXPECT_EQ(back[1], 448.0f);
  EXPECT_EQ(back[9], -1344.0f);
  EXPECT_EQ(back[16], 27.0f);
}

TEST(Nvfp4RefTest, QuantizeAllZero) {
  std::vector<float> w(32, 0.0f);
  std::vector<uint8_t> packed(16, 0xff), scale(2, 0);
  float gs = -1;
  QuantizeNvfp4(w.data(), 1, 32, packed.data(), scale.data(), &gs);
  EXPECT_EQ(gs, 0.0f);
  for (uint8_t b : packed) EXPECT_EQ(b, 0);
  for (uint8_t s : scale) EXPECT_EQ(s, 0x38);
}

TEST(Nvfp4RefTest, QuantizeErrorIsBounded) {
  // Relative error of each element is at most half an e2m1 step at its scale: |w - q| <=
  // block_scale * global_scale * 1 (the widest gap, between 4 and 6, is 2).
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  const int rows = 8, cols = 64;
  std::vector<float> w(rows * cols), back(rows * cols);
  for (float& v : w) v = nd(rng);
  std::vector<uint8_t> packed(rows * cols / 2), scale(rows * cols / 16);
  float gs;
  QuantizeNvfp4(w.data(), rows, cols, packed.data(), scale.data(), &gs);
  DequantizeNvfp4(packed.data(), scale.data(), gs, rows, cols, back.data());
  for (int i = 0; i < rows * cols; ++i) {
    const float s = E4m3ToFloat(scale[i / 16]) * gs;
    EXPECT_LE(std::fabs(w[i] - back[i]), s * 1.0f + 1e-12f) << i;
  }
}

TEST(Nvfp4LayoutTest, ScaleCodeIsExactForEveryPositiveE4m3) {
  for (int b = 1; b < 0x7f; ++b) {
    uint8_t code;
    ASSERT_TRUE(Nvfp4ScaleCode(static_cast<uint8_t>(b), &code).ok());
    const uint16_t bf16 = static_cast<uint16_t>((code << 4) + (232 << 7));
    EXPECT_EQ(static_cast<double>(Bf16ToFloat(bf16)),
              std::ldexp(static_cast<double>(E4m3ToFloat(static_cast<uint8_t>(b))), 119))
        << b;
  }
  uint8_t code;
  EXPECT_FALSE(Nvfp4ScaleCode(0x7f, &code).ok());  // NaN
  EXPECT_FALSE(Nvfp4ScaleCode(0xc0, &code).ok());  // -2
  EXPECT_FALSE(Nvfp4ScaleCode(0x00, &code).ok());
}

// The kernel's decode of a code word (nvfp4_moe_layout.h), on the host.
float KernelDecode(uint32_t q, int r, int half) {
  const uint32_t a[4] = {
      (q << 6) & 0x81c081c0u, (q << 3) & 0x81c081c0u,
      (q & 0x01c001c0u) | ((q << 4) & 0x80008000u), ((q >> 7) & 0x01c001c0u) | ((q << 5) & 0x80008000u)};
  const uint32_t pair = a[r];
  const uint16_t bits = static_cast<uint16_t>(half ? pair >> 16 : pair & 0xffff);
  return static_cast<float>(std::ldexp(static_cast<double>(Bf16ToFloat(bits)), 126));
}

TEST(Nvfp4LayoutTest, RelayoutRoundTripsAndMatchesKernelDecode) {
  std::mt19937 rng(11);
  const int inter = 16, hidden = 128;
  std::vector<uint8_t> gp(inter * hidden / 2), up(inter * hidden / 2);
  std::vector<uint8_t> gsc(inter * hidden / 16), usc(inter * hidden / 16);
  for (auto& b : gp) b = rng() & 0xff;
  for (auto& b : up) b = rng() & 0xff;
  for (auto& b : gsc) b = 1 + rng() % 0x7e;
  for (auto& b : usc) b = 1 + rng() % 0x7e;
  gsc[3] = 0x00;  // a zero scale: that block must come back as zeros
  std::vector<uint8_t> codes(Nvfp4TiledCodeBytes(2 * inter, hidden));
  std::vector<uint8_t> scales(Nvfp4TiledScaleBytes(2 * inter, hidden));
  ASSERT_TRUE(RelayoutNvfp4GateUp(gp.data(), gsc.data(), up.data(), usc.data(), inter, hidden,
                                  codes.data(), scales.data())
                  .ok());
  std::vector<float> tiled(2 * inter * hidden), g(inter * hidden), u(inter * hidden);
  DequantizeTiledNvfp4(codes.data(), scales.data(), 2 * inter, hidden, tiled.data());
  DequantizeNvfp4(gp.data(), gsc.data(), 1.0f, inter, hidden, g.data());
  DequantizeNvfp4(up.data(), usc.data(), 1.0f, inter, hidden, u.data());
  for (int i = 0; i < inter; ++i) {
    const int row_g = 16 * (i / 8) + i % 8, row_u = row_g + 8;
    for (int c = 0; c < hidden; ++c) {
      ASSERT_EQ(tiled[row_g * hidden + c], g[i * hidden + c]) << i << " " << c;
      ASSERT_EQ(tiled[row_u * hidden + c], u[i * hidden + c]) << i << " " << c;
    }
  }
  // The kernel's bit decode of lane 4g+t, word j gives the fragment elements of the header.
  for (int lane = 0; lane < 32; ++lane) {
    const int gg = lane / 4, t = lane % 4;
    for (int j = 0; j < 4; ++j) {
      const uint8_t* p = codes.data() + lane * 16 + j * 4;  // tile (0, 0)
      const uint32_t q = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
      const int rows[4] = {gg, gg + 8, gg, gg + 8};
      const int cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
      for (int r = 0; r < 4; ++r) {
        for (int half = 0; half < 2; ++half) {
          const int row = rows[r], col = 16 * j + cols[r] + half;
          const int src = row < 8 ? row : row - 8;
          const std::vector<uint8_t>& pk = row < 8 ? gp : up;
          const uint8_t b = pk[src * hidden / 2 + col / 2];
          const uint8_t expect_code = col % 2 == 0 ? (b & 0xf) : (b >> 4);
          const std::vector<uint8_t>& sc = row < 8 ? gsc : usc;
          const bool zero_block = (sc[src * hidden / 16 + col / 16] & 0x7f) == 0;
          EXPECT_EQ(KernelDecode(q, r, half), zero_block ? 0.0f : E2m1ToFloat(expect_code))
              << lane << " " << j << " " << r << " " << half;
        }
      }
    }
  }
}

TEST(Nvfp4LayoutTest, RejectsBadShapesAndScales) {
  std::vector<uint8_t> p(16 * 64 / 2, 0), s(16 * 64 / 16, 0x38), c(512), sc(64);
  EXPECT_TRUE(RelayoutNvfp4(p.data(), s.data(), 16, 64, c.data(), sc.data()).ok());
  EXPECT_FALSE(RelayoutNvfp4(p.data(), s.data(), 8, 64, c.data(), sc.data()).ok());
  s[5] = 0x7f;
  EXPECT_FALSE(RelayoutNvfp4(p.data(), s.data(), 16, 64, c.data(), sc.data()).ok());
}

}  // namespace
}  // namespace mlaserve
