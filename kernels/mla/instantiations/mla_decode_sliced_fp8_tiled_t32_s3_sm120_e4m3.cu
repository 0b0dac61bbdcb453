// One instantiation per file so that builds compile them in parallel. The SM120 e4m3 q.k variant
// for fp8_tiled (mla_decode.cc): one block an SM120 SM, 3 stages.
#include "kernels/mla/mla_decode_sliced.cuh"

namespace mlaserve::mla {
MLASERVE_INSTANTIATE_MLA_DECODE_SLICED(KvCacheFormat::kFp8Tiled, 32, 3,
                                       kSm120InlineScheduleMaxBatch, true)
}  // namespace mlaserve::mla
