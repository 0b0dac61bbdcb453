// NVFP4 expert weights rearranged once, at load time, into the layout the GPU grouped GEMM reads.
//
// The kernel computes out^T = W x^T with W as the A operand of mma.sync.m16n8k16 (bf16), so a
// warp dequantizes W straight into A fragments (PTX ISA, "Matrix fragments for mma.m16n8k16",
// .bf16 A: lane = 4g + t holds a0 = W[g][2t..2t+1], a1 = W[g+8][2t..2t+1],
// a2 = W[g][2t+8..2t+9], a3 = W[g+8][2t+8..2t+9] of a 16x16 tile).
//
// Rows split into m-tiles of 16, columns into chunks of 64 (four 16-column scale blocks).
// codes  [rows/16][cols/64][32 lanes][4 words]: word j of lane 4g+t holds the 8 e2m1 codes of the
//        lane's A fragment for columns 64c + 16j .. +15: a0 = (W[g][2t], W[g][2t+1]),
//        a1 = (W[g+8][2t], W[g+8][2t+1]), a2 = (W[g][2t+8], W[g][2t+9]),
//        a3 = (W[g+8][2t+8], W[g+8][2t+9]). Each code's bits (s e1 e0 m) sit where one shift and
//        one mask move them to the bf16 positions (s -> 15, e1 e0 m -> 8 7 6; +16 for the pair's
//        second element), so that the kernel needs 7 operations on the integer pipe per word
//        (masks: LOP3; right shifts: SHF) and 4 left shifts, which ptxas mostly issues as IMAD
//        on the FMA pipe:
//          a0 = (q << 6) & 0x81c081c0            first element m,e0,e1,s at bits 0,1,2,9
//          a1 = (q << 3) & 0x81c081c0            bits 3,4,5,12
//          a2 = q & 0x01c001c0 | (q << 4) & 0x80008000      bits 6,7,8,11
//          a3 = (q >> 7) & 0x01c001c0 | (q << 5) & 0x80008000   bits 13,14,15,10
//        (second elements: the same positions + 16). Searched exhaustively (session 10), counting
//        a LOP3 per masked copy of q and an SHF per right shift: no placement builds every
//        register from one shifted copy, none uses left shifts only, and none with three
//        single-copy registers exists, so 7 is the fewest (the previous placement took 8-9: its
//        a3 needed three copies, two right-shifted). The result is a bf16 pair whose value is
//        e2m1 * 2^-126: exponent and mantissa bits land in the bf16's, and code 1 = 0.5 lands on
//        a bf16 subnormal, which bf16 multiplication keeps.
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
