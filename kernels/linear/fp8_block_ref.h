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
  const float* scale_inv = nullptr;  // [ceil(rows / block_rows), ceil(cols / block_cols)]
  int64_t rows = 0;
  int64_t cols = 0;
  int block_rows = 128;
  int block_cols = 128;
};

// out[r][c] = e4m3(row0 + r, col0 + c) * scale_inv[(row0 + r) / block_rows][(col0 + c) /
// block_cols] for the window [row0, row0 + nrows) x [col0, col0 + ncols): one fp32 rounding of
// the product, as weight_dequant computes it in fp32. e4m3 NaN (0x7f, 0xff) gives NaN.
void DequantizeFp8Block(const Fp8BlockTensor& w, int64_t row0, int64_t nrows, int64_t col0,
                        int64_t ncols, float* out /*[nrows, ncols]*/);

}  // namespace mlaserve
