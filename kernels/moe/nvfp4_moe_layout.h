// NVFP4 expert weights rearranged once, at load time, into the layout the GPU grouped GEMM reads.
//
// The kernel computes out^T = W x^T with W as the A operand of mma.sync.m16n8k16 (bf16), so a
// warp dequantizes W straight into A fragments (PTX ISA, "Matrix fragments for mma.m16n8k16",
// .bf16 A: lane = 4g + t holds a0 = W[g][2t..2t+1], a1 = W[g+8][2t..2t+1],
// a2 = W[g][2t+8..2t+9], a3 = W[g+8][2t+8..2t+9] of a 16x16 tile).
//
// Rows split into m-tiles of 16, columns into chunks of 64 (four 16-column scale blocks).
// codes  [rows/16][cols/64][32 lanes][4 words]: word j of lane 4g+t holds the 8 e2m1 codes of the
//        lane's A fragment for columns 64c + 16j .. +15, nibble n (bits 4n..4n+3):
//          n=3: W[g][2t]    n=7: W[g][2t+1]      (a0)      n=1: W[g][2t+8]    n=5: W[g][2t+9]    (a2)
//          n=2: W[g+8][2t]  n=6: W[g+8][2t+1]    (a1)      n=0: W[g+8][2t+8]  n=4: W[g+8][2t+9]  (a3)
//        so the kernel's `(q << 4r) & 0x80008000 | ((q << 4r) >> 6) & 0x01c001c0` yields a[r] as a
//        bf16 pair whose value is e2m1 * 2^-126 (exponent and mantissa bits placed into the
//        bf16's; code 1 = 0.5 lands on a bf16 subnormal, which bf16 multiplication keeps).
// scales [rows/16][cols/64][8 g][8 bytes]: bytes (s(g,0), s(g+8,0), s(g,1), s(g+8,1), s(g,2),
//        s(g+8,2), s(g,3), s(g+8,3)), s(r,j) = scale of row r, 16-column block j of the chunk,
//        as an 8-bit code u: the bf16 with bits (u << 4) + (232 << 7) equals the e4m3 scale times
//        2^119 exactly (5 exponent bits, 3 mantissa bits; every positive e4m3 value, subnormals
//        included, fits). So bf16(e2m1 * 2^-126) * bf16(scale * 2^119) = e2m1 * scale * 2^-7,
//        exact in bf16 (at most 2 + 4 significant bits); the kernel multiplies its fp32 sums by
//        weight_scale_2 * 2^7.
// Blocks whose e4m3 scale is zero dequantize to zeros and are stored as zero codes.
//
// The fused gate+up projection interleaves the two: m-tile i holds gate rows 8i..8i+7 then up
// rows 8i..8i+7, so one mma tile yields gate and up of the same 8 intermediate features and the
// SiLU(gate)*up epilogue needs no data exchange.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace mlaserve {

inline constexpr int kNvfp4TileRows = 16;
inline constexpr int kNvfp4TileCols = 64;

// Bytes of the rearranged arrays for a [rows, cols] projection (rows % 16 == 0, cols % 64 == 0).
inline size_t Nvfp4TiledCodeBytes(int rows, int cols) {
  return static_cast<size_t>(rows) * cols / 2;
}
inline size_t Nvfp4TiledScaleBytes(int rows, int cols) {
  return static_cast<size_t>(rows) * cols / 16;
}

// The 8-bit scale code for an e4m3 scale (see above); error for negative, NaN or zero scales.
absl::Status Nvfp4ScaleCode(uint8_t e4m3, uint8_t* code);

// Rearranges one [rows, cols] NVFP4 projection (checkpoint layout, see nvfp4_ref.h) into
// tiled_codes [Nvfp4TiledCodeBytes] and tiled_scales [Nvfp4TiledScaleBytes]. Errors name the
// offending row and block.
absl::Status RelayoutNvfp4(const uint8_t* packed /*[rows, cols/2]*/,
                           const uint8_t* scale_e4m3 /*[rows, cols/16]*/, int rows, int cols,
                           uint8_t* tiled_codes, uint8_t* tiled_scales);

// gate and up, each [intermediate, hidden], into one interleaved [2 * intermediate, hidden]
// projection (intermediate % 8 == 0, hidden % 64 == 0).
absl::Status RelayoutNvfp4GateUp(const uint8_t* gate_packed, const uint8_t* gate_scale_e4m3,
                                 const uint8_t* up_packed, const uint8_t* up_scale_e4m3,
                                 int intermediate, int hidden, uint8_t* tiled_codes,
                                 uint8_t* tiled_scales);

// The inverse, for tests: the fp32 values e2m1 * scale (without weight_scale_2) of every element of
// the rearranged projection, in its row order ([rows, cols]).
void DequantizeTiledNvfp4(const uint8_t* tiled_codes, const uint8_t* tiled_scales, int rows,
                          int cols, float* out);

}  // namespace mlaserve
