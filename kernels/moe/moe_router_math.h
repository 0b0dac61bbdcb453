// Router arithmetic that gives the same bits on the host (C++) and on the GPU (CUDA).
//
// Expert selection compares scores exactly, so the CPU reference and the GPU kernel must compute
// every score with the same roundings. Library expf differs between glibc and CUDA by an ulp now
// and then, and nvcc fuses a*b+c into one FMA where the host compiler does not. So scores are
// computed here with explicit fused multiply-adds (correctly rounded on both sides: std::fma,
// __fmaf_rn) and explicitly rounded single operations (__fadd_rn etc. cannot be contracted).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MLASERVE_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define MLASERVE_HD inline
#endif

namespace mlaserve::router_math {

MLASERVE_HD float Fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
MLASERVE_HD float Add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MLASERVE_HD float Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MLASERVE_HD float Div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MLASERVE_HD float Rint(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::rint(x);  // round half to even under the default rounding mode, as rintf on the GPU
#endif
}
// 2^e for -126 <= e <= 127, exactly.
MLASERVE_HD float Pow2(int e) {
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// exp(x) within about 2 ulp (Cephes expf: Cody-Waite reduction by ln 2, degree-7 polynomial),
// identical bits on host and device. Subnormal results are rounded once, by the final multiply.
MLASERVE_HD float Exp(float x) {
  if (!(x <= 88.7f)) return x != x ? x : __builtin_huge_valf();  // NaN stays NaN; overflow -> inf
  if (x < -104.0f) return 0.0f;
  const float k = Rint(Mul(x, 1.44269504088896341f));
  float r = Fma(-k, 0.693359375f, x);  // ln2 split: 0.693359375 - 2.12194440e-4
  r = Fma(-k, -2.12194440e-4f, r);
  const float z = Mul(r, r);
  float p = 1.9875691500e-4f;
  p = Fma(p, r, 1.3981999507e-3f);
  p = Fma(p, r, 8.3334519073e-3f);
  p = Fma(p, r, 4.1665795894e-2f);
  p = Fma(p, r, 1.6666665459e-1f);
  p = Fma(p, r, 5.0000001201e-1f);
  p = Fma(p, z, r);
  p = Add(p, 1.0f);
  const int ki = static_cast<int>(k);  // -150 <= ki <= 128
  const int k1 = ki / 2;
  return Mul(Mul(p, Pow2(k1)), Pow2(ki - k1));
}

// 1 / (1 + exp(-x)).
MLASERVE_HD float Sigmoid(float x) { return Div(1.0f, Add(1.0f, Exp(-x))); }

// The order in which expert selection ranks candidates: higher score first, the lower index on
// equal scores. NaN scores are ranked as -inf by the callers (so the order is total).
MLASERVE_HD bool Better(float score_a, int index_a, float score_b, int index_b) {
  return score_a > score_b || (score_a == score_b && index_a < index_b);
}

}  // namespace mlaserve::router_math
