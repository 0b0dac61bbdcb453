#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/comm/one_shot_all_reduce.h"
#include "kernels/warp_ptx.cuh"

namespace mlaserve {
namespace {

// Two bf16 -0.0: the "not yet written" pattern of a slot word.
constexpr uint32_t kSentinelPair = 0x80008000u;
constexpr size_t kHeaderAlign = 256;

__host__ __device__ int64_t ChunksFor(int64_t elems) {
  return (elems + kOneShotChunkElems - 1) / kOneShotChunkElems;
}

size_t HeaderBytes(int64_t chunks) {
  const size_t bytes = static_cast<size_t>(chunks) * sizeof(uint32_t);
  return (bytes + kHeaderAlign - 1) / kHeaderAlign * kHeaderAlign;
}

// Strong (system-scope, relaxed) accesses: the reader's polls must not hit a stale L1 line, and a
// peer's store must reach this GPU's memory without a fence. PTX ISA, "Memory Consistency Model":
// a vector access is one access a 32-bit element (each element single-copy atomic), which is why
// the reader checks every element of a vector for the sentinel, and why the sentinel is a whole
// bf16 (never torn: a bf16 lies inside one 32-bit element).
__device__ __forceinline__ uint4 LoadSys(const uint4* p) {
  uint4 v;
  asm volatile("ld.relaxed.sys.global.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void StoreSys(uint4* p, const uint4& v) {
  asm volatile("st.relaxed.sys.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ bool HasSentinel(const uint4& v) {
  return (__vcmpeq2(v.x, kSentinelPair) | __vcmpeq2(v.y, kSentinelPair) |
          __vcmpeq2(v.z, kSentinelPair) | __vcmpeq2(v.w, kSentinelPair)) != 0;
}

// -0.0 halves to +0.0.
__device__ __forceinline__ uint32_t Canonical(uint32_t w) {
  return w & ~(__vcmpeq2(w, kSentinelPair) & kSentinelPair);
}

__device__ __forceinline__ void AddPair(uint32_t w, float& lo, float& hi) {
  lo += __uint_as_float(w << 16);
  hi += __uint_as_float(w & 0xffff0000u);
}

__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

struct Layout {
  void* own;           // p.peers[p.rank] (read on the host: a run-time index into the parameter
                       // array would copy it to local memory)
  int64_t slot_elems;  // chunks * kOneShotChunkElems: one slot
  size_t header;       // bytes before the slots
};

__device__ __forceinline__ uint4* Slot(void* workspace, const Layout& l, int ranks, uint32_t gen,
                                       int slot, int64_t element) {
  auto* base = reinterpret_cast<__nv_bfloat16*>(static_cast<uint8_t*>(workspace) + l.header);
  return reinterpret_cast<uint4*>(base + (static_cast<int64_t>(gen) * ranks + slot) * l.slot_elems +
                                  element);
}

__global__ void __launch_bounds__(kOneShotThreads)
    OneShotAllReduceKernel(const OneShotAllReduceParams p, const Layout l) {
  __shared__ uint32_t gen_s;
  void* own = l.own;
  uint32_t* counters = static_cast<uint32_t*>(own);
  auto* data = static_cast<__nv_bfloat16*>(p.data);
  const int64_t chunks = ChunksFor(p.count);
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    // The chunk's counter is written only by this rank's kernels (an earlier launch, or this
    // block's previous pass over another chunk), so a plain load sees it.
    if (threadIdx.x == 0) gen_s = counters[c];
    __syncthreads();
    const uint32_t gen = gen_s;
    const int64_t e0 = c * kOneShotChunkElems + threadIdx.x * 8;
    // Elements past count travel as zeros, so that every slot word of a chunk in use is written
    // each call and restored after it.
    uint4 mine = make_uint4(0, 0, 0, 0);
    if (e0 + 8 <= p.count) {
      mine = *reinterpret_cast<const uint4*>(data + e0);
    } else if (e0 < p.count) {
      uint16_t h[8] = {};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (e0 + i < p.count) h[i] = __bfloat16_as_ushort(data[e0 + i]);
      }
      mine = make_uint4(h[0] | (uint32_t{h[1]} << 16), h[2] | (uint32_t{h[3]} << 16),
                        h[4] | (uint32_t{h[5]} << 16), h[6] | (uint32_t{h[7]} << 16));
    }
    mine = make_uint4(Canonical(mine.x), Canonical(mine.y), Canonical(mine.z), Canonical(mine.w));
    // (Loops over ranks run to the constant kOneShotMaxRanks so that p.peers[q] is read from the
    // parameter space directly; a run-time index would copy the array to local memory.)
#pragma unroll
    for (int q = 0; q < kOneShotMaxRanks; ++q) {
      if (q < p.ranks && q != p.rank) StoreSys(Slot(p.peers[q], l, p.ranks, gen, p.rank, e0), mine);
    }
    float acc[8] = {};
#pragma unroll
    for (int q = 0; q < kOneShotMaxRanks; ++q) {
      if (q >= p.ranks) break;
      uint4 v = mine;
      if (q != p.rank) {
        const uint4* src = Slot(own, l, p.ranks, gen, q, e0);
        v = LoadSys(src);
        if (HasSentinel(v)) {
          const uint64_t t0 = ptx::GlobalTimerNs();
          do {
            v = LoadSys(src);
            if (!HasSentinel(v)) break;
            if (ptx::GlobalTimerNs() - t0 > p.timeout_ns) {
              if (p.error != nullptr) {
                *reinterpret_cast<volatile uint32_t*>(p.error) = static_cast<uint32_t>(q) + 1;
                __threadfence_system();
              }
              __trap();
            }
          } while (true);
        }
      }
      AddPair(v.x, acc[0], acc[1]);
      AddPair(v.y, acc[2], acc[3]);
      AddPair(v.z, acc[4], acc[5]);
      AddPair(v.w, acc[6], acc[7]);
    }
    if (e0 + 8 <= p.count) {
      *reinterpret_cast<uint4*>(data + e0) =
          make_uint4(PackPair(acc[0], acc[1]), PackPair(acc[2], acc[3]), PackPair(acc[4], acc[5]),
                     PackPair(acc[6], acc[7]));
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (e0 + i < p.count) data[e0 + i] = __float2bfloat16_rn(acc[i]);
      }
    }
    // Generation gen - 1 (mod 3) is read: back to the sentinel for its next use, two calls on.
    const uint32_t prev = (gen + kOneShotGenerations - 1) % kOneShotGenerations;
    const uint4 sentinel = make_uint4(kSentinelPair, kSentinelPair, kSentinelPair, kSentinelPair);
#pragma unroll
    for (int q = 0; q < kOneShotMaxRanks; ++q) {
      if (q < p.ranks && q != p.rank) *Slot(own, l, p.ranks, prev, q, e0) = sentinel;
    }
    __syncthreads();  // every thread has read gen_s
    if (threadIdx.x == 0) counters[c] = (gen + 1) % kOneShotGenerations;
  }
}

__global__ void FillWorkspaceKernel(uint32_t* words, int64_t header_words, int64_t total_words) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total_words;
       i += int64_t{gridDim.x} * blockDim.x) {
    words[i] = i < header_words ? 0u : kSentinelPair;
  }
}

int SmCount() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  return sms;
}

}  // namespace

size_t OneShotWorkspaceBytes(int ranks, int64_t max_elems) {
  if (ranks < 1 || ranks > kOneShotMaxRanks || max_elems <= 0) return 0;
  const int64_t chunks = ChunksFor(max_elems);
  return HeaderBytes(chunks) + static_cast<size_t>(kOneShotGenerations) * ranks * chunks *
                                   kOneShotChunkElems * sizeof(__nv_bfloat16);
}

absl::Status InitOneShotWorkspace(void* workspace, int ranks, int64_t max_elems,
                                  cudaStream_t stream) {
  const size_t bytes = OneShotWorkspaceBytes(ranks, max_elems);
  if (bytes == 0 || workspace == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("InitOneShotWorkspace: ranks ", ranks, " (1..",
                                                   kOneShotMaxRanks, "), max_elems ", max_elems,
                                                   " (> 0), workspace non-null"));
  }
  const int64_t words = static_cast<int64_t>(bytes / 4);
  const int64_t header_words = static_cast<int64_t>(HeaderBytes(ChunksFor(max_elems)) / 4);
  const int blocks = static_cast<int>(std::min<int64_t>((words + 255) / 256, 4096));
  FillWorkspaceKernel<<<blocks, 256, 0, stream>>>(static_cast<uint32_t*>(workspace), header_words,
                                                  words);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("InitOneShotWorkspace: launch failed: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

absl::Status InvokeOneShotAllReduce(const OneShotAllReduceParams& p, cudaStream_t stream) {
  auto invalid = [&](const auto&... why) {
    return absl::InvalidArgumentError(absl::StrCat("one-shot all-reduce (rank ", p.rank, " of ",
                                                   p.ranks, ", ", p.count, " bf16): ", why...));
  };
  if (p.ranks < 1 || p.ranks > kOneShotMaxRanks) {
    return invalid("ranks must be in 1..", kOneShotMaxRanks);
  }
  if (p.rank < 0 || p.rank >= p.ranks) return invalid("rank out of range");
  if (p.count < 0 || p.count > p.max_elems) {
    return invalid("count must be in 0..max_elems (", p.max_elems, ")");
  }
  if (p.count == 0) return absl::OkStatus();
  for (int q = 0; q < p.ranks; ++q) {
    if (p.peers[q] == nullptr) return invalid("workspace of rank ", q, " is null");
  }
  if (p.data == nullptr || reinterpret_cast<uintptr_t>(p.data) % 16 != 0) {
    return invalid("data must be non-null and 16-byte aligned");
  }
  const int64_t chunks = ChunksFor(p.count);
  const int cap = p.max_blocks > 0 ? p.max_blocks : SmCount();
  const int blocks = static_cast<int>(std::min<int64_t>(chunks, cap));
  const Layout l{p.peers[p.rank], ChunksFor(p.max_elems) * kOneShotChunkElems,
                 HeaderBytes(ChunksFor(p.max_elems))};
  OneShotAllReduceKernel<<<blocks, kOneShotThreads, 0, stream>>>(p, l);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("one-shot all-reduce: launch failed: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
