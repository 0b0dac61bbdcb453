// The seesaw kernel in FlashMLA's order as 2-block clusters (kPair, mla_decode_seesaw.cuh): the
// two row tiles of a 128-head worker copy each cache block once, multicast into both blocks.
#include "kernels/mla/mla_decode_seesaw.cuh"

namespace mlaserve::mla {
template cudaError_t LaunchMlaDecodeSeesaw<true, 1, true>(const MlaDecodeKernelParams&, int,
                                                          cudaStream_t);
template int MlaDecodeSeesawBlocksPerSm<true, 1, true>();
template int MlaDecodeSeesawPairBlocks<true, 1, true>();
}  // namespace mlaserve::mla
