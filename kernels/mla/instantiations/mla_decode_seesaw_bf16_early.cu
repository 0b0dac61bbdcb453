// The seesaw kernel in FlashMLA's order (kOrder 1, mla_decode_seesaw.cuh): bf16 cache, full
// blocks copied by TMA. A translation unit of its own so that the two orders compile in parallel.
#include "kernels/mla/mla_decode_seesaw.cuh"

namespace mlaserve::mla {
template cudaError_t LaunchMlaDecodeSeesaw<true, 1>(const MlaDecodeKernelParams&, int,
                                                    cudaStream_t);
template int MlaDecodeSeesawBlocksPerSm<true, 1>();
}  // namespace mlaserve::mla
