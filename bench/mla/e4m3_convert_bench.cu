// Issue rate of the two ways to turn fp8 e4m3 cache bytes into f16 MMA operands (the sliced MLA
// kernel converts every K and V byte in registers; kernels/mla/NOTES.md, session 23):
//   f2fp: cvt.rn.f16x2.e4m3x2 (PTX ISA "cvt", sm_89+; SASS F2FP.F16.E4M3.UNPACK_B), two per
//         4 bytes;
//   alu:  three integer instructions per 2 bytes, exact, scaled by 2^-8 (a caller folds 2^8 into
//         its fp32 scales): the 16-bit lane [low byte b, high byte b's sign replicated]
//         (one PRMT makes both lanes of a word), shifted right by one arithmetically and masked
//         with 0xbf80: bit 15 = the sign, bits 13..7 = b's exponent and mantissa (so the f16
//         exponent field is e4m3's, 15 - 7 = 8 less bias), bit 14 and bits 6..0 cleared. e4m3
//         subnormals map to f16 subnormals (m * 2^-9 * 2^-8 = m * 2^7 * 2^-24), so every finite
//         value is exact; NaN (0x7f / 0xff) maps to a finite value (the caches hold none).
// Prints whether the integer form matches cvt bit for bit (times 2^-8) on all 65,536 byte pairs,
// then conversions a second and per SM a clock for each form at 8-32 warps an SM.
//   e4m3_convert_bench
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>

namespace {

__device__ __forceinline__ void CvtF2fp(uint32_t four, uint32_t& lo, uint32_t& hi) {
  asm volatile(
      "{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(four));
}

// Bytes [b0, b1, b2, b3] -> lo = (b0, b1) * 2^-8, hi = (b2, b3) * 2^-8 as f16x2.
__device__ __forceinline__ void CvtAlu(uint32_t w, uint32_t& lo, uint32_t& hi) {
  uint32_t x, y;
  // prmt selector nibbles pick result bytes 0..3; 8 | i replicates byte i's sign bit.
  asm volatile("prmt.b32 %0, %1, 0, 0x1800;" : "=r"(x) : "r"(w));  // [b0, b0, sx(b0), b1]
  asm volatile("prmt.b32 %0, %1, 0, 0x3a22;" : "=r"(y) : "r"(w));  // [b2, b2, sx(b2), b3]
  lo = static_cast<uint32_t>(static_cast<int32_t>(x) >> 1) & 0xbf80bf80u;
  hi = static_cast<uint32_t>(static_cast<int32_t>(y) >> 1) & 0xbf80bf80u;
}

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
        CvtAlu(w[i], lo, hi);
      } else {
        CvtF2fp(w[i], lo, hi);
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
  CvtF2fp(w, f_lo, f_hi);
  CvtAlu(w, a_lo, a_hi);
  for (int i = 0; i < 2; ++i) {
    const uint8_t byte = (pair >> (8 * i)) & 0xff;
    if ((byte & 0x7f) == 0x7f) continue;  // NaN
    const float f = __half2float(__ushort_as_half(static_cast<uint16_t>(f_lo >> (16 * i))));
    const float a = __half2float(__ushort_as_half(static_cast<uint16_t>(a_lo >> (16 * i))));
    if (f * (1.0f / 256.0f) != a || signbit(f) != signbit(a)) atomicAdd(mismatches, 1);
  }
  if (f_lo != f_hi || a_lo != a_hi) atomicAdd(mismatches, 1);  // both halves hold the same pair
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
