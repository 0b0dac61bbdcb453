// DequantizeInt4Group against values worked out by hand from the compressed-tensors
// pack-quantized description (kernels/linear/int4_group_ref.h): the words are built here from
// the documented bit order, not with the library's unpacking.
#include "kernels/linear/int4_group_ref.h"

#include <vector>

#include "gtest/gtest.h"

namespace mlaserve {
namespace {

TEST(Int4GroupRefTest, OneWordByHand) {
  // Row 0 holds q = -8, -7, 0, 1, 7, -1, 3, -3 in columns 0..7. Stored nibbles (q + 8):
  // 0, 1, 8, 9, 15, 7, 11, 5; column 0 in the lowest nibble, so the word read from the most
  // significant nibble down is 0x5B7F9810.
  const int32_t packed[1] = {static_cast<int32_t>(0x5B7F9810u)};
  const float scale[1] = {0.5f};
  Int4GroupTensor w{packed, scale, 1, 8, 32};
  float out[8];
  DequantizeInt4Group(w, 0, 1, 0, 8, out);
  const float want[8] = {-4.0f, -3.5f, 0.0f, 0.5f, 3.5f, -0.5f, 1.5f, -1.5f};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(out[c], want[c]) << "column " << c;
}

TEST(Int4GroupRefTest, GroupsPaddingAndWindows) {
  // 3 rows x 40 columns, group 16: 3 groups a row (the last one 8 columns wide), 5 words a row.
  const int rows = 3, cols = 40, group = 16, words = 5, groups = 3;
  std::vector<int> q(rows * cols);
  std::vector<float> scale(rows * groups);
  for (int i = 0; i < rows * cols; ++i) q[i] = (i * 5 + 3) % 16 - 8;
  for (int i = 0; i < rows * groups; ++i) scale[i] = 0.125f * (i + 1) * (i % 2 ? -1.0f : 1.0f);
  std::vector<int32_t> packed(rows * words, 0);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      uint32_t nibble = static_cast<uint32_t>(q[r * cols + c] + 8);
      uint32_t& word = reinterpret_cast<uint32_t&>(packed[r * words + c / 8]);
      word |= nibble << (4 * (c % 8));
    }
  }
  Int4GroupTensor w{packed.data(), scale.data(), rows, cols, group};
  std::vector<float> out(rows * cols);
  DequantizeInt4Group(w, 0, rows, 0, cols, out.data());
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      // Exact: a small integer times a power-of-two multiple of 1/8.
      EXPECT_EQ(out[r * cols + c], q[r * cols + c] * scale[r * groups + c / group])
          << r << "," << c;
    }
  }
  // A window [1, 3) x [13, 37) reads the same values.
  std::vector<float> win(2 * 24);
  DequantizeInt4Group(w, 1, 2, 13, 24, win.data());
  for (int r = 0; r < 2; ++r) {
    for (int c = 0; c < 24; ++c) EXPECT_EQ(win[r * 24 + c], out[(r + 1) * cols + 13 + c]);
  }
}

}  // namespace
}  // namespace mlaserve
