// SiLU(gate) · up, CPU reference (DeepSeek's MLPs: down(silu(gate x) * up x)).
#pragma once

#include <cstdint>

namespace mlaserve {

// gate, up, out: [n] (out may alias either).
void SiluMulRef(const float* gate, const float* up, int64_t n, float* out);

}  // namespace mlaserve
