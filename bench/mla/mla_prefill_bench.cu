// MLA chunked-prefill attention speed (InvokeMlaPrefill, step 2 of mla_prefill.h) on the current
// GPU. Each configuration: `seqs` sequences of `ctx` cached tokens + `new` new tokens, `heads`
// heads, (nope, v) head dims; inputs random bf16 (|x| in [2^-3, 2^1)).
//
// FLOPs counted: the causal work only, 2 * heads * sum_i keys_i * ((nope + 64) + v) with keys_i
// = ctx + i + 1 (S = Q K^T and O = P V; softmax not counted). The fraction printed is of
// --peak_tflops (default 989: the H100/H200 SXM datasheet dense BF16 figure, which needs wgmma;
// this kernel uses mma.sync, so well below 1 is expected). Median of --iters timed calls after
// 3 warm-up calls, one CSV line per configuration on stdout.
//
//   mla_prefill_bench [--heads 16,128] [--ctx 0,4096] [--new 512,4096] [--seqs 1]
//                     [--dims 128x128,64x64] [--iters 20] [--peak_tflops 989]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/command_line.h"
#include "kernels/mla/mla_prefill.h"

ABSL_FLAG(mlaserve::IntList, heads, (mlaserve::IntList{{16, 128}}),
          "Query heads, each in [1, 1024].");
ABSL_FLAG(mlaserve::IntList, ctx, (mlaserve::IntList{{0, 4096}}),
          "Cached prefix tokens per sequence, each in [0, 16777216].");
ABSL_FLAG(mlaserve::IntList, new, (mlaserve::IntList{{512, 4096}}),
          "New (prefilled) tokens per sequence, each in [1, 16777216].");
ABSL_FLAG(mlaserve::IntList, seqs, (mlaserve::IntList{{1}}),
          "Sequences per call, each in [1, 65536].");
ABSL_FLAG(int32_t, iters, 20, "Timed calls per configuration, in [1, 100000].");
ABSL_FLAG(double, peak_tflops, 989.0, "The GPU's peak bf16 TFLOP/s the fraction is of, > 0.");
ABSL_FLAG(std::vector<std::string>, dims, std::vector<std::string>({"128x128"}),
          "Head dims NOPExV (qk_nope x v_head), comma-separated.");

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

__global__ void FillBf16(uint16_t* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint64_t h = (i + 1) * 0x9e3779b97f4a7c15ULL ^ seed;
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 29;
    const uint32_t exp = 124 + (h % 4);  // 2^-3 .. 2^0 times [1, 2)
    x[i] = static_cast<uint16_t>(((h >> 20) & 0x8000) | (exp << 7) | ((h >> 8) & 0x7f));
  }
}

int Main(int argc, char** argv) {
  ParseFlags(argc, argv, "mla_prefill_bench [flags]");
  const std::vector<int> heads_list = FlagIntsInRange(FLAGS_heads, 1, 1024);
  const std::vector<int> ctx_list = FlagIntsInRange(FLAGS_ctx, 0, 1 << 24);
  const std::vector<int> new_list = FlagIntsInRange(FLAGS_new, 1, 1 << 24);
  const std::vector<int> seqs_list = FlagIntsInRange(FLAGS_seqs, 1, 1 << 16);
  const int iters = FlagInRange(FLAGS_iters, 1, 100000);
  const double peak = absl::GetFlag(FLAGS_peak_tflops);
  if (!(peak > 0)) UsageError(absl::StrCat("--peak-tflops ", peak, ": must be > 0"));
  std::vector<std::pair<int, int>> dims;
  for (const std::string& d : absl::GetFlag(FLAGS_dims)) {
    std::vector<std::string> parts = absl::StrSplit(d, 'x');
    int nope = 0, v = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &nope) ||
        !absl::SimpleAtoi(parts[1], &v) || nope < 1 || v < 1) {
      UsageError("--dims " + d + ": expected NOPExV, e.g. 128x128");
    }
    dims.emplace_back(nope, v);
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::fprintf(stderr, "device %s, %d SMs; peak for the fraction %.0f TFLOP/s\n", prop.name,
               prop.multiProcessorCount, peak);
  std::printf("nope,v,heads,seqs,ctx,new,us,tflops,frac_peak\n");
  for (const auto& [nope, v] : dims) {
    for (int heads : heads_list) {
      for (int seqs : seqs_list) {
        for (int ctx : ctx_list) {
          for (int n : new_list) {
            const int qk = nope + 64;
            const size_t total_q = size_t(seqs) * n, total_kv = size_t(seqs) * (ctx + n);
            std::vector<int32_t> q_begin(seqs + 1), kv_begin(seqs + 1), ctxs(seqs, ctx);
            for (int s = 0; s <= seqs; ++s) {
              q_begin[s] = s * n;
              kv_begin[s] = s * (ctx + n);
            }
            uint16_t *q, *kv, *rope, *out;
            int32_t *d_qb, *d_kvb, *d_ctx;
            CHECK_CUDA(cudaMalloc(&q, total_q * heads * qk * 2));
            CHECK_CUDA(cudaMalloc(&kv, total_kv * heads * (nope + v) * 2));
            CHECK_CUDA(cudaMalloc(&rope, total_kv * 64 * 2));
            CHECK_CUDA(cudaMalloc(&out, total_q * heads * v * 2));
            CHECK_CUDA(cudaMalloc(&d_qb, (seqs + 1) * 4));
            CHECK_CUDA(cudaMalloc(&d_kvb, (seqs + 1) * 4));
            CHECK_CUDA(cudaMalloc(&d_ctx, seqs * 4));
            FillBf16<<<1024, 256>>>(q, total_q * heads * qk, 1);
            FillBf16<<<1024, 256>>>(kv, total_kv * heads * (nope + v), 2);
            FillBf16<<<1024, 256>>>(rope, total_kv * 64, 3);
            CHECK_CUDA(cudaGetLastError());
            CHECK_CUDA(cudaMemcpy(d_qb, q_begin.data(), (seqs + 1) * 4, cudaMemcpyHostToDevice));
            CHECK_CUDA(cudaMemcpy(d_kvb, kv_begin.data(), (seqs + 1) * 4, cudaMemcpyHostToDevice));
            CHECK_CUDA(cudaMemcpy(d_ctx, ctxs.data(), seqs * 4, cudaMemcpyHostToDevice));
            MlaPrefillParams p;
            p.num_seqs = seqs;
            p.heads = heads;
            p.qk_nope = nope;
            p.v_dim = v;
            p.q = q;
            p.kv = kv;
            p.k_rope = rope;
            p.q_begin = d_qb;
            p.kv_begin = d_kvb;
            p.context_lens = d_ctx;
            p.total_q = static_cast<int>(total_q);
            p.max_q_len = n;
            p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(qk));
            p.out = out;
            cudaEvent_t e0, e1;
            CHECK_CUDA(cudaEventCreate(&e0));
            CHECK_CUDA(cudaEventCreate(&e1));
            std::vector<float> times;
            for (int it = 0; it < iters + 3; ++it) {
              CHECK_CUDA(cudaEventRecord(e0));
              const absl::Status st = InvokeMlaPrefill(p, nullptr);
              CHECK_CUDA(cudaEventRecord(e1));
              if (!st.ok()) {
                std::fprintf(stderr, "%s\n", st.ToString().c_str());
                return 1;
              }
              CHECK_CUDA(cudaEventSynchronize(e1));
              float ms = 0;
              CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
              if (it >= 3) times.push_back(ms);
            }
            std::sort(times.begin(), times.end());
            const double us = 1e3 * times[times.size() / 2];
            // sum_{i<n} (ctx + i + 1) keys per (sequence, head).
            const double keys = double(n) * ctx + double(n) * (n + 1) / 2;
            const double flops = 2.0 * seqs * heads * keys * (qk + v);
            const double tflops = flops / (us * 1e-6) / 1e12;
            std::printf("%d,%d,%d,%d,%d,%d,%.1f,%.1f,%.3f\n", nope, v, heads, seqs, ctx, n, us,
                        tflops, tflops / peak);
            std::fflush(stdout);
            CHECK_CUDA(cudaEventDestroy(e0));
            CHECK_CUDA(cudaEventDestroy(e1));
            for (void* ptr :
                 {static_cast<void*>(q), static_cast<void*>(kv), static_cast<void*>(rope),
                  static_cast<void*>(out), static_cast<void*>(d_qb), static_cast<void*>(d_kvb),
                  static_cast<void*>(d_ctx)}) {
              CHECK_CUDA(cudaFree(ptr));
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
