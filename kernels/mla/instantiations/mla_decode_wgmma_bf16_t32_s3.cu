// One instantiation per file so that builds compile them in parallel.
#include "kernels/mla/mla_decode_wgmma.cuh"

namespace mlaserve::mla {
MLASERVE_INSTANTIATE_MLA_DECODE_WGMMA(KvCacheFormat::kBf16, 32, 3, false)
}  // namespace mlaserve::mla
