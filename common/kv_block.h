// The paged KV cache's block size, shared by the coordinator's block manager and the workers'
// cache layout (DESIGN.md: 64 tokens a block).
#pragma once

namespace mlaserve {

inline constexpr int kKvBlockTokens = 64;

}  // namespace mlaserve
