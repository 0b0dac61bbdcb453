// The MLA decode kernels' timeline stamps (MlaTimelineEvent, mla_decode_params.h): thread 0 of a
// block writes the %globaltimer (ns) for an event into the call's timeline buffer. Compiled to
// nothing without MLASERVE_KERNEL_TIMELINE (cmake -DMLASERVE_KERNEL_TIMELINE=ON), so the default
// build's kernels are unchanged.
#pragma once

#include <cuda_runtime.h>

#include "kernels/mla/mla_decode_params.h"
#include "kernels/warp_ptx.cuh"

namespace mlaserve::mla {

// row: the block's row of the buffer (split block i: i; combine block i: kMlaTimelineBlocks + i).
__device__ __forceinline__ void MlaTimelineStamp(const MlaDecodeKernelParams& p, int row,
                                                 int event) {
#ifdef MLASERVE_KERNEL_TIMELINE
  if (p.timeline != nullptr && threadIdx.x == 0 && row < 2 * kMlaTimelineBlocks) {
    p.timeline[static_cast<size_t>(row) * kMlaTimelineEvents + event] = ptx::GlobalTimerNs();
  }
#else
  (void)p;
  (void)row;
  (void)event;
#endif
}

}  // namespace mlaserve::mla
