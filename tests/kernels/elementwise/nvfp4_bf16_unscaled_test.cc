// DequantizeNvfp4ToBf16Unscaled (kernels/linear/linear_ref.h) against DequantizeNvfp4
// (kernels/moe/nvfp4_ref.h). The bf16 value must be exactly e2m1 * e4m3 (exact in bf16), so
// bf16 * global_scale in fp32 equals DequantizeNvfp4's (e2m1 * e4m3) * global_scale bit for bit:
// both are the same single fp32 rounding of the same exact product.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/linear/linear_ref.h"
#include "kernels/moe/nvfp4_ref.h"

namespace mlaserve {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

TEST(Nvfp4Bf16UnscaledTest, MatchesDequantizeNvfp4) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> byte(0, 255);
  for (const auto [rows, cols] : {std::pair{1, 16}, std::pair{7, 96}, std::pair{33, 512}}) {
    std::vector<uint8_t> packed(static_cast<size_t>(rows) * cols / 2);
    std::vector<uint8_t> scale(static_cast<size_t>(rows) * cols / kNvfp4BlockSize);
    for (auto& b : packed) b = static_cast<uint8_t>(byte(rng));  // every e2m1 code, both signs
    for (auto& s : scale) {
      do {
        s = static_cast<uint8_t>(byte(rng));  // every finite e4m3, subnormals and zero included
      } while ((s & 0x7f) == 0x7f);           // NaN scales: separate test below
    }
    std::vector<uint16_t> bf16(static_cast<size_t>(rows) * cols);
    DequantizeNvfp4ToBf16Unscaled(packed.data(), scale.data(), rows, cols, bf16.data());
    for (const float g : {1.0f, 3.0517578e-05f, 0.0123456f}) {
      std::vector<float> ref(bf16.size());
      DequantizeNvfp4(packed.data(), scale.data(), g, rows, cols, ref.data());
      int bad = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        const float got = Bf16ToFloat(bf16[i]) * g;
        if (Bits(got) != Bits(ref[i]) && ++bad <= 5) {
          ADD_FAILURE() << "rows " << rows << " cols " << cols << " g " << g << " element " << i
                        << ": bf16 " << Bf16ToFloat(bf16[i]) << " * g = " << got
                        << ", DequantizeNvfp4 " << ref[i];
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

TEST(Nvfp4Bf16UnscaledTest, LowNibbleIsEvenColumnAndNanScaleGivesNan) {
  // Row of 32: code 0x2 (1.0) in even columns, 0xf (-6) in odd ones; scale 2.0 (e4m3 0x40), then
  // a NaN scale for the second block.
  std::vector<uint8_t> packed(16, 0xf2);
  const std::vector<uint8_t> scale = {0x40, 0x7f};
  std::vector<uint16_t> out(32);
  DequantizeNvfp4ToBf16Unscaled(packed.data(), scale.data(), 1, 32, out.data());
  for (int c = 0; c < 16; ++c) EXPECT_EQ(Bf16ToFloat(out[c]), c % 2 == 0 ? 2.0f : -12.0f) << c;
  for (int c = 16; c < 32; ++c) EXPECT_TRUE(std::isnan(Bf16ToFloat(out[c]))) << c;
}

}  // namespace
}  // namespace mlaserve
