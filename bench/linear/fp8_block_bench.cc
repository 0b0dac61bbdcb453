// DeepSeek FP8 block-128 projections against bf16 ones on the GPU (issue 21): the time of one
// projection with the FP8 block GEMM (kernels/linear/fp8_block_gemm.h: activation quantization
// + cuBLASLt's block-scaled FP8 GEMM) and with the bf16 LinearGemm on the same shape (the
// dequantized weights the model uses where FP8 is not supported), each beside its floor: the
// bytes it must move (weights in their format + scales + activations in and out) over the
// device-to-device copy bandwidth measured in the same run (read + write bytes per second).
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

#include "kernels/linear/fp8_block_gemm.h"
#include "kernels/linear/linear.h"

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

std::vector<int> Ints(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::vector<int> rows = {1, 8, 64, 256, 2048};
  int reps = 50;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rows")) rows = Ints(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: fp8_block_bench [--rows 1,8,64] [--reps 50]\n");
      return 2;
    }
  }
  if (!mlaserve::Fp8BlockGemm::Supported(0)) {
    std::fprintf(stderr, "fp8_block_bench: this GPU has no cuBLASLt block-scaled FP8 (SM90 only)\n");
    return 1;
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
  auto fp8 = mlaserve::Fp8BlockGemm::Create();
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
    std::vector<void*> w8(copies), w16(copies), ws(copies);
    for (int c = 0; c < copies; ++c) {
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
      const double t8 = MedianMs([&] {
        a.w = static_cast<const uint8_t*>(w8[turn % copies]);
        a.w_scale = static_cast<const float*>(ws[turn % copies]);
        ++turn;
        if (auto s = (*fp8)->Run(a, nullptr); !s.ok()) {
          if (ok) std::fprintf(stderr, "%s m %d: %s\n", p.name, m, std::string(s.message()).c_str());
          ok = false;
        }
      }, reps);
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
      const double act = double(m) * p.k * 2 + double(m) * p.n * 2;
      const double b8 = double(p.n) * p.k + nb * kb * 4 + act, b16 = 2.0 * p.n * p.k + act;
      const double flops = 2.0 * m * p.n * p.k;
      std::printf(
          "%-8s n %5lld k %5lld m %5d | fp8 block %8.4f ms, %.2f of copy BW, %6.1f TFLOP/s | bf16 %8.4f ms, "
          "%.2f of copy BW, %6.1f TFLOP/s | bf16 / fp8 time %.2f%s\n",
          p.name, static_cast<long long>(p.n), static_cast<long long>(p.k), m, t8, b8 / bw / (t8 * 1e-3),
          flops / (t8 * 1e-3) / 1e12, t16, b16 / bw / (t16 * 1e-3), flops / (t16 * 1e-3) / 1e12, t16 / t8,
          ok ? "" : " (fp8 FAILED)");
    }
    for (int c = 0; c < copies; ++c) {
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
