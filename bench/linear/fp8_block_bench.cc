// DeepSeek FP8 block-128 projections against bf16 ones on the GPU (issue 21): the time of one
// projection with the FP8 block GEMM (kernels/linear/fp8_block_gemm.h: activation quantization
// + cuBLASLt's block-scaled FP8 GEMM; SM90 only, skipped elsewhere), with the weight-only FP8
// kernel the model uses up to 256 rows (kernels/moe/fp8_dense_linear.h: the expert GEMM's dense
// mode, e4m3 converted in registers) and with the bf16 LinearGemm on the same shape (what the
// model runs above 256 rows, on a dequantized copy), each beside its floor: the bytes it must move
// (weights in their format + scales + activations in and out) over the device-to-device copy
// bandwidth measured in the same run (read + write bytes per second).
//
//   fp8_block_bench [--rows 1,8,64,256,2048] [--reps 50]
//
// Shapes: DeepSeek-R1's projections at 8-way tensor parallelism (16 of 128 heads): q_a
// [1536, 7168], kv_a [576, 7168], q_b [3072, 1536], kv_b [4096, 512], o_proj [7168, 2048],
// dense gate_up [4608, 7168].
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/command_line.h"
#include "kernels/linear/fp8_block_gemm.h"
#include "kernels/linear/linear.h"
#include "kernels/moe/fp8_dense_linear.h"

namespace {

#define CHECK_CUDA(e)                                                              \
  do {                                                                             \
    cudaError_t err_ = (e);                                                        \
    if (err_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s: %s\n", #e, cudaGetErrorString(err_));              \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

template <class F>
double MedianMs(F&& f, int reps) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    f();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return t[t.size() / 2];
}

}  // namespace

ABSL_FLAG(mlaserve::IntList, rows, (mlaserve::IntList{{1, 8, 64, 256, 2048}}),
          "Row counts (tokens) to time, comma-separated.");
ABSL_FLAG(int32_t, reps, 50, "Timed repetitions per figure (the median is printed).");

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  mlaserve::ParseFlags(argc, argv, "fp8_block_bench [--rows 1,8,64,256,2048] [--reps 50]");
  const std::vector<int> rows = mlaserve::FlagIntsInRange(FLAGS_rows, 1, 1 << 16);
  const int reps = mlaserve::FlagInRange(FLAGS_reps, 1, 100000);
  const bool block_fp8 = mlaserve::Fp8BlockGemm::Supported(0);
  if (!block_fp8) {
    std::fprintf(stderr,
                 "fp8_block_bench: no cuBLASLt block-scaled FP8 on this GPU (SM90 only): "
                 "weight-only FP8 and bf16 only\n");
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  // Copy bandwidth: 2 GiB device to device, read + write bytes.
  const size_t copy_bytes = size_t{1} << 31;
  void *src, *dst;
  CHECK_CUDA(cudaMalloc(&src, copy_bytes));
  CHECK_CUDA(cudaMalloc(&dst, copy_bytes));
  CHECK_CUDA(cudaMemset(src, 1, copy_bytes));
  const double copy_ms = MedianMs([&] { CHECK_CUDA(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); }, 10);
  const double bw = 2.0 * copy_bytes / (copy_ms * 1e-3);
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(dst));
  std::printf("device %s: copy bandwidth %.0f GB/s (read + write)\n", prop.name, bw / 1e9);

  struct Proj {
    const char* name;
    int64_t n, k;
  };
  const std::vector<Proj> projs = {{"q_a", 1536, 7168}, {"kv_a", 576, 7168},  {"q_b", 3072, 1536},
                                   {"kv_b", 4096, 512}, {"o_proj", 7168, 2048}, {"gate_up", 4608, 7168}};
  auto fp8 = block_fp8 ? mlaserve::Fp8BlockGemm::Create()
                       : absl::StatusOr<std::unique_ptr<mlaserve::Fp8BlockGemm>>(nullptr);
  auto bf16 = mlaserve::LinearGemm::Create();
  if (!fp8.ok() || !bf16.ok()) {
    std::fprintf(stderr, "create failed\n");
    return 1;
  }
  const int max_rows = *std::max_element(rows.begin(), rows.end());
  for (const Proj& p : projs) {
    const int64_t kb = p.k / 128, nb = (p.n + 127) / 128;
    // Several copies of the weights, rotated, so no repetition reads them from L2 (50 MB).
    const int copies = std::max<int64_t>(2, (256ll << 20) / (p.n * p.k));
    // The weight-only kernel's layout (fp8_moe_layout.h): [n_p, k_p] codes, an fp32 per 8 x 64.
    const int64_t n_p = nb * 128, k_p = kb * 128;
    std::vector<void*> w8(copies), w16(copies), ws(copies), wt(copies), wts(copies);
    for (int c = 0; c < copies; ++c) {
      CHECK_CUDA(cudaMalloc(&wt[c], n_p * k_p));
      CHECK_CUDA(cudaMalloc(&wts[c], n_p * k_p / 128));
      CHECK_CUDA(cudaMemset(wt[c], 0x38, n_p * k_p));
      std::vector<float> tiled_scales(n_p * k_p / 512, 1.0f / 64);
      CHECK_CUDA(
          cudaMemcpy(wts[c], tiled_scales.data(), tiled_scales.size() * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMalloc(&w8[c], p.n * p.k));
      CHECK_CUDA(cudaMalloc(&w16[c], p.n * p.k * 2));
      CHECK_CUDA(cudaMalloc(&ws[c], nb * kb * 4));
      CHECK_CUDA(cudaMemset(w8[c], 0x38, p.n * p.k));   // e4m3 1.0
      CHECK_CUDA(cudaMemset(w16[c], 0x3c, p.n * p.k * 2));
      std::vector<float> one(nb * kb, 1.0f / 64);
      CHECK_CUDA(cudaMemcpy(ws[c], one.data(), one.size() * 4, cudaMemcpyHostToDevice));
    }
    void *x, *out, *scratch;
    CHECK_CUDA(cudaMalloc(&x, int64_t{max_rows} * p.k * 2));
    CHECK_CUDA(cudaMalloc(&out, int64_t{max_rows} * p.n * 2));
    CHECK_CUDA(cudaMalloc(&scratch, mlaserve::Fp8BlockGemm::ScratchBytes(max_rows, p.n, p.k)));
    CHECK_CUDA(cudaMemset(x, 0x3c, int64_t{max_rows} * p.k * 2));
    for (int m : rows) {
      int turn = 0;
      mlaserve::Fp8BlockGemm::Args a;
      a.m = m;
      a.n = p.n;
      a.k = p.k;
      a.x = x;
      a.x_stride = p.k;
      a.out = out;
      a.out_stride = p.n;
      a.scratch = scratch;
      bool ok = true;
      double t8 = 0;  // 0: not run (no block-scaled FP8 on this GPU)
      auto run8 = [&] {
        a.w = static_cast<const uint8_t*>(w8[turn % copies]);
        a.w_scale = static_cast<const float*>(ws[turn % copies]);
        ++turn;
        if (auto s = (*fp8)->Run(a, nullptr); !s.ok()) {
          if (ok) std::fprintf(stderr, "%s m %d: %s\n", p.name, m, std::string(s.message()).c_str());
          ok = false;
        }
      };
      if (block_fp8) t8 = MedianMs(run8, reps);
      mlaserve::LinearGemm::Args b;
      b.m = m;
      b.n = p.n;
      b.k = p.k;
      b.x = x;
      b.x_stride = p.k;
      b.out = out;
      b.out_stride = p.n;
      const double t16 = MedianMs([&] {
        b.w = w16[turn % copies];
        ++turn;
        if (auto s = (*bf16)->Run(b, nullptr); !s.ok()) std::fprintf(stderr, "bf16: %s\n", std::string(s.message()).c_str());
      }, reps);
      mlaserve::Fp8DenseLinearParams d;
      d.m = m;
      d.n = static_cast<int>(p.n);
      d.n_p = static_cast<int>(n_p);
      d.k_p = static_cast<int>(k_p);
      d.x = x;
      d.out = out;
      auto run_wo = [&] {
        d.codes = static_cast<const uint8_t*>(wt[turn % copies]);
        d.scales = static_cast<const uint8_t*>(wts[turn % copies]);
        ++turn;
        CHECK_CUDA(mlaserve::InvokeFp8DenseLinear(d, nullptr));
      };
      const double two = MedianMs(run_wo, reps);
      const double act = double(m) * p.k * 2 + double(m) * p.n * 2;
      const double b8 = double(p.n) * p.k + nb * kb * 4 + act, b16 = 2.0 * p.n * p.k + act;
      const double bwo = double(n_p) * k_p * (1.0 + 1.0 / 128) + act;
      const double flops = 2.0 * m * p.n * p.k;
      auto frac = [&](double bytes, double ms) { return ms > 0 ? bytes / bw / (ms * 1e-3) : 0.0; };
      auto tflops = [&](double ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0; };
      std::printf(
          "%-8s n %5lld k %5lld m %5d | fp8 block %8.4f ms, %.2f of copy BW, %6.1f TFLOP/s | fp8 "
          "weight-only %8.4f ms, %.2f, %6.1f | bf16 %8.4f ms, %.2f, %6.1f | bf16 / fp8 block "
          "%.2f, bf16 / weight-only %.2f%s\n",
          p.name, static_cast<long long>(p.n), static_cast<long long>(p.k), m, t8, frac(b8, t8),
          tflops(t8), two, frac(bwo, two), tflops(two), t16, frac(b16, t16), tflops(t16),
          t8 > 0 ? t16 / t8 : 0.0, t16 / two, ok ? "" : " (fp8 FAILED)");
    }
    for (int c = 0; c < copies; ++c) {
      cudaFree(wt[c]);
      cudaFree(wts[c]);
      cudaFree(w8[c]);
      cudaFree(w16[c]);
      cudaFree(ws[c]);
    }
    cudaFree(x);
    cudaFree(out);
    cudaFree(scratch);
  }
  return 0;
}
