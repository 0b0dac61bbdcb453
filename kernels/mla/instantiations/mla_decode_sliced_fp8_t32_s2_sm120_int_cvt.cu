// One instantiation per file so that builds compile them in parallel.
#include "kernels/mla/mla_decode_sliced.cuh"

namespace mlaserve::mla {
MLASERVE_INSTANTIATE_MLA_DECODE_SLICED_INT_CVT(KvCacheFormat::kFp8, 32, 2,
                                               kSm120InlineScheduleMaxBatch)
}  // namespace mlaserve::mla
