#include "kernels/moe/fp8_moe_layout.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "kernels/moe/mma_fragment_layout.h"

namespace mlaserve {
namespace {

// Byte offsets of every element of a 16 x 64 chunk (fp8_moe_layout.h), from MmaAFragmentSlotOf.
struct Placement {
  uint16_t at[16][64];
  Placement() {
    for (int r = 0; r < 16; ++r) {
      for (int c = 0; c < 64; ++c) {
        const int j = c / 16;
        const MmaAFragmentSlot s = MmaAFragmentSlotOf(r, c % 16);
        at[r][c] =
            static_cast<uint16_t>((j / 2) * 512 + s.lane * 16 + (j % 2) * 8 + 2 * s.reg + s.elem);
      }
    }
  }
};

const Placement& Places() {
  static const Placement p;
  return p;
}

// One row of the rearranged projection: a row of a checkpoint window, or padding (w == nullptr).
struct RowSource {
  const Fp8BlockTensor* w = nullptr;
  int row = -1;  // row of the window
};

absl::Status CheckSource(const Fp8BlockTensor& w, const char* what) {
  const int64_t last_row = w.origin_row + w.rows - 1, last_col = w.origin_col + w.cols - 1;
  if (w.rows < 0 || w.cols <= 0 || w.block_rows <= 0 || w.block_cols <= 0 || w.origin_row < 0 ||
      w.origin_col < 0 || (w.rows > 0 && (w.weight == nullptr || w.scale_inv == nullptr)) ||
      (w.rows > 0 &&
       (last_row / w.block_rows >= w.GridRows() || last_col / w.block_cols >= w.GridCols()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 relayout (", what,
                     "): need rows >= 0, cols > 0, weight and scale_inv set and the "
                     "window inside the scale grid; got rows [",
                     w.origin_row, ", ", w.origin_row + w.rows, ") x columns [", w.origin_col, ", ",
                     w.origin_col + w.cols, ") with blocks ", w.block_rows, " x ", w.block_cols,
                     " and a ", w.GridRows(), " x ", w.GridCols(), " grid"));
  }
  if (w.block_rows % kFp8HalfRows != 0 || w.block_cols % kFp8TileCols != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 relayout (", what, "): weight_block_size [", w.block_rows, ", ", w.block_cols,
        "] is not a multiple of [8, 64], which the GPU layout's scales (one per 8 rows x 64 "
        "columns) need (DeepSeek's is [128, 128])"));
  }
  if (w.origin_row % kFp8HalfRows != 0 || w.origin_col % kFp8TileCols != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 relayout (", what, "): the shard starts at row ", w.origin_row, ", column ",
        w.origin_col,
        " of the checkpoint tensor; the GPU layout needs a row that is a multiple "
        "of 8 and a column that is a multiple of 64 (each 8 x 64 piece in one scale block): "
        "choose a rank count that splits the tensor into shards of multiples of 8 rows and 64 "
        "columns (DeepSeek's expert width 2048 splits so over up to 32 ranks)"));
  }
  return absl::OkStatus();
}

// rows_src.size() rows (a multiple of 16) of `cols` window columns, padded to cols_p.
absl::Status Relayout(const std::vector<RowSource>& rows_src, int cols, int cols_p,
                      uint8_t* tiled_codes, uint8_t* tiled_scales) {
  const int rows = static_cast<int>(rows_src.size());
  if (rows % kFp8TileRows != 0 || cols_p % kFp8TileCols != 0 || cols > cols_p) {
    return absl::InvalidArgumentError(absl::StrCat("FP8 relayout: padded shape [", rows, ", ",
                                                   cols_p,
                                                   "] is not a multiple of [16, 64] or narrower "
                                                   "than the ",
                                                   cols, " columns"));
  }
  const Placement& P = Places();
  const int kchunks = cols_p / kFp8TileCols;
  for (int mt = 0; mt < rows / kFp8TileRows; ++mt) {
    for (int kc = 0; kc < kchunks; ++kc) {
      const size_t chunk = static_cast<size_t>(mt) * kchunks + kc;
      uint8_t* dst = tiled_codes + chunk * kFp8ChunkCodeBytes;
      float s[2] = {0.0f, 0.0f};  // padding halves keep 0
      for (int r = 0; r < kFp8TileRows; ++r) {
        const RowSource& src = rows_src[mt * kFp8TileRows + r];
        const int c0 = kc * kFp8TileCols;
        if (src.w == nullptr || c0 >= cols) {
          for (int c = 0; c < kFp8TileCols; ++c) {
            dst[P.at[r][c]] = 0;
          }
          continue;
        }
        const Fp8BlockTensor& w = *src.w;
        // The chunk's 64 columns (and the half's 8 rows) lie in one block (CheckSource).
        const float sc = w.ScaleOf(src.row, c0);
        if (!std::isfinite(sc)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "FP8 relayout: scale block [", (w.origin_row + src.row) / w.block_rows, ", ",
              (w.origin_col + c0) / w.block_cols, "] (weight_scale_inv) is ", sc, ", not finite"));
        }
        s[r / kFp8HalfRows] = sc;
        const uint8_t* codes = w.weight + static_cast<size_t>(src.row) * w.cols + c0;
        const int n = cols - c0 < kFp8TileCols ? cols - c0 : kFp8TileCols;
        for (int c = 0; c < n; ++c) {
          dst[P.at[r][c]] = codes[c];
        }
        for (int c = n; c < kFp8TileCols; ++c) {
          dst[P.at[r][c]] = 0;
        }
      }
      std::memcpy(tiled_scales + chunk * kFp8ChunkScaleBytes, s, sizeof(s));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int Fp8ChunkByteOf(int r, int c) { return Places().at[r][c]; }

absl::Status RelayoutFp8(const Fp8BlockTensor& w, int rows_p, int cols_p, uint8_t* tiled_codes,
                         uint8_t* tiled_scales) {
  if (absl::Status st = CheckSource(w, "projection"); !st.ok()) {
    return st;
  }
  if (rows_p < w.rows || rows_p % kFp8TileRows != 0) {
    return absl::InvalidArgumentError(absl::StrCat("FP8 relayout: ", w.rows,
                                                   " rows do not fit a padded height of ", rows_p,
                                                   " (a multiple of 16)"));
  }
  std::vector<RowSource> src(rows_p);
  for (int r = 0; r < w.rows; ++r) {
    src[r] = {&w, r};
  }
  return Relayout(src, static_cast<int>(w.cols), cols_p, tiled_codes, tiled_scales);
}

absl::Status RelayoutFp8GateUp(const Fp8BlockTensor& gate, const Fp8BlockTensor& up,
                               int intermediate_p, int cols_p, uint8_t* tiled_codes,
                               uint8_t* tiled_scales) {
  if (absl::Status st = CheckSource(gate, "gate"); !st.ok()) {
    return st;
  }
  if (absl::Status st = CheckSource(up, "up"); !st.ok()) {
    return st;
  }
  if (gate.rows != up.rows || gate.cols != up.cols) {
    return absl::InvalidArgumentError(absl::StrCat("FP8 gate/up relayout: gate [", gate.rows, ", ",
                                                   gate.cols, "] and up [", up.rows, ", ", up.cols,
                                                   "] differ in shape"));
  }
  if (intermediate_p < gate.rows || intermediate_p % kFp8HalfRows != 0) {
    return absl::InvalidArgumentError(absl::StrCat("FP8 gate/up relayout: ", gate.rows,
                                                   " features do not fit a padded ", intermediate_p,
                                                   " (a multiple of 8)"));
  }
  std::vector<RowSource> src(2 * static_cast<size_t>(intermediate_p));
  for (int i = 0; i < gate.rows; ++i) {
    const int tile = i / 8, g = i % 8;
    src[16 * tile + g] = {&gate, i};
    src[16 * tile + 8 + g] = {&up, i};
  }
  return Relayout(src, static_cast<int>(gate.cols), cols_p, tiled_codes, tiled_scales);
}

void DequantizeTiledFp8(const uint8_t* tiled_codes, const uint8_t* tiled_scales, int rows, int cols,
                        float* out) {
  const int kchunks = cols / kFp8TileCols;
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const size_t chunk = static_cast<size_t>(r / kFp8TileRows) * kchunks + c / kFp8TileCols;
      const uint8_t code = tiled_codes[chunk * kFp8ChunkCodeBytes + Fp8ChunkByteOf(r % 16, c % 64)];
      float s;
      std::memcpy(&s, tiled_scales + chunk * kFp8ChunkScaleBytes + 4 * ((r % 16) / 8), 4);
      out[static_cast<size_t>(r) * cols + c] = E4m3ToFloat(code) * s;
    }
  }
}

}  // namespace mlaserve
