// Prefill key gather (mla_prefill.h, step 1): one warp per output key row. Lane l owns latent
// dims 16 l .. 16 l + 15 (32 lanes x 16 = 512) and rope dims 2 l, 2 l + 1 (32 x 2 = 64), so a row
// is one 32-B read + one 4-B read per lane for bf16 sources and the stores are 2 x 16 B + 4 B.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kernels/mla/mla_prefill.h"

namespace mlaserve {
namespace {

constexpr int kGatherWarps = 8;  // 256 threads per block.

// e4m3 pair -> two fp32, exactly (e4m3 fits f16, f16 fits fp32), then times the scale with an
// IEEE multiply (as KvCacheDecodeRow's fp32 `E4m3ToFloat(x) * scale`) whatever the fast-math
// flags, then RNE to bf16.
__device__ __forceinline__ uint32_t E4m3x2ToBf16x2(uint16_t two, float scale) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat16 lo = __float2bfloat16_rn(__fmul_rn(f.x, scale));
  const __nv_bfloat16 hi = __float2bfloat16_rn(__fmul_rn(f.y, scale));
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

// 16 e4m3 latent values (one uint4) -> 16 bf16 (two uint4).
__device__ __forceinline__ void DecodeE4m3x16(uint4 raw, float scale, uint4& out0, uint4& out1) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = E4m3x2ToBf16x2(static_cast<uint16_t>(w[i] & 0xffffu), scale);
    o[2 * i + 1] = E4m3x2ToBf16x2(static_cast<uint16_t>(w[i] >> 16), scale);
  }
  out0 = make_uint4(o[0], o[1], o[2], o[3]);
  out1 = make_uint4(o[4], o[5], o[6], o[7]);
}

template <KvCacheFormat kFormat>
__global__ void __launch_bounds__(kGatherWarps * 32)
    MlaPrefillGatherKernel(float fp8_scale, const uint8_t* __restrict__ kv_pool,
                           const int32_t* __restrict__ block_table, int max_blocks_per_seq,
                           const int32_t* __restrict__ context_lens,
                           const int32_t* __restrict__ q_begin,
                           const int32_t* __restrict__ kv_begin,
                           const uint16_t* __restrict__ new_latent, int64_t latent_stride,
                           const uint16_t* __restrict__ new_rope, int64_t rope_stride, int num_seqs,
                           int total_kv, uint16_t* __restrict__ out_latent,
                           uint16_t* __restrict__ out_rope) {
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kGatherWarps + (threadIdx.x >> 5);
  if (r >= total_kv) return;
  // The sequence of row r: the last s with kv_begin[s] <= r (empty sequences skipped).
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (kv_begin[mid] <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int s = lo;
  const int t = r - kv_begin[s];
  const int ctx = context_lens[s];
  const int kv_len = kv_begin[s + 1] - kv_begin[s];
  const int n_new = q_begin[s + 1] - q_begin[s];
  uint4 l0, l1;
  uint32_t rope2;
  bool ok = t >= 0 && t < kv_len && ctx >= 0 && kv_len == ctx + n_new;
  if (ok && t < ctx) {
    const int block =
        t / kKvBlockTokens < max_blocks_per_seq
            ? block_table[static_cast<int64_t>(s) * max_blocks_per_seq + t / kKvBlockTokens]
            : -1;
    ok = block >= 0;
    if (ok) {
      constexpr size_t kRowBytes = KvCacheBytesPerToken(kFormat);
      const uint8_t* src =
          kv_pool + (static_cast<int64_t>(block) * kKvBlockTokens + t % kKvBlockTokens) * kRowBytes;
      if constexpr (kFormat == KvCacheFormat::kBf16) {
        l0 = reinterpret_cast<const uint4*>(src)[2 * lane];
        l1 = reinterpret_cast<const uint4*>(src)[2 * lane + 1];
        rope2 = reinterpret_cast<const uint32_t*>(src + 2 * kMlaLatentDim)[lane];
      } else if constexpr (kFormat == KvCacheFormat::kFp8) {
        DecodeE4m3x16(reinterpret_cast<const uint4*>(src)[lane], fp8_scale, l0, l1);
        rope2 =
            E4m3x2ToBf16x2(reinterpret_cast<const uint16_t*>(src + kMlaLatentDim)[lane], fp8_scale);
      } else {  // kFp8Tiled: lane's 16 values lie in tile lane / 8.
        const float scale =
            reinterpret_cast<const float*>(src + kFp8TiledScaleOffset)[lane / (kFp8TileDim / 16)];
        DecodeE4m3x16(reinterpret_cast<const uint4*>(src)[lane], scale, l0, l1);
        rope2 = reinterpret_cast<const uint32_t*>(src + kFp8TiledRopeOffset)[lane];
      }
    }
  } else if (ok) {
    const int64_t row = static_cast<int64_t>(q_begin[s]) + (t - ctx);
    const uint4* src = reinterpret_cast<const uint4*>(new_latent + row * latent_stride);
    l0 = src[2 * lane];
    l1 = src[2 * lane + 1];
    rope2 = reinterpret_cast<const uint32_t*>(new_rope + row * rope_stride)[lane];
  }
  if (!ok) {  // Inconsistent metadata: NaN (bf16 0xffff) makes the attention output visibly bad.
    l0 = l1 = make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
    rope2 = 0xffffffffu;
  }
  uint4* dst = reinterpret_cast<uint4*>(out_latent + static_cast<int64_t>(r) * kMlaLatentDim);
  dst[2 * lane] = l0;
  dst[2 * lane + 1] = l1;
  reinterpret_cast<uint32_t*>(out_rope + static_cast<int64_t>(r) * kMlaRopeDim)[lane] = rope2;
}

absl::Status CudaError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(what) + ": " + cudaGetErrorString(err));
}

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

absl::Status InvokeMlaPrefillGather(const MlaPrefillGatherParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.total_kv < 0 || p.max_blocks_per_seq < 0) {
    return absl::InvalidArgumentError(
        "MLA prefill gather: num_seqs, total_kv and max_blocks_per_seq must be >= 0");
  }
  if (p.total_kv == 0) return absl::OkStatus();
  if (p.num_seqs == 0) {
    return absl::InvalidArgumentError("MLA prefill gather: total_kv > 0 with num_seqs == 0");
  }
  if (p.kv_pool == nullptr || p.block_table == nullptr || p.context_lens == nullptr ||
      p.q_begin == nullptr || p.kv_begin == nullptr || p.new_latent == nullptr ||
      p.new_rope == nullptr || p.out_latent == nullptr || p.out_rope == nullptr) {
    return absl::InvalidArgumentError(
        "MLA prefill gather: kv_pool, block_table, context_lens, q_begin, kv_begin, new_latent, "
        "new_rope, out_latent and out_rope must be set");
  }
  if (!Aligned(p.kv_pool, 16) || !Aligned(p.new_latent, 16) || p.latent_stride % 8 != 0 ||
      !Aligned(p.new_rope, 4) || p.rope_stride % 2 != 0 || !Aligned(p.out_latent, 16) ||
      !Aligned(p.out_rope, 4)) {
    return absl::InvalidArgumentError(
        "MLA prefill gather: kv_pool, new_latent rows (latent_stride % 8 == 0) and out_latent "
        "must be 16-B aligned; new_rope rows (rope_stride % 2 == 0) and out_rope 4-B aligned");
  }
  if (p.format == KvCacheFormat::kF32) {
    return absl::InvalidArgumentError(
        "MLA prefill gather: f32 is the CPU reference's cache format only; use bf16, fp8 or "
        "fp8_tiled");
  }
  if (p.format == KvCacheFormat::kFp8 && !(p.fp8_scale > 0.0f)) {
    return absl::InvalidArgumentError("MLA prefill gather: fp8_scale must be > 0");
  }
  const int grid = (p.total_kv + kGatherWarps - 1) / kGatherWarps;
  const auto* pool = static_cast<const uint8_t*>(p.kv_pool);
  const auto* latent = static_cast<const uint16_t*>(p.new_latent);
  const auto* rope = static_cast<const uint16_t*>(p.new_rope);
  auto* out_latent = static_cast<uint16_t*>(p.out_latent);
  auto* out_rope = static_cast<uint16_t*>(p.out_rope);
#define MLASERVE_GATHER_LAUNCH(FORMAT)                                                   \
  MlaPrefillGatherKernel<FORMAT><<<grid, kGatherWarps * 32, 0, stream>>>(                \
      p.fp8_scale, pool, p.block_table, p.max_blocks_per_seq, p.context_lens, p.q_begin, \
      p.kv_begin, latent, p.latent_stride, rope, p.rope_stride, p.num_seqs, p.total_kv,  \
      out_latent, out_rope)
  switch (p.format) {
    case KvCacheFormat::kBf16:
      MLASERVE_GATHER_LAUNCH(KvCacheFormat::kBf16);
      break;
    case KvCacheFormat::kFp8:
      MLASERVE_GATHER_LAUNCH(KvCacheFormat::kFp8);
      break;
    case KvCacheFormat::kFp8Tiled:
      MLASERVE_GATHER_LAUNCH(KvCacheFormat::kFp8Tiled);
      break;
    case KvCacheFormat::kF32:
      break;
  }
#undef MLASERVE_GATHER_LAUNCH
  return CudaError(cudaGetLastError(), "MLA prefill gather launch");
}

}  // namespace mlaserve
