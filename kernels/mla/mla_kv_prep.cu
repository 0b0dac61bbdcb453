// The fused MLA input kernel (mla_kv_prep.h). Compiled without --use_fast_math (its own library):
// cosf and sinf stay accurate at positions up to 160k, as in kernels/rope.
#include "kernels/mla/mla_kv_prep.h"

#include <cuda_bf16.h>

#include <limits>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/mla/kv_cache_write.cuh"
#include "kernels/programmatic_launch.cuh"

namespace mlaserve {
namespace {

constexpr int kPrepWarps = 4;

__device__ __forceinline__ float Lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float Hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ uint32_t Bf16Bits(float v) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
}

// q's RoPE, one warp a vector v (row v / q_heads, head v % q_heads): RopeKernel's operations
// for dim 64 (lane i rotates pair i; every lane reads before any writes).
__device__ __forceinline__ void RotateQ(const MlaKvPrepParams& p, int64_t v, int lane) {
  if (v >= p.rows * p.q_heads) return;  // whole warps
  const int64_t row = v / p.q_heads;
  const int j = static_cast<int>(v % p.q_heads);
  __nv_bfloat16* vec = static_cast<__nv_bfloat16*>(p.q) + row * p.q_row_stride + p.q_first_col +
                       j * p.q_vec_stride;
  constexpr int kHalf = kMlaRopeDim / 2;
  const int i = lane;
  const float x0 = __bfloat162float(vec[p.interleaved ? 2 * i : i]);
  const float x1 = __bfloat162float(vec[p.interleaved ? 2 * i + 1 : i + kHalf]);
  __syncwarp();
  const float pos = static_cast<float>(p.positions[row]);
  const float angle = __fmul_rn(p.inv_freq[i], pos);
  const float c = __fmul_rn(cosf(angle), p.attention_scaling);
  const float s = __fmul_rn(sinf(angle), p.attention_scaling);
  vec[i] = __float2bfloat16_rn(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));
  vec[i + kHalf] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s)));
}

// q's absorption (MlaKvPrepParams::w_kb), block `idx` of them: head j = idx / 16, output
// columns 32 (idx % 16) .. + 31. Lane l of warp g takes column pair l % 16 and k group 2 g + l / 16
// (k = kg, kg + 8, ...); its kRows rows' sums (rows past p.rows compute on zeros) meet those of
// the other half-warp by a shuffle, then warps 1-3 hand theirs to warp 0 through shared memory,
// which adds them in warp order and rounds. kRows is the step's row count rounded up to 1, 2 or 4.
// Measured against cuBLASLt's absorption on the H200 (bench/RESULTS.md, session 13): a first
// version (64-column blocks, 32 k a thread, every row guarded in an unrolled 16-row loop) ran
// ~2,200 instructions a warp at one warp a scheduler: 15-23 us in ncu against nvjet's 3.5-4.1,
// and the 16-layer Kimi shard's batch-1 step 1.28 -> 1.39-1.58 ms. The work a warp is what
// sets the time here, so this form keeps it near 100 instructions at one row.
constexpr int kAbsorbCols = 32;                              // output columns a block
constexpr int kAbsorbKGroups = 2 * kPrepWarps;               // k groups a block
constexpr int kAbsorbK = kMlaPrepAbsorbMaxNope / kAbsorbKGroups;  // W_kb words a thread

template <int kRows>
__device__ __forceinline__ void AbsorbQ(const MlaKvPrepParams& p, unsigned idx) {
  constexpr int kChunks = kMlaLatentDim / kAbsorbCols;
  __shared__ float qs[kRows * kMlaPrepAbsorbMaxNope];
  __shared__ float2 part[kPrepWarps - 1][kRows][16];
  const int j = static_cast<int>(idx / kChunks), chunk = static_cast<int>(idx % kChunks);
  const int rows = static_cast<int>(p.rows), nope = p.absorb_nope;
  const int tid = threadIdx.x, lane = tid & 31, g = tid >> 5;
  const int pair = lane & 15, kg = 2 * g + (lane >> 4);
  // W_kb first (every load in flight at once), then q's nope values of head j (zeros past rows).
  const uint32_t* w = static_cast<const uint32_t*>(p.w_kb) +
                      (static_cast<size_t>(j) * nope * kMlaLatentDim + chunk * kAbsorbCols) / 2 +
                      pair;
  uint32_t wv[kAbsorbK];
#pragma unroll
  for (int i = 0; i < kAbsorbK; ++i) {
    const int k = kg + kAbsorbKGroups * i;
    wv[i] = k < nope ? __ldg(w + static_cast<size_t>(k) * (kMlaLatentDim / 2)) : 0u;
  }
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(p.q);
  for (int i = tid; i < kRows * nope; i += kPrepWarps * 32) {
    const int r = i / nope, k = i % nope;
    qs[i] = r < rows ? __bfloat162float(q[r * p.q_row_stride + j * p.q_vec_stride + k]) : 0.0f;
  }
  __syncthreads();
  float2 acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = make_float2(0.0f, 0.0f);
#pragma unroll
  for (int i = 0; i < kAbsorbK; ++i) {
    const int k = kg + kAbsorbKGroups * i;
    if (k < nope) {
      const float w0 = Lo(wv[i]), w1 = Hi(wv[i]);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float x = qs[r * nope + k];
        acc[r].x = fmaf(x, w0, acc[r].x);
        acc[r].y = fmaf(x, w1, acc[r].y);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    acc[r].x += __shfl_xor_sync(0xffffffffu, acc[r].x, 16);
    acc[r].y += __shfl_xor_sync(0xffffffffu, acc[r].y, 16);
  }
  if (g > 0 && lane < 16) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) part[g - 1][r][lane] = acc[r];
  }
  __syncthreads();
  if (g > 0 || lane >= 16) return;
  uint32_t* out = static_cast<uint32_t*>(p.q_abs);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r < rows) {
      float2 v = acc[r];
#pragma unroll
      for (int o = 0; o < kPrepWarps - 1; ++o) {
        v.x += part[o][r][lane].x;
        v.y += part[o][r][lane].y;
      }
      const size_t at =
          (static_cast<size_t>(r) * p.q_heads + j) * kMlaQkDim + chunk * kAbsorbCols;
      out[at / 2 + lane] = Bf16Bits(v.x) | (Bf16Bits(v.y) << 16);
    }
  }
}

// One warp per row. Lane l holds latent dims 16 l .. 16 l + 15 and rope dims 2 l, 2 l + 1 (the
// cache write's layout, kv_cache_write.cuh) and rotates rope pair l. Blocks from kv_blocks on
// rotate q's vectors (RotateQ), and from absorb_begin on absorb q (AbsorbQ<kAbsorbRows>; 0: no
// absorption blocks).
template <KvCacheFormat kFormat, int kAbsorbRows>
__global__ void __launch_bounds__(kPrepWarps * 32)
    MlaKvPrepKernel(const MlaKvPrepParams p, const unsigned kv_blocks,
                    const unsigned absorb_begin) {
  pdl::WaitForPrerequisiteGrid();  // launched programmatically: nothing is read before this
  pdl::AllowDependentLaunch();
  const int lane = threadIdx.x & 31;
  if constexpr (kAbsorbRows > 0) {
    if (blockIdx.x >= absorb_begin) {
      AbsorbQ<kAbsorbRows>(p, blockIdx.x - absorb_begin);
      return;
    }
  }
  if (blockIdx.x >= kv_blocks) {
    RotateQ(p, static_cast<int64_t>(blockIdx.x - kv_blocks) * kPrepWarps + (threadIdx.x >> 5),
            lane);
    return;
  }
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kPrepWarps + (threadIdx.x >> 5);
  if (r >= p.rows) return;  // whole warps
  const uint16_t* row = static_cast<const uint16_t*>(p.kv) + r * p.kv_stride;
  const uint4* lat = reinterpret_cast<const uint4*>(row) + 2 * lane;
  const uint4 in0 = lat[0], in1 = lat[1];
  const uint32_t rope_in = reinterpret_cast<const uint32_t*>(row + kMlaLatentDim)[lane];

  // RmsNorm of the latent: RmsNormRef's operations (sum of squares in fp32, 1 / sqrt(mean + eps)
  // with IEEE division and square root, weight * (x * inv), one bf16 rounding).
  const uint32_t w_in[8] = {in0.x, in0.y, in0.z, in0.w, in1.x, in1.y, in1.z, in1.w};
  float x[16];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[2 * i] = Lo(w_in[i]);
    x[2 * i + 1] = Hi(w_in[i]);
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) sum = __fadd_rn(sum, __fmul_rn(x[i], x[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, o));
  const float inv =
      __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum, static_cast<float>(kMlaLatentDim)),
                                           p.eps)));
  const float4* wv = reinterpret_cast<const float4*>(p.norm_weight) + 4 * lane;
  uint32_t w_out[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 w = wv[i];
    w_out[2 * i] = Bf16Bits(__fmul_rn(w.x, __fmul_rn(x[4 * i], inv))) |
                   (Bf16Bits(__fmul_rn(w.y, __fmul_rn(x[4 * i + 1], inv))) << 16);
    w_out[2 * i + 1] = Bf16Bits(__fmul_rn(w.z, __fmul_rn(x[4 * i + 2], inv))) |
                       (Bf16Bits(__fmul_rn(w.w, __fmul_rn(x[4 * i + 3], inv))) << 16);
  }
  const uint4 out0 = make_uint4(w_out[0], w_out[1], w_out[2], w_out[3]);
  const uint4 out1 = make_uint4(w_out[4], w_out[5], w_out[6], w_out[7]);
  uint4* lat_out = reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.latent_out) +
                                            r * kMlaLatentDim) +
                   2 * lane;
  lat_out[0] = out0;
  lat_out[1] = out1;

  // RoPE of pair `lane` (RopeKernel's operations): x0, x1 from dims (2 l, 2 l + 1) interleaved or
  // (l, l + 32); outputs to dims l and l + 32.
  float x0, x1;
  if (p.interleaved) {
    x0 = Lo(rope_in);
    x1 = Hi(rope_in);
  } else {
    const uint32_t a = __shfl_sync(0xffffffffu, rope_in, lane >> 1);
    const uint32_t b = __shfl_sync(0xffffffffu, rope_in, 16 + (lane >> 1));
    x0 = (lane & 1) ? Hi(a) : Lo(a);
    x1 = (lane & 1) ? Hi(b) : Lo(b);
  }
  const float pos = static_cast<float>(p.positions[r]);
  const float angle = __fmul_rn(p.inv_freq[lane], pos);
  const float c = __fmul_rn(cosf(angle), p.attention_scaling);
  const float s = __fmul_rn(sinf(angle), p.attention_scaling);
  const uint32_t lo = Bf16Bits(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));  // dim lane
  const uint32_t hi = Bf16Bits(__fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s)));  // dim lane + 32
  // Lane l stores dims 2 l, 2 l + 1: from lanes 2 l, 2 l + 1's lo (l < 16) or 2 l - 32, 2 l - 31's
  // hi.
  const int src0 = (2 * lane) & 31, src1 = (2 * lane + 1) & 31;
  const uint32_t lo0 = __shfl_sync(0xffffffffu, lo, src0), lo1 = __shfl_sync(0xffffffffu, lo, src1);
  const uint32_t hi0 = __shfl_sync(0xffffffffu, hi, src0), hi1 = __shfl_sync(0xffffffffu, hi, src1);
  const uint32_t rope_out = lane < 16 ? (lo0 | (lo1 << 16)) : (hi0 | (hi1 << 16));
  reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.rope_out) + r * kMlaRopeDim)[lane] =
      rope_out;

  const int64_t slot = p.slots[r];
  if (slot < 0) return;  // the same for every lane of the warp
  constexpr size_t kRowBytes = KvCacheBytesPerToken(kFormat);
  uint8_t* dst = static_cast<uint8_t*>(p.kv_pool) + static_cast<size_t>(slot) * kRowBytes;
  mla::StoreKvRow<kFormat>(lane, out0, out1, rope_out, p.fp8_scale, dst);
}

bool Aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

}  // namespace

absl::Status InvokeMlaKvPrep(const MlaKvPrepParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.rows > (int64_t{1} << 31) * kPrepWarps) {
    return absl::InvalidArgumentError(absl::StrCat("InvokeMlaKvPrep: rows ", p.rows, " out of range"));
  }
  if (p.rows == 0) return absl::OkStatus();
  if (p.kv == nullptr || p.norm_weight == nullptr || p.positions == nullptr ||
      p.inv_freq == nullptr || p.latent_out == nullptr || p.rope_out == nullptr ||
      p.slots == nullptr || p.kv_pool == nullptr) {
    return absl::InvalidArgumentError("InvokeMlaKvPrep: every pointer must be set");
  }
  const int64_t need = kMlaLatentDim + kMlaRopeDim;
  if (p.kv_stride < need || p.kv_stride % 8 != 0 || !Aligned(p.kv, 16) ||
      !Aligned(p.latent_out, 16) || !Aligned(p.rope_out, 4) || !Aligned(p.norm_weight, 16)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InvokeMlaKvPrep: kv rows must be 16-byte aligned with a stride >= ", need,
        " and a multiple of 8 (got ", p.kv_stride, "), latent_out 16- and rope_out 4-byte aligned"));
  }
  int64_t q_blocks = 0;
  if (p.q != nullptr) {
    const int64_t extent = p.q_first_col + (p.q_heads - 1) * p.q_vec_stride + kMlaRopeDim;
    if (p.q_heads < 1 || p.q_first_col < 0 || (p.q_heads > 1 && p.q_vec_stride < kMlaRopeDim) ||
        (p.rows > 1 && p.q_row_stride < extent)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "InvokeMlaKvPrep: q's RoPE vectors overlap or lie outside their rows: q_heads ",
          p.q_heads, ", q_first_col ", p.q_first_col, ", q_vec_stride ", p.q_vec_stride,
          ", q_row_stride ", p.q_row_stride));
    }
    q_blocks = (p.rows * p.q_heads + kPrepWarps - 1) / kPrepWarps;
  }
  int64_t absorb_blocks = 0;
  if (p.w_kb != nullptr) {
    if (p.q == nullptr || p.q_abs == nullptr || p.rows > kMlaPrepAbsorbMaxRows ||
        p.absorb_nope < 4 || p.absorb_nope > kMlaPrepAbsorbMaxNope || p.absorb_nope % 4 != 0 ||
        p.q_first_col != p.absorb_nope || !Aligned(p.w_kb, 4) || !Aligned(p.q_abs, 4)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "InvokeMlaKvPrep: q's absorption needs q and q_abs set, rows <= ",
          kMlaPrepAbsorbMaxRows, " (got ", p.rows, "), a nope width that is a multiple of 4 in "
          "[4, ", kMlaPrepAbsorbMaxNope, "] and equal to q_first_col (got ", p.absorb_nope, ", ",
          p.q_first_col, "), w_kb and q_abs 4-byte aligned"));
    }
    absorb_blocks = static_cast<int64_t>(p.q_heads) * (kMlaLatentDim / kAbsorbCols);
  }
  const int64_t kv_blocks = (p.rows + kPrepWarps - 1) / kPrepWarps;
  if (kv_blocks + q_blocks + absorb_blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("InvokeMlaKvPrep: ", p.rows, " rows are too many for one launch"));
  }
  const unsigned grid = static_cast<unsigned>(kv_blocks + q_blocks + absorb_blocks);
  const unsigned kvb = static_cast<unsigned>(kv_blocks);
  const unsigned absorb_begin = static_cast<unsigned>(kv_blocks + q_blocks);
  const int absorb_rows = absorb_blocks == 0 ? 0 : p.rows <= 1 ? 1 : p.rows <= 2 ? 2 : 4;
  auto launch = [&](auto kernel) {
    return pdl::LaunchKernel(kernel, dim3(grid), dim3(kPrepWarps * 32), 0, stream, p.programmatic,
                             p, kvb, absorb_begin);
  };
  // One kernel per (format, absorbed rows) pair.
  auto for_format = [&](auto format_tag) {
    constexpr KvCacheFormat f = decltype(format_tag)::value;
    switch (absorb_rows) {
      case 1:
        return launch(MlaKvPrepKernel<f, 1>);
      case 2:
        return launch(MlaKvPrepKernel<f, 2>);
      case 4:
        return launch(MlaKvPrepKernel<f, 4>);
      default:
        return launch(MlaKvPrepKernel<f, 0>);
    }
  };
  cudaError_t err = cudaSuccess;
  switch (p.format) {
    case KvCacheFormat::kBf16:
      err = for_format(std::integral_constant<KvCacheFormat, KvCacheFormat::kBf16>{});
      break;
    case KvCacheFormat::kFp8:
      err = for_format(std::integral_constant<KvCacheFormat, KvCacheFormat::kFp8>{});
      break;
    case KvCacheFormat::kFp8Tiled:
      err = for_format(std::integral_constant<KvCacheFormat, KvCacheFormat::kFp8Tiled>{});
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("InvokeMlaKvPrep: no GPU cache format ",
                       std::string(KvCacheFormatName(p.format))));
  }
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("InvokeMlaKvPrep: launch failed: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
