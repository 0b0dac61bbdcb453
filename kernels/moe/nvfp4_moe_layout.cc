#include "kernels/moe/nvfp4_moe_layout.h"

#include <bit>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "kernels/moe/mma_fragment_layout.h"

namespace mlaserve {
namespace {

// Fragment register (0..3), element (0: first, 1: second) and lane of element (r, c) of a 16x16
// tile (mma_fragment_layout.h).
void FragmentSlot(int r, int c, int* lane, int* reg, int* elem) {
  const MmaAFragmentSlot s = MmaAFragmentSlotOf(r, c);
  *lane = s.lane;
  *reg = s.reg;
  *elem = s.elem;
}

// Bit positions in the code word of bits (m, e0, e1, s) of register `reg`'s first element
// (nvfp4_moe_layout.h); the second element's are 16 higher.
constexpr int kCodeBitPos[4][4] = {{0, 1, 2, 9}, {3, 4, 5, 12}, {6, 7, 8, 11}, {13, 14, 15, 10}};

uint32_t PlaceCode(uint8_t code, int reg, int elem) {
  uint32_t w = 0;
  for (int b = 0; b < 4; ++b) {
    if ((code >> b) & 1) w |= 1u << (kCodeBitPos[reg][b] + 16 * elem);
  }
  return w;
}

uint8_t TakeCode(uint32_t word, int reg, int elem) {
  uint8_t code = 0;
  for (int b = 0; b < 4; ++b) code |= ((word >> (kCodeBitPos[reg][b] + 16 * elem)) & 1) << b;
  return code;
}

// Source row of each row of the rearranged projection: a pointer pair (packed, scale) per row.
struct RowSource {
  const uint8_t* packed;
  const uint8_t* scale;
  int src_row;
};

// Where element (r, c) of a 16x16 tile goes, and its code's bits placed for (reg, elem): tables
// built once from FragmentSlot and PlaceCode, so that the loop below does two lookups and an OR
// per element (Kimi-K2.5 has 2.1 G expert weights per MoE layer on rank 0 of 8 alone: the bit-by-
// bit form took ~65 s a layer on one core, measured on the H200 machine).
struct Tables {
  uint8_t lane[16][16];
  uint32_t placed[16][16][16];  // [r][c][code]: the word bits of element (r, c) holding `code`
  Tables() {
    for (int r = 0; r < 16; ++r) {
      for (int c = 0; c < 16; ++c) {
        int l, reg, elem;
        FragmentSlot(r, c, &l, &reg, &elem);
        lane[r][c] = static_cast<uint8_t>(l);
        for (int code = 0; code < 16; ++code) {
          placed[r][c][code] = PlaceCode(static_cast<uint8_t>(code), reg, elem);
        }
      }
    }
  }
};

const Tables& LayoutTables() {
  static const Tables t;
  return t;
}

absl::Status Relayout(const std::vector<RowSource>& rows_src, int cols, uint8_t* tiled_codes,
                      uint8_t* tiled_scales) {
  const int rows = static_cast<int>(rows_src.size());
  if (rows % kNvfp4TileRows != 0 || cols % kNvfp4TileCols != 0) {
    return absl::InvalidArgumentError(absl::StrCat("NVFP4 relayout: shape [", rows, ", ", cols,
                                                   "] is not a multiple of [16, 64]"));
  }
  const Tables& T = LayoutTables();
  const int kchunks = cols / kNvfp4TileCols;
  const int nblk = cols / 16;
  // The scale code of every e4m3 byte (0: not a positive number, reported below).
  uint8_t scale_code[256];
  bool scale_ok[256];
  for (int v = 0; v < 256; ++v) scale_ok[v] = Nvfp4ScaleCode(static_cast<uint8_t>(v), &scale_code[v]).ok();
  uint8_t one_code = 0;
  (void)Nvfp4ScaleCode(0x38, &one_code);  // 1.0, for zero blocks (their codes are zero)
  for (int mt = 0; mt < rows / 16; ++mt) {
    for (int kc = 0; kc < kchunks; ++kc) {
      const size_t tile = static_cast<size_t>(mt) * kchunks + kc;
      uint32_t words[32][4] = {};
      uint8_t* sc = tiled_scales + tile * 64;
      for (int r = 0; r < 16; ++r) {
        const RowSource& src = rows_src[mt * 16 + r];
        const uint8_t* row = src.packed + static_cast<size_t>(src.src_row) * (cols / 2);
        for (int j = 0; j < 4; ++j) {
          const int blk = kc * 4 + j;
          const uint8_t s8 = src.scale[static_cast<size_t>(src.src_row) * nblk + blk];
          const bool zero_block = (s8 & 0x7f) == 0;
          if (!zero_block && !scale_ok[s8]) {
            uint8_t unused;
            const absl::Status st = Nvfp4ScaleCode(s8, &unused);
            return absl::InvalidArgumentError(absl::StrCat("NVFP4 relayout: row ", src.src_row,
                                                           ", block ", blk, ": ",
                                                           std::string(st.message())));
          }
          sc[(r % 8) * 8 + 2 * j + r / 8] = zero_block ? one_code : scale_code[s8];
          if (zero_block) continue;
          const uint8_t* bytes = row + (kc * 64 + j * 16) / 2;
          for (int cc = 0; cc < 16; cc += 2) {
            const uint8_t b = bytes[cc / 2];
            words[T.lane[r][cc]][j] |= T.placed[r][cc][b & 0xf];
            words[T.lane[r][cc + 1]][j] |= T.placed[r][cc + 1][b >> 4];
          }
        }
      }
      uint8_t* dst = tiled_codes + tile * 512;
      for (int lane = 0; lane < 32; ++lane) {
        for (int j = 0; j < 4; ++j) {
          for (int b = 0; b < 4; ++b)
            dst[lane * 16 + j * 4 + b] = (words[lane][j] >> (8 * b)) & 0xff;
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Nvfp4ScaleCode(uint8_t e4m3, uint8_t* code) {
  const float v = E4m3ToFloat(e4m3);
  if (!(v > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("e4m3 scale 0x", absl::Hex(e4m3), " is not a positive number"));
  }
  // v * 2^119 lies in [2^110, 1.75 * 2^127]; its bf16 exponent field is 237..254.
  int e;
  const double m = std::frexp(static_cast<double>(v), &e);  // v = m * 2^e, m in [0.5, 1)
  const int field = (e - 1) + 119 + 127;
  const int mant3 = static_cast<int>((m * 2.0 - 1.0) * 8.0);
  *code = static_cast<uint8_t>(((field - 232) << 3) | mant3);
  return absl::OkStatus();
}

absl::Status RelayoutNvfp4(const uint8_t* packed, const uint8_t* scale_e4m3, int rows, int cols,
                           uint8_t* tiled_codes, uint8_t* tiled_scales) {
  std::vector<RowSource> src(rows);
  for (int r = 0; r < rows; ++r) src[r] = {packed, scale_e4m3, r};
  return Relayout(src, cols, tiled_codes, tiled_scales);
}

absl::Status RelayoutNvfp4GateUp(const uint8_t* gate_packed, const uint8_t* gate_scale_e4m3,
                                 const uint8_t* up_packed, const uint8_t* up_scale_e4m3,
                                 int intermediate, int hidden, uint8_t* tiled_codes,
                                 uint8_t* tiled_scales) {
  if (intermediate % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVFP4 gate/up relayout: intermediate ", intermediate, " % 8 != 0"));
  }
  std::vector<RowSource> src(2 * intermediate);
  for (int i = 0; i < intermediate; ++i) {
    const int tile = i / 8, g = i % 8;
    src[16 * tile + g] = {gate_packed, gate_scale_e4m3, i};
    src[16 * tile + 8 + g] = {up_packed, up_scale_e4m3, i};
  }
  return Relayout(src, hidden, tiled_codes, tiled_scales);
}

void DequantizeTiledNvfp4(const uint8_t* tiled_codes, const uint8_t* tiled_scales, int rows,
                          int cols, float* out) {
  const int kchunks = cols / kNvfp4TileCols;
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const int mt = r / 16, kc = c / 64, j = (c % 64) / 16, rr = r % 16, cc = c % 16;
      const size_t tile = static_cast<size_t>(mt) * kchunks + kc;
      int lane, reg, elem;
      FragmentSlot(rr, cc, &lane, &reg, &elem);
      const uint8_t* w = tiled_codes + tile * 512 + lane * 16 + j * 4;
      const uint32_t word = w[0] | (w[1] << 8) | (w[2] << 16) | (static_cast<uint32_t>(w[3]) << 24);
      const uint8_t e2m1 = TakeCode(word, reg, elem);
      const uint8_t code = tiled_scales[tile * 64 + (rr % 8) * 8 + 2 * j + rr / 8];
      // Decode the scale code the way the kernel does: bf16 bits (code << 4) + (232 << 7).
      const uint32_t bf16 = (static_cast<uint32_t>(code) << 4) + (232u << 7);
      const double scale =
          static_cast<double>(Bf16ToFloat(static_cast<uint16_t>(bf16))) * std::ldexp(1.0, -119);
      out[static_cast<size_t>(r) * cols + c] = static_cast<float>(E2m1ToFloat(e2m1) * scale);
    }
  }
}

}  // namespace mlaserve
