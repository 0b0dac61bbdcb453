// How many blocks of a kernel an SM holds at a given dynamic shared memory, and the device's SM
// count: what a persistent or wave-sized launch needs (the MoE few-expert kernels, the tile
// kernel's wave tail). The driver is asked once per (kernel, device, block size, shared memory)
// and the answer cached: cudaFuncSetAttribute and cudaOccupancyMaxActiveBlocksPerMultiprocessor
// cost microseconds of host time each, which eager decode steps (graphs off, e.g. several ranks)
// paid on every MoE launch. The kernel's dynamic shared memory limit is opted in to the largest
// size ever asked for on that device and never lowered, so a launch with any size asked before
// stays valid.
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>
#include <vector>

namespace mlaserve {

struct ResidentBlocks {
  int sms = 0;     // the current device's multiprocessors
  int per_sm = 0;  // blocks of the kernel resident on one at once
};

namespace resident_internal {

struct Entry {
  const void* kernel;
  int device, threads, smem;
  ResidentBlocks r;
};
struct Limit {
  const void* kernel;
  int device, smem;
};
struct Cache {
  std::mutex mu;
  std::vector<Entry> entries;
  std::vector<Limit> limits;  // the opted-in shared memory of each (kernel, device)
};
inline Cache& GetCache() {
  static Cache* cache = new Cache;  // never destroyed: launches may run during static teardown
  return *cache;
}

// Raises the kernel's opted-in dynamic shared memory on `device` to at least smem; the cache's
// lock is held.
inline cudaError_t OptIn(Cache& c, const void* kernel, int device, int smem) {
  for (Limit& l : c.limits) {
    if (l.kernel == kernel && l.device == device) {
      if (smem <= l.smem) return cudaSuccess;
      const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e == cudaSuccess) l.smem = smem;
      return e;
    }
  }
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess) c.limits.push_back({kernel, device, smem});
  return e;
}

}  // namespace resident_internal

// Opts the kernel in to smem bytes of dynamic shared memory on the current device (once) and
// returns its resident blocks an SM at `threads` threads a block. A failed query is not cached.
template <class Kernel>
cudaError_t QueryResidentBlocks(Kernel* kernel, int threads, int smem, ResidentBlocks* out) {
  using namespace resident_internal;
  const void* fn = reinterpret_cast<const void*>(kernel);
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  Cache& c = GetCache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (const Entry& en : c.entries) {
    if (en.kernel == fn && en.device == device && en.threads == threads && en.smem == smem) {
      *out = en.r;
      return cudaSuccess;
    }
  }
  ResidentBlocks r;
  cudaError_t e = OptIn(c, fn, device, smem);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&r.sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r.per_sm, fn, threads,
                                                      static_cast<size_t>(smem));
  }
  if (e != cudaSuccess) return e;
  c.entries.push_back({fn, device, threads, smem, r});
  *out = r;
  return cudaSuccess;
}

// Opts the kernel in to smem bytes of dynamic shared memory on the current device, once.
template <class Kernel>
cudaError_t OptInDynamicSmem(Kernel* kernel, int smem) {
  using namespace resident_internal;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  Cache& c = GetCache();
  std::lock_guard<std::mutex> lock(c.mu);
  return OptIn(c, reinterpret_cast<const void*>(kernel), device, smem);
}

}  // namespace mlaserve
