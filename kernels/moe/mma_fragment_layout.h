// Where each element of a 16x16 A tile of mma.sync.m16n8k16 (bf16 / f16) lives in a warp (PTX ISA,
// "Matrix fragments for mma.m16n8k16 with floating point type", A operand): lane 4g + t holds
// a0 = A[g][2t..2t+1], a1 = A[g+8][2t..2t+1], a2 = A[g][2t+8..2t+9], a3 = A[g+8][2t+8..2t+9], the
// lower column of each pair in the register's low half. The weight layouts of the grouped expert
// GEMMs (nvfp4_moe_layout.h, int4_moe_layout.h) place their codes by it on the host.
#pragma once

namespace mlaserve {

struct MmaAFragmentSlot {
  int lane;  // 0..31
  int reg;   // a0..a3
  int elem;  // 0: the register's low half (even column), 1: its high half
};

// The slot of element (r, c) of a 16x16 tile, r and c in [0, 16).
inline MmaAFragmentSlot MmaAFragmentSlotOf(int r, int c) {
  const int g = r % 8, hi_row = r / 8;
  const int t = (c % 8) / 2, hi_col = c / 8;
  return {4 * g + t, hi_row + 2 * hi_col, c % 2};
}

}  // namespace mlaserve
