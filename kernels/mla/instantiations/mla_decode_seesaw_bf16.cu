// The seesaw kernel's instantiations (bf16 cache; full blocks copied by TMA, a sequence's last,
// partly filled block and the zero block by cp.async), order 0; order 1 is in
// mla_decode_seesaw_bf16_early.cu.
#include "kernels/mla/mla_decode_seesaw.cuh"

namespace mlaserve::mla {
template cudaError_t LaunchMlaDecodeSeesaw<true, 0>(const MlaDecodeKernelParams&, int,
                                                    cudaStream_t);
template int MlaDecodeSeesawBlocksPerSm<true, 0>();
}  // namespace mlaserve::mla
