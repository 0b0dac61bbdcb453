// Launchers of the NVFP4 grouped GEMMs: pick the instantiation for params.tile_tokens.
#include "kernels/moe/nvfp4_moe_gemm.h"

namespace mlaserve {

int ChooseMoeTileTokens(int tokens, int top_k, int num_experts) {
  const long long rows = static_cast<long long>(tokens) * top_k;
  const long long per_expert = (rows + num_experts - 1) / (num_experts > 0 ? num_experts : 1);
  if (per_expert <= kMoeTileTokensSmall) return kMoeTileTokensSmall;
  if (per_expert <= 2 * kMoeTileTokensMedium) return kMoeTileTokensMedium;
  return kMoeTileTokensLarge;
}

namespace {
template <bool kGateUp>
cudaError_t Dispatch(const Nvfp4MoeGemmParams& p, cudaStream_t stream) {
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

cudaError_t InvokeNvfp4MoeGateUp(const Nvfp4MoeGemmParams& p, cudaStream_t stream) {
  return Dispatch<true>(p, stream);
}
cudaError_t InvokeNvfp4MoeDown(const Nvfp4MoeGemmParams& p, cudaStream_t stream) {
  return Dispatch<false>(p, stream);
}

}  // namespace mlaserve
