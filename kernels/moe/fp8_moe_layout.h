// DeepSeek FP8 block-scaled expert weights (format: kernels/linear/fp8_block_ref.h) rearranged
// once, at load time, into the layout the GPU grouped GEMM reads (fp8_moe_gemm.h).
//
// W is the A operand of mma.sync.m16n8k16 (bf16): rows in m-tiles of 16, columns in chunks of 64,
// as in the 4-bit layouts (nvfp4_moe_layout.h), but one byte a weight:
//
// codes  [rows/16][cols/64][2 halves][32 lanes][16 bytes]: half h holds the 16-column blocks
//        j = 2h and 2h + 1; the lane's 8 bytes of block j (at 8 (j % 2)) are its A fragment
//        (mma_fragment_layout.h: a0 = W[g][2t..2t+1], a1 = W[g+8][2t..2t+1], a2 = W[g][2t+8..+9],
//        a3 = W[g+8][2t+8..+9]), register r at bytes 2r (the even column, the register's low half)
//        and 2r + 1: the checkpoint's e4m3 codes, unchanged. A lane reads its two 16-byte vectors
//        at 16 * lane and 512 + 16 * lane (no shared-memory bank conflicts).
// scales [rows/16][cols/64][2 fp32]: (s of the tile's rows 0..7, s of its rows 8..15) for the
//        chunk's columns, s the checkpoint's weight_scale_inv of their 128 x 128 block (each
//        8-row half of a tile and each 64-column chunk lies in one block: see RelayoutFp8).
//        8 bytes per 1024 code bytes (0.8%).
// Padding rows and columns (the kernels' multiples of 128) get code 0 (+0) and scale 0.
//
// The kernel's weight is bf16(fp32(e4m3 * s)): the e4m3 pair converted exactly to f16 (cvt.rn
// .f16x2.e4m3x2, sm_89+; no e4m3 -> bf16x2 form exists in PTX for sm_90 or sm_120), each value
// widened to fp32 and multiplied by s in fp32 (one rounding, as DeepSeek's weight_dequant computes
// it), the pair rounded once more to bf16 (cvt.rn.bf16x2.f32): bit for bit the bf16 weights the
// load-time dequantization uploaded before (DequantizeFp8Block, then round to nearest even), and
// what DeepSeek's fp8_cast_bf16.py writes. The CPU backend uses fp32(e4m3 * s) unrounded; the two
// differ by at most 2^-9 relative per weight. Fp8PairToBf16 is that expression, shared by the
// kernel and the host unit tests.
//
// The fused gate+up projection interleaves the two as the 4-bit layouts do: m-tile i holds gate
// rows 8i..8i+7 then up rows 8i..8i+7 (so a tile's two scales are gate's and up's).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "kernels/linear/fp8_block_ref.h"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#define MLASERVE_FP8_HD __host__ __device__ __forceinline__
#else
#define MLASERVE_FP8_HD inline
#endif

namespace mlaserve {

inline constexpr int kFp8TileRows = 16;
inline constexpr int kFp8TileCols = 64;
inline constexpr int kFp8ChunkCodeBytes = 1024;  // one 16 x 64 chunk
inline constexpr int kFp8ChunkScaleBytes = 8;    // two fp32
inline constexpr int kFp8HalfRows = 8;           // rows sharing one scale in the tiled layout

// Bytes of the rearranged arrays for a [rows, cols] projection (rows % 16 == 0, cols % 64 == 0).
inline size_t Fp8TiledCodeBytes(int rows, int cols) { return static_cast<size_t>(rows) * cols; }
inline size_t Fp8TiledScaleBytes(int rows, int cols) {
  return static_cast<size_t>(rows) * cols / (kFp8ChunkCodeBytes / kFp8ChunkScaleBytes);
}

// e4m3 to fp32 exactly from the bits: the sign and the 7 magnitude bits placed at fp32's bits 31
// and 20..26 are e4m3 * 2^-120 (e4m3's exponent field in fp32's low 4 exponent bits; subnormal
// e4m3 codes land on fp32 subnormals, still exact), and the multiplication by 2^120 is exact.
// The NaN codes 0x7f / 0xff read as +-480 here (the kernel's cvt path gives NaN).
MLASERVE_FP8_HD float Fp8BitsToFloat(uint32_t code) {
  const uint32_t bits = ((code & 0x80u) << 24) | ((code & 0x7fu) << 20);
#if defined(__CUDA_ARCH__)
  return __fmul_rn(__uint_as_float(bits), 0x1p120f);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f * 0x1p120f;
#endif
}

// bf16 round to nearest even of an fp32 (NaN stays NaN).
MLASERVE_FP8_HD uint32_t Fp8RoundToBf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return (u >> 16) | 0x40u;
  }
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// Register formation of the kernel: the e4m3 pair `codes` (bits 0..7: the register's low half,
// 8..15: its high half) times the fp32 block scale `scale`, as the bf16 pair bf16(fp32(e4m3 *
// scale)). On sm_89+ devices: cvt.rn.f16x2.e4m3x2 (exact), cvt.f32.f16 twice, mul.rn.f32 twice,
// cvt.rn.bf16x2.f32 (6 instructions per 2 weights); elsewhere, or with
// MLASERVE_FP8_DECODE_BITS defined, and on the host: Fp8BitsToFloat (the same values except the
// NaN codes).
MLASERVE_FP8_HD uint32_t Fp8PairToBf16(uint32_t codes, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(MLASERVE_FP8_DECODE_BITS)
  uint32_t h2, d;
  float lo, hi;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(static_cast<uint16_t>(codes)));
  asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
      : "=f"(lo), "=f"(hi)
      : "r"(h2));
  lo = __fmul_rn(lo, scale);
  hi = __fmul_rn(hi, scale);
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#elif defined(__CUDA_ARCH__)
  const float lo = __fmul_rn(Fp8BitsToFloat(codes & 0xffu), scale);
  const float hi = __fmul_rn(Fp8BitsToFloat((codes >> 8) & 0xffu), scale);
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  const float lo = Fp8BitsToFloat(codes & 0xffu) * scale;
  const float hi = Fp8BitsToFloat((codes >> 8) & 0xffu) * scale;
  return Fp8RoundToBf16Bits(lo) | (Fp8RoundToBf16Bits(hi) << 16);
#endif
}

// Rearranges one projection, the window `w` ([w.rows, w.cols] codes of the checkpoint tensor at
// (w.origin_row, w.origin_col), its whole scale grid), into a zero-padded [rows_p, cols_p] tiled
// one (rows_p >= w.rows, rows_p % 16 == 0, cols_p >= w.cols, cols_p % 64 == 0): tiled_codes
// [Fp8TiledCodeBytes(rows_p, cols_p)], tiled_scales [Fp8TiledScaleBytes(rows_p, cols_p)].
// The layout's scale per 8 rows x 64 columns needs block_rows % 8 == 0, block_cols % 64 == 0,
// origin_row % 8 == 0 and origin_col % 64 == 0 (DeepSeek's 128 x 128 blocks and a tensor-parallel
// slice of 2048 over up to 32 ranks qualify). Errors name the rule broken, or the block of a NaN
// or infinite scale.
absl::Status RelayoutFp8(const Fp8BlockTensor& w, int rows_p, int cols_p, uint8_t* tiled_codes,
                         uint8_t* tiled_scales);

// gate and up, each [intermediate, cols] (the same shape and window columns), into one interleaved
// [2 * intermediate_p, cols_p] projection (intermediate_p >= intermediate, a multiple of 8).
absl::Status RelayoutFp8GateUp(const Fp8BlockTensor& gate, const Fp8BlockTensor& up,
                               int intermediate_p, int cols_p, uint8_t* tiled_codes,
                               uint8_t* tiled_scales);

// The inverse, for tests: fp32(e4m3 * s) (what DequantizeFp8Block gives, not rounded to bf16) of
// every element of the rearranged projection, in its row order ([rows, cols]).
void DequantizeTiledFp8(const uint8_t* tiled_codes, const uint8_t* tiled_scales, int rows, int cols,
                        float* out);

// Where element (r, c) of a 16 x 64 chunk lies among the chunk's 1024 code bytes.
int Fp8ChunkByteOf(int r, int c);

}  // namespace mlaserve
