// MLA prefill attention kernel for qk_nope = 16, v_dim = 16 (mla_prefill_attention.cuh).
#include "kernels/mla/mla_prefill_attention.cuh"

MLASERVE_INSTANTIATE_MLA_PREFILL(16, 16);
