// Explicit instantiation: BF16 fused gate+up projection, 16 activation rows per tile.
#include "kernels/moe/bf16_moe_gemm.cuh"

namespace mlaserve::bf16_moe_gemm {
template cudaError_t Launch<true, 16>(const Bf16MoeGemmParams&, cudaStream_t);
}  // namespace mlaserve::bf16_moe_gemm
