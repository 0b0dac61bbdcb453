// Linear layer y = x W^T, CPU reference with fp32 accumulation. W is fp32, bf16 or NVFP4
// (ModelOpt layout, DESIGN.md "Formats"); NVFP4 rows are dequantized exactly
// (e2m1 × e4m3 block scale × global scale) before the dot products.
#pragma once

#include <cstdint>

namespace mlaserve {

struct LinearRefWeight {
  int out_features = 0;
  int in_features = 0;
  const float* f32 = nullptr;              // [out, in], or
  const uint16_t* bf16 = nullptr;          // [out, in], or
  const uint8_t* nvfp4_packed = nullptr;   // [out, in / 2], low nibble = even column
  const uint8_t* nvfp4_scale = nullptr;    // [out, in / 16] e4m3
  float nvfp4_global_scale = 1.0f;         // weight_scale_2
};

// x: [tokens, in]; out: [tokens, out]. Uses up to `threads` threads over output rows.
void LinearRef(const float* x, int64_t tokens, const LinearRefWeight& w, float* out,
               int threads = 1);

}  // namespace mlaserve
