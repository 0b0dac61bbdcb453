// One instantiation per file so that builds compile them in parallel.
#include "kernels/mla/mla_decode_fp8mma.cuh"

namespace mlaserve::mla {
MLASERVE_INSTANTIATE_MLA_DECODE_FP8MMA(KvCacheFormat::kFp8Tiled, 4)
}  // namespace mlaserve::mla
