// Launchers of the BF16 grouped GEMMs (pick the instantiation for params.tile_tokens) and the
// load-time weight relayout into their fragment order.
#include <cuda_runtime.h>

#include "kernels/moe/bf16_moe_gemm.h"
#include "kernels/moe/nvfp4_moe_gemm.h"

namespace mlaserve {
namespace {

template <bool kGateUp>
cudaError_t Dispatch(const Bf16MoeGemmParams& p, cudaStream_t stream) {
  switch (p.tile_tokens) {
    case kMoeTileTokensSmall:
      return bf16_moe_gemm::Launch<kGateUp, kMoeTileTokensSmall>(p, stream);
    case kMoeTileTokensMedium:
      return bf16_moe_gemm::Launch<kGateUp, kMoeTileTokensMedium>(p, stream);
    case kMoeTileTokensLarge:
      return bf16_moe_gemm::Launch<kGateUp, kMoeTileTokensLarge>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// One thread per 16-byte word of the tiled output: lane `lane` of fragment j of chunk (mt, kc)
// (layout: bf16_moe_gemm.h). Elements outside the source (padding) are zero.
__global__ void RelayoutBf16MoeWeightKernel(const Bf16MoeRelayoutParams p) {
  const size_t words = static_cast<size_t>(p.n) * p.k / 8;
  const size_t q = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (q >= words) return;
  const int lane = static_cast<int>(q % 32);
  const int j = static_cast<int>((q / 32) % 4);
  const size_t chunk = q / 128;
  const int chunks_k = p.k / 64;
  const int kc = static_cast<int>(chunk % chunks_k);
  const int mt = static_cast<int>(chunk / chunks_k);
  const int g = lane >> 2, t = lane & 3;
  __align__(16) __nv_bfloat16 v[8];
#pragma unroll
  for (int reg = 0; reg < 4; ++reg) {
    const int rr = g + 8 * (reg & 1);  // row within the 16-row m-tile
    const __nv_bfloat16* src = p.src;
    int row = mt * 16 + rr;
    if (p.up != nullptr) {  // interleaved gate_up: rows 0-7 gate, 8-15 up of features 8mt..+7
      row = mt * 8 + (rr & 7);
      if (rr >= 8) src = p.up;
    }
#pragma unroll
    for (int el = 0; el < 2; ++el) {
      const int col = kc * 64 + j * 16 + (reg >> 1) * 8 + 2 * t + el;
      v[reg * 2 + el] = row < p.src_rows && col < p.src_cols
                            ? src[static_cast<size_t>(row) * p.src_cols + col]
                            : __float2bfloat16_rn(0.0f);
    }
  }
  reinterpret_cast<uint4*>(p.dst)[q] = *reinterpret_cast<const uint4*>(v);
}

}  // namespace

cudaError_t InvokeBf16MoeGateUp(const Bf16MoeGemmParams& p, cudaStream_t stream) {
  return Dispatch<true>(p, stream);
}
cudaError_t InvokeBf16MoeDown(const Bf16MoeGemmParams& p, cudaStream_t stream) {
  return Dispatch<false>(p, stream);
}

cudaError_t InvokeRelayoutBf16MoeWeight(const Bf16MoeRelayoutParams& p, cudaStream_t stream) {
  if (p.src == nullptr || p.dst == nullptr || p.n <= 0 || p.k <= 0 || p.n % 16 != 0 ||
      p.k % 64 != 0 || p.src_rows < 0 || p.src_cols < 0 || p.src_cols > p.k ||
      p.src_rows > (p.up != nullptr ? p.n / 2 : p.n)) {
    return cudaErrorInvalidValue;
  }
  const size_t words = static_cast<size_t>(p.n) * p.k / 8;
  constexpr int kThreads = 256;
  const size_t blocks = (words + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffffu) return cudaErrorInvalidValue;
  RelayoutBf16MoeWeightKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlaserve
