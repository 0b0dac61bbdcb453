// One instantiation per file so that builds compile them in parallel. The SM120 e4m3 q.k variant
// for fp8 (mla_decode.cc): two blocks an SM120 SM, as mla_decode_sliced_fp8_t32_s2_sm120.cu.
#include "kernels/mla/mla_decode_sliced.cuh"

namespace mlaserve::mla {
static_assert(sliced::Config<KvCacheFormat::kFp8, 32, 2, kSm120InlineScheduleMaxBatch,
                             true>::kTwoBlocksSm120);
MLASERVE_INSTANTIATE_MLA_DECODE_SLICED(KvCacheFormat::kFp8, 32, 2, kSm120InlineScheduleMaxBatch,
                                       true)
}  // namespace mlaserve::mla
