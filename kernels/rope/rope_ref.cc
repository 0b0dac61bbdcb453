#include "kernels/rope/rope_ref.h"

#include <cmath>
#include <vector>

namespace mlaserve {

void RopeRef(float* x, int64_t rows, int64_t row_stride, int per_pos, const int32_t* positions,
             const float* inv_freq, int dim, float attention_scaling, bool interleaved) {
  const int half = dim / 2;
  std::vector<float> tmp(dim);
  for (int64_t r = 0; r < rows; ++r) {
    float* v = x + r * row_stride;
    const float pos = static_cast<float>(positions[r / per_pos]);
    for (int i = 0; i < half; ++i) {
      const float angle = inv_freq[i] * pos;
      const float c = std::cos(angle) * attention_scaling;
      const float s = std::sin(angle) * attention_scaling;
      const float x0 = interleaved ? v[2 * i] : v[i];
      const float x1 = interleaved ? v[2 * i + 1] : v[i + half];
      tmp[i] = x0 * c - x1 * s;
      tmp[i + half] = x1 * c + x0 * s;
    }
    for (int i = 0; i < dim; ++i) v[i] = tmp[i];
  }
}

}  // namespace mlaserve
