// The fused few-expert layer (moe_few_expert_layer.h) for FP8 experts.
#include "kernels/moe/fp8_moe_gemm.cuh"
#include "kernels/moe/moe_few_expert_layer.cuh"

namespace mlaserve {

cudaError_t InvokeFewExpertLayer(const Fp8MoeGemmParams& gate_up, const Fp8MoeGemmParams& down,
                                 const FewExpertLayerArgs& args, cudaStream_t stream) {
  return moe_gemm::LaunchFewExpertLayer<moe_gemm::Fp8Format>(gate_up, down, args, stream);
}

}  // namespace mlaserve
