// NVFP4, INT4 and FP8 MoE expert-path benchmark on full-size shapes (hidden 7168, intermediate
// 2048, top-8): decode (1..256 tokens) against the device's measured copy bandwidth on the weight
// bytes of the active experts (codes + scales), prefill (2k..32k tokens) in TFLOP/s. Weights are
// cold: L2 is emptied (a 256 MB read; --l2-flush memset for the method before session 26) before
// every timed run. The BF16 peer (cuBLAS through PyTorch) is bf16_peer.py.
//
// Times per configuration: the four stages one by one (events between them, plain launches; the
// stage columns), the layer as one InvokeNvfp4Moe / InvokeInt4Moe / InvokeFp8Moe call with plain
// launches ("plain") and with its default launches ("layer": programmatic for small decode
// batches, kMoeProgrammaticMaxRows), and for decode that call replayed as a CUDA graph ("graph");
// the same with the few-expert kernel for both GEMMs ("few", "few graph"; 16-token tiles).
// Note: "layer" and "graph" run the tile kernel even where the decode step would take the
// few-expert one ("(auto)" marks those rows).
//
// Usage: moe_bench [--quick | --decode | --prefill] [--int4 | --fp8]
//   --int4: Kimi-K2.5 EP8 (48 of 384 experts local) in INT4 (compressed-tensors, group 32,
//   bf16 scales: kernels/moe/int4_moe.h) and, in the same process for comparison, in NVFP4, at
//   1, 8, 64 and 256 decode tokens (with --prefill: 8192 tokens instead).
//   --fp8: DeepSeek-R1 shapes, all 256 experts and EP8 (32 of 256 local), in FP8 block-128 (e4m3
//   codes, an fp32 scale per 128 x 128 block: kernels/moe/fp8_moe.h; the layout holds one per
//   8 x 64 weights, 1/128 of the code bytes) and, in the same process, in NVFP4, at 1, 8, 64 and
//   256 decode tokens (with --prefill: 8192 tokens instead).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/command_line.h"
#include "kernels/moe/fp8_moe.h"
#include "kernels/moe/int4_moe.h"
#include "kernels/moe/moe_few_expert.h"
#include "kernels/moe/moe_few_expert_layer.h"
#include "kernels/moe/nvfp4_moe.h"
#include "kernels/moe/nvfp4_moe_gemm.h"

namespace {

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

__device__ uint32_t Hash(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9e3779b97f4a7c15ull + seed;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return static_cast<uint32_t>(x);
}

// Random codes; scale codes for e4m3 scales in [0.25, 4) (bf16 exponents 244..247 of the layout's
// 8-bit code); activations ~ uniform(-1, 1) in bf16.
__global__ void FillCodes(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    p[i] = Hash(i, seed) & 0xff;
  }
}
__global__ void FillScales(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const uint32_t h = Hash(i, seed);
    p[i] = static_cast<uint8_t>(((12 + (h & 3)) << 3) | ((h >> 2) & 7));
  }
}
// INT4 group scales: bf16 in [2^-8, 2^-7) (exponent 119, random mantissa).
__global__ void FillInt4Scales(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    p[i] = static_cast<uint16_t>(0x3b80u | (Hash(i, seed) & 0x7fu));
  }
}
// FP8 codes with bit 6 clear: exponent fields 0..7 (|v| <= 1.875, no NaN codes); fp32 scales.
__global__ void FillFp8Codes(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    p[i] = Hash(i, seed) & 0xbf;
  }
}
__global__ void FillF32(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    p[i] = v;
  }
}
__global__ void FillBf16(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    p[i] = __float2bfloat16((Hash(i, seed) & 0xffff) / 32768.0f - 1.0f);
  }
}

// Empties L2 for a timed run by reading n 16-byte vectors (--l2-flush read, the default): the lines
// it leaves are clean. A memset (--l2-flush memset, the method before session 26) leaves up to an
// L2 of dirty lines, whose write-back then takes DRAM bandwidth from the timed kernels' reads
// (bench/linear/linear_bench on the H100, session 26: cuBLASLt's q_a at 64 rows 17.9 us after a
// memset, 11.5 us after a read). The sink is written only for a value the XOR of the buffer's
// words never takes, so the loads cannot be dropped.
__global__ void ReadFlushKernel(const uint4* p, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const uint4 v = __ldcg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

enum class Format { kNvfp4, kInt4, kFp8 };

struct Config {
  const char* name;
  int num_experts;  // global
  int num_local;    // experts on this rank: ids [0, num_local)
  Format format = Format::kNvfp4;
};

}  // namespace

using namespace mlaserve;  // NOLINT: a benchmark main

ABSL_FLAG(bool, quick, false, "Prefill at 2k tokens only.");
ABSL_FLAG(bool, decode, false, "Decode only (for comparing build variants).");
ABSL_FLAG(bool, prefill, false, "Prefill only.");
ABSL_FLAG(bool, int4, false, "Also the INT4 (compressed-tensors) expert format, beside NVFP4 on the same routing draws.");
ABSL_FLAG(mlaserve::IntList, decode_tokens, mlaserve::IntList{},
          "Decode token counts instead of the mode's (e.g. one count to profile one launch).");
ABSL_FLAG(bool, fp8, false, "Also the FP8 block-128 (DeepSeek) expert format, beside NVFP4 on the same routing draws.");
ABSL_FLAG(std::string, l2_flush, "read",
          "How L2 is emptied before every timed run: read (a 256 MB read, clean lines left) or "
          "memset (a 256 MB memset, the method before session 26: its dirty lines' write-back "
          "slows the timed kernels).");
ABSL_FLAG(bool, timeline, false,
          "Decode, 1-4 tokens: after the timings, one graph replay of the fused layer with a "
          "timeline of each block's phases (FewExpertLayerEvent), printed as min / median / max "
          "over blocks. Needs kernels built with MLASERVE_KERNEL_TIMELINE "
          "(cmake -DMLASERVE_KERNEL_TIMELINE=ON); other builds leave it empty and say so.");
ABSL_FLAG(int, decode_active, 0,
          "Decode steps: redraw the routing until this rank's local experts hold exactly this many "
          "active ones (0: the first draw, as before; -1: the expected number, round(tokens x "
          "top_k x local / routed experts), at least 1), so that e.g. the one-token EP8 row has "
          "the one active expert a batch-1 rank usually sees.");

int main(int argc, char** argv) {
  ParseFlags(argc, argv,
             "moe_bench [--quick] [--decode | --prefill] [--int4] [--fp8] [--decode_tokens N,...]");
  const bool quick = absl::GetFlag(FLAGS_quick), decode_only = absl::GetFlag(FLAGS_decode),
             prefill_only = absl::GetFlag(FLAGS_prefill),
             int4 = absl::GetFlag(FLAGS_int4), fp8 = absl::GetFlag(FLAGS_fp8);
  const int decode_active = absl::GetFlag(FLAGS_decode_active);
  if (decode_active < -1) {
    std::fprintf(stderr, "moe_bench: --decode-active %d: must be -1, 0 or a count\n",
                 decode_active);
    return 2;
  }
  const int H = 7168, I = 2048, K = 8;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaEvent_t ev[5];
  for (auto& e : ev) CK(cudaEventCreate(&e));
  void* flush;
  const size_t flush_bytes = 256ull << 20;
  CK(cudaMalloc(&flush, flush_bytes));
  CK(cudaMemset(flush, 1, flush_bytes));
  unsigned* flush_sink;
  CK(cudaMalloc(&flush_sink, sizeof(unsigned)));
  const std::string l2_flush = absl::GetFlag(FLAGS_l2_flush);
  if (l2_flush != "read" && l2_flush != "memset") {
    std::fprintf(stderr, "moe_bench: --l2-flush %s: must be read or memset\n", l2_flush.c_str());
    return 2;
  }
  const bool read_flush = l2_flush == "read";
  std::printf("L2 emptied before every timed run by a 256 MB %s\n", read_flush ? "read" : "memset");
  auto flush_l2 = [&](int it) {
    if (read_flush) {
      ReadFlushKernel<<<4 * prop.multiProcessorCount, 512, 0, s>>>(static_cast<const uint4*>(flush),
                                                                   flush_bytes / 16, flush_sink);
      CK(cudaGetLastError());
    } else {
      CK(cudaMemsetAsync(flush, it & 0xff, flush_bytes, s));
    }
  };
  // The fused few-expert layer's counters (moe_few_expert_layer.h), 0 between calls.
  int* layer_counters;
  CK(cudaMalloc(&layer_counters, 2 * sizeof(int)));
  CK(cudaMemset(layer_counters, 0, 2 * sizeof(int)));
  // --timeline: the fused layer's per-block stamps (a grid is at most the resident blocks).
  const bool want_timeline = absl::GetFlag(FLAGS_timeline);
  constexpr int kTimelineBlocks = 4096;
  uint64_t* timeline = nullptr;
  if (want_timeline) {
    CK(cudaMalloc(&timeline, kTimelineBlocks * kFewExpertLayerTimelineEvents * sizeof(uint64_t)));
  }

  // Copy bandwidth: device-to-device copy of 2 GiB, bytes read + written.
  float copy_gbps;
  {
    const size_t bytes = 2ull << 30;
    void *a, *b;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    CK(cudaMemsetAsync(a, 1, bytes, s));
    std::vector<float> t;
    for (int i = 0; i < 12; ++i) {
      CK(cudaEventRecord(ev[0], s));
      CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
      CK(cudaEventRecord(ev[1], s));
      CK(cudaEventSynchronize(ev[1]));
      float ms;
      CK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
      if (i >= 2) t.push_back(ms);
    }
    copy_gbps = 2.0 * bytes / (Median(t) * 1e-3) / 1e9;
    std::printf("copy bandwidth (read + write): %.0f GB/s\n", copy_gbps);
    CK(cudaFree(a));
    CK(cudaFree(b));
  }

  std::vector<Config> configs = {{"ep8_48_of_384", 384, 48}, {"all_256", 256, 256}};
  std::vector<int> decode_tokens = {1, 2, 4, 8, 32, 64, 128};
  std::vector<int> prefill_tokens = {2048, 8192, 32768};
  if (quick) prefill_tokens = {2048};
  if (decode_only) prefill_tokens = {};
  if (prefill_only) decode_tokens = {};
  if (int4) {
    configs = {{"ep8_48_of_384", 384, 48, Format::kNvfp4}, {"ep8_48_of_384", 384, 48, Format::kInt4}};
    if (!prefill_only) decode_tokens = {1, 8, 64, 256};
    prefill_tokens = prefill_only ? std::vector<int>{8192} : std::vector<int>{};
  }
  if (fp8) {
    configs = {{"r1_all_256", 256, 256, Format::kFp8},
               {"r1_all_256", 256, 256, Format::kNvfp4},
               {"r1_ep8_32_of_256", 256, 32, Format::kFp8},
               {"r1_ep8_32_of_256", 256, 32, Format::kNvfp4}};
    if (!prefill_only) decode_tokens = {1, 8, 64, 256};
    prefill_tokens = prefill_only ? std::vector<int>{8192} : std::vector<int>{};
  }
  const std::vector<int> only = FlagIntsInRange(FLAGS_decode_tokens, 1, 256, /*allow_empty=*/true);
  if (!only.empty()) decode_tokens = only;
  const double flop_per_row = 2.0 * (2.0 * I * H + 1.0 * H * I);
  // INT4's layout has NVFP4's bytes: codes 4 bits a weight, one bf16 scale per 32 weights. FP8's:
  // a byte a weight, an fp32 scale per 8 x 64 weights.
  std::printf(
      "weight bytes per expert (codes + scales: e4m3 per 16 for NVFP4, bf16 per 32 for INT4; "
      "fp32 per 512 for FP8): %.2f MB (NVFP4, INT4), %.2f MB (FP8); bf16: %.2f MB\n",
      3.0 * H * I * (0.5 + 1.0 / 16) / 1e6, 3.0 * H * I * (1.0 + 1.0 / 128) / 1e6,
      3.0 * H * I * 2 / 1e6);
  std::printf(
      "\n%-16s %5s %6s %4s %6s %7s | %8s %8s %8s %8s %8s | %8s %8s %8s | %7s %6s %6s "
      "%6s | %8s %8s\n",
      "config", "fmt", "tokens", "tile", "active", "rows", "dispatch", "gate_up", "down", "combine",
      "stages", "plain", "layer", "graph", "GB/s", "%stage", "%layer", "%graph", "TFLOP/s",
      "TF_layer");

  std::mt19937 rng(1234);
  for (const Config& c : configs) {
    // --int4, --fp8: every format sees the same routing draws.
    if (int4 || fp8) rng.seed(1234);
    const int E = c.num_local;
    const bool is_fp8 = c.format == Format::kFp8, is_int4 = c.format == Format::kInt4;
    // Per expert: codes and scales of gate_up [2I, H] and down [H, I].
    const size_t gu_codes_e = is_fp8 ? static_cast<size_t>(2 * I) * H : static_cast<size_t>(I) * H;
    const size_t dn_codes_e = is_fp8 ? static_cast<size_t>(H) * I : static_cast<size_t>(H) * I / 2;
    const size_t gu_scales_e = gu_codes_e / (is_fp8 ? 128 : 8);
    const size_t dn_scales_e = dn_codes_e / (is_fp8 ? 128 : 8);
    const double bytes_per_expert = gu_codes_e + gu_scales_e + dn_codes_e + dn_scales_e;
    uint8_t *gu_c, *gu_s, *dn_c, *dn_s;
    float *gu_gs, *dn_gs;
    CK(cudaMalloc(&gu_c, gu_codes_e * E));
    CK(cudaMalloc(&gu_s, gu_scales_e * E));
    CK(cudaMalloc(&dn_c, dn_codes_e * E));
    CK(cudaMalloc(&dn_s, dn_scales_e * E));
    CK(cudaMalloc(&gu_gs, 2 * E * sizeof(float)));
    CK(cudaMalloc(&dn_gs, E * sizeof(float)));
    if (is_fp8) {
      FillFp8Codes<<<4096, 256, 0, s>>>(gu_c, gu_codes_e * E, 1);
      FillFp8Codes<<<4096, 256, 0, s>>>(dn_c, dn_codes_e * E, 3);
    } else {
      FillCodes<<<4096, 256, 0, s>>>(gu_c, gu_codes_e * E, 1);
      FillCodes<<<4096, 256, 0, s>>>(dn_c, dn_codes_e * E, 3);
    }
    if (is_fp8) {
      FillF32<<<4096, 256, 0, s>>>(reinterpret_cast<float*>(gu_s), gu_scales_e * E / 4, 1e-3f);
      FillF32<<<4096, 256, 0, s>>>(reinterpret_cast<float*>(dn_s), dn_scales_e * E / 4, 1e-3f);
    } else if (is_int4) {
      FillInt4Scales<<<4096, 256, 0, s>>>(reinterpret_cast<uint16_t*>(gu_s), gu_scales_e * E / 2,
                                          2);
      FillInt4Scales<<<4096, 256, 0, s>>>(reinterpret_cast<uint16_t*>(dn_s), dn_scales_e * E / 2,
                                          4);
    } else {
      FillScales<<<4096, 256, 0, s>>>(gu_s, gu_scales_e * E, 2);
      FillScales<<<4096, 256, 0, s>>>(dn_s, dn_scales_e * E, 4);
    }
    std::vector<float> gs(2 * E, 1e-3f);
    CK(cudaMemcpy(gu_gs, gs.data(), 2 * E * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dn_gs, gs.data(), E * 4, cudaMemcpyHostToDevice));
    const Nvfp4MoeWeights weights{0, E, H, I, gu_c, gu_s, gu_gs, dn_c, dn_s, dn_gs};
    const Int4MoeWeights int4_weights{0, E, H, I, gu_c, gu_s, dn_c, dn_s};
    const Fp8MoeWeights fp8_weights{0, E, H, I, gu_c, gu_s, dn_c, dn_s};

    std::vector<int> all_tokens = decode_tokens;
    all_tokens.insert(all_tokens.end(), prefill_tokens.begin(), prefill_tokens.end());
    for (int tokens : all_tokens) {
      const bool decode = tokens <= 256;
      // Uniform routing over all global experts, 8 distinct per token; decode steps redrawn until
      // the active count is --decode-active's where asked.
      int want_active = 0;
      if (decode && decode_active != 0) {
        const double expected = static_cast<double>(tokens) * K * E / c.num_experts;
        want_active =
            decode_active > 0 ? decode_active : std::max(1, static_cast<int>(expected + 0.5));
        if (want_active > std::min(E, tokens * K)) {
          std::fprintf(stderr,
                       "moe_bench: %s, %d tokens: %d active experts cannot be drawn; skipped\n",
                       c.name, tokens, want_active);
          continue;
        }
      }
      std::vector<int32_t> ids(static_cast<size_t>(tokens) * K);
      std::vector<int> perm(c.num_experts);
      std::vector<int> count(E, 0);
      int active = 0, rows = 0;
      bool drawn = true;
      for (int attempt = 0;; ++attempt) {
        std::fill(count.begin(), count.end(), 0);
        for (int t = 0; t < tokens; ++t) {
          for (int e = 0; e < c.num_experts; ++e) perm[e] = e;
          for (int j = 0; j < K; ++j) {
            std::uniform_int_distribution<int> d(j, c.num_experts - 1);
            std::swap(perm[j], perm[d(rng)]);
            ids[static_cast<size_t>(t) * K + j] = perm[j];
            if (perm[j] < E) ++count[perm[j]];
          }
        }
        active = rows = 0;
        for (int n : count) {
          active += n > 0;
          rows += n;
        }
        if (want_active == 0 || active == want_active) break;
        if (attempt == 100000) {
          // E.g. all 256 experts local at 12 tokens: 96 distinct experts from 96 picks.
          std::fprintf(stderr,
                       "moe_bench: %s, %d tokens: no draw with %d active experts in 100000; "
                       "skipped\n",
                       c.name, tokens, want_active);
          drawn = false;
          break;
        }
      }
      if (!drawn) continue;
      std::vector<float> w(ids.size(), 1.0f / K);
      int32_t* d_ids;
      float* d_w;
      __nv_bfloat16* d_x;
      float* d_out;
      CK(cudaMalloc(&d_ids, ids.size() * 4));
      CK(cudaMalloc(&d_w, w.size() * 4));
      CK(cudaMalloc(&d_x, static_cast<size_t>(tokens) * H * 2));
      CK(cudaMalloc(&d_out, static_cast<size_t>(tokens) * H * 4));
      CK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_w, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
      FillBf16<<<1024, 256, 0, s>>>(d_x, static_cast<size_t>(tokens) * H, 5);
      const size_t ws_bytes = Nvfp4MoeWorkspaceBytes(tokens, K, E, H, I);
      void* ws;
      CK(cudaMalloc(&ws, ws_bytes));
      Nvfp4MoeParams p{};
      p.weights = weights;
      p.tokens = tokens;
      p.top_k = K;
      p.tile_tokens = ChooseMoeTileTokens(tokens, K, c.num_experts);
      p.x = d_x;
      p.topk_ids = d_ids;
      p.topk_weights = d_w;
      p.out = d_out;
      p.workspace = ws;
      p.workspace_bytes = ws_bytes;
      // The same call in the INT4 format (its workspace is NVFP4's).
      Int4MoeParams q{};
      q.weights = int4_weights;
      q.tokens = p.tokens;
      q.top_k = p.top_k;
      q.tile_tokens = p.tile_tokens;
      q.x = p.x;
      q.topk_ids = p.topk_ids;
      q.topk_weights = p.topk_weights;
      q.out = p.out;
      q.workspace = p.workspace;
      q.workspace_bytes = p.workspace_bytes;
      // And in the FP8 format.
      Fp8MoeParams f{};
      f.weights = fp8_weights;
      f.tokens = p.tokens;
      f.top_k = p.top_k;
      f.tile_tokens = p.tile_tokens;
      f.x = p.x;
      f.topk_ids = p.topk_ids;
      f.topk_weights = p.topk_weights;
      f.out = p.out;
      f.workspace = p.workspace;
      f.workspace_bytes = p.workspace_bytes;
      Nvfp4MoeParams plain = p;
      plain.plain_launches = true;
      Int4MoeParams q_plain = q;
      q_plain.plain_launches = true;
      Fp8MoeParams f_plain = f;
      f_plain.plain_launches = true;
      // The few-expert kernel (moe_few_expert.h) for both GEMMs, and whether InvokeMoeExperts
      // would pick it here.
      const bool few_ok = decode && p.tile_tokens == kMoeTileTokensSmall;
      const bool few_auto = ChooseMoeFewExpert(E, c.num_experts, tokens, K);
      Nvfp4MoeParams p_few = p;
      Int4MoeParams q_few = q;
      Fp8MoeParams f_few = f;
      p_few.few_expert = q_few.few_expert = f_few.few_expert = true;
      // And the whole layer as the fused few-expert launch, where it applies (1-4 tokens).
      const bool layer_ok = few_ok && FewExpertLayerApplies(tokens, K, H, I);
      Nvfp4MoeParams p_fused = p_few;
      Int4MoeParams q_fused = q_few;
      Fp8MoeParams f_fused = f_few;
      p_fused.few_expert_layer_counters = q_fused.few_expert_layer_counters =
          f_fused.few_expert_layer_counters = layer_counters;
      auto stage = [&](int i) {
        if (is_fp8) {
          return i == 0   ? InvokeFp8MoeDispatchStage(f, s)
                 : i == 1 ? InvokeFp8MoeGateUpStage(f, s)
                 : i == 2 ? InvokeFp8MoeDownStage(f, s)
                          : InvokeFp8MoeCombineStage(f, s);
        }
        if (is_int4) {
          return i == 0   ? InvokeInt4MoeDispatchStage(q, s)
                 : i == 1 ? InvokeInt4MoeGateUpStage(q, s)
                 : i == 2 ? InvokeInt4MoeDownStage(q, s)
                          : InvokeInt4MoeCombineStage(q, s);
        }
        return i == 0   ? InvokeNvfp4MoeDispatchStage(p, s)
               : i == 1 ? InvokeNvfp4MoeGateUpStage(p, s)
               : i == 2 ? InvokeNvfp4MoeDownStage(p, s)
                        : InvokeNvfp4MoeCombineStage(p, s);
      };
      auto layer = [&](bool plain_launches) {
        if (is_fp8) return InvokeFp8Moe(plain_launches ? f_plain : f, s);
        if (is_int4) return InvokeInt4Moe(plain_launches ? q_plain : q, s);
        return InvokeNvfp4Moe(plain_launches ? plain : p, s);
      };
      const int reps = decode ? 30 : (tokens >= 32768 ? 3 : 6);
      std::vector<float> t_disp, t_gu, t_dn, t_comb, t_total;
      for (int it = 0; it < reps + 2; ++it) {
        flush_l2(it);
        CK(cudaEventRecord(ev[0], s));
        for (int i = 0; i < 4; ++i) {
          CK(stage(i));
          CK(cudaEventRecord(ev[i + 1], s));
        }
        CK(cudaEventSynchronize(ev[4]));
        if (it < 2) continue;  // warm-up
        float ms[4], tot;
        for (int i = 0; i < 4; ++i) CK(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
        CK(cudaEventElapsedTime(&tot, ev[0], ev[4]));
        t_disp.push_back(ms[0] * 1e3f);
        t_gu.push_back(ms[1] * 1e3f);
        t_dn.push_back(ms[2] * 1e3f);
        t_comb.push_back(ms[3] * 1e3f);
        t_total.push_back(tot * 1e3f);
      }
      // The whole layer as one call: `launch` once per timed run, L2 flushed before each.
      auto time_layer = [&](auto launch) {
        std::vector<float> t;
        for (int it = 0; it < reps + 2; ++it) {
          flush_l2(it);
          CK(cudaEventRecord(ev[0], s));
          launch();
          CK(cudaEventRecord(ev[1], s));
          CK(cudaEventSynchronize(ev[1]));
          float ms;
          CK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
          if (it >= 2) t.push_back(ms * 1e3f);
        }
        return static_cast<double>(Median(t));
      };
      const double us_plain = time_layer([&] { CK(layer(true)); });
      const double us_layer = time_layer([&] { CK(layer(false)); });
      double us_few = 0;
      if (few_ok) {
        us_few = time_layer([&] {
          CK(is_fp8    ? InvokeFp8Moe(f_few, s)
             : is_int4 ? InvokeInt4Moe(q_few, s)
                       : InvokeNvfp4Moe(p_few, s));
        });
      }
      double us_fused = 0;
      if (layer_ok) {
        us_fused = time_layer([&] {
          CK(is_fp8    ? InvokeFp8Moe(f_fused, s)
             : is_int4 ? InvokeInt4Moe(q_fused, s)
                       : InvokeNvfp4Moe(p_fused, s));
        });
      }
      // Prefill tiles (NVFP4, INT4) on the mma.sync kernel, against the default (the SM90 wgmma kernel
      // where the device has it, moe_weight_only_wgmma.cuh): the layer, plain launches.
      double us_mma = 0;
      if (!is_fp8 && p.tile_tokens == kMoeTileTokensLarge) {
        Nvfp4MoeParams p_mma = plain;
        Int4MoeParams q_mma = q_plain;
        p_mma.prefill_wgmma = q_mma.prefill_wgmma = false;
        us_mma = time_layer(
            [&] { CK(is_int4 ? InvokeInt4Moe(q_mma, s) : InvokeNvfp4Moe(p_mma, s)); });
      }
      // A call replayed from a CUDA graph, as the decode step runs it.
      auto time_graph = [&](auto launch) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        launch();
        CK(cudaStreamEndCapture(s, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        const double us = time_layer([&] { CK(cudaGraphLaunch(exec, s)); });
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
        return us;
      };
      double us_graph = 0, us_few_graph = 0, us_tail_graph = 0;
      if (decode) {
        us_graph = time_graph([&] { CK(layer(false)); });
        if (p.tile_tokens == kMoeTileTokensSmall) {  // the tile kernel with its wave tail
          Nvfp4MoeParams p_tail = p;
          Int4MoeParams q_tail = q;
          Fp8MoeParams f_tail = f;
          p_tail.wave_tail = q_tail.wave_tail = f_tail.wave_tail = -1;
          p_tail.expected_tiles = q_tail.expected_tiles = f_tail.expected_tiles =
              MoeExpectedDecodeTiles(E, c.num_experts, tokens, K);
          us_tail_graph = time_graph([&] {
            CK(is_fp8    ? InvokeFp8Moe(f_tail, s)
               : is_int4 ? InvokeInt4Moe(q_tail, s)
                         : InvokeNvfp4Moe(p_tail, s));
          });
        }
        if (few_ok) {
          us_few_graph = time_graph([&] {
            CK(is_fp8    ? InvokeFp8Moe(f_few, s)
               : is_int4 ? InvokeInt4Moe(q_few, s)
                         : InvokeNvfp4Moe(p_few, s));
          });
        }
      }
      // The fused layer's phases, from one graph replay after an L2 flush (the timed replays'
      // conditions).
      std::string timeline_line;
      if (want_timeline && layer_ok) {
        const size_t tl_bytes = kTimelineBlocks * kFewExpertLayerTimelineEvents * sizeof(uint64_t);
        Nvfp4MoeParams p_tl = p_fused;
        Int4MoeParams q_tl = q_fused;
        Fp8MoeParams f_tl = f_fused;
        p_tl.few_expert_layer_timeline = q_tl.few_expert_layer_timeline =
            f_tl.few_expert_layer_timeline = timeline;
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        CK(is_fp8    ? InvokeFp8Moe(f_tl, s)
           : is_int4 ? InvokeInt4Moe(q_tl, s)
                     : InvokeNvfp4Moe(p_tl, s));
        CK(cudaStreamEndCapture(s, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        for (int it = 0; it < 3; ++it) {  // the last replay's stamps are kept
          CK(cudaMemsetAsync(timeline, 0, tl_bytes, s));
          flush_l2(it);
          CK(cudaEventRecord(ev[0], s));
          CK(cudaGraphLaunch(exec, s));
          CK(cudaEventRecord(ev[1], s));
          CK(cudaEventSynchronize(ev[1]));
        }
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
        std::vector<uint64_t> h(kTimelineBlocks * kFewExpertLayerTimelineEvents);
        CK(cudaMemcpy(h.data(), timeline, tl_bytes, cudaMemcpyDeviceToHost));
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
        uint64_t t0 = UINT64_MAX;
        int blocks = 0;
        for (int b = 0; b < kTimelineBlocks; ++b) {
          const uint64_t e = h[b * kFewExpertLayerTimelineEvents + kLayerEntry];
          if (e != 0) {
            ++blocks;
            t0 = std::min(t0, e);
          }
        }
        static const char* const kNames[kFewExpertLayerTimelineEvents] = {
            "entry",           "prerequisite",  "staged",         "gate_up_done",
            "down_wait_begin", "down_wait_end", "last_item_done", "exit"};
        if (blocks == 0) {
          timeline_line =
              "  timeline: no stamps (kernels built without MLASERVE_KERNEL_TIMELINE: "
              "cmake -DMLASERVE_KERNEL_TIMELINE=ON)\n";
        } else {
          char buf[256];
          std::snprintf(buf, sizeof(buf),
                        "  timeline (fused, one graph replay of %.1f us, %d blocks; us after the "
                        "first block's entry, min / median / max over the blocks that reach it):",
                        ms * 1e3, blocks);
          timeline_line = buf;
          for (int e = 0; e < kFewExpertLayerTimelineEvents; ++e) {
            std::vector<double> v;
            for (int b = 0; b < kTimelineBlocks; ++b) {
              const uint64_t x = h[b * kFewExpertLayerTimelineEvents + e];
              if (x != 0 && x >= t0) v.push_back((x - t0) * 1e-3);
            }
            if (v.empty()) continue;
            std::sort(v.begin(), v.end());
            std::snprintf(buf, sizeof(buf), " %s %.1f/%.1f/%.1f (%zu)", kNames[e], v.front(),
                          v[v.size() / 2], v.back(), v.size());
            timeline_line += buf;
          }
          timeline_line += "\n";
        }
      }
      const double us_total = Median(t_total), us_gemm = Median(t_gu) + Median(t_dn);
      const double bytes = bytes_per_expert * active;
      auto pct = [&](double us) {
        return us > 0 ? 100.0 * bytes / (us * 1e-6) / 1e9 / copy_gbps : 0;
      };
      const double tflops = flop_per_row * rows / (us_gemm * 1e-6) / 1e12;
      std::printf(
          "%-16s %5s %6d %4d %6d %7d | %8.1f %8.1f %8.1f %8.1f %8.1f | %8.1f %8.1f %8.1f | %7.0f "
          "%5.1f%% %5.1f%% %5.1f%% | %8.1f %8.1f | few %8.1f us %5.1f%% %s| few graph %8.1f us "
          "%5.1f%% | fused %8.1f us %5.1f%% | mma.sync %8.1f us %6.1f TF | tail graph %8.1f us "
          "%5.1f%%\n",
          c.name,
          is_fp8    ? "fp8"
          : is_int4 ? "int4"
                    : "nvfp4",
          tokens, p.tile_tokens, active, rows, Median(t_disp), Median(t_gu), Median(t_dn),
          Median(t_comb), us_total, us_plain, us_layer, us_graph, bytes / (us_layer * 1e-6) / 1e9,
          pct(us_total), pct(us_layer), pct(us_graph), tflops,
          flop_per_row * rows / (us_layer * 1e-6) / 1e12, us_few, pct(us_few),
          few_auto ? "(auto) " : "", us_few_graph, pct(us_few_graph), us_fused, pct(us_fused),
          us_mma, us_mma > 0 ? flop_per_row * rows / (us_mma * 1e-6) / 1e12 : 0.0, us_tail_graph,
          pct(us_tail_graph));
      std::fputs(timeline_line.c_str(), stdout);
      std::fflush(stdout);
      CK(cudaFree(ws));
      CK(cudaFree(d_ids));
      CK(cudaFree(d_w));
      CK(cudaFree(d_x));
      CK(cudaFree(d_out));
    }
    CK(cudaFree(gu_c));
    CK(cudaFree(gu_s));
    CK(cudaFree(dn_c));
    CK(cudaFree(dn_s));
    CK(cudaFree(gu_gs));
    CK(cudaFree(dn_gs));
  }
  std::printf(
      "\nus: stages = dispatch + gate_up + down + combine timed one by one; plain = one "
      "InvokeNvfp4Moe / InvokeInt4Moe / InvokeFp8Moe call, plain launches; layer = the same call, "
      "default "
      "launches (programmatic for tokens * top_k <= 256 in decode); graph = that call replayed as "
      "a CUDA graph (decode only); few: the layer call with the few-expert kernel "
      "(moe_few_expert_gemm.cuh) for both GEMMs (16-token tiles only), (auto) where "
      "InvokeMoeExperts picks it, and that call replayed as a graph (against the layer's graph "
      "column, the comparison the decode step's choice rests on); fused: the same as one launch "
      "(moe_few_expert_layer.h; 1-4 tokens); mma.sync: the layer (plain launches) with 128-token "
      "tiles on the mma.sync kernel instead of the default (SM90: wgmma, "
      "moe_weight_only_wgmma.cuh), and its TFLOP/s; tail graph: the graph column with the tile "
      "kernel's wave tail on the few-expert kernel (Nvfp4MoeParams::wave_tail, the decode step's "
      "default where it keeps the tile kernel). GB/s: weight bytes of the active experts (codes + "
      "scales) / "
      "layer time; %%stage, %%layer, %%graph: of the copy bandwidth above. TFLOP/s: 2 * rows * 3 "
      "* H * I / (gate_up + down time); TF_layer: the same over the layer time.\n");
  return 0;
}
