// One instantiation per file so that builds compile them in parallel.
#include "kernels/mla/mla_decode_tokens.cuh"

namespace mlaserve::mla {
MLASERVE_INSTANTIATE_MLA_DECODE_TOKENS(KvCacheFormat::kFp8Tiled)
}  // namespace mlaserve::mla
