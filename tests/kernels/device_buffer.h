// What the GPU tests share: whether a GPU is present (tests GTEST_SKIP without one), a typed
// device buffer, and the assertion on a CUDA call's result.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "gtest/gtest.h"

namespace mlaserve {

inline bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define CUDA_OK(expr)                                                          \
  do {                                                                         \
    const cudaError_t err_ = (expr);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)

// count elements of T on the device (ptr is null if the allocation failed).
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceBuffer(size_t n) : count(n) {
    if (cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(T)) !=
        cudaSuccess) {
      ptr = nullptr;
    }
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  // Upload and Poison return when the bytes are on the device. cudaMemcpy and cudaMemset run on
  // the legacy default stream, which a cudaStreamNonBlocking stream does not wait for, and
  // cudaMemset (like a pageable cudaMemcpy's last DMA) may still be running when they return: a
  // kernel launched next on such a stream could run before them. (It did: moe_experts_gpu_test's
  // INT4 case at 1 token saw its output poisoned after the kernels had written it, 64 of 64
  // elements NaN, on the H200 2026-12-01; the same binary passed an hour before.)
  cudaError_t Upload(const std::vector<T>& v) {
    if (ptr == nullptr || v.size() > count) return cudaErrorInvalidValue;
    const cudaError_t e = cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
    return e != cudaSuccess ? e : cudaDeviceSynchronize();
  }
  // 0xFF bytes everywhere (NaN for floats): an element a kernel fails to write shows.
  cudaError_t Poison() {
    const cudaError_t e = cudaMemset(ptr, 0xff, std::max<size_t>(count, 1) * sizeof(T));
    return e != cudaSuccess ? e : cudaDeviceSynchronize();
  }
  // The contents; on a failed copy, as many default values (which the comparisons then reject).
  std::vector<T> Download() const {
    std::vector<T> v(count);
    if (ptr == nullptr ||
        cudaMemcpy(v.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) {
      std::fill(v.begin(), v.end(), T{});
    }
    return v;
  }
};

}  // namespace mlaserve
