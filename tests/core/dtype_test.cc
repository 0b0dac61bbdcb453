// Exhaustive checks of the host element conversions against their definitions (common/dtype.h).
#include "common/dtype.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace mlaserve {
namespace {

// Independent decoder written from the format definition: (-1)^s * 2^(e-bias) * (1 + m/2^M),
// subnormal when e == 0.
double DefinitionValue(uint32_t bits, int exp_bits, int man_bits, int bias) {
  const uint32_t s = (bits >> (exp_bits + man_bits)) & 1;
  const uint32_t e = (bits >> man_bits) & ((1u << exp_bits) - 1);
  const uint32_t m = bits & ((1u << man_bits) - 1);
  const double frac = static_cast<double>(m) / static_cast<double>(1u << man_bits);
  const double v = e == 0 ? std::pow(2.0, 1 - bias) * frac : std::pow(2.0, int(e) - bias) * (1 + frac);
  return s ? -v : v;
}

// All finite values of a format, ascending, for brute-force nearest-even rounding.
struct Grid {
  std::vector<double> values;
  std::vector<uint32_t> codes;  // positive codes, same order
};

Grid PositiveGrid(uint32_t num_codes, double (*decode)(uint32_t)) {
  Grid g;
  for (uint32_t c = 0; c < num_codes; ++c) {
    const double v = decode(c);
    if (std::isfinite(v) && !std::signbit(v)) {
      g.values.push_back(v);
      g.codes.push_back(c);
    }
  }
  return g;
}

// Brute-force round-to-nearest-even on a grid: the nearest value; on a tie, the one with an
// even code (its mantissa's last bit is 0).
double BruteRound(const Grid& g, double a, bool saturate, double inf_threshold) {
  if (a > g.values.back()) {
    if (saturate) return g.values.back();
    if (a >= inf_threshold) return std::numeric_limits<double>::infinity();
  }
  size_t best = 0;
  for (size_t i = 1; i < g.values.size(); ++i) {
    const double d_best = std::fabs(g.values[best] - a), d = std::fabs(g.values[i] - a);
    if (d < d_best || (d == d_best && (g.codes[i] & 1) == 0)) best = i;
  }
  return g.values[best];
}

TEST(DTypeTest, Bf16DecodeIsUpperHalfOfFloat) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(c));
    EXPECT_EQ(std::bit_cast<uint32_t>(f), c << 16);
  }
}

TEST(DTypeTest, Bf16RoundTripEveryCode) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(c));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(f))));
    } else {
      EXPECT_EQ(FloatToBf16(f), c) << c;
    }
  }
}

TEST(DTypeTest, Bf16RoundsToNearestEvenBetweenNeighbours) {
  // For every pair of adjacent finite positive codes, the midpoint goes to the even code,
  // a hair below goes down, a hair above goes up.
  for (uint32_t c = 0; c < 0x7f7f; ++c) {
    const float lo = Bf16ToFloat(c), hi = Bf16ToFloat(c + 1);
    const float mid = std::bit_cast<float>((c << 16) | 0x8000u);
    EXPECT_EQ(FloatToBf16(mid), (c & 1) ? c + 1 : c) << c;
    EXPECT_EQ(FloatToBf16(std::nextafter(mid, lo)), c);
    EXPECT_EQ(FloatToBf16(std::nextafter(mid, hi)), c + 1);
  }
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);  // overflow -> inf
}

TEST(DTypeTest, Fp16MatchesDefinitionAndCompilerConversion) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float f = Fp16ToFloat(static_cast<uint16_t>(c));
    const uint32_t e = (c >> 10) & 0x1f;
    if (e == 0x1f) {
      EXPECT_TRUE((c & 0x3ff) ? std::isnan(f) : std::isinf(f));
      continue;
    }
    EXPECT_EQ(f, static_cast<float>(DefinitionValue(c, 5, 10, 15))) << c;
    EXPECT_EQ(FloatToFp16(f), c);
#ifdef __FLT16_MANT_DIG__
    // GCC's _Float16 conversion is IEEE round-to-nearest-even: an independent oracle.
    const _Float16 h = static_cast<_Float16>(f);
    EXPECT_EQ(std::bit_cast<uint16_t>(h), c);
#endif
  }
#ifdef __FLT16_MANT_DIG__
  // Every float between neighbours: compare with the compiler on a dense sweep of bit patterns.
  // (Clang 14, the sanitizer build's compiler, has no _Float16 on x86-64: the GCC build runs this.)
  for (uint32_t u = 0; u < 0x7f800000u; u += 4099) {
    const float f = std::bit_cast<float>(u);
    EXPECT_EQ(FloatToFp16(f), std::bit_cast<uint16_t>(static_cast<_Float16>(f))) << f;
    EXPECT_EQ(FloatToFp16(-f), std::bit_cast<uint16_t>(static_cast<_Float16>(-f))) << -f;
  }
#endif
}

double DecodeE4m3(uint32_t c) { return E4m3ToFloat(static_cast<uint8_t>(c)); }
double DecodeE5m2(uint32_t c) { return E5m2ToFloat(static_cast<uint8_t>(c)); }
double DecodeE2m1(uint32_t c) { return E2m1ToFloat(static_cast<uint8_t>(c)); }

TEST(DTypeTest, E4m3EveryCodeMatchesDefinition) {
  for (uint32_t c = 0; c < 256; ++c) {
    const float f = E4m3ToFloat(static_cast<uint8_t>(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << c;
      continue;
    }
    EXPECT_EQ(f, static_cast<float>(DefinitionValue(c, 4, 3, 7))) << c;
    EXPECT_EQ(FloatToE4m3(f), c) << c;
  }
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
}

TEST(DTypeTest, E4m3RoundsToNearestEvenAndSaturates) {
  const Grid g = PositiveGrid(128, DecodeE4m3);
  for (uint32_t u = 0; u < 0x44200000u; u += 997) {  // 0 .. 640
    const float f = std::bit_cast<float>(u);
    const double want = BruteRound(g, f, /*saturate=*/true, 0);
    EXPECT_EQ(E4m3ToFloat(FloatToE4m3(f)), static_cast<float>(want)) << f;
    EXPECT_EQ(E4m3ToFloat(FloatToE4m3(-f)), -static_cast<float>(want)) << -f;
  }
  EXPECT_EQ(FloatToE4m3(1e9f), 0x7e);
  EXPECT_EQ(FloatToE4m3(-1e9f), 0xfe);
  EXPECT_EQ(FloatToE4m3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(FloatToE4m3(464.0f), 0x7e);  // halfway 448..480 -> even (448)
  EXPECT_TRUE(std::isnan(E4m3ToFloat(FloatToE4m3(std::nanf("")))));
}

TEST(DTypeTest, E5m2EveryCodeAndRounding) {
  for (uint32_t c = 0; c < 256; ++c) {
    const float f = E5m2ToFloat(static_cast<uint8_t>(c));
    const uint32_t e = (c >> 2) & 0x1f;
    if (e == 0x1f) {
      EXPECT_TRUE((c & 3) ? std::isnan(f) : std::isinf(f)) << c;
      continue;
    }
    EXPECT_EQ(f, static_cast<float>(DefinitionValue(c, 5, 2, 15))) << c;
    EXPECT_EQ(FloatToE5m2(f), c) << c;
  }
  const Grid g = PositiveGrid(128, DecodeE5m2);
  for (uint32_t u = 0; u < 0x47800000u; u += 7919) {  // 0 .. 65536
    const float f = std::bit_cast<float>(u);
    const double want = BruteRound(g, f, /*saturate=*/false, /*inf_threshold=*/61440.0);
    EXPECT_EQ(E5m2ToFloat(FloatToE5m2(f)), static_cast<float>(want)) << f;
  }
  EXPECT_EQ(FloatToE5m2(61440.0f), 0x7c);  // halfway to the next binade: overflow to inf
}

TEST(DTypeTest, E2m1EveryCodeAndRounding) {
  const float expected[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (uint32_t c = 0; c < 16; ++c) {
    const float f = E2m1ToFloat(static_cast<uint8_t>(c));
    EXPECT_EQ(f, (c & 8) ? -expected[c & 7] : expected[c & 7]) << c;
    EXPECT_EQ(FloatToE2m1(f), c) << c;
  }
  const Grid g = PositiveGrid(8, DecodeE2m1);
  for (int i = 0; i <= 8000; ++i) {
    const float f = i * 0.001f;
    const double want = BruteRound(g, f, true, 0);
    EXPECT_EQ(E2m1ToFloat(FloatToE2m1(f)), static_cast<float>(want)) << f;
  }
  // Ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
  EXPECT_EQ(E2m1ToFloat(FloatToE2m1(0.25f)), 0.0f);
  EXPECT_EQ(E2m1ToFloat(FloatToE2m1(0.75f)), 1.0f);
  EXPECT_EQ(E2m1ToFloat(FloatToE2m1(1.25f)), 1.0f);
  EXPECT_EQ(E2m1ToFloat(FloatToE2m1(1.75f)), 2.0f);
  EXPECT_EQ(E2m1ToFloat(FloatToE2m1(2.5f)), 2.0f);
  EXPECT_EQ(E2m1ToFloat(FloatToE2m1(3.5f)), 4.0f);
  EXPECT_EQ(E2m1ToFloat(FloatToE2m1(5.0f)), 4.0f);
  EXPECT_EQ(E2m1ToFloat(FloatToE2m1(100.0f)), 6.0f);
  EXPECT_EQ(E2m1ToFloat(FloatToE2m1(-100.0f)), -6.0f);
}

TEST(DTypeTest, Ue8m0EveryCodeAndRoundUp) {
  for (uint32_t c = 0; c < 255; ++c) {
    const float f = Ue8m0ToFloat(static_cast<uint8_t>(c));
    EXPECT_EQ(static_cast<double>(f), std::ldexp(1.0, int(c) - 127)) << c;
    EXPECT_EQ(FloatToUe8m0RoundUp(f), c) << c;
    if (c > 0 && c < 254) {
      EXPECT_EQ(FloatToUe8m0RoundUp(std::nextafter(f, std::numeric_limits<float>::infinity())), c + 1) << c;
    }
  }
  EXPECT_TRUE(std::isnan(Ue8m0ToFloat(255)));
  EXPECT_EQ(FloatToUe8m0RoundUp(3.0f), 128 + 1);  // 3 -> 4
  EXPECT_EQ(FloatToUe8m0RoundUp(0.0f), 0);
}

TEST(DTypeTest, SafetensorsNamesAndSizes) {
  for (std::string_view name : {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64",
                                "F16", "BF16", "F32", "F64", "C64", "F8_E4M3", "F8_E5M2",
                                "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"}) {
    auto d = ParseDType(name);
    ASSERT_TRUE(d.ok()) << name;
    EXPECT_EQ(DTypeName(*d), name);
  }
  EXPECT_FALSE(ParseDType("bfloat16").ok());
  EXPECT_EQ(*DTypeByteSize(DType::kBF16, 10), 20u);
  EXPECT_EQ(*DTypeByteSize(DType::kF4, 10), 5u);
  EXPECT_FALSE(DTypeByteSize(DType::kF4, 3).ok());
  EXPECT_EQ(*DTypeByteSize(DType::kF6E2M3, 4), 3u);
}

}  // namespace
}  // namespace mlaserve
