// The MLA decode benches' shared timing (bench/mla/mla_decode_bench.cu and its FlashMLA peer,
// bench/mla/flashmla_peer.cu), so the two programs measure the same way by construction: the copy
// bandwidth ceiling, the number of cache copies that defeat L2, and the median replay of a graph
// holding one call per copy. Host code only (CUDA runtime).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace mlaserve::bench {

inline void DecodeTimingCheck(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

// Device-to-device copy bandwidth, bytes read + written a second: a 4 GiB copy, median of 10
// after 2 warm-ups.
inline double MeasureCopyBandwidth() {
  const size_t bytes = size_t{4} << 30;
  void *a, *b;
  DecodeTimingCheck(cudaMalloc(&a, bytes), "cudaMalloc");
  DecodeTimingCheck(cudaMalloc(&b, bytes), "cudaMalloc");
  DecodeTimingCheck(cudaMemset(a, 1, bytes), "cudaMemset");
  cudaEvent_t e0, e1;
  DecodeTimingCheck(cudaEventCreate(&e0), "cudaEventCreate");
  DecodeTimingCheck(cudaEventCreate(&e1), "cudaEventCreate");
  std::vector<float> ms;
  for (int i = 0; i < 12; ++i) {
    DecodeTimingCheck(cudaEventRecord(e0), "cudaEventRecord");
    DecodeTimingCheck(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
    DecodeTimingCheck(cudaEventRecord(e1), "cudaEventRecord");
    DecodeTimingCheck(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float t;
    DecodeTimingCheck(cudaEventElapsedTime(&t, e0, e1), "cudaEventElapsedTime");
    if (i >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  DecodeTimingCheck(cudaEventDestroy(e0), "cudaEventDestroy");
  DecodeTimingCheck(cudaEventDestroy(e1), "cudaEventDestroy");
  DecodeTimingCheck(cudaFree(a), "cudaFree");
  DecodeTimingCheck(cudaFree(b), "cudaFree");
  return 2.0 * bytes / (ms[ms.size() / 2] * 1e-3);
}

// Cache copies of pool_bytes each for one graph: together >= 256 MB (L2 is 50-60 MB), 1..512.
inline int ColdL2Copies(size_t pool_bytes) {
  return static_cast<int>(std::clamp<size_t>((size_t{256} << 20) / pool_bytes + 1, 1, 512));
}

// Microseconds a call: the median of replays of `exec` (2 warm-ups, then 5..200 replays until 100
// ms have been timed) divided by the `copies` calls the graph holds.
inline double MedianReplayUs(cudaGraphExec_t exec, cudaStream_t stream, int copies) {
  cudaEvent_t e0, e1;
  DecodeTimingCheck(cudaEventCreate(&e0), "cudaEventCreate");
  DecodeTimingCheck(cudaEventCreate(&e1), "cudaEventCreate");
  for (int i = 0; i < 2; ++i) DecodeTimingCheck(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
  DecodeTimingCheck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<float> ms;
  float total = 0.0f;
  for (int i = 0; i < 200 && (i < 5 || total < 100.0f); ++i) {
    DecodeTimingCheck(cudaEventRecord(e0, stream), "cudaEventRecord");
    DecodeTimingCheck(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    DecodeTimingCheck(cudaEventRecord(e1, stream), "cudaEventRecord");
    DecodeTimingCheck(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float t;
    DecodeTimingCheck(cudaEventElapsedTime(&t, e0, e1), "cudaEventElapsedTime");
    ms.push_back(t);
    total += t;
  }
  std::sort(ms.begin(), ms.end());
  DecodeTimingCheck(cudaEventDestroy(e0), "cudaEventDestroy");
  DecodeTimingCheck(cudaEventDestroy(e1), "cudaEventDestroy");
  return ms[ms.size() / 2] * 1e3 / copies;
}

}  // namespace mlaserve::bench
