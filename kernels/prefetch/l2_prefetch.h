// Weights into the L2 cache ahead of use (kernels/prefetch/l2_prefetch.cuh has the PTX facts).
//
// Why: a decode step of a few tokens runs each projection as a kernel that reads tens of MB once.
// Such a kernel spends much of its time ramping up and draining (launch, first loads, the tail),
// so it streams the HBM at a fraction of copy bandwidth, and the kernels between them (MLA over a
// short cache, norms, the router) read almost nothing. Prefetch requests issued during those
// kernels keep the HBM busy and let the projections that follow read from L2. A hint only: the
// results never change, only the time.
//
// This header is included by C++20 host code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace mlaserve {

struct L2PrefetchRanges {
  static constexpr int kMaxRanges = 8;
  const void* base[kMaxRanges] = {};
  size_t bytes[kMaxRanges] = {};
  int count = 0;
  // 0: cp.async.bulk.prefetch per lane (sm_90+), 1: prefetch.global.L2 per 128-byte line.
  int mode = 0;
  // Thread blocks (one warp each) that issue the requests; <= 0: one per SM.
  int blocks = 0;
  // Launched programmatically (programmatic_launch.cuh's rules): the requests go out while the previous
  // kernel runs; the kernel then waits for it before finishing, so the stream's order is kept.
  bool programmatic = true;
};

// Issues the requests on `stream`; reads and writes no memory the program can see. Ranges need no
// alignment (each is trimmed inward to 16-byte boundaries); empty ranges are skipped.
cudaError_t InvokeL2Prefetch(const L2PrefetchRanges& ranges, cudaStream_t stream);

}  // namespace mlaserve
