#include "kernels/activation/silu_mul_ref.h"

#include <cmath>

namespace mlaserve {

void SiluMulRef(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

}  // namespace mlaserve
