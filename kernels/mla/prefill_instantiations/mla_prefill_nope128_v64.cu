// MLA prefill attention kernel for qk_nope = 128, v_dim = 64 (mla_prefill_attention.cuh).
#include "kernels/mla/mla_prefill_attention.cuh"

MLASERVE_INSTANTIATE_MLA_PREFILL(128, 64);
