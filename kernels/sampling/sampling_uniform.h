// The uniform number a sampled request draws at one generation step: SplitMix64 of (seed, step),
// counter-based so that no state is carried between steps. Shared by the CPU reference
// (sampling_ref.cc) and the CUDA sampler (sampling.cu) so that both draw the same bits.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define MLASERVE_SAMPLING_HD __host__ __device__ __forceinline__
#else
#define MLASERVE_SAMPLING_HD inline
#endif

namespace mlaserve {

MLASERVE_SAMPLING_HD uint64_t SamplingSplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// In [0, 1) with 53 random bits; exact in double (an integer below 2^53 times 2^-53).
MLASERVE_SAMPLING_HD double SamplingUniformOf(uint64_t seed, uint64_t step) {
  const uint64_t bits =
      SamplingSplitMix64(SamplingSplitMix64(seed) ^ (step * 0xd1b54a32d192ed03ull));
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);
}

}  // namespace mlaserve
