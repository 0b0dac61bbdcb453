// Explicit instantiation: gate_up projection, 64 activation rows per tile.
#include "kernels/moe/int4_moe_gemm.cuh"

namespace mlaserve::moe_gemm {
template cudaError_t Launch<true, 64>(const Int4MoeGemmParams&, cudaStream_t);
}  // namespace mlaserve::moe_gemm
