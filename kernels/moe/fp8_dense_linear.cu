// The dense FP8 projections of fp8_dense_linear.h on the FP8 GEMM's dense mode.
#include "kernels/moe/fp8_dense_linear.h"
#include "kernels/moe/fp8_moe_gemm.h"

namespace mlaserve {

cudaError_t InvokeFp8DenseLinear(const Fp8DenseLinearParams& p, cudaStream_t stream) {
  if (p.m < 0 || p.n <= 0 || p.n > p.n_p || p.n_p % 128 != 0 || p.k_p % 128 != 0 ||
      p.x == nullptr || p.codes == nullptr || p.scales == nullptr || p.out == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (p.m == 0) return cudaSuccess;
  // The smallest tile holding the rows (the weight is streamed once per row tile).
  const int tile = p.m <= kMoeTileTokensSmall    ? kMoeTileTokensSmall
                   : p.m <= kMoeTileTokensMedium ? kMoeTileTokensMedium
                                                 : kMoeTileTokensLarge;
  const int tiles = (p.m + tile - 1) / tile;
  if (tiles > 65535) return cudaErrorInvalidValue;
  Fp8MoeGemmParams g{};
  g.tile_tokens = tile;
  g.programmatic = false;
  g.num_local_experts = 1;
  g.n = p.n_p;
  g.k = p.k_p;
  g.max_tiles = tiles;
  g.a = static_cast<const __nv_bfloat16*>(p.x);
  g.w_codes = p.codes;
  g.w_scales = p.scales;
  g.dense_rows = p.m;
  g.dense_n = p.n;
  g.dense_alpha = p.alpha;
  g.dense_out = static_cast<__nv_bfloat16*>(p.out);
  return InvokeFp8DenseGemm(g, stream);
}

cudaError_t InvokeFp8DenseToBf16(const uint8_t* codes, const uint8_t* scales, int n_p, int k_p,
                                 int n, int k, void* out, cudaStream_t stream) {
  return InvokeFp8TiledToBf16(codes, scales, n_p, k_p, n, k, static_cast<__nv_bfloat16*>(out),
                              stream);
}

}  // namespace mlaserve
