// DeepSeek-V3 / R1 FP8 weights (the official releases) on the host: the project's one
// definition of the format.
//
// Format: config.json quantization_config {"quant_method": "fp8", "fmt": "e4m3",
// "weight_block_size": [128, 128], "activation_scheme": "dynamic"}; each quantized linear has
//   weight            float8_e4m3fn [rows, cols]
//   weight_scale_inv  fp32 [ceil(rows / 128), ceil(cols / 128)]  one scale per 128x128 block
// and, despite the name, w[r][c] = fp8(r, c) * weight_scale_inv[r / 128][c / 128] (a
// multiplication). Source, read 2026-12-01 (no code copied): deepseek-ai/DeepSeek-V3
// inference/kernel.py, weight_dequant / weight_dequant_kernel (loads the fp8 block as fp32,
// multiplies by s[pid_m * ceil(N/128) + pid_n]; weight_quant stores s = amax / 448, the factor
// that multiplies back) and inference/fp8_cast_bf16.py (which uses weight_dequant). The MTP
// layer (model.layers.61, num_nextn_predict_layers) is in the checkpoint and is not loaded.
#pragma once

#include <cstdint>

namespace mlaserve {

struct Fp8BlockTensor {
  const uint8_t* weight = nullptr;   // e4m3 [rows, cols]
  const float* scale_inv = nullptr;  // [GridRows(), GridCols()]
  int64_t rows = 0;
  int64_t cols = 0;
  int block_rows = 128;
  int block_cols = 128;
  // A window of a larger checkpoint tensor (a tensor-parallel shard held as its own array):
  // weight[0][0] is the tensor's element (origin_row, origin_col) and scale_inv is the tensor's
  // whole grid, grid_rows x grid_cols. All zero: weight is the whole tensor.
  int64_t origin_row = 0, origin_col = 0;
  int64_t grid_rows = 0, grid_cols = 0;  // 0: ceil(rows / block_rows), ceil(cols / block_cols)

  int64_t GridRows() const {
    return grid_rows > 0 ? grid_rows : (rows + block_rows - 1) / block_rows;
  }
  int64_t GridCols() const {
    return grid_cols > 0 ? grid_cols : (cols + block_cols - 1) / block_cols;
  }
  // The scale of element (r, c) of weight.
  float ScaleOf(int64_t r, int64_t c) const {
    return scale_inv[(origin_row + r) / block_rows * GridCols() + (origin_col + c) / block_cols];
  }
};

// out[r][c] = e4m3(row0 + r, col0 + c) * ScaleOf(row0 + r, col0 + c) for the window
// [row0, row0 + nrows) x [col0, col0 + ncols) of weight: one fp32 rounding of the product, as
// weight_dequant computes it in fp32. e4m3 NaN (0x7f, 0xff) gives NaN.
void DequantizeFp8Block(const Fp8BlockTensor& w, int64_t row0, int64_t nrows, int64_t col0,
                        int64_t ncols, float* out /*[nrows, ncols]*/);

}  // namespace mlaserve
