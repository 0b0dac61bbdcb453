// Explicit instantiation: a dense projection (one weight, no routing), 64 activation rows per tile.
#include "kernels/moe/fp8_moe_gemm.cuh"

namespace mlaserve::moe_gemm {
template cudaError_t LaunchDense<64>(const Fp8MoeGemmParams&, cudaStream_t);
}  // namespace mlaserve::moe_gemm
