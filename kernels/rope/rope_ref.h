// Rotary position embedding, CPU reference, as transformers' DeepseekV3 applies it.
//
// For each rotary vector x of `dim` values at position p, angle_i = p * inv_freq[i]
// (i < dim/2), c = cos(angle_i) * attention_scaling, s = sin(angle_i) * attention_scaling.
//  - interleaved (DeepSeek's layout, rope_interleave true): pairs (x[2i], x[2i+1]) rotate by
//    angle_i, and the result is written de-interleaved: out[i] = x0 c - x1 s,
//    out[i + dim/2] = x1 c + x0 s. That is transformers' apply_rotary_pos_emb_interleave; dot
//    products are the same as rotating in place, and q and k get the same order.
//  - not interleaved: the halves (x[i], x[i + dim/2]) rotate by angle_i (rotate_half).
// The angle is computed in fp32 as transformers does (inv_freq fp32 × position fp32).
#pragma once

#include <cstdint>

namespace mlaserve {

// x: `rows` vectors at stride `row_stride` floats, vector r at position positions[r / per_pos]
// where `per_pos` vectors share a position (e.g. the heads of one token). In place.
void RopeRef(float* x, int64_t rows, int64_t row_stride, int per_pos, const int32_t* positions,
             const float* inv_freq, int dim, float attention_scaling, bool interleaved);

}  // namespace mlaserve
