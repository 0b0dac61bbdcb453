// Launchers of the INT4 grouped GEMMs: pick the instantiation for params.tile_tokens.
#include "kernels/moe/int4_moe_gemm.h"

namespace mlaserve {
namespace {
template <bool kGateUp>
cudaError_t Dispatch(const Int4MoeGemmParams& p, cudaStream_t stream) {
  switch (p.tile_tokens) {
    case kMoeTileTokensSmall:
      return moe_gemm::Launch<kGateUp, kMoeTileTokensSmall>(p, stream);
    case kMoeTileTokensMedium:
      return moe_gemm::Launch<kGateUp, kMoeTileTokensMedium>(p, stream);
    case kMoeTileTokensLarge:
      return moe_gemm::Launch<kGateUp, kMoeTileTokensLarge>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}
}  // namespace

cudaError_t InvokeInt4MoeGateUp(const Int4MoeGemmParams& p, cudaStream_t stream) {
  return Dispatch<true>(p, stream);
}
cudaError_t InvokeInt4MoeDown(const Int4MoeGemmParams& p, cudaStream_t stream) {
  return Dispatch<false>(p, stream);
}

}  // namespace mlaserve
