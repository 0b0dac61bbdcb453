// MLA decode speed on the current GPU: time per call of the whole decode (schedule + split
// kernel + combine), cold L2, replayed from a CUDA graph as a serving step would run it.
//
// For each (format, heads, batch, context): every sequence holds `context` tokens (s_q = 1),
// block tables are random permutations of the pool's blocks. Bytes counted = KV rows read in the
// format (context * bytes_per_token per sequence) + q (bf16) + out (bf16); the partial outputs
// of split sequences are NOT counted (they are overhead the kernel must hide). Cold L2: the graph
// holds `copies` calls, each on its own KV pool, with copies * pool >= 256 MB (L2 is 60 MB).
// The ceiling is the device-to-device copy bandwidth measured in the same run (bytes read +
// written).
//
// Output: one CSV line per configuration on stdout (and a summary table on stderr).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/mla/decode_timing.h"
#include "common/command_line.h"
#include "kernels/mla/kv_cache_format.h"
#include "kernels/mla/mla_decode.h"
#include "kernels/mla/mla_decode_params.h"

ABSL_FLAG(mlaserve::IntList, batch, (mlaserve::IntList{{1, 8, 32, 64, 128}}),
          "Batch sizes, each in [1, 65536].");
ABSL_FLAG(mlaserve::IntList, context, (mlaserve::IntList{{1024, 8192, 32768, 131072}}),
          "Tokens of context per sequence, each in [1, 16777216].");
ABSL_FLAG(mlaserve::IntList, heads, (mlaserve::IntList{{8, 16, 64, 128}}),
          "Query heads per GPU, each in [1, 1024].");
ABSL_FLAG(mlaserve::IntList, variant, (mlaserve::IntList{{-1}}),
          "Kernel variants by index (-1: the one the dispatcher picks).");
ABSL_FLAG(mlaserve::IntList, workers, (mlaserve::IntList{{0}}),
          "Caps on the persistent workers, each >= 0 (0: none).");
ABSL_FLAG(mlaserve::IntList, min_share, (mlaserve::IntList{{0}}),
          "Smallest shares of the balanced split in 16-token units, each in [0, 1024] (0: the "
          "default rule, MlaDecodeParams::min_share; 4: the rule before session 13).");
ABSL_FLAG(mlaserve::IntList, kv_tma_l2, (mlaserve::IntList{{1}}),
          "MlaDecodeParams::kv_tma_l2 values to run (bit flags: 1 evict_first policy on the TMA "
          "cache copies, 2 128-B L2 fills in the pool's tensor map; seesaw variants only; 1 is the "
          "default, other values get the suffix /l2hN)");
ABSL_FLAG(mlaserve::IntList, combine_row_warps, (mlaserve::IntList{{-1}}),
          "MlaDecodeParams::combine_row_warps values to run (-1: the default rule, 0: the "
          "per-chunk combine, suffix /cc, 1: one warp a row where the call has more than 16 rows, "
          "suffix /cw).");
ABSL_FLAG(bool, timeline, false,
          "After each configuration's timing: its graph replayed once more with the last call's "
          "timeline on (MlaDecodeParams::timeline): the split and combine blocks' phases, us after "
          "the first split block's entry, min / median / max over blocks, on stderr. Needs kernels "
          "built with cmake -DMLASERVE_KERNEL_TIMELINE=ON (other builds say there are no stamps); "
          "the sliced variants and the combines only.");
ABSL_FLAG(std::vector<std::string>, format, std::vector<std::string>({"bf16", "fp8", "fp8_tiled"}),
          "KV cache formats.");

namespace mlaserve {
namespace {

#define CHECK_CUDA(expr)                                                                           \
  do {                                                                                             \
    cudaError_t err_ = (expr);                                                                     \
    if (err_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

__device__ __forceinline__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Random finite bf16: |x| in [2^-7, 2^4).
__device__ __forceinline__ uint16_t RandomBf16(uint32_t h) {
  const uint32_t exp = 120 + (h % 11);
  return static_cast<uint16_t>(((h >> 8) & 0x8000) | (exp << 7) | ((h >> 4) & 0x7f));
}
// Random finite e4m3 (never the NaN code 0x7f / 0xff): exponent field 0..14.
__device__ __forceinline__ uint8_t RandomE4m3(uint32_t h) {
  return static_cast<uint8_t>((h & 0x80) | (h % 15) << 3 | ((h >> 8) & 7));
}

// Fills rows of the format with random finite values (no zeros: they run faster than data).
__global__ void FillPool(uint8_t* pool, size_t rows, KvCacheFormat format, uint64_t seed) {
  const size_t row_bytes = KvCacheBytesPerToken(format);
  for (size_t r = blockIdx.x * size_t(blockDim.y) + threadIdx.y; r < rows;
       r += size_t(gridDim.x) * blockDim.y) {
    uint8_t* row = pool + r * row_bytes;
    for (int i = threadIdx.x; i < static_cast<int>(row_bytes) / 2; i += blockDim.x) {
      const uint32_t h = Hash(seed * 0x9e3779b97f4a7c15ULL + r * 1024 + i);
      uint16_t v;
      if (format == KvCacheFormat::kBf16) {
        v = RandomBf16(h);
      } else if (format == KvCacheFormat::kFp8 || 2 * i < kMlaLatentDim) {
        v = RandomE4m3(h) | (RandomE4m3(h >> 12) << 8);
      } else if (2 * i < kFp8TiledRopeOffset) {
        // Tile scales: fp32 2^-4 = 0x3d800000, little endian halves.
        v = (i % 2 == 0) ? 0x0000 : 0x3d80;
      } else {
        v = RandomBf16(h);
      }
      reinterpret_cast<uint16_t*>(row)[i] = v;
    }
  }
}

__global__ void FillBf16(uint16_t* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    x[i] = RandomBf16(Hash(seed + i * 7919));
  }
}

struct Result {
  double us, bytes;
};

// --timeline: the calls of the timed graph once more, the last with its timeline on, so that the
// stamped call runs behind the others as in the timed replays; then each event's spread over the
// blocks that reached it.
void PrintTimeline(MlaDecodeParams p, const std::vector<uint8_t*>& pools, cudaStream_t stream) {
  constexpr int kRows = 2 * mla::kMlaTimelineBlocks, kEvents = mla::kMlaTimelineEvents;
  unsigned long long* d_tl;
  CHECK_CUDA(cudaMalloc(&d_tl, sizeof(unsigned long long) * kRows * kEvents));
  CHECK_CUDA(cudaMemsetAsync(d_tl, 0, sizeof(unsigned long long) * kRows * kEvents, stream));
  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (size_t c = 0; c < pools.size(); ++c) {
    p.kv_pool = pools[c];
    p.timeline = c + 1 == pools.size() ? d_tl : nullptr;
    if (!InvokeMlaDecode(p, stream).ok()) std::exit(1);
  }
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphLaunch(exec, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<unsigned long long> h(static_cast<size_t>(kRows) * kEvents);
  CHECK_CUDA(cudaMemcpy(h.data(), d_tl, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaFree(d_tl));
  unsigned long long t0 = ~0ull;
  for (int r = 0; r < mla::kMlaTimelineBlocks; ++r) {
    const unsigned long long e = h[static_cast<size_t>(r) * kEvents + mla::kMlaEntry];
    if (e != 0) t0 = std::min(t0, e);
  }
  if (t0 == ~0ull) {
    std::fprintf(stderr,
                 "  timeline: no stamps (kernels built without MLASERVE_KERNEL_TIMELINE, "
                 "or a variant without them)\n");
    return;
  }
  static const char* const kNames[kEvents] = {"entry",      "scheduled",   "q_ready",
                                              "first_tile", "tiles_done",  "split_exit",
                                              "combine_in", "combine_exit"};
  std::string line =
      "  timeline (us after the first split block's entry; min/median/max (blocks)):";
  for (int e = 0; e < kEvents; ++e) {
    const bool combine = e >= mla::kMlaCombineEntry;
    std::vector<double> v;
    for (int r = 0; r < mla::kMlaTimelineBlocks; ++r) {
      const unsigned long long x =
          h[(static_cast<size_t>(r) + (combine ? mla::kMlaTimelineBlocks : 0)) * kEvents + e];
      if (x != 0 && x >= t0) v.push_back((x - t0) * 1e-3);
    }
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    char buf[128];
    std::snprintf(buf, sizeof(buf), " %s %.1f/%.1f/%.1f (%zu)", kNames[e], v.front(),
                  v[v.size() / 2], v.back(), v.size());
    line += buf;
  }
  std::fprintf(stderr, "%s\n", line.c_str());
}

Result TimeConfig(KvCacheFormat format, int heads, int batch, int context, int variant,
                  int max_workers, int min_share, int combine_row_warps, int kv_tma_l2) {
  const size_t row_bytes = KvCacheBytesPerToken(format);
  const int blocks_per_seq = (context + kKvBlockTokens - 1) / kKvBlockTokens;
  const size_t num_blocks = size_t(batch) * blocks_per_seq;
  const size_t pool_bytes = num_blocks * kKvBlockTokens * row_bytes;
  const int copies = bench::ColdL2Copies(pool_bytes);
  std::vector<uint8_t*> pools(copies);
  for (int c = 0; c < copies; ++c) {
    CHECK_CUDA(cudaMalloc(&pools[c], pool_bytes));
    FillPool<<<1024, dim3(32, 8)>>>(pools[c], num_blocks * kKvBlockTokens, format, 17 + c);
    CHECK_CUDA(cudaGetLastError());
  }
  std::mt19937 rng(batch * 131 + context);
  std::vector<int32_t> table(num_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  std::vector<int32_t> lens(batch, context);
  int32_t *d_table, *d_lens;
  uint16_t *d_q, *d_out;
  float* d_lse;
  CHECK_CUDA(cudaMalloc(&d_table, table.size() * 4));
  CHECK_CUDA(cudaMalloc(&d_lens, lens.size() * 4));
  CHECK_CUDA(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  const size_t q_elems = size_t(batch) * heads * kMlaQkDim;
  const size_t out_elems = size_t(batch) * heads * kMlaLatentDim;
  CHECK_CUDA(cudaMalloc(&d_q, q_elems * 2));
  CHECK_CUDA(cudaMalloc(&d_out, out_elems * 2));
  CHECK_CUDA(cudaMalloc(&d_lse, size_t(batch) * heads * 4));
  FillBf16<<<1024, 256>>>(d_q, q_elems, 5);
  auto plan = PlanMlaDecode(batch, 1, heads, format, variant, max_workers);
  if (!plan.ok()) {
    std::fprintf(stderr, "%s\n", plan.status().ToString().c_str());
    std::exit(1);
  }
  void* ws;
  CHECK_CUDA(cudaMalloc(&ws, plan->workspace_bytes));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  MlaDecodeParams p;
  p.q = d_q;
  p.block_table = d_table;
  p.max_blocks_per_seq = blocks_per_seq;
  p.seq_lens = d_lens;
  p.batch = batch;
  p.s_q = 1;
  p.heads = heads;
  p.format = format;
  p.kv_scale = 0.05f;
  p.softmax_scale = 0.1352f * 0.1352f / 0.0417f / 24.0f;  // ~ DeepSeek-V3 (mscale^2 / sqrt(192))
  p.out = d_out;
  p.lse = d_lse;
  p.workspace = ws;
  p.workspace_bytes = plan->workspace_bytes;
  p.variant = plan->variant;
  p.max_workers = max_workers;
  p.min_share = min_share;
  p.combine_row_warps = combine_row_warps;
  p.kv_tma_l2 = kv_tma_l2;
  // Warm-up outside the graph (module load, smem opt-in, occupancy query).
  p.kv_pool = pools[0];
  absl::Status st = InvokeMlaDecode(p, stream);
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    std::exit(1);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int c = 0; c < copies; ++c) {
    p.kv_pool = pools[c];
    const absl::Status captured = InvokeMlaDecode(p, stream);
    if (!captured.ok()) {
      std::fprintf(stderr, "%s\n", captured.ToString().c_str());
      std::exit(1);
    }
  }
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  const double us = bench::MedianReplayUs(exec, stream, copies);
  if (absl::GetFlag(FLAGS_timeline)) PrintTimeline(p, pools, stream);
  const double bytes =
      double(batch) * context * row_bytes + double(q_elems) * 2 + double(out_elems) * 2;
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(stream));
  for (uint8_t* pool : pools) CHECK_CUDA(cudaFree(pool));
  CHECK_CUDA(cudaFree(d_table));
  CHECK_CUDA(cudaFree(d_lens));
  CHECK_CUDA(cudaFree(d_q));
  CHECK_CUDA(cudaFree(d_out));
  CHECK_CUDA(cudaFree(d_lse));
  CHECK_CUDA(cudaFree(ws));
  return {us, bytes};
}

int Main(int argc, char** argv) {
  ParseFlags(argc, argv, "mla_decode_bench [flags]");
  const std::vector<int> batches = FlagIntsInRange(FLAGS_batch, 1, 1 << 16);
  const std::vector<int> contexts = FlagIntsInRange(FLAGS_context, 1, 1 << 24);
  const std::vector<int> heads_list = FlagIntsInRange(FLAGS_heads, 1, 1024);
  const std::vector<int> variants = FlagIntsInRange(FLAGS_variant, -1, 1 << 16);
  const std::vector<int> workers_list = FlagIntsInRange(FLAGS_workers, 0, 1 << 16);
  const std::vector<int> shares = FlagIntsInRange(FLAGS_min_share, 0, 1024);
  const std::vector<int> row_warps = FlagIntsInRange(FLAGS_combine_row_warps, -1, 1);
  const std::vector<int> l2_hints = FlagIntsInRange(FLAGS_kv_tma_l2, 0, 3);
  std::vector<KvCacheFormat> formats;
  for (const std::string& name : absl::GetFlag(FLAGS_format)) {
    absl::StatusOr<KvCacheFormat> f = ParseKvCacheFormat(name);
    if (!f.ok()) UsageError("--format " + name + ": " + std::string(f.status().message()));
    formats.push_back(*f);
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const double copy_bw = bench::MeasureCopyBandwidth();
  std::fprintf(stderr, "device %s, %d SMs, L2 %d MB; d2d copy bandwidth %.0f GB/s\n", prop.name,
               prop.multiProcessorCount, prop.l2CacheSize >> 20, copy_bw / 1e9);
  std::printf("impl,format,heads,batch,context,variant,us,bytes,gbps,frac_copy,copy_gbps\n");
  // Every combination of the tuning knobs, each timed in every configuration.
  struct Knobs {
    int workers, share, cw, l2;
  };
  std::vector<Knobs> knobs;
  for (int workers : workers_list) {
    for (int share : shares) {
      for (int cw : row_warps) {
        for (int l2 : l2_hints) {
          knobs.push_back({workers, share, cw, l2});
        }
      }
    }
  }
  for (KvCacheFormat f : formats) {
    for (int heads : heads_list) {
      for (int variant : variants) {
        for (int batch : batches) {
          for (int context : contexts) {
            for (const Knobs& k : knobs) {
              const Result r =
                  TimeConfig(f, heads, batch, context, variant, k.workers, k.share, k.cw, k.l2);
              std::string vname = MlaDecodeVariantName(
                  variant >= 0 ? variant : PlanMlaDecode(batch, 1, heads, f)->variant);
              if (k.workers > 0) {
                vname +=
                    "/w" + std::to_string(
                               PlanMlaDecode(batch, 1, heads, f, variant, k.workers)->num_workers);
              }
              if (k.share > 0) vname += "/s" + std::to_string(k.share);
              if (k.cw >= 0) vname += k.cw == 1 ? "/cw" : "/cc";
              if (k.l2 != 1) vname += "/l2h" + std::to_string(k.l2);
              const double gbps = r.bytes / (r.us * 1e-6) / 1e9;
              std::printf("mlaserve,%s,%d,%d,%d,%s%s,%.2f,%.0f,%.1f,%.3f,%.1f\n",
                          std::string(KvCacheFormatName(f)).c_str(), heads, batch, context,
                          variant < 0 ? "auto:" : "", vname.c_str(), r.us, r.bytes, gbps,
                          gbps * 1e9 / copy_bw, copy_bw / 1e9);
              std::fflush(stdout);
              std::fprintf(stderr, "%-9s h=%3d %-22s b=%3d ctx=%6d %9.1f us %7.0f GB/s %.3f\n",
                           std::string(KvCacheFormatName(f)).c_str(), heads, vname.c_str(), batch,
                           context, r.us, gbps, gbps * 1e9 / copy_bw);
            }
          }
        }
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace mlaserve

int main(int argc, char** argv) { return mlaserve::Main(argc, argv); }
