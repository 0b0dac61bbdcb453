// Explicit instantiation: gate_up projection, 16 activation rows per tile.
#include "kernels/moe/nvfp4_moe_gemm.cuh"

namespace mlaserve::moe_gemm {
template cudaError_t Launch<true, 16>(const Nvfp4MoeGemmParams&, cudaStream_t);
}  // namespace mlaserve::moe_gemm
