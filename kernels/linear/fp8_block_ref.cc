#include "kernels/linear/fp8_block_ref.h"

#include "common/dtype.h"

namespace mlaserve {

void DequantizeFp8Block(const Fp8BlockTensor& w, int64_t row0, int64_t nrows, int64_t col0,
                        int64_t ncols, float* out) {
  const int64_t scale_cols = w.GridCols();
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t row = row0 + r;
    const uint8_t* wrow = w.weight + row * w.cols;
    const float* srow = w.scale_inv + ((w.origin_row + row) / w.block_rows) * scale_cols;
    for (int64_t c = 0; c < ncols; ++c) {
      const int64_t col = col0 + c;
      out[r * ncols + c] = E4m3ToFloat(wrow[col]) * srow[(w.origin_col + col) / w.block_cols];
    }
  }
}

}  // namespace mlaserve
