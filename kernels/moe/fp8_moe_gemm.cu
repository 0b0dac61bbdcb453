// Launchers of the FP8 grouped and dense GEMMs: pick the instantiation for params.tile_tokens; the
// tiled -> bf16 conversion for large dense row counts.
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

cudaError_t DispatchDense(const Fp8MoeGemmParams& p, cudaStream_t stream) {
  switch (p.tile_tokens) {
    case kMoeTileTokensSmall:
      return moe_gemm::LaunchDense<kMoeTileTokensSmall>(p, stream);
    case kMoeTileTokensMedium:
      return moe_gemm::LaunchDense<kMoeTileTokensMedium>(p, stream);
    case kMoeTileTokensLarge:
      return moe_gemm::LaunchDense<kMoeTileTokensLarge>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// One thread per e4m3 pair (2 bytes of a chunk): its row and columns from the byte's place
// (fp8_moe_layout.h: byte 512 h + 16 lane + 8 (j % 2) + 2 reg + elem of chunk (mt, kc)).
__global__ void Fp8TiledToBf16Kernel(const uint8_t* __restrict__ codes,
                                     const float* __restrict__ scales, int cols_p, int rows,
                                     int cols, size_t pairs, __nv_bfloat16* __restrict__ out) {
  const int kchunks = cols_p / kFp8TileCols;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t chunk = i / (kFp8ChunkCodeBytes / 2);
    const int b = static_cast<int>(i % (kFp8ChunkCodeBytes / 2)) * 2;  // the pair's first byte
    const int h = b / 512, lane = (b % 512) / 16, jj = (b % 16) / 8, reg = (b % 8) / 2;
    const int j = 2 * h + jj, g = lane / 4, t = lane % 4;
    const int rr = g + 8 * (reg & 1), cc = 16 * j + 2 * t + 8 * (reg >> 1);
    const int mt = static_cast<int>(chunk / kchunks), kc = static_cast<int>(chunk % kchunks);
    const int r = 16 * mt + rr, c = 64 * kc + cc;
    if (r >= rows || c >= cols) continue;
    const uint32_t pair = codes[chunk * kFp8ChunkCodeBytes + b] |
                          (static_cast<uint32_t>(codes[chunk * kFp8ChunkCodeBytes + b + 1]) << 8);
    const uint32_t v = Fp8PairToBf16(pair, scales[chunk * 2 + rr / 8]);
    __nv_bfloat16* o = out + static_cast<size_t>(r) * cols + c;
    o[0] = __ushort_as_bfloat16(static_cast<unsigned short>(v & 0xffffu));
    if (c + 1 < cols) o[1] = __ushort_as_bfloat16(static_cast<unsigned short>(v >> 16));
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

cudaError_t InvokeFp8DenseGemm(const Fp8MoeGemmParams& p, cudaStream_t stream) {
  if (p.num_local_experts != 1 || p.dense_rows < 0 || p.dense_n <= 0 || p.dense_n > p.n ||
      p.tile_tokens <= 0 || p.a == nullptr || p.dense_out == nullptr ||
      p.max_tiles != (p.dense_rows + p.tile_tokens - 1) / p.tile_tokens) {
    return cudaErrorInvalidValue;
  }
  if (p.dense_rows == 0) return cudaSuccess;
  return DispatchDense(p, stream);
}

cudaError_t InvokeFp8TiledToBf16(const uint8_t* codes, const uint8_t* scales, int rows_p,
                                 int cols_p, int rows, int cols, __nv_bfloat16* out,
                                 cudaStream_t stream) {
  if (rows_p % kFp8TileRows != 0 || cols_p % kFp8TileCols != 0 || rows > rows_p || cols > cols_p ||
      rows < 0 || cols < 0) {
    return cudaErrorInvalidValue;
  }
  const size_t pairs = static_cast<size_t>(rows_p) * cols_p / 2;
  if (pairs == 0 || rows == 0 || cols == 0) return cudaSuccess;
  const size_t blocks = (pairs + 255) / 256 < 8192 ? (pairs + 255) / 256 : 8192;
  Fp8TiledToBf16Kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      codes, reinterpret_cast<const float*>(scales), cols_p, rows, cols, pairs, out);
  return cudaGetLastError();
}

cudaError_t InvokeFp8PairDecodeCheck(const uint32_t* codes, const float* scales, uint32_t* out,
                                     int n, cudaStream_t stream) {
  if (n <= 0) return n == 0 ? cudaSuccess : cudaErrorInvalidValue;
  const int blocks = (n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024;
  Fp8PairDecodeCheckKernel<<<blocks, 256, 0, stream>>>(codes, scales, out, n);
  return cudaGetLastError();
}

}  // namespace mlaserve
