// Programmatic dependent launch (PDL, sm_90+) for kernels that run back to back on one stream:
// the kernels of one MoE layer (dispatch -> gate_up -> down -> combine) and the decode step's
// skinny projections (kernels/linear/skinny_gemm.h). A kernel launched with
// LaunchKernel(..., programmatic = true) may start while its predecessor is still running: its
// blocks become resident, set up (a skinny GEMM issues its first weight loads), and wait in
// WaitForPrerequisiteGrid until the predecessor has finished and its writes are visible. That
// hides the launch and ramp-up gap between the kernels, which at 1-8 decode tokens is a large
// part of each kernel's time. The dependent launches once every block of the predecessor has
// called AllowDependentLaunch or exited.
//
// Rules every kernel here follows: read nothing a predecessor writes before
// WaitForPrerequisiteGrid (the one exception, documented in nvfp4_moe_gemm.cuh, is the down
// GEMM's read of the dispatch offsets, which completed before gate_up let down start); a kernel
// that is itself launched programmatically calls AllowDependentLaunch only after
// WaitForPrerequisiteGrid, so that a dependent that starts early can rely on every grid before
// its predecessor having finished. Kernels launched plainly (norms, SiLU, the MLA combine) may
// call it first thing. On devices before sm_90 both are no-ops and the launcher never sets the
// attribute.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <utility>

namespace mlaserve::pdl {

__device__ __forceinline__ void WaitForPrerequisiteGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// True when the current device supports programmatic dependent launch (compute capability 9+).
// Asked of the driver once per device (every programmatic launch asks).
inline bool DeviceSupportsProgrammaticLaunch() {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> known[kCachedDevices] = {};  // 0: not asked yet, 1: no, 2: yes
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (dev >= 0 && dev < kCachedDevices) {
    const int k = known[dev].load(std::memory_order_relaxed);
    if (k != 0) return k == 2;
  }
  const bool yes =
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
      major >= 9;
  if (dev >= 0 && dev < kCachedDevices) known[dev].store(yes ? 2 : 1, std::memory_order_relaxed);
  return yes;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), programmatically dependent on the
// previous kernel of `stream` when `programmatic` (and the device has PDL; the legacy default
// stream, nullptr, always gets a plain launch).
template <class... KernelArgs, class... Args>
cudaError_t LaunchKernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                            cudaStream_t stream, bool programmatic, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (programmatic && stream != nullptr && DeviceSupportsProgrammaticLaunch()) {
    config.attrs = attr;
    config.numAttrs = 1;
  }
  cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace mlaserve::pdl
