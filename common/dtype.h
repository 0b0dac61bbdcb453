// Element types of checkpoints and caches, and exact host conversions between them and fp32.
//
// One table for the whole project: the safetensors reader, the quantizer, the CPU kernels and
// the tests that check GPU kernels all convert through these functions.
//
// Formats (bit layouts from IEEE 754, the OCP 8-bit floating point spec v1.0 and the OCP
// Microscaling spec v1.0):
//   bf16      s1 e8 m7, bias 127                     (upper half of an fp32)
//   fp16      s1 e5 m10, bias 15, inf and NaN          max 65504
//   e4m3fn    s1 e4 m3, bias 7, no inf, NaN = S.1111.111  max 448, min subnormal 2^-9
//   e5m2      s1 e5 m2, bias 15, inf and NaN           max 57344, min subnormal 2^-16
//   e2m1      s1 e2 m1, bias 1, no inf or NaN          codes 0..7 = 0 .5 1 1.5 2 3 4 6; bit 3 sign
//   ue8m0     e8, bias 127, no sign; 255 = NaN          value 2^(code-127)
// Narrowing conversions round to nearest, ties to even. e4m3 and e2m1 saturate to their
// largest finite magnitude (448, 6), as CUDA's __NV_SATFINITE conversions and ModelOpt's
// quantizers do; fp16, bf16 and e5m2 overflow to infinity as IEEE 754 does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace mlaserve {

float Bf16ToFloat(uint16_t bits);
uint16_t FloatToBf16(float value);

float Fp16ToFloat(uint16_t bits);
uint16_t FloatToFp16(float value);

float E4m3ToFloat(uint8_t bits);
uint8_t FloatToE4m3(float value);  // NaN -> 0x7f (sign kept); |x| > 448 -> ±448.

float E5m2ToFloat(uint8_t bits);
uint8_t FloatToE5m2(float value);

// `code` uses its low 4 bits only.
float E2m1ToFloat(uint8_t code);
uint8_t FloatToE2m1(float value);  // |x| > 6 -> ±6; NaN -> +0 (e2m1 has no NaN).

float Ue8m0ToFloat(uint8_t bits);
// The smallest power of two >= value (scales must not make the scaled block overflow).
// value <= 2^-127 gives code 0; value > 2^127 or NaN gives 255 (NaN).
uint8_t FloatToUe8m0RoundUp(float value);

// Element types of safetensors files (names as the format writes them) and of our buffers.
enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kU16,
  kI16,
  kU32,
  kI32,
  kU64,
  kI64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kC64,
  kF8E4M3,
  kF8E5M2,
  kF8E8M0,
  kF6E2M3,
  kF6E3M2,
  kF4,
};

// Bits per element: 4 for F4, 6 for the F6 types, 8 * bytes for the rest.
int DTypeBits(DType dtype);
// Name as safetensors writes it ("BF16", "F8_E4M3", ...).
std::string_view DTypeName(DType dtype);
absl::StatusOr<DType> ParseDType(std::string_view safetensors_name);
// Bytes for `num_elements` elements; an error where the bits do not fill whole bytes.
absl::StatusOr<size_t> DTypeByteSize(DType dtype, uint64_t num_elements);

// n elements of a float dtype (F32, BF16, F16) as fp32; false for any other dtype.
bool DecodeFloats(DType dtype, const void* src, size_t n, float* dst);

}  // namespace mlaserve
