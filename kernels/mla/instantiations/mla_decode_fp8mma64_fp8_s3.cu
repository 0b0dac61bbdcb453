// One instantiation per file so that builds compile them in parallel.
#include "kernels/mla/mla_decode_fp8mma64.cuh"

namespace mlaserve::mla {
MLASERVE_INSTANTIATE_MLA_DECODE_FP8MMA64(KvCacheFormat::kFp8, 3)
}  // namespace mlaserve::mla
