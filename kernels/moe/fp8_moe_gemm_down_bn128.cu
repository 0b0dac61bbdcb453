// Explicit instantiation: down projection, 128 activation rows per tile.
#include "kernels/moe/fp8_moe_gemm.cuh"

namespace mlaserve::moe_gemm {
template cudaError_t Launch<false, 128>(const Fp8MoeGemmParams&, cudaStream_t);
}  // namespace mlaserve::moe_gemm
