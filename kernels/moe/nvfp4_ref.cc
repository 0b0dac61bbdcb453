#include "kernels/moe/nvfp4_ref.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "common/dtype.h"

namespace mlaserve {
namespace {

void CheckCols(int cols) {
  if (cols % kNvfp4BlockSize != 0) {
    std::fprintf(stderr, "NVFP4: cols %d is not a multiple of %d\n", cols, kNvfp4BlockSize);
    std::abort();
  }
}

}  // namespace

void DequantizeNvfp4(const uint8_t* packed, const uint8_t* block_scale_e4m3, float global_scale,
                     int rows, int cols, float* out) {
  CheckCols(cols);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* prow = packed + static_cast<size_t>(r) * (cols / 2);
    const uint8_t* srow = block_scale_e4m3 + static_cast<size_t>(r) * (cols / kNvfp4BlockSize);
    float* orow = out + static_cast<size_t>(r) * cols;
    for (int c = 0; c < cols; ++c) {
      const uint8_t code = (c % 2 == 0) ? (prow[c / 2] & 0xf) : (prow[c / 2] >> 4);
      const float scale = E4m3ToFloat(srow[c / kNvfp4BlockSize]);
      orow[c] = (E2m1ToFloat(code) * scale) * global_scale;
    }
  }
}

uint8_t ModelOptE2m1Code(float x) {
  // searchsorted(bounds, |x|) counts the bounds strictly below |x|; +1 on an odd bound.
  static constexpr float kBounds[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const uint8_t sign = x < 0 ? 8 : 0;
  const float a = std::fabs(x);
  uint8_t ord = 0;
  for (float b : kBounds) ord += (b < a) ? 1 : 0;
  if (a == 0.75f || a == 1.75f || a == 3.5f) ord += 1;
  return static_cast<uint8_t>(sign | ord);
}

void QuantizeNvfp4(const float* w, int rows, int cols, uint8_t* packed, uint8_t* block_scale,
                   float* global_scale) {
  CheckCols(cols);
  float amax = 0.0f;
  for (size_t i = 0; i < static_cast<size_t>(rows) * cols; ++i)
    amax = std::fmax(amax, std::fabs(w[i]));
  const float gs = amax / (6.0f * 448.0f);
  *global_scale = gs;
  const int nb = cols / kNvfp4BlockSize;
  for (int r = 0; r < rows; ++r) {
    const float* wrow = w + static_cast<size_t>(r) * cols;
    for (int b = 0; b < nb; ++b) {
      const float* blk = wrow + b * kNvfp4BlockSize;
      float bamax = 0.0f;
      for (int i = 0; i < kNvfp4BlockSize; ++i) bamax = std::fmax(bamax, std::fabs(blk[i]));
      uint8_t s8;
      if (gs == 0.0f) {
        s8 = FloatToE4m3(1.0f);
      } else {
        float s = bamax / (6.0f * gs);
        if (s == 0.0f) s = 1.0f;
        s = std::fmax(s, 0x1p-9f);
        s8 = FloatToE4m3(s);
      }
      block_scale[static_cast<size_t>(r) * nb + b] = s8;
      const float denom = E4m3ToFloat(s8) * gs;
      for (int i = 0; i < kNvfp4BlockSize; ++i) {
        const int c = b * kNvfp4BlockSize + i;
        const uint8_t code = gs == 0.0f ? 0 : ModelOptE2m1Code(blk[i] / denom);
        uint8_t& byte = packed[static_cast<size_t>(r) * (cols / 2) + c / 2];
        if (c % 2 == 0) {
          byte = code;
        } else {
          byte = static_cast<uint8_t>(byte | (code << 4));
        }
      }
    }
  }
}

}  // namespace mlaserve
