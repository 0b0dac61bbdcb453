// DequantizeFp8Block against values worked out by hand from DeepSeek's format description
// (kernels/linear/fp8_block_ref.h): e4m3 bytes decoded here by their bit fields.
#include "kernels/linear/fp8_block_ref.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace mlaserve {
namespace {

TEST(Fp8BlockRefTest, BytesByHand) {
  // e4m3: sign | 4 exponent bits (bias 7) | 3 mantissa bits.
  // 0x38 = 0 0111 000 = 1.0; 0x40 = 2.0; 0xC4 = 1 1000 100 = -3.0; 0x01 = 2^-9 (subnormal);
  // 0x7E = 0 1111 110 = 448.
  const uint8_t weight[5] = {0x38, 0x40, 0xC4, 0x01, 0x7E};
  const float scale_inv[1] = {0.25f};
  Fp8BlockTensor w{weight, scale_inv, 1, 5, 128, 128};
  float out[5];
  DequantizeFp8Block(w, 0, 1, 0, 5, out);
  const float want[5] = {0.25f, 0.5f, -0.75f, 0.25f * std::ldexp(1.0f, -9), 112.0f};
  for (int c = 0; c < 5; ++c) EXPECT_EQ(out[c], want[c]) << "column " << c;
  // scale_inv multiplies (it is not divided by).
  EXPECT_EQ(out[0], 1.0f * scale_inv[0]);
}

TEST(Fp8BlockRefTest, BlocksPartialEdgesAndWindows) {
  // 5 x 7 weight, blocks 2 x 3: a scale grid of ceil(5/2) x ceil(7/3) = 3 x 3 with partial
  // blocks at the bottom and right edges.
  const int rows = 5, cols = 7;
  std::vector<uint8_t> weight(rows * cols);
  std::vector<float> value(rows * cols);
  for (int i = 0; i < rows * cols; ++i) {
    // Normal numbers 0 eeee mmm with e in 5..9, m = i % 8: value (1 + m/8) * 2^(e - 7).
    const int e = 5 + i % 5, m = i % 8;
    weight[i] = static_cast<uint8_t>((i % 3 == 0 ? 0x80 : 0) | (e << 3) | m);
    value[i] = (i % 3 == 0 ? -1.0f : 1.0f) * (1.0f + m / 8.0f) * std::ldexp(1.0f, e - 7);
  }
  std::vector<float> scale(9);
  for (int i = 0; i < 9; ++i) scale[i] = std::ldexp(1.0f, i - 4);
  Fp8BlockTensor w{weight.data(), scale.data(), rows, cols, 2, 3};
  std::vector<float> out(rows * cols);
  DequantizeFp8Block(w, 0, rows, 0, cols, out.data());
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      EXPECT_EQ(out[r * cols + c], value[r * cols + c] * scale[(r / 2) * 3 + c / 3])
          << r << "," << c;
    }
  }
  std::vector<float> win(3 * 4);
  DequantizeFp8Block(w, 2, 3, 3, 4, win.data());
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 4; ++c) EXPECT_EQ(win[r * 4 + c], out[(r + 2) * cols + 3 + c]);
  }
}

}  // namespace
}  // namespace mlaserve
