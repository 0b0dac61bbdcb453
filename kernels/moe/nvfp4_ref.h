// NVFP4 (NVIDIA ModelOpt) weights on the host: the project's one dequantizer and quantizer.
//
// Format (DESIGN.md "Formats"): a [rows, cols] weight is stored as
//   packed       uint8 [rows, cols / 2]   two e2m1 codes a byte, the LOW nibble holds the even
//   column block_scale  e4m3  [rows, cols / 16]  one scale per 16 consecutive columns of a row
//   global_scale fp32 scalar              (`weight_scale_2` in the checkpoint)
// and w[r][c] = e2m1(code[r][c]) * e4m3(block_scale[r][c / 16]) * global_scale.
#pragma once

#include <cstdint>

namespace mlaserve {

inline constexpr int kNvfp4BlockSize = 16;  // columns sharing one e4m3 scale

// out[r][c] = w[r][c] as defined above, computed in fp32 (e2m1 * e4m3 is exact in fp32; the
// product with global_scale is one fp32 rounding, the same as ModelOpt's dequantize in fp32).
// cols must be a multiple of 16.
void DequantizeNvfp4(const uint8_t* packed /*[rows, cols/2]*/,
                     const uint8_t* block_scale_e4m3 /*[rows, cols/16]*/, float global_scale,
                     int rows, int cols, float* out /*[rows, cols]*/);

// The e2m1 code ModelOpt gives a value already divided by its scales: round to nearest with ties
// to the even code (the bounds 0.25 0.75 1.25 1.75 2.5 3.5 5 of NVFP4QTensor._cast_fp4, where a
// value on an "odd" bound 0.75, 1.75, 3.5 goes up and one on 0.25, 1.25, 2.5, 5 goes down),
// saturating at 6; the sign bit is set for every x < 0, so tiny negatives give -0 (code 8).
uint8_t ModelOptE2m1Code(float x);

// Quantizes like ModelOpt's NVFP4QTensor.quantize (dynamic weight path, block size 16):
//   global_scale = amax(|w|) / (6 * 448)                         (get_weights_scaling_factor_2)
//   s_block      = e4m3(max(block_amax / (6 * global_scale), 2^-9)), 1.0 for an all-zero block
//   code         = ModelOptE2m1Code(w / (float(s_block) * global_scale))
// Source: NVIDIA/Model-Optimizer modelopt/torch/quantization/qtensor/nvfp4_tensor.py
// (get_weights_scaling_factor_2, get_weights_scaling_factor, quantize, _cast_fp4), read
// 2026-11-29. A tensor of all zeros gets global_scale 0 there (and NaN codes); here it gets
// global_scale 0, scales 1.0 and codes 0, which dequantize to the same zeros.
// cols must be a multiple of 16.
void QuantizeNvfp4(const float* w /*[rows, cols]*/, int rows, int cols,
                   uint8_t* packed /*[rows, cols/2]*/, uint8_t* block_scale /*[rows, cols/16]*/,
                   float* global_scale);

}  // namespace mlaserve
