// Bulk (TMA) global -> shared copies completed on an mbarrier (sm_90+): one thread starts a copy
// of up to a few KB and every waiting thread learns of its arrival from the barrier's phase. Used
// where a warp wants many KB in flight without holding them in registers
// (kernels/moe/moe_few_expert_gemm.cuh, the staged variant).
//
// PTX facts (PTX ISA 8.0; libcu++'s cuda::ptx wrappers list the same forms and targets):
// - `mbarrier.init.shared::cta.b64 [bar], count;` sets the expected arrivals; the barrier starts in
//   phase 0. `fence.mbarrier_init.release.cluster;` makes an init visible to the async proxy (the
//   copy engine) before the barrier is used by it; a CTA barrier after it publishes it to threads.
// - `mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], bytes;` arrives once and adds `bytes` to
//   the transaction count the phase waits for.
// - `cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], size, [bar];`
//   copies `size` bytes (a multiple of 16; dst and src 16-byte aligned) and completes `size` bytes
//   of the barrier's transaction count when written. A CTA not launched as a cluster is a cluster
//   of one, so its own shared::cta addresses are valid shared::cluster addresses.
// - `mbarrier.try_wait.parity.shared::cta.b64 p, [bar], parity;` is true once the phase with that
//   parity has completed (all arrivals and all transaction bytes).
// - Shared memory read by ordinary loads and then overwritten by a bulk copy: the copy runs in the
//   async proxy, so `fence.proxy.async.shared::cta;` orders the earlier reads before it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/warp_ptx.cuh"

namespace mlaserve::ptx {

__device__ __forceinline__ void MbarrierInit(uint64_t* bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(count)
               : "memory");
#endif
}

__device__ __forceinline__ void FenceMbarrierInit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void FenceProxyAsyncShared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void MbarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void BulkCopyToShared(void* dst, const void* src, uint32_t bytes,
                                                 uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
#endif
}

// Returns once the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void MbarrierWait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t addr = SmemAddr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (done == 0);
#endif
}

}  // namespace mlaserve::ptx
