#include "kernels/moe/int4_moe_layout.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "kernels/linear/int4_group_ref.h"
#include "kernels/moe/mma_fragment_layout.h"

namespace mlaserve {
namespace {

constexpr uint32_t kZeroNibble = 8;  // q = 0

// One row of the rearranged projection: its checkpoint row, or padding (packed == nullptr).
struct RowSource {
  const int32_t* packed = nullptr;  // the row's words
  const uint16_t* scale = nullptr;  // the row's scales
  int row = -1;                     // checkpoint row, for messages
};

// Where element (r, c) of a 16x16 tile goes: its lane and the bit of the lane's word (per
// int4_moe_layout.h: 4 * reg + 16 * elem), from MmaAFragmentSlotOf once.
struct Placement {
  uint8_t lane[16][16];
  uint8_t bit[16][16];
  Placement() {
    for (int r = 0; r < 16; ++r) {
      for (int c = 0; c < 16; ++c) {
        const MmaAFragmentSlot s = MmaAFragmentSlotOf(r, c);
        lane[r][c] = static_cast<uint8_t>(s.lane);
        bit[r][c] = static_cast<uint8_t>(4 * s.reg + 16 * s.elem);
      }
    }
  }
};

const Placement& Places() {
  static const Placement p;
  return p;
}

bool Bf16Finite(uint16_t b) { return (b & 0x7f80u) != 0x7f80u; }

absl::Status CheckSource(const Int4SourceRows& w, const char* what) {
  if (w.rows < 0 || w.cols <= 0 || w.src_cols <= 0 || w.group_size <= 0 ||
      w.group_size % kInt4ScaleSlotCols != 0 || w.col0 < 0 || w.col0 % kInt4ScaleSlotCols != 0 ||
      w.col0 + w.cols > w.src_cols || (w.rows > 0 && (w.packed == nullptr || w.scale == nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "INT4 relayout (", what,
        "): need rows >= 0, packed and scale set, group_size a multiple "
        "of 32 (the GPU layout's scale slot), col0 a multiple of 32 and col0 + cols <= the "
        "checkpoint's columns; got rows ",
        w.rows, ", group_size ", w.group_size, ", columns [", w.col0, ", ", w.col0 + w.cols,
        ") of ", w.src_cols));
  }
  return absl::OkStatus();
}

// rows_src.size() rows (a multiple of 16) of `cols` projection columns starting at checkpoint
// column col0, padded to cols_p.
absl::Status Relayout(const std::vector<RowSource>& rows_src, int col0, int cols, int src_cols,
                      int group_size, int cols_p, uint8_t* tiled_codes, uint8_t* tiled_scales) {
  const int rows = static_cast<int>(rows_src.size());
  if (rows % kInt4TileRows != 0 || cols_p % kInt4TileCols != 0 || cols > cols_p) {
    return absl::InvalidArgumentError(absl::StrCat("INT4 relayout: padded shape [", rows, ", ",
                                                   cols_p,
                                                   "] is not a multiple of [16, 64] or "
                                                   "narrower than the ",
                                                   cols, " columns"));
  }
  const Placement& P = Places();
  const int groups = (src_cols + group_size - 1) / group_size;
  const int kchunks = cols_p / kInt4TileCols;
  for (int mt = 0; mt < rows / kInt4TileRows; ++mt) {
    for (int kc = 0; kc < kchunks; ++kc) {
      const size_t tile = static_cast<size_t>(mt) * kchunks + kc;
      uint32_t words[32][4] = {};
      uint8_t* sc = tiled_scales + tile * 64;
      for (int r = 0; r < 16; ++r) {
        const RowSource& src = rows_src[mt * 16 + r];
        for (int h = 0; h < 2; ++h) {
          const int c = kc * kInt4TileCols + h * kInt4ScaleSlotCols;  // projection column
          uint16_t s = 0;
          if (src.packed != nullptr && c < cols) {
            const int group = (col0 + c) / group_size;
            s = src.scale[group];
            if (!Bf16Finite(s)) {
              return absl::InvalidArgumentError(
                  absl::StrCat("INT4 relayout: row ", src.row, ", group ", group, " of ", groups,
                               ": scale bf16 0x", absl::Hex(s), " is not finite"));
            }
          }
          const int at = (r % 8) * 8 + (2 * h + r / 8) * 2;
          sc[at] = static_cast<uint8_t>(s & 0xff);
          sc[at + 1] = static_cast<uint8_t>(s >> 8);
        }
        for (int j = 0; j < 4; ++j) {
          const int c0 = kc * kInt4TileCols + j * 16;  // projection column of the block
          uint32_t nib[16];
          if (src.packed != nullptr && c0 + 16 <= cols) {
            // col0 % 32 == 0 and c0 % 16 == 0: the block is two whole checkpoint words.
            const int word = (col0 + c0) / kInt4PerWord;
            const uint32_t w0 = static_cast<uint32_t>(src.packed[word]);
            const uint32_t w1 = static_cast<uint32_t>(src.packed[word + 1]);
            for (int k = 0; k < 8; ++k) {
              nib[k] = (w0 >> (4 * k)) & 0xfu;
              nib[8 + k] = (w1 >> (4 * k)) & 0xfu;
            }
          } else {
            for (int k = 0; k < 16; ++k) {
              const int c = col0 + c0 + k;
              nib[k] = src.packed != nullptr && c0 + k < cols
                           ? (static_cast<uint32_t>(src.packed[c / kInt4PerWord]) >>
                              (4 * (c % kInt4PerWord))) &
                                 0xfu
                           : kZeroNibble;
            }
          }
          for (int k = 0; k < 16; ++k) {
            words[P.lane[r][k]][j] |= nib[k] << P.bit[r][k];
          }
        }
      }
      uint8_t* dst = tiled_codes + tile * 512;
      for (int lane = 0; lane < 32; ++lane) {
        for (int j = 0; j < 4; ++j) {
          for (int b = 0; b < 4; ++b) {
            dst[lane * 16 + j * 4 + b] = (words[lane][j] >> (8 * b)) & 0xff;
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

RowSource Row(const Int4SourceRows& w, int r) {
  const size_t words = (static_cast<size_t>(w.src_cols) + kInt4PerWord - 1) / kInt4PerWord;
  const size_t groups = (static_cast<size_t>(w.src_cols) + w.group_size - 1) / w.group_size;
  return {w.packed + r * words, w.scale + r * groups, r};
}

}  // namespace

absl::Status RelayoutInt4(const Int4SourceRows& w, int rows_p, int cols_p, uint8_t* tiled_codes,
                          uint8_t* tiled_scales) {
  if (absl::Status st = CheckSource(w, "projection"); !st.ok()) {
    return st;
  }
  if (rows_p < w.rows || rows_p % kInt4TileRows != 0) {
    return absl::InvalidArgumentError(absl::StrCat("INT4 relayout: ", w.rows,
                                                   " rows do not fit a padded height of ", rows_p,
                                                   " (a multiple of 16)"));
  }
  std::vector<RowSource> src(rows_p);
  for (int r = 0; r < w.rows; ++r) {
    src[r] = Row(w, r);
  }
  return Relayout(src, w.col0, w.cols, w.src_cols, w.group_size, cols_p, tiled_codes, tiled_scales);
}

absl::Status RelayoutInt4GateUp(const Int4SourceRows& gate, const Int4SourceRows& up,
                                int intermediate_p, int cols_p, uint8_t* tiled_codes,
                                uint8_t* tiled_scales) {
  if (absl::Status st = CheckSource(gate, "gate"); !st.ok()) {
    return st;
  }
  if (absl::Status st = CheckSource(up, "up"); !st.ok()) {
    return st;
  }
  if (gate.rows != up.rows || gate.cols != up.cols || gate.col0 != up.col0 ||
      gate.src_cols != up.src_cols || gate.group_size != up.group_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("INT4 gate/up relayout: gate [", gate.rows, ", ", gate.cols, "] and up [",
                     up.rows, ", ", up.cols, "] differ in shape, column window or group size"));
  }
  if (intermediate_p < gate.rows || intermediate_p % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("INT4 gate/up relayout: ", gate.rows,
                                                   " features do not fit a padded ", intermediate_p,
                                                   " (a multiple of 8)"));
  }
  std::vector<RowSource> src(2 * static_cast<size_t>(intermediate_p));
  for (int i = 0; i < gate.rows; ++i) {
    const int tile = i / 8, g = i % 8;
    src[16 * tile + g] = Row(gate, i);
    src[16 * tile + 8 + g] = Row(up, i);
  }
  return Relayout(src, gate.col0, gate.cols, gate.src_cols, gate.group_size, cols_p, tiled_codes,
                  tiled_scales);
}

void DequantizeTiledInt4(const uint8_t* tiled_codes, const uint8_t* tiled_scales, int rows,
                         int cols, float* out) {
  const int kchunks = cols / kInt4TileCols;
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const int mt = r / 16, kc = c / 64, j = (c % 64) / 16, h = (c % 64) / 32;
      const int rr = r % 16, cc = c % 16;
      const size_t tile = static_cast<size_t>(mt) * kchunks + kc;
      const MmaAFragmentSlot s = MmaAFragmentSlotOf(rr, cc);
      const uint8_t* w = tiled_codes + tile * 512 + s.lane * 16 + j * 4;
      const uint32_t word = w[0] | (w[1] << 8) | (w[2] << 16) | (static_cast<uint32_t>(w[3]) << 24);
      const uint32_t pair = Int4BiasedPair(word, s.reg);
      const uint16_t biased = static_cast<uint16_t>(s.elem ? pair >> 16 : pair & 0xffff);
      const float q = Bf16ToFloat(biased) - 136.0f;  // exact: 128 + u - 136
      const uint8_t* sp = tiled_scales + tile * 64 + (rr % 8) * 8 + (2 * h + rr / 8) * 2;
      const uint16_t scale = static_cast<uint16_t>(sp[0] | (sp[1] << 8));
      out[static_cast<size_t>(r) * cols + c] = q * Bf16ToFloat(scale);
    }
  }
}

}  // namespace mlaserve
