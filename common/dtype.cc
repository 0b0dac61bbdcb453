#include "common/dtype.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"

namespace mlaserve {
namespace {

// A small IEEE-like binary format: `exp_bits` exponent bits with bias 2^(exp_bits-1)-1
// unless given, `man_bits` mantissa bits.
struct MiniFloat {
  int exp_bits;
  int man_bits;
  int bias;
  bool has_inf;          // all-ones exponent is inf/NaN (IEEE); otherwise finite values
  double max_finite;     // largest finite magnitude
  bool saturate;         // overflow -> max_finite instead of inf
  uint32_t nan_bits;     // code for NaN (without sign)
  bool has_nan;
};

constexpr MiniFloat kFp16{5, 10, 15, true, 65504.0, false, 0x7e00, true};
constexpr MiniFloat kE4m3{4, 3, 7, false, 448.0, true, 0x7f, true};
constexpr MiniFloat kE5m2{5, 2, 15, true, 57344.0, false, 0x7e, true};
constexpr MiniFloat kE2m1{2, 1, 1, false, 6.0, true, 0, false};

double DecodeMini(const MiniFloat& f, uint32_t bits) {
  const uint32_t sign = (bits >> (f.exp_bits + f.man_bits)) & 1;
  const uint32_t exp = (bits >> f.man_bits) & ((1u << f.exp_bits) - 1);
  const uint32_t man = bits & ((1u << f.man_bits) - 1);
  const uint32_t exp_all_ones = (1u << f.exp_bits) - 1;
  double v;
  if (f.has_inf && exp == exp_all_ones) {
    v = man == 0 ? std::numeric_limits<double>::infinity()
                 : std::numeric_limits<double>::quiet_NaN();
  } else if (!f.has_inf && f.has_nan && exp == exp_all_ones &&
             man == ((1u << f.man_bits) - 1)) {
    v = std::numeric_limits<double>::quiet_NaN();  // e4m3fn: S.1111.111
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(man), 1 - f.bias - f.man_bits);
  } else {
    v = std::ldexp(static_cast<double>(man + (1u << f.man_bits)),
                   static_cast<int>(exp) - f.bias - f.man_bits);
  }
  return sign ? -v : v;
}

uint32_t EncodeMini(const MiniFloat& f, float value) {
  const uint32_t sign_bit = 1u << (f.exp_bits + f.man_bits);
  const bool negative = std::signbit(value);
  const uint32_t sign = negative ? sign_bit : 0;
  if (std::isnan(value)) return f.has_nan ? (sign | f.nan_bits) : 0;
  const double a = std::fabs(static_cast<double>(value));
  const uint32_t exp_all_ones = (1u << f.exp_bits) - 1;
  const uint32_t inf_bits = exp_all_ones << f.man_bits;
  auto max_bits = [&]() -> uint32_t {
    // Largest finite code: all-ones exponent is reserved when the format has inf; for e4m3fn
    // only the all-ones mantissa of the top exponent is (NaN).
    if (f.has_inf) return ((exp_all_ones - 1) << f.man_bits) | ((1u << f.man_bits) - 1);
    if (f.has_nan) return (exp_all_ones << f.man_bits) | ((1u << f.man_bits) - 2);
    return (exp_all_ones << f.man_bits) | ((1u << f.man_bits) - 1);
  };
  if (std::isinf(a)) return sign | (f.saturate || !f.has_inf ? max_bits() : inf_bits);
  if (a == 0.0) return sign;

  // Quantum (spacing) at a's binade, never below the subnormal spacing.
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int unbiased = e - 1;
  const int min_normal_exp = 1 - f.bias;
  if (unbiased < min_normal_exp) unbiased = min_normal_exp;
  const double quantum = std::ldexp(1.0, unbiased - f.man_bits);
  const double scaled = a / quantum;  // exact: power-of-two scaling
  double n = std::nearbyint(scaled);  // default rounding mode: to nearest, ties to even
  const double rounded = n * quantum;
  if (rounded > f.max_finite) return sign | (f.saturate || !f.has_inf ? max_bits() : inf_bits);
  if (rounded == 0.0) return sign;
  // Re-encode the rounded value (rounding may have carried into the next binade).
  std::frexp(rounded, &e);
  int exp_field = e - 1 + f.bias;
  uint32_t bits;
  if (exp_field <= 0) {
    bits = static_cast<uint32_t>(std::ldexp(rounded, f.bias - 1 + f.man_bits));
  } else {
    const double mant = std::ldexp(rounded, -(e - 1)) - 1.0;  // in [0, 1)
    bits = (static_cast<uint32_t>(exp_field) << f.man_bits) |
           static_cast<uint32_t>(std::ldexp(mant, f.man_bits));
  }
  return sign | bits;
}

}  // namespace

float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t FloatToBf16(float value) {
  uint32_t u = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((u >> 16) | 0x0040);  // quiet, sign kept
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

float Fp16ToFloat(uint16_t bits) { return static_cast<float>(DecodeMini(kFp16, bits)); }
uint16_t FloatToFp16(float value) { return static_cast<uint16_t>(EncodeMini(kFp16, value)); }

float E4m3ToFloat(uint8_t bits) { return static_cast<float>(DecodeMini(kE4m3, bits)); }
uint8_t FloatToE4m3(float value) { return static_cast<uint8_t>(EncodeMini(kE4m3, value)); }

float E5m2ToFloat(uint8_t bits) { return static_cast<float>(DecodeMini(kE5m2, bits)); }
uint8_t FloatToE5m2(float value) { return static_cast<uint8_t>(EncodeMini(kE5m2, value)); }

float E2m1ToFloat(uint8_t code) { return static_cast<float>(DecodeMini(kE2m1, code & 0xfu)); }
uint8_t FloatToE2m1(float value) { return static_cast<uint8_t>(EncodeMini(kE2m1, value)); }

float Ue8m0ToFloat(uint8_t bits) {
  if (bits == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return static_cast<float>(std::ldexp(1.0, static_cast<int>(bits) - 127));
}

uint8_t FloatToUe8m0RoundUp(float value) {
  if (std::isnan(value)) return 0xff;
  if (!(value > 0.0f)) return 0;
  int e;
  const double m = std::frexp(static_cast<double>(value), &e);  // value = m * 2^e
  int log2_ceil = (m == 0.5) ? e - 1 : e;
  if (log2_ceil < -127) return 0;
  if (log2_ceil > 127) return 0xff;
  return static_cast<uint8_t>(log2_ceil + 127);
}

namespace {
struct DTypeInfo {
  DType dtype;
  std::string_view name;
  int bits;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kBool, "BOOL", 8},      {DType::kU8, "U8", 8},
    {DType::kI8, "I8", 8},          {DType::kU16, "U16", 16},
    {DType::kI16, "I16", 16},       {DType::kU32, "U32", 32},
    {DType::kI32, "I32", 32},       {DType::kU64, "U64", 64},
    {DType::kI64, "I64", 64},       {DType::kF16, "F16", 16},
    {DType::kBF16, "BF16", 16},     {DType::kF32, "F32", 32},
    {DType::kF64, "F64", 64},       {DType::kC64, "C64", 64},
    {DType::kF8E4M3, "F8_E4M3", 8}, {DType::kF8E5M2, "F8_E5M2", 8},
    {DType::kF8E8M0, "F8_E8M0", 8}, {DType::kF6E2M3, "F6_E2M3", 6},
    {DType::kF6E3M2, "F6_E3M2", 6}, {DType::kF4, "F4", 4},
};
}  // namespace

int DTypeBits(DType dtype) {
  for (const auto& info : kDTypes) {
    if (info.dtype == dtype) return info.bits;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  for (const auto& info : kDTypes) {
    if (info.dtype == dtype) return info.name;
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  for (const auto& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown safetensors dtype \"", std::string(name), "\""));
}

absl::StatusOr<size_t> DTypeByteSize(DType dtype, uint64_t num_elements) {
  const uint64_t bits = static_cast<uint64_t>(DTypeBits(dtype));
  if (num_elements > std::numeric_limits<uint64_t>::max() / 64) {
    return absl::InvalidArgumentError(absl::StrCat("element count ", num_elements, " overflows"));
  }
  const uint64_t total_bits = bits * num_elements;
  if (total_bits % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(num_elements, " elements of ", std::string(DTypeName(dtype)),
                                                   " do not fill whole bytes"));
  }
  return static_cast<size_t>(total_bits / 8);
}

bool DecodeFloats(DType dtype, const void* src, size_t n, float* dst) {
  const auto* bytes = static_cast<const uint8_t*>(src);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return true;
    case DType::kBF16:
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, bytes + 2 * i, 2);
        dst[i] = dtype == DType::kBF16 ? Bf16ToFloat(v) : Fp16ToFloat(v);
      }
      return true;
    default:
      return false;
  }
}

}  // namespace mlaserve
