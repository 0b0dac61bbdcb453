// Host side of the GPU MLA decode: argument checks, launch plan, dispatch (see mla_decode.h).
#include "kernels/mla/mla_decode.h"

#include <cuda_runtime_api.h>

#include <algorithm>
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
  const char* name;
  int rows_per_cta;
  int inline_schedule_max_batch;   // the kernel schedules batches up to this itself
  BlocksPerSmFn blocks_per_sm[3];  // Indexed by KvCacheFormat.
  LaunchFn launch[3];
  // Workers per SM at most (0: every resident block slot). The deep ring is meant for small
  // batches with many bytes in flight a block; where its format fits 3 blocks an SM (fp8_tiled
  // since session 19's smaller score tiles), 3 workers an SM cut a batch-1 call into 1.5x the
  // pieces: measured on the H100 (bench/RESULTS.md, session 20; 3 reps, minimum), fp8_tiled 8-16
  // heads at batch 1-4 ran 1.03-1.13x faster with 2 an SM from 32k tokens (16 heads batch 1 x 32k
  // 30.6 -> 27.0 us) and within 2% at 1k (one case of 24, 8 heads batch 1 x 4k, 0.94x); fp8 and
  // bf16 fit 2 anyway. The shallow ring's fp8_tiled likewise (session 27, H100, one run each way,
  // mla_decode_bench --workers 264 against the plan's 396): at 8-16 heads x batch 16-64 x 1k-32k it
  // ran 1.00-1.15x faster at 2 workers an SM than at the 3 that fit, in all 48 cases (8 heads
  // batch 64 x 1k 37.3 -> 34.8 us, 16 heads batch 16 x 4k 41.7 -> 36.8; 330 workers, 2-3 an SM,
  // lost to both). The shallow ring's fp8 (3 an SM as well) was not measured at 2 and keeps 3.
  // Indexed by KvCacheFormat; 0: no cap.
  int max_blocks_per_sm[3] = {0, 0, 0};
  bool fp8_mma = false;  // q.k and P.V on e4m3 tensor cores (MlaDecodeVariantFp8Mma)
};

// Warp-sliced kernel (mla_decode_sliced.cuh), 16 rows per block: tile tokens and stages per
// format (bf16, fp8, fp8_tiled).
constexpr int kSched = mla::kInlineScheduleMaxBatch;
#define MLASERVE_MLA_SLICED(NAME, T, SB, S8, ST, CAP_B, CAP_8, CAP_T)                       \
  VariantEntry {                                                                            \
    NAME, 16, kSched,                                                                       \
        {&mla::MlaDecodeSlicedBlocksPerSm<KvCacheFormat::kBf16, T, SB, kSched, false>,      \
         &mla::MlaDecodeSlicedBlocksPerSm<KvCacheFormat::kFp8, T, S8, kSched, false>,       \
         &mla::MlaDecodeSlicedBlocksPerSm<KvCacheFormat::kFp8Tiled, T, ST, kSched, false>}, \
        {&mla::LaunchMlaDecodeSliced<KvCacheFormat::kBf16, T, SB, kSched, false>,           \
         &mla::LaunchMlaDecodeSliced<KvCacheFormat::kFp8, T, S8, kSched, false>,            \
         &mla::LaunchMlaDecodeSliced<KvCacheFormat::kFp8Tiled, T, ST, kSched, false>},      \
    {                                                                                       \
      CAP_B, CAP_8, CAP_T                                                                   \
    }                                                                                       \
  }

// A format a variant has no kernel for.
int NotBuilt() { return 0; }
cudaError_t NotBuiltLaunch(const mla::MlaDecodeKernelParams&, int, cudaStream_t) {
  return cudaErrorInvalidDeviceFunction;
}

// SM120 variants (kernels/mla/NOTES.md, session 18), the sliced kernel in the fp8 formats only:
// * two blocks: fp8, 2 stages, P in the score tiles' padding and the in-kernel schedule up to
//   batch 256: 49,672 B a block, so an SM120 SM (100 KB) holds two blocks where every other fp8
//   variant holds one. fp8_tiled (656-B rows: 52,736 B even without P and the schedule) and bf16
//   (37 KB a stage) do not fit two with 32-token tiles, the smallest this kernel has.
// * e4m3 q.k: the same, with q.k on e4m3 x e4m3 MMAs straight from the cache bytes (native on
//   SM 12.x at twice the f16 rate; no conversion of K, 72 of a warp-tile's 136 conversions), and
//   fp8_tiled with 3 stages (one block on SM120).
constexpr int kSched120 = mla::kSm120InlineScheduleMaxBatch;
using mla::LaunchMlaDecodeSliced;
using mla::MlaDecodeSlicedBlocksPerSm;
constexpr KvCacheFormat kFp8 = KvCacheFormat::kFp8, kFp8Tiled = KvCacheFormat::kFp8Tiled;
const VariantEntry kSm120TwoBlocks{
    "sliced_tile32_sm120_fp8",
    16,
    kSched120,
    {&NotBuilt, &MlaDecodeSlicedBlocksPerSm<kFp8, 32, 2, kSched120, false>, &NotBuilt},
    {&NotBuiltLaunch, &LaunchMlaDecodeSliced<kFp8, 32, 2, kSched120, false>, &NotBuiltLaunch}};
const VariantEntry kSm120E4m3{
    "sliced_tile32_sm120_e4m3_qk",
    16,
    kSched120,
    {&NotBuilt, &MlaDecodeSlicedBlocksPerSm<kFp8, 32, 2, kSched120, true>,
     &MlaDecodeSlicedBlocksPerSm<kFp8Tiled, 32, 3, kSched120, true>},
    {&NotBuiltLaunch, &LaunchMlaDecodeSliced<kFp8, 32, 2, kSched120, true>,
     &LaunchMlaDecodeSliced<kFp8Tiled, 32, 3, kSched120, true>}};

// The instantiated kernels (instantiations/*.cu): the same kernel with two cp.async ring depths.
// (The first kernel of this directory, 16-token tiles with a shared-memory fp8 dequantize pass,
// lost to these in every case measured and was removed; bench/RESULTS.md keeps its figures;
// so was session 21's q-in-shared-memory variant, 0.84-1.02x the best of these on the H100,
// session 22.)
// SM90a warpgroup-MMA kernel (mla_decode_wgmma.cuh), 64 rows per block: tile tokens and raw
// ring depth per format.
#define MLASERVE_MLA_WGMMA(NAME, T, SB, S8, ST)                             \
  VariantEntry {                                                            \
    NAME, 64, kSched,                                                       \
        {&mla::MlaDecodeWgmmaBlocksPerSm<KvCacheFormat::kBf16, T, SB>,      \
         &mla::MlaDecodeWgmmaBlocksPerSm<KvCacheFormat::kFp8, T, S8>,       \
         &mla::MlaDecodeWgmmaBlocksPerSm<KvCacheFormat::kFp8Tiled, T, ST>}, \
    {                                                                       \
      &mla::LaunchMlaDecodeWgmma<KvCacheFormat::kBf16, T, SB>,              \
          &mla::LaunchMlaDecodeWgmma<KvCacheFormat::kFp8, T, S8>,           \
          &mla::LaunchMlaDecodeWgmma<KvCacheFormat::kFp8Tiled, T, ST>       \
    }                                                                       \
  }

// The wgmma kernel with its loop one tile ahead (kernels/mla/NOTES.md, sessions 22-23), the fp8
// formats: the next tile's q.k runs on the tensor cores beside this tile's softmax and before its
// p.v; tile it + 2 is converted after tile it's p.v (two operand tiles are all that fit). The same
// loop in bf16 lost (0.93-1.04x, session 23) and was removed.
const VariantEntry kWgmmaAhead{"wgmma_rows64_tile32_ahead",
                               64,
                               kSched,
                               {&NotBuilt, &mla::MlaDecodeWgmmaBlocksPerSm<kFp8, 32, 3, true>,
                                &mla::MlaDecodeWgmmaBlocksPerSm<kFp8Tiled, 32, 3, true>},
                               {&NotBuiltLaunch, &mla::LaunchMlaDecodeWgmma<kFp8, 32, 3, true>,
                                &mla::LaunchMlaDecodeWgmma<kFp8Tiled, 32, 3, true>}};

// The seesaw kernel (mla_decode_seesaw.cuh; kernels/mla/NOTES.md, sessions 28-29), bf16 only:
// 64-token blocks, one a warpgroup, O split by columns, full blocks copied by TMA.
const VariantEntry kSeesawTma{
    "wgmma_rows64_seesaw_tma",
    64,
    kSched,
    {&mla::MlaDecodeSeesawBlocksPerSm<true, 0>, &NotBuilt, &NotBuilt},
    {&mla::LaunchMlaDecodeSeesaw<true, 0>, &NotBuiltLaunch, &NotBuiltLaunch}};
// The same in FlashMLA's order of operations (kOrder 1: P1 in a buffer of its own, buffer 1
// refilled mid-pair, the next q.k issued behind the last P.V, pages read a pair ahead); the P1
// buffer leaves room for the in-kernel schedule of 64 sequences only.
const VariantEntry kSeesawEarly{
    "wgmma_rows64_seesaw_tma_early",
    64,
    mla::kSeesawEarlyInlineScheduleMaxBatch,
    {&mla::MlaDecodeSeesawBlocksPerSm<true, 1>, &NotBuilt, &NotBuilt},
    {&mla::LaunchMlaDecodeSeesaw<true, 1>, &NotBuiltLaunch, &NotBuiltLaunch}};

// q.k and P.V on e4m3 wgmma (mla_decode_fp8mma64.cuh, the form of mla_decode_fp8mma.cuh;
// kernels/mla/NOTES.md, sessions 33-34), the fp8 formats: nothing converted, half the tensor work
// of the bf16-MMA kernels; 64-token tiles split by tokens between the warpgroups. Its arithmetic
// is the emulated FP8 tensor-core form (MlaDecodeVariantFp8Mma).
const VariantEntry kFp8Mma64{"wgmma_rows64_fp8mma_t64",
                             64,
                             kSched,
                             {&NotBuilt, &mla::MlaDecodeFp8Mma64BlocksPerSm<kFp8, 3>,
                              &mla::MlaDecodeFp8Mma64BlocksPerSm<kFp8Tiled, 3>},
                             {&NotBuiltLaunch, &mla::LaunchMlaDecodeFp8Mma64<kFp8, 3>,
                              &mla::LaunchMlaDecodeFp8Mma64<kFp8Tiled, 3>},
                             {0, 0, 0},
                             true};
// (Its form with the next tile's q.k issued behind this tile's P.V, the barrier before the
// transpose waiting for the P.V alone, lost on the H100 in all 24 cases of session 34's sweep:
// fp8 0.87-0.98x, fp8_tiled 0.82-0.97x this one; bench/mla/results/
// h100_2026-12-07_s34_fp8mma64_early.csv; removed.) Its P.V as O^T = V^T P^T, V's A fragments
// loaded from the tile into registers (no V^T stored to shared memory and read back), with a 3-
// and a 4-deep ring (session 35, 6b3bbc2, H100): 0.97-1.10x this one, a wash at batch 64 (ncu:
// the short-scoreboard stalls went, MIO-throttle ones came); bench/mla/results/
// h100_2026-12-07_s35_vregs_s4.csv; removed.

const VariantEntry kVariants[] = {
    MLASERVE_MLA_SLICED("sliced_tile32_shallow", 32, 2, 3, 2, 0, 0, 2),
    MLASERVE_MLA_SLICED("sliced_tile32_deep", 32, 2, 4, 3, 2, 2, 2),
    MLASERVE_MLA_WGMMA("wgmma_rows64_tile32", 32, 3, 3, 3),
    kSm120TwoBlocks,
    kSm120E4m3,
    kWgmmaAhead,
    kSeesawTma,
    kSeesawEarly,
    kFp8Mma64,
};
constexpr int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

constexpr int kWgmmaVariant = 2;
constexpr int kTwoBlocksFp8Variant = 3;
constexpr int kSm120E4m3Variant = 4;
constexpr int kWgmmaAheadVariant = 5;
constexpr int kSeesawVariant = 6;
constexpr int kFp8Mma64Variant = 8;

// Measured on the H200 (bench/RESULTS.md):
// * sliced kernels (2026-11-29 session 2): the deep ring (fp8: 4 stages, 2 blocks/SM) wins at
//   batch 1 (0.167 vs 0.144 of copy bandwidth at 32k), the shallow one (3 stages, 3 blocks/SM)
//   from batch 64 (0.65 vs 0.60);
// * the wgmma kernel (2026-12-03 session 8, one run, every format): from 64 query rows it is
//   1.1-2.6x faster wherever the call reads >= 32k tokens (64 heads x batch 64 x 32k: bf16 2.33x,
//   fp8 1.65x, fp8_tiled 1.74x; 128 heads 1.63-2.57x) and 0.77-0.88x at batch 1 x 1k (3-4 us);
//   below 64 rows it pads to 64 and loses (8-16 heads: 0.46-0.99x). The plan cannot see lengths
//   (graphs replay it), so rows decide: >= 64 rows take the wgmma kernel where the device has it.
// * SM 12.x (100 KB of shared memory an SM, native e4m3 mma.sync): the fp8 formats take the e4m3
//   q.k variant (fp8 two blocks an SM where the others run one). Chosen from the shared-memory
//   arithmetic and the instruction counts (kernels/mla/NOTES.md), unmeasured until an SM120 GPU
//   is lent (bench/RESULTS.md says so); the two-blocks f16 variant is the other candidate.
// * fp8 below 64 rows at batch <= 8 (2026-12-05 session 19, one run, 2 reps, fp8 8 and 16 heads,
//   4k and 32k): the SM120 two-blocks variant (2 stages, P in the padding) is also the H200's
//   fastest there, 1.00-1.20x the deep / shallow ring (8 heads batch 8 x 4k 20.4 -> 18.0 us, 16
//   heads batch 1 x 32k 24.5 -> 22.5); at batch 64 x 32k it loses with 16 heads (417.6 -> 450.0).
// * the wgmma kernel one tile ahead (2026-12-06 session 23, H100, one run, 2 reps, minimum; raw:
//   bench/mla/results/h100_2026-12-06_s23_ahead_ab.csv): the fp8 formats 1.03-1.13x faster than
//   the chained loop at 16 / 64 / 128 heads, batch 1 and 64, 32k and 128k (fp8 64 heads batch 64 x
//   32k 921.7 -> 833.6 us); bf16 0.93-1.04x (64 heads batch 64 x 128k 0.948): it keeps the
//   chained loop (the variant has no bf16 kernel).
// * e4m3 -> f16 by integer instructions instead of cvt (2026-12-06 session 24, H100, one run, 2
//   reps; bench/mla/results/h100_2026-12-06_s24_int_cvt_*.csv): cvt converts 83.8 values an SM a
//   clock against the integer form's 42.0 (bench/mla/e4m3_convert_bench.cu), and the integer form
//   lost in every kernel it went into: shallow ring 0.83-0.97x, two blocks 0.81-0.94x, 64-row
//   ahead 0.95-1.00x. Removed; the kernels convert with cvt.
// * the seesaw kernel with TMA copies (2026-12-06 session 29, H100, one run; raw:
//   bench/mla/results/h100_2026-12-06_s29_seesaw_tma.csv), bf16 against the chained 64-row kernel:
//   128 heads 1.27-1.29x at batch 64 x 32k-128k (1,613.7 -> 1,272.7 us at 32k), 1.23x at batch 1 x
//   128k, 0.98x at batch 1 x 32k; 64 heads 0.99-1.02x at batch 64 and 0.83-0.92x at batch 1. So
//   bf16 with more than 64 rows (two row tiles) takes it; 64 rows keep the chained kernel.
// * the seesaw kernel at exactly 64 rows (2026-12-07 session 36; raw:
//   bench/mla/results/h100_2026-12-07_s36_bf16_64_128_variants.log, H100, two runs, minimum):
//   against the chained kernel at 64 heads, batch 16 1.13 / 0.99 / 1.05x (4k / 32k / 128k),
//   batch 64 1.01 / 1.02 / 1.08x, batch 4 0.84-1.07x, batch 1 0.95-0.96x. On the H200 the same
//   session measured FlashMLA's seesaw-order kernel at 0.90-0.995 of copy bandwidth at 64 heads
//   x batch 64 where the chained kernel reads 0.68-0.70 (h200_2026-12-07_s36_table.log,
//   h200_2026-12-07_s36_flashmla.csv); our seesaw kernel there is unmeasured. So 64 rows take the
//   seesaw kernel from batch 16 (kSeesaw64RowsMinBatch), the chained one below.
// * the e4m3 tensor-core kernel with 64-token tiles (2026-12-07 session 34, H200, one run, 2 reps,
//   minimum; raw: bench/mla/results/h200_2026-12-07_s34_fp8mma64.csv), against the ahead kernel
//   at 64 / 128 heads, batch 1 / 16 / 64, 4k / 32k: fp8 1.13-1.56x (128 heads batch 64 x 32k
//   1,563.2 -> 1,000.2 us), fp8_tiled 0.98-1.09x (0.98-1.02x at batch 1, 1.05-1.09x from batch
//   16); on the H100 the same day (h100_2026-12-07_s34_fp8mma64_early.csv) fp8 1.04-1.52x,
//   fp8_tiled 0.98-1.09x. So the fp8 formats from 64 rows take it where the device has it (SM90);
//   its arithmetic is the FP8 tensor-core form, within issue 18's accuracy bounds (accuracy_test).
constexpr int kSeesaw64RowsMinBatch = 16;
int DefaultVariant(int batch, int rows, KvCacheFormat format, int cc_major, bool fp8_mma) {
  if ((rows > 64 || (rows == 64 && batch >= kSeesaw64RowsMinBatch)) &&
      MlaDecodeVariantAvailable(kSeesawVariant, format)) {
    return kSeesawVariant;
  }
  if (fp8_mma && rows >= 64 && MlaDecodeVariantAvailable(kFp8Mma64Variant, format)) {
    return kFp8Mma64Variant;
  }
  if (rows >= 64 && MlaDecodeVariantAvailable(kWgmmaAheadVariant, format)) {
    return kWgmmaAheadVariant;
  }
  if (rows >= 64 && MlaDecodeVariantAvailable(kWgmmaVariant, format)) return kWgmmaVariant;
  if (cc_major == 12 && MlaDecodeVariantAvailable(kSm120E4m3Variant, format)) {
    return kSm120E4m3Variant;
  }
  if (format == KvCacheFormat::kFp8 && batch <= 8 &&
      MlaDecodeVariantAvailable(kTwoBlocksFp8Variant, format)) {
    return kTwoBlocksFp8Variant;
  }
  return batch < 8 ? 1 : 0;
}

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

bool MlaDecodeVariantAvailable(int variant, KvCacheFormat format) {
  if (variant < 0 || variant >= kNumVariants || format == KvCacheFormat::kF32) return false;
  return kVariants[variant].blocks_per_sm[static_cast<int>(format)]() > 0;
}

bool MlaDecodeVariantFp8Mma(int variant) {
  return variant >= 0 && variant < kNumVariants && kVariants[variant].fp8_mma;
}

std::string MlaDecodeVariantName(int variant) {
  if (variant < 0 || variant >= kNumVariants) return "auto";
  return kVariants[variant].name;
}

absl::StatusOr<MlaDecodePlan> PlanMlaDecode(int batch, int s_q, int heads, KvCacheFormat format,
                                            int variant, int max_workers, int invariant_max_seq_len,
                                            bool fp8_tensor_cores) {
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
  if (max_workers < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MLA decode: max_workers ", max_workers, " < 0 (0 = no cap)"));
  }
  if (invariant_max_seq_len < 0) {
    return absl::InvalidArgumentError(absl::StrCat("MLA decode: invariant_max_seq_len ",
                                                   invariant_max_seq_len, " < 0 (0 = off)"));
  }
  const int rows = s_q * heads;
  int device = 0, sms = 0, cc_major = 0;
  if (auto s = CudaStatus(cudaGetDevice(&device), "cudaGetDevice"); !s.ok()) return s;
  if (auto s = CudaStatus(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                          "cudaDeviceGetAttribute");
      !s.ok()) {
    return s;
  }
  if (auto s =
          CudaStatus(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device),
                     "cudaDeviceGetAttribute");
      !s.ok()) {
    return s;
  }
  // The batch-invariant schedule takes one variant whatever the batch (the variants differ in
  // pipeline depth only, but one kernel is the simplest statement of invariance).
  if (variant < 0) {
    variant = invariant_max_seq_len > 0
                  ? 0
                  : DefaultVariant(batch, rows, format, cc_major, fp8_tensor_cores);
  }
  if (variant >= kNumVariants) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLA decode: variant ", variant, " >= ", kNumVariants, " (MlaDecodeVariantCount)"));
  }
  if (!MlaDecodeVariantAvailable(variant, format)) {
    return absl::InvalidArgumentError(
        absl::StrCat("MLA decode: variant ", kVariants[variant].name, " has no ",
                     std::string(KvCacheFormatName(format)), " kernel that runs on this device"));
  }
  const int rows_per_cta = kVariants[variant].rows_per_cta;
  int per_sm = kVariants[variant].blocks_per_sm[static_cast<int>(format)]();
  if (const int cap = kVariants[variant].max_blocks_per_sm[static_cast<int>(format)]; cap > 0) {
    per_sm = std::min(per_sm, cap);
  }
  const int row_tiles = (rows + rows_per_cta - 1) / rows_per_cta;
  MlaDecodePlan plan;
  plan.variant = variant;
  plan.rows_per_cta = rows_per_cta;
  plan.num_workers = std::max(1, sms * per_sm / row_tiles);
  if (max_workers > 0) plan.num_workers = std::min(plan.num_workers, max_workers);
  if (invariant_max_seq_len > 0) {
    // One worker per piece of every sequence, as long as the longest may be.
    const int64_t pieces = mla::MlaScheduledCost(invariant_max_seq_len, mla::kInvariantShareCost) /
                           mla::kInvariantShareCost;
    const int64_t workers = pieces * batch;
    if (workers > (int64_t{1} << 24)) {
      return absl::InvalidArgumentError(
          absl::StrCat("MLA decode: batch-invariant schedule of ", batch, " sequences of up to ",
                       invariant_max_seq_len, " tokens needs ", workers, " workers (limit 2^24)"));
    }
    plan.num_workers = static_cast<int>(workers);
  }
  plan.workspace_bytes = Layout(batch, rows, plan.num_workers).total;
  return plan;
}

absl::Status InvokeMlaDecode(const MlaDecodeParams& p, cudaStream_t stream) {
  absl::StatusOr<MlaDecodePlan> plan = PlanMlaDecode(p.batch, p.s_q, p.heads, p.format, p.variant,
                                                     p.max_workers, p.invariant_max_seq_len);
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
  if (p.min_share < 0 || p.min_share > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("MLA decode: min_share ", p.min_share, " outside [0, 1024]"));
  }
  if (p.combine_row_warps < -1 || p.combine_row_warps > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("MLA decode: combine_row_warps ", p.combine_row_warps, " outside [-1, 1]"));
  }
  if (p.kv_tma_l2 < 0 || p.kv_tma_l2 > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("MLA decode: kv_tma_l2 ", p.kv_tma_l2, " outside [0, 3]"));
  }
  if (p.q_rope != nullptr &&
      (reinterpret_cast<uintptr_t>(p.q_rope) % 16 != 0 || p.q_rope_stride < kMlaRopeDim ||
       p.q_rope_stride % 8 != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLA decode: q_rope must be 16-B aligned with a stride >= ", kMlaRopeDim,
        " and a multiple of 8 elements (got ", p.q_rope_stride, ")"));
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
  k.q_rope = p.q_rope != nullptr ? static_cast<const uint16_t*>(p.q_rope) : k.q + kMlaLatentDim;
  k.q_rope_stride = p.q_rope != nullptr ? p.q_rope_stride : kMlaQkDim;
  k.kv_pool = static_cast<const uint8_t*>(p.kv_pool);
  k.block_table = p.block_table;
  k.seq_lens = p.seq_lens;
  k.max_blocks_per_seq = p.max_blocks_per_seq;
  k.batch = p.batch;
  k.s_q = p.s_q;
  k.heads = p.heads;
  k.rows = rows;
  k.num_workers = plan->num_workers;
  k.fixed_share = p.invariant_max_seq_len > 0 ? mla::kInvariantShareCost : 0;
  const float kv = p.format == KvCacheFormat::kFp8 ? p.kv_scale : 1.0f;
  k.score_scale_log2 = static_cast<float>(static_cast<double>(p.softmax_scale) * kv * M_LOG2E);
  k.out_scale = kv;
  k.out = static_cast<uint16_t*>(p.out);
  k.lse = p.lse;
  k.schedule = reinterpret_cast<int32_t*>(ws + layout.schedule);
  k.o_part = reinterpret_cast<float*>(ws + layout.o_part);
  k.lse_part = reinterpret_cast<float*>(ws + layout.lse_part);
  const int row_tiles = (rows + plan->rows_per_cta - 1) / plan->rows_per_cta;
  // The split kernel computes small batches' schedule itself (one launch fewer).
  k.inline_schedule = p.batch <= kVariants[plan->variant].inline_schedule_max_batch;
  k.programmatic_combine = p.programmatic_combine ? 1 : 0;
  k.min_share = p.min_share;  // 0: MlaBalancedShare's rule for short jobs
  // MlaDecodeParams::combine_row_warps's rule (measured: see there).
  k.combine_row_warps =
      p.combine_row_warps == 1 || (p.combine_row_warps < 0 && p.batch * rows >= 1024 &&
                                   plan->num_workers <= 16 * p.batch)
          ? 1
          : 0;
  k.kv_tma_l2 = p.kv_tma_l2;
  k.timeline = p.timeline;
  if (!k.inline_schedule) {
    if (auto s = CudaStatus(mla::LaunchMlaDecodeSchedule(k, stream), "MLA decode schedule");
        !s.ok()) {
      return s;
    }
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
