// The fused few-expert layer (moe_few_expert_layer.h) for NVFP4 experts, and where it applies.
#include "kernels/moe/moe_few_expert_layer.cuh"
#include "kernels/moe/nvfp4_moe_gemm.cuh"

namespace mlaserve {

bool FewExpertLayerApplies(int tokens, int top_k, int hidden, int intermediate) {
  if (tokens < 1 || tokens > kFewExpertLayerMaxTokens || top_k < 1 ||
      tokens * top_k > kFewExpertLayerMaxRows || hidden <= 0 || intermediate <= 0 ||
      hidden % 128 != 0 || intermediate % 128 != 0) {
    return false;
  }
  return moe_gemm::FewExpertLayerSmemLayout(hidden, intermediate).total <=
         moe_gemm::kFewExpertMaxSmemBytes;
}

cudaError_t InvokeFewExpertLayer(const Nvfp4MoeGemmParams& gate_up, const Nvfp4MoeGemmParams& down,
                                 const FewExpertLayerArgs& args, cudaStream_t stream) {
  return moe_gemm::LaunchFewExpertLayer<moe_gemm::Nvfp4Format>(gate_up, down, args, stream);
}

}  // namespace mlaserve
