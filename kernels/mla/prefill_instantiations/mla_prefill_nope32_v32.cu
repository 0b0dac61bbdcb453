// MLA prefill attention kernel for qk_nope = 32, v_dim = 32 (mla_prefill_attention.cuh).
#include "kernels/mla/mla_prefill_attention.cuh"

MLASERVE_INSTANTIATE_MLA_PREFILL(32, 32);
