#include "kernels/linear/int4_group_ref.h"

namespace mlaserve {

void DequantizeInt4Group(const Int4GroupTensor& w, int64_t row0, int64_t nrows, int64_t col0,
                         int64_t ncols, float* out) {
  const int64_t words = (w.cols + kInt4PerWord - 1) / kInt4PerWord;
  const int64_t groups = (w.cols + w.group_size - 1) / w.group_size;
  for (int64_t r = 0; r < nrows; ++r) {
    const int32_t* prow = w.packed + (row0 + r) * words;
    const float* srow = w.scale + (row0 + r) * groups;
    for (int64_t c = 0; c < ncols; ++c) {
      const int64_t col = col0 + c;
      const uint32_t word = static_cast<uint32_t>(prow[col / kInt4PerWord]);
      const int q = static_cast<int>((word >> (4 * (col % kInt4PerWord))) & 0xfu) - 8;
      out[r * ncols + c] = static_cast<float>(q) * srow[col / w.group_size];
    }
  }
}

}  // namespace mlaserve
