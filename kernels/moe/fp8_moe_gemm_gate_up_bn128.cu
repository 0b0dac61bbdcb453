// Explicit instantiation: gate_up projection, 128 activation rows per tile.
#include "kernels/moe/fp8_moe_gemm.cuh"

namespace mlaserve::moe_gemm {
template cudaError_t Launch<true, 128>(const Fp8MoeGemmParams&, cudaStream_t);
}  // namespace mlaserve::moe_gemm
