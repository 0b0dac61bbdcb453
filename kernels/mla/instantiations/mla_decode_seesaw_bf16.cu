// The seesaw kernel's instantiation (bf16 cache; full blocks copied by TMA, a sequence's last,
// partly filled block and the zero block by cp.async).
#include "kernels/mla/mla_decode_seesaw.cuh"

namespace mlaserve::mla {
template cudaError_t LaunchMlaDecodeSeesaw<true>(const MlaDecodeKernelParams&, int, cudaStream_t);
template int MlaDecodeSeesawBlocksPerSm<true>();
}  // namespace mlaserve::mla
