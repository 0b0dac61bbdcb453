// One instantiation per file so that builds compile them in parallel. This one keeps q's
// fragments in shared memory (kQSmem): 2 stages, 69,128 B a block, 3 blocks an H100 / H200 SM.
#include "kernels/mla/mla_decode_sliced.cuh"

namespace mlaserve::mla {
static_assert(
    sliced::Config<KvCacheFormat::kFp8, 32, 2, kInlineScheduleMaxBatch, false, true>::kMinBlocks ==
    3);
MLASERVE_INSTANTIATE_MLA_DECODE_SLICED(KvCacheFormat::kFp8, 32, 2, kInlineScheduleMaxBatch, false,
                                       true)
}  // namespace mlaserve::mla
