// The fused few-expert layer (moe_few_expert_layer.h) for INT4 experts.
#include "kernels/moe/int4_moe_gemm.cuh"
#include "kernels/moe/moe_few_expert_layer.cuh"

namespace mlaserve {

cudaError_t InvokeFewExpertLayer(const Int4MoeGemmParams& gate_up, const Int4MoeGemmParams& down,
                                 const FewExpertLayerArgs& args, cudaStream_t stream) {
  return moe_gemm::LaunchFewExpertLayer<moe_gemm::Int4Format>(gate_up, down, args, stream);
}

}  // namespace mlaserve
