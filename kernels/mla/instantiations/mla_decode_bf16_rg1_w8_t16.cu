// One instantiation per file so that builds compile them in parallel.
#include "kernels/mla/mla_decode_kernel.cuh"

namespace mlaserve::mla {
MLASERVE_INSTANTIATE_MLA_DECODE_SPLIT(KvCacheFormat::kBf16, 1, 8, 16)
}  // namespace mlaserve::mla
