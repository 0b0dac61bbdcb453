// Explicit instantiation: down projection, 16 activation rows per tile.
#include "kernels/moe/int4_moe_gemm.cuh"

namespace mlaserve::moe_gemm {
template cudaError_t Launch<false, 16>(const Int4MoeGemmParams&, cudaStream_t);
}  // namespace mlaserve::moe_gemm
