// Explicit instantiation: a dense projection (one weight, no routing), 16 activation rows per tile.
#include "kernels/moe/fp8_moe_gemm.cuh"

namespace mlaserve::moe_gemm {
template cudaError_t LaunchDense<16>(const Fp8MoeGemmParams&, cudaStream_t);
}  // namespace mlaserve::moe_gemm
