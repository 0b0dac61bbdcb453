// Linear layer y = x W^T, CPU reference with fp32 accumulation. W is fp32, bf16 or NVFP4
// (ModelOpt layout, DESIGN.md "Formats"); NVFP4 rows are dequantized exactly
// (e2m1 × e4m3 block scale × global scale) before the dot products.
#pragma once

#include <cstdint>

namespace mlaserve {

struct LinearRefWeight {
  int out_features = 0;
  int in_features = 0;
  const float* f32 = nullptr;             // [out, in], or
  const uint16_t* bf16 = nullptr;         // [out, in], or
  const uint8_t* nvfp4_packed = nullptr;  // [out, in / 2], low nibble = even column
  const uint8_t* nvfp4_scale = nullptr;   // [out, in / 16] e4m3
  float nvfp4_global_scale = 1.0f;        // weight_scale_2
};

// x: [tokens, in]; out: [tokens, out]. Uses up to `threads` threads over output rows.
void LinearRef(const float* x, int64_t tokens, const LinearRefWeight& w, float* out,
               int threads = 1);

// bf16 bits of e2m1(code) * e4m3(block_scale), WITHOUT the global scale (weight_scale_2): the
// product has at most 2 + 4 significant bits and lies in [2^-10, 2688], so it is exact in bf16,
// and a bf16 GEMM on these values with alpha = weight_scale_2 computes the NVFP4 projection
// (non-expert NVFP4 weights on the GPU, kernels/linear/linear.h). A NaN scale (e4m3 0x7f, 0xff)
// gives NaN. cols must be a multiple of 16 (kNvfp4BlockSize).
void DequantizeNvfp4ToBf16Unscaled(const uint8_t* packed /*[rows, cols/2]*/,
                                   const uint8_t* scale_e4m3 /*[rows, cols/16]*/, int64_t rows,
                                   int64_t cols, uint16_t* out_bf16 /*[rows, cols]*/);

}  // namespace mlaserve
