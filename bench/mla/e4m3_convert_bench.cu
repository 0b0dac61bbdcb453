// Rate of the two ways an MLA decode kernel can turn fp8 e4m3 cache bytes into f16 MMA operands
// (kernels/mla/NOTES.md, sessions 23-24; kernels/mla/e4m3_convert.cuh, where the bit layout is
// explained):
//   f2fp: cvt.rn.f16x2.e4m3x2 (E4m3x4ToF16x2x2; SASS F2FP.F16.E4M3.UNPACK_B), two per 4 bytes,
//         what the kernels use;
//   alu:  three integer instructions per 2 bytes, exact, times 2^-8 (E4m3x4ToF16x2x2Scaled; a
//         kernel would take 2^8 back in its fp32 scales).
// Prints whether the integer form, in both of the sliced kernel's layouts (one word; byte j of two
// tokens' words, p.v), matches cvt times 2^-8 on all 65,536 byte pairs (NaN skipped: the caches
// hold none), then conversions a second and per SM a clock for each form at 8-32 warps an SM.
// H100 (session 24): f2fp 83.8, alu 42.0 an SM a clock, so the kernels keep cvt; on another GPU
// (SM120) run this first before considering the integer form.
//   e4m3_convert_bench
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "kernels/mla/e4m3_convert.cuh"

namespace {

using mlaserve::mla::E4m3PairToF16x2Scaled;
using mlaserve::mla::E4m3x4ToF16x2x2;
using mlaserve::mla::E4m3x4ToF16x2x2Scaled;
using mlaserve::mla::PrmtSigned;

template <bool kAlu>
__global__ void ThroughputKernel(const uint32_t* in, uint32_t* out, int iters) {
  uint32_t w[8];
  for (int i = 0; i < 8; ++i) w[i] = in[(threadIdx.x + i * 37) & 1023];
  uint32_t acc = 0;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t lo, hi;
      if constexpr (kAlu) {
        E4m3x4ToF16x2x2Scaled(w[i], lo, hi);
      } else {
        E4m3x4ToF16x2x2(w[i], lo, hi);
      }
      acc ^= lo ^ hi;  // both forms pay the same one LOP3 a pair here
      w[i] += 0x01010101u;
    }
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

__global__ void ExactnessKernel(int* mismatches) {
  const uint32_t pair = threadIdx.x + 256 * blockIdx.x;  // 65,536 byte pairs
  const uint32_t w = pair | (pair << 16);
  uint32_t f_lo, f_hi, a_lo, a_hi;
  E4m3x4ToF16x2x2(w, f_lo, f_hi);
  E4m3x4ToF16x2x2Scaled(w, a_lo, a_hi);
  for (int i = 0; i < 2; ++i) {
    const uint8_t byte = (pair >> (8 * i)) & 0xff;
    if ((byte & 0x7f) == 0x7f) continue;  // NaN
    const float f = __half2float(__ushort_as_half(static_cast<uint16_t>(f_lo >> (16 * i))));
    const float a = __half2float(__ushort_as_half(static_cast<uint16_t>(a_lo >> (16 * i))));
    if (f * (1.0f / 256.0f) != a || signbit(f) != signbit(a)) atomicAdd(mismatches, 1);
  }
  if (f_lo != f_hi || a_lo != a_hi) atomicAdd(mismatches, 1);  // both halves hold the same pair
  // The p.v form: byte j of two tokens' words straight into one pair (selector j | j << 4 |
  // (8 | j) << 8 | (4 + j) << 12), against cvt of the same two bytes.
  const uint32_t t0 = pair & 0xff, t1 = pair >> 8;
  const uint32_t v0 = t0 * 0x01010101u, v1 = t1 * 0x01010101u;  // byte j = t0 / t1 for every j
  uint32_t ref, unused;
  E4m3x4ToF16x2x2(t0 | (t1 << 8), ref, unused);
  const uint32_t pv[4] = {E4m3PairToF16x2Scaled(PrmtSigned<0x4800>(v0, v1)),
                          E4m3PairToF16x2Scaled(PrmtSigned<0x5911>(v0, v1)),
                          E4m3PairToF16x2Scaled(PrmtSigned<0x6a22>(v0, v1)),
                          E4m3PairToF16x2Scaled(PrmtSigned<0x7b33>(v0, v1))};
  for (int j = 0; j < 4; ++j) {
    for (int i = 0; i < 2; ++i) {
      if ((((pair >> (8 * i)) & 0x7f)) == 0x7f) continue;  // NaN
      const float f = __half2float(__ushort_as_half(static_cast<uint16_t>(ref >> (16 * i))));
      const float a = __half2float(__ushort_as_half(static_cast<uint16_t>(pv[j] >> (16 * i))));
      if (f * (1.0f / 256.0f) != a || signbit(f) != signbit(a)) atomicAdd(mismatches, 1);
    }
  }
}

#define CHECK(x)                                                    \
  do {                                                              \
    cudaError_t e_ = (x);                                           \
    if (e_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      return 1;                                                     \
    }                                                               \
  } while (0)

}  // namespace

int main() {
  int dev = 0, sms = 0, clock_khz = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device %s, %d SMs, %d MHz\n", prop.name, sms, clock_khz / 1000);
  uint32_t *in = nullptr, *out = nullptr;
  int* mismatches = nullptr;
  CHECK(cudaMalloc(&in, 1024 * sizeof(uint32_t)));
  CHECK(cudaMalloc(&out, static_cast<size_t>(sms) * 2048 * sizeof(uint32_t)));
  CHECK(cudaMallocManaged(&mismatches, sizeof(int)));
  CHECK(cudaMemset(in, 0x3b, 1024 * sizeof(uint32_t)));
  *mismatches = 0;
  ExactnessKernel<<<256, 256>>>(mismatches);
  CHECK(cudaDeviceSynchronize());
  std::printf("integer form against cvt x 2^-8: %d mismatches in 65,536 byte pairs (NaN skipped)\n",
              *mismatches);
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  constexpr int kIters = 4096;
  for (int threads : {256, 512, 1024}) {
    for (int alu = 0; alu < 2; ++alu) {
      const int blocks = sms * (2048 / threads);
      float best = 1e30f;
      for (int rep = 0; rep < 3; ++rep) {
        CHECK(cudaEventRecord(e0));
        if (alu) {
          ThroughputKernel<true><<<blocks, threads>>>(in, out, kIters);
        } else {
          ThroughputKernel<false><<<blocks, threads>>>(in, out, kIters);
        }
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        best = std::fmin(best, ms);
      }
      const double values = static_cast<double>(blocks) * threads * kIters * 8 * 4;
      std::printf("%s %4d threads a block: %.3f ms, %.1f G e4m3/s, %.1f an SM a clock\n",
                  alu ? "alu " : "f2fp", threads, best, values / best / 1e6,
                  values / (best * 1e-3) / sms / (clock_khz * 1e3));
    }
  }
  return 0;
}
