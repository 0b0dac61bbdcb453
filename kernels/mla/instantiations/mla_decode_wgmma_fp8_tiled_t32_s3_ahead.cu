// One instantiation per file so that builds compile them in parallel.
#include "kernels/mla/mla_decode_wgmma.cuh"

namespace mlaserve::mla {
MLASERVE_INSTANTIATE_MLA_DECODE_WGMMA(KvCacheFormat::kFp8Tiled, 32, 3, true)
}  // namespace mlaserve::mla
