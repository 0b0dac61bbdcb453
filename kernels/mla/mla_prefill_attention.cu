// Host side of the MLA prefill attention (mla_prefill.h, step 2): argument checks and the
// dispatch over (qk_nope, v_dim) to the kernel instantiations (mla_prefill_attention.cuh,
// prefill_instantiations/*.cu).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kernels/mla/mla_prefill.h"
#include "kernels/mla/mla_prefill_params.h"

namespace mlaserve {
namespace {

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

absl::Status InvokeMlaPrefill(const MlaPrefillParams& p, cudaStream_t stream) {
  const std::string dims =
      "(qk_nope " + std::to_string(p.qk_nope) + ", v_dim " + std::to_string(p.v_dim) + ")";
  if (p.qk_rope != 64) {
    return absl::InvalidArgumentError("MLA prefill: qk_rope must be 64, got " +
                                      std::to_string(p.qk_rope));
  }
  using LaunchFn = cudaError_t (*)(const mla::MlaPrefillKernelArgs&, dim3, cudaStream_t);
  LaunchFn launch = nullptr;
  if (p.qk_nope == 16 && p.v_dim == 16) launch = &mla::LaunchMlaPrefill<16, 16>;
  if (p.qk_nope == 32 && p.v_dim == 32) launch = &mla::LaunchMlaPrefill<32, 32>;
  if (p.qk_nope == 64 && p.v_dim == 64) launch = &mla::LaunchMlaPrefill<64, 64>;
  if (p.qk_nope == 128 && p.v_dim == 128) launch = &mla::LaunchMlaPrefill<128, 128>;
  if (p.qk_nope == 128 && p.v_dim == 64) launch = &mla::LaunchMlaPrefill<128, 64>;
  if (launch == nullptr) {
    return absl::InvalidArgumentError(
        "MLA prefill: unsupported head dims " + dims +
        "; supported: (16, 16), (32, 32), (64, 64), (128, 128), (128, 64)");
  }
  if (p.heads < 1 || p.heads > 128) {
    return absl::InvalidArgumentError("MLA prefill: heads must be 1..128, got " +
                                      std::to_string(p.heads));
  }
  if (p.num_seqs < 0 || p.num_seqs > 65535 || p.total_q < 0 || p.max_q_len < 0) {
    return absl::InvalidArgumentError(
        "MLA prefill: num_seqs must be 0..65535 (grid z), total_q and max_q_len >= 0");
  }
  if (p.num_seqs == 0 || p.total_q == 0 || p.max_q_len == 0) return absl::OkStatus();
  if (p.q == nullptr || p.kv == nullptr || p.k_rope == nullptr || p.q_begin == nullptr ||
      p.kv_begin == nullptr || p.context_lens == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError(
        "MLA prefill: q, kv, k_rope, q_begin, kv_begin, context_lens and out must be set");
  }
  if (!Aligned16(p.q) || !Aligned16(p.kv) || !Aligned16(p.k_rope) ||
      reinterpret_cast<uintptr_t>(p.out) % 4 != 0) {
    return absl::InvalidArgumentError(
        "MLA prefill: q, kv and k_rope must be 16-B aligned (cp.async), out 4-B aligned");
  }
  mla::MlaPrefillKernelArgs args{static_cast<const uint16_t*>(p.q),
                                 static_cast<const uint16_t*>(p.kv),
                                 static_cast<const uint16_t*>(p.k_rope),
                                 p.q_begin,
                                 p.kv_begin,
                                 p.context_lens,
                                 p.heads,
                                 p.softmax_scale * 1.4426950408889634f,
                                 static_cast<uint16_t*>(p.out)};
  const dim3 grid((p.max_q_len + mla::kPrefillBlockRows - 1) / mla::kPrefillBlockRows, p.heads,
                  p.num_seqs);
  const cudaError_t err = launch(args, grid, stream);
  if (err != cudaSuccess) {
    return absl::InternalError("MLA prefill " + dims + " launch: " + cudaGetErrorString(err));
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
