// One instantiation per file so that builds compile them in parallel. This one is the SM120
// two-blocks variant (mla_decode.cc): 2 stages and the in-kernel schedule up to batch 256 leave
// 49,672 B a block, under the 50,176 that two blocks get of SM120's 100 KB.
#include "kernels/mla/mla_decode_sliced.cuh"

namespace mlaserve::mla {
static_assert(
    sliced::Config<KvCacheFormat::kFp8, 32, 2, kSm120InlineScheduleMaxBatch>::kTwoBlocksSm120);
MLASERVE_INSTANTIATE_MLA_DECODE_SLICED(KvCacheFormat::kFp8, 32, 2, kSm120InlineScheduleMaxBatch,
                                       false)
}  // namespace mlaserve::mla
