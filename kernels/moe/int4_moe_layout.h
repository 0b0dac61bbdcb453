// compressed-tensors INT4 expert weights (format: kernels/linear/int4_group_ref.h) rearranged
// once, at load time, into the layout the GPU grouped GEMM reads (int4_moe_gemm.h).
//
// The tiling is NVFP4's (nvfp4_moe_layout.h): W is the A operand of mma.sync.m16n8k16 (bf16),
// rows in m-tiles of 16, columns in chunks of 64, and per chunk a lane reads one 16-byte vector of
// codes and one 8-byte vector of scales; the bytes per weight are NVFP4's too (0.5 + 2 / 32).
//
// codes  [rows/16][cols/64][32 lanes][4 words]: word j of lane 4g+t holds the 8 nibbles of the
//        lane's A fragment for columns 64c + 16j .. +15 (mma_fragment_layout.h: a0 =
//        W[g][2t..2t+1], a1 = W[g+8][2t..2t+1], a2 = W[g][2t+8..2t+9], a3 = W[g+8][2t+8..2t+9]).
//        Register r's first element sits at bits 4r..4r+3 and its second at bits 16+4r..16+4r+3, as
//        the checkpoint's own nibble u = q + 8 (q in [-8, 7]). So the kernel gets register r with
//        one shift and one LOP3: ((word >> 4r) & 0x000f000f) | 0x43004300 is the bf16 pair (128 +
//        u0, 128 + u1) (exponent 2^7, u in the low mantissa bits); one bf16x2 subtraction of 136
//        makes it the pair (q0, q1) exactly, one bf16x2 multiply by the pair of scales rounds it
//        once.
// scales [rows/16][cols/64][8 g][4 bf16]: (s(g, 0), s(g+8, 0), s(g, 1), s(g+8, 1)), s(r, h) = the
//        bf16 scale of row r for columns 64c + 32h .. +31 (a checkpoint group of 32 columns; a
//        group of 64, 128, ... columns is repeated in each of its 32-column slots).
// Padding rows and columns (the kernels' multiples of 128) get code 8 (q = 0) and scale 0.
//
// The kernel's weight is therefore bf16(q * s), the product rounded once to nearest even: what
// compressed-tensors' own dequantization yields in the bf16 model dtype ((q - 0) * scale in bf16),
// and bit for bit what the earlier load-time dequantization to bf16 uploaded. The CPU backend uses
// q * s exactly (fp32); the two differ by at most 2^-9 relative per weight.
//
// The fused gate+up projection interleaves the two as NVFP4 does: m-tile i holds gate rows
// 8i..8i+7 then up rows 8i..8i+7.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

#if defined(__CUDACC__)
#define MLASERVE_INT4_HD __host__ __device__ __forceinline__
#else
#define MLASERVE_INT4_HD inline
#endif

namespace mlaserve {

inline constexpr int kInt4TileRows = 16;
inline constexpr int kInt4TileCols = 64;
inline constexpr int kInt4ScaleSlotCols = 32;  // columns sharing one scale in the tiled layout

// bf16x2 constants of the kernel's decode: (136, 136) (136 = 128 + 8), and for the sm_80 form
// (x * 1 + -136) (1.0, 1.0) and (-136, -136).
inline constexpr uint32_t kInt4Bf16x2Bias = 0x43084308u;
inline constexpr uint32_t kInt4Bf16x2One = 0x3f803f80u;
inline constexpr uint32_t kInt4Bf16x2MinusBias = 0xc308c308u;

// Fragment register `reg` (0..3) of a code word as the bf16 pair (128 + u0, 128 + u1): the
// kernel's own expression, shared with the host so that the unit tests run it.
MLASERVE_INT4_HD uint32_t Int4BiasedPair(uint32_t word, int reg) {
  return ((word >> (4 * reg)) & 0x000f000fu) | 0x43004300u;
}

// The bf16 scale pair a register is multiplied by, from a lane's scale word (s(g), s(g + 8)) of one
// 32-column group: (s(g), s(g)) for registers a0 / a2 (rows g), (s(g + 8), s(g + 8)) for a1 / a3.
// On the device the half is broadcast by two PTX moves that ptxas folds into the consuming bf16
// multiply's operand swizzle (.H0_H0 / .H1_H1): no instruction of its own (session 21; it was one
// PRMT a register before).
MLASERVE_INT4_HD uint32_t Int4ScalePair(uint32_t word, bool row_plus_8) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  if (row_plus_8) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n mov.b32 %0, {h, h};\n}\n"
        : "=r"(d)
        : "r"(word));
  } else {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n mov.b32 %0, {l, l};\n}\n"
        : "=r"(d)
        : "r"(word));
  }
  return d;
#else
  const uint32_t s = row_plus_8 ? word >> 16 : word & 0xffffu;
  return s | (s << 16);
#endif
}

// Bytes of the rearranged arrays for a [rows, cols] projection (rows % 16 == 0, cols % 64 == 0).
inline size_t Int4TiledCodeBytes(int rows, int cols) {
  return static_cast<size_t>(rows) * cols / 2;
}
inline size_t Int4TiledScaleBytes(int rows, int cols) {
  return static_cast<size_t>(rows) * cols / 16;
}

// One projection as the loader reads it: whole rows of the checkpoint tensor (src_cols columns),
// of which the projection is columns [col0, col0 + cols) (col0 > 0 for a tensor-parallel slice).
struct Int4SourceRows {
  const int32_t* packed = nullptr;  // [rows, ceil(src_cols / 8)] pack-quantized words
  const uint16_t* scale = nullptr;  // bf16 bits [rows, ceil(src_cols / group_size)]
  int rows = 0;
  int src_cols = 0;
  int group_size = 32;  // a multiple of 32
  int col0 = 0;         // a multiple of 32, so every 32-column slot lies in one group
  int cols = 0;
};

// Rearranges one projection into a zero-padded [rows_p, cols_p] tiled one (rows_p >= rows,
// rows_p % 16 == 0, cols_p >= cols, cols_p % 64 == 0): tiled_codes [Int4TiledCodeBytes(rows_p,
// cols_p)], tiled_scales [Int4TiledScaleBytes(rows_p, cols_p)]. Errors name the shape rule broken,
// or the row and group of a NaN or infinite scale.
absl::Status RelayoutInt4(const Int4SourceRows& w, int rows_p, int cols_p, uint8_t* tiled_codes,
                          uint8_t* tiled_scales);

// gate and up, each [intermediate, cols] (the same shape), into one interleaved
// [2 * intermediate_p, cols_p] projection (intermediate_p >= intermediate, intermediate_p % 8 ==
// 0).
absl::Status RelayoutInt4GateUp(const Int4SourceRows& gate, const Int4SourceRows& up,
                                int intermediate_p, int cols_p, uint8_t* tiled_codes,
                                uint8_t* tiled_scales);

// The inverse, for tests: q * s in fp32 (exact, not rounded to bf16) of every element of the
// rearranged projection, in its row order ([rows, cols]), decoded with Int4BiasedPair.
void DequantizeTiledInt4(const uint8_t* tiled_codes, const uint8_t* tiled_scales, int rows,
                         int cols, float* out);

}  // namespace mlaserve
