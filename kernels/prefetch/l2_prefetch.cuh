// Device helpers that ask the memory system to bring global memory into the L2 cache ahead of
// the kernels that read it (kernels/prefetch/l2_prefetch.h says when that pays).
//
// PTX facts (PTX ISA 8.0, "cp.async.bulk.prefetch"; libcu++'s cp_async_bulk_prefetch):
// `cp.async.bulk.prefetch.L2.global [src], size;` (sm_90+) is a non-blocking hint: it may start
// an asynchronous copy of `size` bytes into L2 and has no completion mechanism; src must be 16-byte
// aligned and size a multiple of 16. `prefetch.global.L2 [a];` (sm_20+) hints one cache line. Neither
// changes memory or raises a fault the program can see, so a prefetch never changes results.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlaserve::prefetch {

// How a share is requested: one bulk request per lane (the TMA unit splits it into lines), or one
// `prefetch.global.L2` per 128-byte line (for comparison, and for devices before sm_90).
enum class L2PrefetchMode : int { kBulk = 0, kLines = 1 };

// Share `part` of `parts` of [base, base + bytes), trimmed inward to 16-byte boundaries (a few
// bytes at either end may stay unprefetched), requested by the 32 lanes of the calling warp.
// Every lane of the warp calls it with the same arguments.
__device__ __forceinline__ void PrefetchL2Share(const void* base, size_t bytes, unsigned part,
                                                unsigned parts, L2PrefetchMode mode) {
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(base) + 15) & ~uintptr_t{15};
  const uintptr_t end = (reinterpret_cast<uintptr_t>(base) + bytes) & ~uintptr_t{15};
  if (end <= begin || parts == 0) return;
  const size_t units = (end - begin) / 16;  // 16-byte units
  const size_t lane = threadIdx.x & 31;
  // This warp's share, then this lane's slice of it: contiguous 16-byte units.
  const size_t s0 = units * part / parts, s1 = units * (part + 1) / parts;
  const size_t l0 = s0 + (s1 - s0) * lane / 32, l1 = s0 + (s1 - s0) * (lane + 1) / 32;
  if (l1 <= l0) return;
  const uintptr_t p0 = begin + l0 * 16, p1 = begin + l1 * 16;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (mode == L2PrefetchMode::kBulk) {
    // A slice fits the 32-bit size operand in pieces of at most 1 GiB.
    for (uintptr_t p = p0; p < p1; p += (uintptr_t{1} << 30)) {
      const uint32_t n = static_cast<uint32_t>(
          (p1 - p) < (uintptr_t{1} << 30) ? (p1 - p) : (uintptr_t{1} << 30));
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(n) : "memory");
    }
    return;
  }
#endif
  (void)mode;
  for (uintptr_t p = p0 & ~uintptr_t{127}; p < p1; p += 128) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p < p0 ? p0 : p));
  }
}

}  // namespace mlaserve::prefetch
