// Launchers of the FP8 grouped GEMMs: pick the instantiation for params.tile_tokens.
#include "kernels/moe/fp8_moe_gemm.h"
#include "kernels/moe/fp8_moe_layout.h"

namespace mlaserve {
namespace {
template <bool kGateUp>
cudaError_t Dispatch(const Fp8MoeGemmParams& p, cudaStream_t stream) {
  switch (p.tile_tokens) {
    case kMoeTileTokensSmall:
      return moe_gemm::Launch<kGateUp, kMoeTileTokensSmall>(p, stream);
    case kMoeTileTokensMedium:
      return moe_gemm::Launch<kGateUp, kMoeTileTokensMedium>(p, stream);
    case kMoeTileTokensLarge:
      return moe_gemm::Launch<kGateUp, kMoeTileTokensLarge>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

__global__ void Fp8PairDecodeCheckKernel(const uint32_t* __restrict__ codes,
                                         const float* __restrict__ scales,
                                         uint32_t* __restrict__ out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = Fp8PairToBf16(codes[i] & 0xffffu, scales[i]);
  }
}
}  // namespace

cudaError_t InvokeFp8MoeGateUp(const Fp8MoeGemmParams& p, cudaStream_t stream) {
  return Dispatch<true>(p, stream);
}
cudaError_t InvokeFp8MoeDown(const Fp8MoeGemmParams& p, cudaStream_t stream) {
  return Dispatch<false>(p, stream);
}

cudaError_t InvokeFp8PairDecodeCheck(const uint32_t* codes, const float* scales, uint32_t* out,
                                     int n, cudaStream_t stream) {
  if (n <= 0) return n == 0 ? cudaSuccess : cudaErrorInvalidValue;
  const int blocks = (n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024;
  Fp8PairDecodeCheckKernel<<<blocks, 256, 0, stream>>>(codes, scales, out, n);
  return cudaGetLastError();
}

}  // namespace mlaserve
