// Explicit instantiation: BF16 fused gate+up projection, 64 activation rows per tile.
#include "kernels/moe/bf16_moe_gemm.cuh"

namespace mlaserve::bf16_moe_gemm {
template cudaError_t Launch<true, 64>(const Bf16MoeGemmParams&, cudaStream_t);
}  // namespace mlaserve::bf16_moe_gemm
