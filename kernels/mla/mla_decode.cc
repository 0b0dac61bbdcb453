// Host side of the GPU MLA decode: argument checks, launch plan, dispatch (see mla_decode.h).
#include "kernels/mla/mla_decode.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/mla/mla_decode_params.h"

namespace mlaserve {
namespace {

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

using BlocksPerSmFn = int (*)();
using LaunchFn = cudaError_t (*)(const mla::MlaDecodeKernelParams&, int, cudaStream_t);
struct VariantEntry {
  mla::MlaDecodeVariant shape;
  BlocksPerSmFn blocks_per_sm[3];  // Indexed by KvCacheFormat.
  LaunchFn launch[3];
};

#define MLASERVE_MLA_VARIANT(RG, W, T)                                         \
  VariantEntry {                                                               \
    {RG, W, T},                                                                \
        {&mla::MlaDecodeSplitBlocksPerSm<KvCacheFormat::kBf16, RG, W, T>,      \
         &mla::MlaDecodeSplitBlocksPerSm<KvCacheFormat::kFp8, RG, W, T>,       \
         &mla::MlaDecodeSplitBlocksPerSm<KvCacheFormat::kFp8Tiled, RG, W, T>}, \
    {                                                                          \
      &mla::LaunchMlaDecodeSplit<KvCacheFormat::kBf16, RG, W, T>,              \
          &mla::LaunchMlaDecodeSplit<KvCacheFormat::kFp8, RG, W, T>,           \
          &mla::LaunchMlaDecodeSplit<KvCacheFormat::kFp8Tiled, RG, W, T>       \
    }                                                                          \
  }

// The instantiated kernels (instantiations/*.cu): (row groups, warps per row group, tile tokens).
// On the H200 (bench/RESULTS.md, 2026-11-29) these two won every (format, heads) class of a sweep
// over six variants; (1, 8, 16), (1, 8, 32), (1, 4, 32) and (2, 8, 16) were slower (the 8-warp
// ones need > 128 registers and spill under the 2-blocks-per-SM cap) and are not instantiated,
// to keep CI builds short. The template still takes them: add a file and a line here.
const VariantEntry kVariants[] = {
    MLASERVE_MLA_VARIANT(1, 4, 16),
    MLASERVE_MLA_VARIANT(2, 4, 16),
};
constexpr int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

// 16 query rows per block when heads * s_q <= 16 (one block reads each KV byte once); else 32
// (fewer blocks re-reading the same KV through L2 than with 16).
int DefaultVariant(int rows, KvCacheFormat /*format*/) { return rows <= 16 ? 0 : 1; }

size_t AlignUp(size_t x) { return (x + 255) / 256 * 256; }

struct WorkspaceLayout {
  size_t schedule = 0, o_part = 0, lse_part = 0, total = 0;
};

WorkspaceLayout Layout(int batch, int rows, int num_workers) {
  WorkspaceLayout l;
  const size_t slots = static_cast<size_t>(num_workers) + batch;
  l.schedule = 0;
  l.o_part = AlignUp(sizeof(int32_t) * (batch + 2));
  l.lse_part = l.o_part + AlignUp(sizeof(float) * slots * rows * kMlaLatentDim);
  l.total = l.lse_part + AlignUp(sizeof(float) * slots * rows);
  return l;
}

}  // namespace

int MlaDecodeVariantCount() { return kNumVariants; }

std::string MlaDecodeVariantName(int variant) {
  if (variant < 0 || variant >= kNumVariants) return "auto";
  const mla::MlaDecodeVariant& v = kVariants[variant].shape;
  return absl::StrCat("rows", 16 * v.row_groups, "_warps", v.warps_per_row_group, "_tile",
                      v.tile_tokens);
}

absl::StatusOr<MlaDecodePlan> PlanMlaDecode(int batch, int s_q, int heads, KvCacheFormat format,
                                            int variant) {
  if (batch < 1)
    return absl::InvalidArgumentError(absl::StrCat("MLA decode: batch ", batch, " < 1"));
  if (format == KvCacheFormat::kF32) {
    return absl::InvalidArgumentError("MLA decode: f32 is the CPU reference's cache format only");
  }
  if (s_q < 1 || s_q > 4) {
    return absl::InvalidArgumentError(absl::StrCat("MLA decode: s_q ", s_q, " outside 1..4"));
  }
  if (heads < 1 || heads > 128) {
    return absl::InvalidArgumentError(absl::StrCat("MLA decode: heads ", heads, " outside 1..128"));
  }
  const int rows = s_q * heads;
  if (variant < 0) variant = DefaultVariant(rows, format);
  if (variant >= kNumVariants) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLA decode: variant ", variant, " >= ", kNumVariants, " (MlaDecodeVariantCount)"));
  }
  const int rows_per_cta = 16 * kVariants[variant].shape.row_groups;
  int device = 0, sms = 0;
  if (auto s = CudaStatus(cudaGetDevice(&device), "cudaGetDevice"); !s.ok()) return s;
  if (auto s = CudaStatus(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                          "cudaDeviceGetAttribute");
      !s.ok()) {
    return s;
  }
  const int per_sm = kVariants[variant].blocks_per_sm[static_cast<int>(format)]();
  if (per_sm == 0) {
    return absl::InternalError(
        "MLA decode kernel cannot be resident on this device (shared memory opt-in failed?)");
  }
  const int row_tiles = (rows + rows_per_cta - 1) / rows_per_cta;
  MlaDecodePlan plan;
  plan.variant = variant;
  plan.rows_per_cta = rows_per_cta;
  plan.num_workers = std::max(1, sms * per_sm / row_tiles);
  plan.workspace_bytes = Layout(batch, rows, plan.num_workers).total;
  return plan;
}

absl::Status InvokeMlaDecode(const MlaDecodeParams& p, cudaStream_t stream) {
  absl::StatusOr<MlaDecodePlan> plan = PlanMlaDecode(p.batch, p.s_q, p.heads, p.format, p.variant);
  if (!plan.ok()) return plan.status();
  if (p.q == nullptr || p.kv_pool == nullptr || p.block_table == nullptr || p.seq_lens == nullptr ||
      p.out == nullptr || p.workspace == nullptr) {
    return absl::InvalidArgumentError(
        "MLA decode: q, kv_pool, block_table, seq_lens, out and workspace must be set");
  }
  if (p.max_blocks_per_seq < 1) {
    return absl::InvalidArgumentError("MLA decode: max_blocks_per_seq must be >= 1");
  }
  if (reinterpret_cast<uintptr_t>(p.kv_pool) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.q) % 4 != 0 || reinterpret_cast<uintptr_t>(p.out) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(p.workspace) % 256 != 0) {
    return absl::InvalidArgumentError(
        "MLA decode: kv_pool must be 16-B, q 4-B, out 8-B and workspace 256-B aligned");
  }
  if (p.workspace_bytes < plan->workspace_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("MLA decode: workspace of ", p.workspace_bytes,
                                                   " B, needs ", plan->workspace_bytes,
                                                   " B (PlanMlaDecode)"));
  }
  if (!(p.softmax_scale > 0.0f) || (p.format == KvCacheFormat::kFp8 && !(p.kv_scale > 0.0f))) {
    return absl::InvalidArgumentError(
        "MLA decode: softmax_scale (and kv_scale for fp8) must be > 0");
  }
  const int rows = p.s_q * p.heads;
  const WorkspaceLayout layout = Layout(p.batch, rows, plan->num_workers);
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  mla::MlaDecodeKernelParams k{};
  k.q = static_cast<const uint16_t*>(p.q);
  k.kv_pool = static_cast<const uint8_t*>(p.kv_pool);
  k.block_table = p.block_table;
  k.seq_lens = p.seq_lens;
  k.max_blocks_per_seq = p.max_blocks_per_seq;
  k.batch = p.batch;
  k.s_q = p.s_q;
  k.heads = p.heads;
  k.rows = rows;
  k.num_workers = plan->num_workers;
  const float kv = p.format == KvCacheFormat::kFp8 ? p.kv_scale : 1.0f;
  k.score_scale_log2 = static_cast<float>(static_cast<double>(p.softmax_scale) * kv * M_LOG2E);
  k.out_scale = kv;
  k.out = static_cast<uint16_t*>(p.out);
  k.lse = p.lse;
  k.schedule = reinterpret_cast<int32_t*>(ws + layout.schedule);
  k.o_part = reinterpret_cast<float*>(ws + layout.o_part);
  k.lse_part = reinterpret_cast<float*>(ws + layout.lse_part);
  const int row_tiles = (rows + plan->rows_per_cta - 1) / plan->rows_per_cta;
  if (auto s = CudaStatus(mla::LaunchMlaDecodeSchedule(k, stream), "MLA decode schedule");
      !s.ok()) {
    return s;
  }
  if (auto s = CudaStatus(kVariants[plan->variant].launch[static_cast<int>(p.format)](
                              k, plan->num_workers * row_tiles, stream),
                          "MLA decode split kernel");
      !s.ok()) {
    return s;
  }
  return CudaStatus(mla::LaunchMlaDecodeCombine(k, stream), "MLA decode combine");
}

absl::Status InvokeKvCacheWrite(const KvCacheWriteParams& p, cudaStream_t stream) {
  if (p.n < 0) return absl::InvalidArgumentError("KV cache write: n < 0");
  if (p.n == 0) return absl::OkStatus();
  if (p.latent == nullptr || p.rope == nullptr || p.slots == nullptr || p.kv_pool == nullptr) {
    return absl::InvalidArgumentError(
        "KV cache write: latent, rope, slots and kv_pool must be set");
  }
  if (reinterpret_cast<uintptr_t>(p.latent) % 16 != 0 || p.latent_stride % 8 != 0 ||
      reinterpret_cast<uintptr_t>(p.rope) % 4 != 0 || p.rope_stride % 2 != 0 ||
      reinterpret_cast<uintptr_t>(p.kv_pool) % 16 != 0) {
    return absl::InvalidArgumentError(
        "KV cache write: latent rows must be 16-B aligned (stride % 8), rope rows 4-B aligned "
        "(stride % 2), kv_pool 16-B aligned");
  }
  if (p.format == KvCacheFormat::kF32) {
    return absl::InvalidArgumentError(
        "KV cache write: f32 is the CPU reference's cache format only; use bf16, fp8 or fp8_tiled");
  }
  if (p.format == KvCacheFormat::kFp8 && !(p.fp8_scale > 0.0f)) {
    return absl::InvalidArgumentError("KV cache write: fp8_scale must be > 0");
  }
  return CudaStatus(
      mla::LaunchKvCacheWrite(p.format, p.fp8_scale, static_cast<const uint16_t*>(p.latent),
                              p.latent_stride, static_cast<const uint16_t*>(p.rope), p.rope_stride,
                              p.slots, p.n, static_cast<uint8_t*>(p.kv_pool), stream),
      "KV cache write");
}

}  // namespace mlaserve
