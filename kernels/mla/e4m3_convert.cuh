// e4m3 -> f16 conversions of the MLA decode kernels (mla_decode_sliced.cuh, mla_decode_wgmma.cuh)
// and bench/mla/e4m3_convert_bench.cu, which checks the two forms against each other on every
// byte pair and measures their rates. The kernels convert with cvt: on the H100 it converts 83.8
// values an SM a clock against the integer form's 42.0, and the integer form lost in every kernel
// it was tried in (bench/RESULTS.md, session 24). The integer form stays for the bench, so that a
// GPU whose cvt rate differs (SM120, unmeasured) can be checked in seconds.
#pragma once

#include <cstdint>

namespace mlaserve::mla {

// Four e4m3 (byte i = element i) to two f16x2: bytes 0, 1 -> lo, bytes 2, 3 -> hi, exactly.
// Splitting the register into its 16-bit halves in PTX lets ptxas read the upper half in place
// (the C++ form `x >> 16` cost one SHF per conversion: 11.5% of the instructions, ncu).
__device__ __forceinline__ void E4m3x4ToF16x2x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(four));
}

// The integer e4m3 -> f16 conversion (kernels/mla/NOTES.md, sessions 23-24): one
// PRMT makes the 16-bit lanes [b, b's sign replicated] of a word, an arithmetic shift right by
// one and a mask with 0xbf80 leave bit 15 = the sign and bits 13..7 = b's exponent and mantissa,
// i.e. f16 with e4m3's exponent field (bias 7 against f16's 15): b x 2^-8, exact for every finite
// e4m3 (subnormals m x 2^-9 land on f16 subnormals m x 2^7 x 2^-24).
// The last two steps, from a word [b, b, b's sign replicated, b'] -> f16x2 (b, b') x 2^-8.
__device__ __forceinline__ uint32_t E4m3PairToF16x2Scaled(uint32_t x) {
  return static_cast<uint32_t>(static_cast<int32_t>(x) >> 1) & 0xbf80bf80u;
}
// prmt.b32 (PTX ISA "prmt", default mode): selector nibble n picks result byte n from the 8 bytes
// of {b, a}; a nibble with bit 3 set replicates that byte's sign bit instead. (Inline PTX:
// __byte_perm documents only the low 3 bits of each nibble.)
template <uint32_t kSel>
__device__ __forceinline__ uint32_t PrmtSigned(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "n"(kSel));
  return d;
}
// E4m3x4ToF16x2x2's four values times 2^-8.
__device__ __forceinline__ void E4m3x4ToF16x2x2Scaled(uint32_t four, uint32_t& lo, uint32_t& hi) {
  lo = E4m3PairToF16x2Scaled(PrmtSigned<0x1800>(four, 0));  // [b0, b0, sx(b0), b1]
  hi = E4m3PairToF16x2Scaled(PrmtSigned<0x3a22>(four, 0));  // [b2, b2, sx(b2), b3]
}

}  // namespace mlaserve::mla
