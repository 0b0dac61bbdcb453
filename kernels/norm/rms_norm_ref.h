// RMSNorm, CPU reference: y = w * x / sqrt(mean(x^2) + eps), per row, fp32 throughout
// (transformers' DeepseekV3RMSNorm computes the variance in fp32 the same way).
#pragma once

#include <cstdint>

namespace mlaserve {

// x, out: [rows, dim] (may alias); weight: [dim].
void RmsNormRef(const float* x, const float* weight, int64_t rows, int dim, float eps, float* out);

}  // namespace mlaserve
