#include "kernels/norm/rms_norm_ref.h"

#include <cmath>

namespace mlaserve {

void RmsNormRef(const float* x, const float* weight, int64_t rows, int dim, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = out + r * dim;
    double sum = 0.0;
    for (int i = 0; i < dim; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(sum / dim) + eps);
    for (int i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
}

}  // namespace mlaserve
