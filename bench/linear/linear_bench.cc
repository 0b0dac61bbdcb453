// The bf16 projections of a decode step (LinearGemm: the skinny kernels up to 4 rows, cuBLASLt
// above) on Kimi-K2.5's rank-0-of-8 shapes, against the copy bandwidth measured in the same run,
// with cuBLASLt's algorithm chosen each way LinearGemm::SetHeuristicChoice offers: the
// heuristic's first algorithm (the default), its next ones, and its first without split-K. Weights
// are cold (L2 emptied by reading 128 MB before every timed run), as in a step that reads each
// layer's weights once. Times are between two events around the one launch, so they include its
// launch latency (a step's back-to-back launches hide some of it): the fractions are low bounds.
// Prints one line per (shape, rows, choice): time, GB/s of the bytes the product must move (weight
// + activations in and out), the fraction of copy bandwidth, and the algorithm (id, tile, stages,
// split-K, reduction scheme). Up to 4 rows LinearGemm runs the skinny kernels
// (kernels/linear/skinny_gemm.h), whatever the choice; 5-16 rows are also timed on their
// tensor-core variant (choice skinny_mma), and 5-64 rows on the split-K tensor-core decode GEMM
// (kernels/linear/decode_gemm.h; choice decode_gemm).
//
//   linear_bench [--rows 1,4,8,16,32,64,128,256] [--ranks 0,1,2,3] [--reps 20]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "common/command_line.h"
#include "kernels/linear/decode_gemm.h"
#include "kernels/linear/linear.h"

namespace {

#define CHECK_CUDA(e)                                                 \
  do {                                                                \
    cudaError_t err_ = (e);                                           \
    if (err_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #e, cudaGetErrorString(err_)); \
      std::exit(1);                                                   \
    }                                                                 \
  } while (0)

struct Shape {
  const char* name;
  int64_t n, k;
};

// Kimi-K2.5 at 8-way parallelism, rank 0 (8 of 64 heads; the shared expert and the dense MLP
// tensor-parallel; the router replicated, fp32 out; lm_head vocabulary-parallel).
constexpr Shape kShapes[] = {
    {"q_a", 1536, 7168},      {"kv_a", 576, 7168},        {"q_b", 1536, 1536},
    {"o_proj", 7168, 1024},   {"shared_gate", 256, 7168}, {"shared_down", 7168, 256},
    {"router", 384, 7168},    {"dense_gate", 2304, 7168}, {"dense_down", 7168, 2304},
    {"lm_head", 20480, 7168},
};

}  // namespace

ABSL_FLAG(mlaserve::IntList, rows, (mlaserve::IntList{{8, 16, 32, 64, 128, 256}}),
          "Activation rows (tokens) of each product.");
ABSL_FLAG(mlaserve::IntList, ranks, (mlaserve::IntList{{0, 1, 2, 3}}),
          "Heuristic ranks to time (0: the heuristic's first algorithm, LinearGemm's default).");
ABSL_FLAG(int32_t, reps, 20, "Timed runs of each product (median), 1..1000.");

int main(int argc, char** argv) {
  mlaserve::ParseFlags(argc, argv, "linear_bench [--rows N,...] [--ranks R,...] [--reps N]");
  const std::vector<int64_t> rows = absl::GetFlag(FLAGS_rows).values;
  const std::vector<int64_t> ranks = absl::GetFlag(FLAGS_ranks).values;
  const int reps = std::clamp(absl::GetFlag(FLAGS_reps), 1, 1000);
  for (int64_t r : rows) {
    if (r < 1 || r > 65536) {
      std::fprintf(stderr, "linear_bench: --rows %lld: must be in [1, 65536]\n",
                   static_cast<long long>(r));
      return 2;
    }
  }
  for (int64_t r : ranks) {
    if (r < 0 || r > 15) {
      std::fprintf(stderr, "linear_bench: --ranks %lld: must be in [0, 15]\n",
                   static_cast<long long>(r));
      return 2;
    }
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));

  // Copy bandwidth (read + write bytes a second) of a 1 GB device-to-device copy.
  const size_t copy_bytes = size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaMalloc(&src, copy_bytes));
  CHECK_CUDA(cudaMalloc(&dst, copy_bytes));
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  float best_ms = 1e30f;
  for (int i = 0; i < 6; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    CHECK_CUDA(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice));
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (i > 0) best_ms = std::min(best_ms, ms);
  }
  CHECK_CUDA(cudaFree(dst));
  CHECK_CUDA(cudaFree(src));
  const double copy_gbps = 2.0 * copy_bytes / (best_ms * 1e-3) / 1e9;
  std::printf("device %s, %d SMs; d2d copy bandwidth %.0f GB/s\n", prop.name,
              prop.multiProcessorCount, copy_gbps);

  // L2 is emptied by a one-row product over a 128 MB weight (the skinny kernel: reads, writes
  // 16 KB), so the lines it leaves are clean: a memset left 50 MB of dirty lines whose write-back
  // slowed whatever ran next.
  const int64_t flush_n = 8192, flush_k = 8192;
  void *flush_w = nullptr, *flush_x = nullptr, *flush_out = nullptr;
  CHECK_CUDA(cudaMalloc(&flush_w, flush_n * flush_k * 2));
  CHECK_CUDA(cudaMalloc(&flush_x, flush_k * 2));
  CHECK_CUDA(cudaMalloc(&flush_out, flush_n * 2));
  CHECK_CUDA(cudaMemset(flush_w, 0x11, flush_n * flush_k * 2));
  CHECK_CUDA(cudaMemset(flush_x, 0x11, flush_k * 2));
  mlaserve::LinearGemm::Args flush;
  flush.m = 1;
  flush.n = flush_n;
  flush.k = flush_k;
  flush.x = flush_x;
  flush.x_stride = flush_k;
  flush.w = flush_w;
  flush.out = flush_out;
  flush.out_stride = flush_n;
  int64_t max_w = 0, max_io = 0;
  int64_t max_rows = 1;
  for (int64_t r : rows) max_rows = std::max(max_rows, r);
  for (const Shape& s : kShapes) {
    max_w = std::max(max_w, s.n * s.k);
    max_io = std::max(max_io, std::max(s.n, s.k));
  }
  void *w = nullptr, *x = nullptr, *out = nullptr;
  CHECK_CUDA(cudaMalloc(&w, max_w * 2));
  CHECK_CUDA(cudaMalloc(&x, static_cast<size_t>(max_rows) * max_io * 2));
  CHECK_CUDA(cudaMalloc(&out, static_cast<size_t>(max_rows) * max_io * 4));
  CHECK_CUDA(cudaMemset(w, 0x11, max_w * 2));  // small finite bf16 values
  CHECK_CUDA(cudaMemset(x, 0x11, static_cast<size_t>(max_rows) * max_io * 2));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  auto gemm = mlaserve::LinearGemm::Create(size_t{32} << 20);
  if (!gemm.ok()) {
    std::fprintf(stderr, "%s\n", std::string(gemm.status().message()).c_str());
    return 1;
  }

  std::printf("shape,n,k,rows,choice,us,gbps,frac_copy,algorithm\n");
  struct Choice {
    std::string label;
    int rank, no_split_rows, skinny_mma_rows, decode_rows = 0;
  };
  std::vector<Choice> choices;
  for (int64_t r : ranks) {
    choices.push_back({"rank" + std::to_string(r), static_cast<int>(r), 0, 0});
  }
  choices.push_back({"no_split", 0, 1, 0});
  // The skinny kernels' tensor-core variant (5..16 rows, LinearGemm::SetSkinnyTensorCoreRows).
  choices.push_back({"skinny_mma", 0, 0, mlaserve::kSkinnyMmaMaxRows});
  // The split-K tensor-core decode GEMM (5..64 rows, LinearGemm::SetDecodeGemmRows).
  choices.push_back({"decode_gemm", 0, 0, 0, mlaserve::kDecodeGemmMaxRows});
  for (const Shape& s : kShapes) {
    for (int64_t m : rows) {
      mlaserve::LinearGemm::Args args;
      args.m = m;
      args.n = s.n;
      args.k = s.k;
      args.x = x;
      args.x_stride = s.k;
      args.w = w;
      args.out = out;
      const bool router = std::string(s.name) == "router";
      args.out_dtype = router ? mlaserve::DType::kF32 : mlaserve::DType::kBF16;
      args.out_stride = s.n;
      const double bytes = 2.0 * s.n * s.k + 2.0 * m * s.k + (router ? 4.0 : 2.0) * m * s.n;
      for (const Choice& c : choices) {
        if (c.skinny_mma_rows > 0 && (m <= mlaserve::kSkinnyMaxRows || m > c.skinny_mma_rows)) {
          continue;
        }
        if (c.decode_rows > 0 && (m <= mlaserve::kSkinnyMaxRows || m > c.decode_rows)) continue;
        (*gemm)->SetHeuristicChoice(c.rank, c.no_split_rows);
        (*gemm)->SetSkinnyTensorCoreRows(c.skinny_mma_rows);
        (*gemm)->SetDecodeGemmRows(c.decode_rows);
        // Up to kSkinnyMaxRows rows (and with skinny_mma) Run takes the skinny kernels.
        const bool skinny = m <= mlaserve::kSkinnyMaxRows || c.skinny_mma_rows > 0;
        auto summary = skinny          ? absl::StatusOr<std::string>(m <= mlaserve::kSkinnyMaxRows
                                                                         ? "skinny kernel (CUDA cores)"
                                                                         : "skinny kernel (mma)")
                       : c.decode_rows ? absl::StatusOr<std::string>("decode GEMM (split-K mma)")
                                       : (*gemm)->PlanSummary(args);
        std::vector<float> t;
        bool failed = false;
        for (int i = 0; i < reps + 2 && !failed; ++i) {
          if (absl::Status f = (*gemm)->Run(flush, stream); !f.ok()) {
            std::fprintf(stderr, "flush: %s\n", std::string(f.message()).c_str());
            return 1;
          }
          CHECK_CUDA(cudaEventRecord(a, stream));
          absl::Status st = (*gemm)->Run(args, stream);
          CHECK_CUDA(cudaEventRecord(b, stream));
          CHECK_CUDA(cudaEventSynchronize(b));
          if (!st.ok()) {
            std::fprintf(stderr, "%s m %lld %s: %s\n", s.name, static_cast<long long>(m),
                         c.label.c_str(), std::string(st.message()).c_str());
            failed = true;
            break;
          }
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
          if (i >= 2) t.push_back(ms);
        }
        if (failed) continue;
        std::sort(t.begin(), t.end());
        const double us = t[t.size() / 2] * 1e3;
        const double gbps = bytes / (us * 1e-6) / 1e9;
        std::printf(
            "%s,%lld,%lld,%lld,%s,%.2f,%.0f,%.3f,%s\n", s.name, static_cast<long long>(s.n),
            static_cast<long long>(s.k), static_cast<long long>(m), c.label.c_str(), us, gbps,
            gbps / copy_gbps,
            summary.ok() ? summary->c_str() : std::string(summary.status().message()).c_str());
      }
    }
  }
  (*gemm)->SetHeuristicChoice(0, 0);
  (*gemm)->SetSkinnyTensorCoreRows(0);
  (*gemm)->SetDecodeGemmRows(0);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  return 0;
}
