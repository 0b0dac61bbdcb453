// Explicit instantiation: gate_up projection, 128 activation rows per tile.
#include "kernels/moe/int4_moe_gemm.cuh"

namespace mlaserve::moe_gemm {
template cudaError_t Launch<true, 128>(const Int4MoeGemmParams&, cudaStream_t);
}  // namespace mlaserve::moe_gemm
