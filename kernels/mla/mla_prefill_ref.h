// CPU reference of the MLA chunked prefill (mla_prefill.h), non-absorbed form, fp32.
//
// The arithmetic is exactly CpuOps::MlaNaive's (worker/backend/cpu_ops.cc): per (sequence,
// head, query) the fp32 dot over the nope dims then the rope dims, times softmax_scale, a
// running max, exp(score - max), their sum in key order, p = exp / sum, o += p * v in key
// order. With every context_lens[s] == 0 the output is bit-identical to MlaNaive's.
#pragma once

#include <cstdint>

namespace mlaserve {

// Query i of sequence s (row q_begin[s] + i) attends to keys kv_begin[s] + j, j = 0 ..
// context_lens[s] + i. kv_begin[s+1] - kv_begin[s] must be context_lens[s] + (q_begin[s+1] -
// q_begin[s]). qk_rope is the rope width of q and the row length of k_rope. Uses a few threads
// (one (sequence, head) pair at a time each; the result does not depend on the thread count).
void MlaPrefillRef(int num_seqs, int heads, int qk_nope, int qk_rope, int v_dim,
                   const float* q /*[total_q, heads, qk_nope+qk_rope]*/,
                   const float* kv /*[total_kv, heads, qk_nope+v_dim]*/,
                   const float* k_rope /*[total_kv, qk_rope]*/, const int32_t* q_begin,
                   const int32_t* kv_begin, const int32_t* context_lens, float softmax_scale,
                   float* out /*[total_q, heads, v_dim]*/);

}  // namespace mlaserve
