// compressed-tensors "pack-quantized" INT4 weights (the Kimi-K2 Thinking / K2.5 / K2.6 releases)
// on the host: the project's one definition of the format.
//
// Format, read 2026-12-01 from neuralmagic/compressed-tensors (no code copied):
//  - compressors/quantized_compressors/pack_quantized.py, pack_to_int32 / unpack_from_int32 and
//    PackedQuantizationCompressor.compression_param_info: a [rows, cols] weight is stored as
//      weight_packed  int32 [rows, ceil(cols / 8)]: column c sits in word c / 8 at bits
//                     [4 * (c % 8), 4 * (c % 8) + 4) (the LOWEST nibble holds column 8k), as the
//                     unsigned value q + 8 (signed q in [-8, 7] shifted by 2^(num_bits-1));
//                     padding columns past `cols` are zero nibbles;
//      weight_shape   int32 [2] = (rows, cols);
//      weight_scale   [rows, ceil(cols / group_size)] in the model's dtype (bf16 for Kimi);
//      weight_zero_point only for asymmetric schemes (not accepted here: Kimi is symmetric).
//  - quantization/lifecycle/forward.py, _process_quantization / _dequantize: group strategy,
//    column c uses scale[:, c / group_size]; w = (q - zero_point) * scale, zero_point = 0 when
//    symmetric.
// Kimi's config: config_groups.group_0.weights {num_bits 4, type int, strategy group,
// group_size 32, symmetric true}, format pack-quantized, only the routed experts quantized
// (ignore: lm_head, re:.*self_attn.*, re:.*shared_experts.*,
// re:.*mlp\.(gate|up|gate_up|down)_proj.*).
#pragma once

#include <cstdint>

namespace mlaserve {

inline constexpr int kInt4PerWord = 8;  // int4 codes packed in one int32

// The full tensor: packed [rows, ceil(cols/8)] int32, scale [rows, ceil(cols/group_size)] fp32
// (a bf16 or fp16 checkpoint scale widened exactly).
struct Int4GroupTensor {
  const int32_t* packed = nullptr;
  const float* scale = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int group_size = 32;
};

// out[r][c] = q(row0 + r, col0 + c) * scale(row0 + r, (col0 + c) / group_size) for the window
// [row0, row0 + nrows) x [col0, col0 + ncols) of `w`. |q| <= 8 (4 bits) times a bf16 scale (8
// significant bits) has at most 12 significant bits: exact in fp32.
void DequantizeInt4Group(const Int4GroupTensor& w, int64_t row0, int64_t nrows, int64_t col0,
                         int64_t ncols, float* out /*[nrows, ncols]*/);

}  // namespace mlaserve
