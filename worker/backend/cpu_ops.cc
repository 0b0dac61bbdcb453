#include "worker/backend/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/activation/silu_mul_ref.h"
#include "kernels/linear/linear_ref.h"
#include "kernels/mla/mla_decode_ref.h"
#include "kernels/moe/moe_ref.h"
#include "kernels/moe/moe_router_ref.h"
#include "kernels/norm/rms_norm_ref.h"
#include "kernels/rope/rope_ref.h"

namespace mlaserve {
namespace {

LinearRefWeight RefWeight(const LinearWeight& w) {
  LinearRefWeight r;
  r.out_features = w.out_features;
  r.in_features = w.in_features;
  if (w.nvfp4()) {
    r.nvfp4_packed = w.weight.data<uint8_t>();
    r.nvfp4_scale = w.block_scale.data<uint8_t>();
    r.nvfp4_global_scale = w.global_scale;
  } else {
    r.f32 = w.weight.data<float>();
  }
  return r;
}

MoeLinearRef MoeRef(const LinearWeight& w) {
  MoeLinearRef r;
  if (w.nvfp4()) {
    r.nvfp4_packed = w.weight.data<uint8_t>();
    r.nvfp4_scale = w.block_scale.data<uint8_t>();
    r.nvfp4_global_scale = w.global_scale;
  } else {
    r.f32 = w.weight.data<float>();
  }
  return r;
}

}  // namespace

Tensor CpuOps::Activation(std::vector<int64_t> shape) {
  return Tensor::Host(DType::kF32, std::move(shape));
}

Tensor CpuOps::Upload(const Tensor& host) {
  if (host.dtype() != DType::kBF16 && host.dtype() != DType::kF16) return host;
  Tensor out = Tensor::Host(DType::kF32, host.shape());
  DecodeFloats(host.dtype(), host.data<void>(), static_cast<size_t>(host.numel()), out.data<float>());
  return out;
}

void CpuOps::CopyToHost(const Tensor& src, void* dst) { std::memcpy(dst, src.data<void>(), src.nbytes()); }

void CpuOps::Embed(const Tensor& table, int64_t vocab_begin, const std::vector<int32_t>& ids,
                   Tensor& out) {
  const int64_t rows = table.dim(0), hidden = table.dim(1);
  float* o = out.data<float>();
  for (size_t t = 0; t < ids.size(); ++t) {
    const int64_t r = ids[t] - vocab_begin;
    if (r >= 0 && r < rows) {
      std::memcpy(o + t * hidden, table.data<float>() + r * hidden, hidden * sizeof(float));
    } else {
      std::fill(o + t * hidden, o + (t + 1) * hidden, 0.0f);
    }
  }
}

void CpuOps::RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& out) {
  RmsNormRef(x.data<float>(), weight.data<float>(), x.numel() / weight.numel(),
             static_cast<int>(weight.numel()), eps, out.data<float>());
}

void CpuOps::Linear(const Tensor& x, const LinearWeight& w, Tensor& out) {
  LinearRef(x.data<float>(), x.numel() / w.in_features, RefWeight(w), out.data<float>(), threads_);
}

void CpuOps::SiluMul(const Tensor& gate, const Tensor& up, Tensor& out) {
  SiluMulRef(gate.data<float>(), up.data<float>(), gate.numel(), out.data<float>());
}

void CpuOps::Add(const Tensor& x, Tensor& acc) {
  const float* a = x.data<float>();
  float* b = acc.data<float>();
  for (int64_t i = 0; i < acc.numel(); ++i) b[i] += a[i];
}

void CpuOps::Columns(const Tensor& x, int64_t begin, Tensor& out) {
  const int64_t rows = x.dim(0), in_cols = x.numel() / rows, n = out.numel() / rows;
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out.data<float>() + r * n, x.data<float>() + r * in_cols + begin, n * sizeof(float));
  }
}

void CpuOps::Rope(Tensor& x, int64_t first_col, int per_row, int64_t stride, int dim,
                  const std::vector<int32_t>& positions, const Tensor& inv_freq,
                  float attention_scaling, bool interleaved) {
  const int64_t rows = x.dim(0), cols = x.numel() / rows;
  for (int64_t r = 0; r < rows; ++r) {
    RopeRef(x.data<float>() + r * cols + first_col, per_row, stride, per_row, &positions[r],
            inv_freq.data<float>(), dim, attention_scaling, interleaved);
  }
}

void CpuOps::KvWrite(const Tensor& latent, const Tensor& k_rope, const std::vector<int64_t>& slots,
                     KvCacheLayer& cache) {
  KvCacheWriteRef(cache.format, cache.fp8_scale, latent.data<float>(), k_rope.data<float>(),
                  slots.data(), static_cast<int>(slots.size()), cache.pool.data<uint8_t>());
}

void CpuOps::MlaNaive(const MlaShape& s, const Tensor& q, const Tensor& latent,
                      const Tensor& k_rope, const LinearWeight& kv_b,
                      const std::vector<SequenceSlice>& seqs, Tensor& out) {
  const int64_t tokens = latent.dim(0);
  const int qk = s.qk_nope + s.qk_rope;
  const int kv_cols = s.qk_nope + s.v_dim;
  // Keys' nope part and values for every new token: [T, heads, nope + v].
  std::vector<float> kv(tokens * s.heads * kv_cols);
  LinearRef(latent.data<float>(), tokens, RefWeight(kv_b), kv.data(), threads_);
  const float* qd = q.data<float>();
  const float* kr = k_rope.data<float>();
  float* o = out.data<float>();
  std::vector<float> scores;
  for (const SequenceSlice& seq : seqs) {
    for (int h = 0; h < s.heads; ++h) {
      for (int i = 0; i < seq.num_tokens; ++i) {
        const int64_t ti = seq.token_begin + i;
        const float* qi = qd + (ti * s.heads + h) * qk;
        scores.assign(i + 1, 0.0f);
        float mx = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          const int64_t tj = seq.token_begin + j;
          const float* kj = kv.data() + (tj * s.heads + h) * kv_cols;
          float dot = 0.0f;
          for (int d = 0; d < s.qk_nope; ++d) dot += qi[d] * kj[d];
          for (int d = 0; d < s.qk_rope; ++d) dot += qi[s.qk_nope + d] * kr[tj * s.qk_rope + d];
          scores[j] = dot * s.softmax_scale;
          mx = std::max(mx, scores[j]);
        }
        float sum = 0.0f;
        for (float& v : scores) sum += (v = std::exp(v - mx));
        float* oi = o + (ti * s.heads + h) * s.v_dim;
        std::fill(oi, oi + s.v_dim, 0.0f);
        for (int j = 0; j <= i; ++j) {
          const float p = scores[j] / sum;
          const float* vj = kv.data() + ((seq.token_begin + j) * s.heads + h) * kv_cols + s.qk_nope;
          for (int d = 0; d < s.v_dim; ++d) oi[d] += p * vj[d];
        }
      }
    }
  }
}

void CpuOps::MlaAbsorbed(const MlaShape& s, const Tensor& q, const Tensor& w_kb,
                         const Tensor& w_vb, const KvCacheLayer& cache,
                         const std::vector<SequenceSlice>& seqs, Tensor& out) {
  const int qk = s.qk_nope + s.qk_rope;
  const float* qd = q.data<float>();
  const float* kb = w_kb.data<float>();
  const float* vb = w_vb.data<float>();
  float* o = out.data<float>();
  for (const SequenceSlice& seq : seqs) {
    const int n = seq.num_tokens;
    // q_abs [n, heads, 576]: latent part = q_nope · W_kb[h] (nope x 512), then the rope part.
    std::vector<float> q_abs(static_cast<size_t>(n) * s.heads * kMlaQkDim, 0.0f);
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < s.heads; ++h) {
        const float* qi = qd + ((seq.token_begin + i) * s.heads + h) * qk;
        float* dst = q_abs.data() + (static_cast<size_t>(i) * s.heads + h) * kMlaQkDim;
        for (int d = 0; d < s.qk_nope; ++d) {
          const float* row = kb + (static_cast<size_t>(h) * s.qk_nope + d) * kMlaLatentDim;
          for (int c = 0; c < kMlaLatentDim; ++c) dst[c] += qi[d] * row[c];
        }
        std::copy(qi + s.qk_nope, qi + qk, dst + kMlaLatentDim);
      }
    }
    std::vector<float> latent_out(static_cast<size_t>(n) * s.heads * kMlaLatentDim);
    const int32_t seq_len = seq.context_len + n;
    MlaDecodeRefParams p{};
    p.q = q_abs.data();
    p.kv_pool = cache.pool.data<uint8_t>();
    p.block_table = seq.block_table.data();
    p.max_blocks_per_seq = static_cast<int>(seq.block_table.size());
    p.seq_lens = &seq_len;
    p.batch = 1;
    p.s_q = n;
    p.heads = s.heads;
    p.format = cache.format;
    p.kv_scale = cache.fp8_scale;
    p.softmax_scale = s.softmax_scale;
    p.out = latent_out.data();
    p.lse = nullptr;
    MlaDecodeRef(p);
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < s.heads; ++h) {
        const float* li = latent_out.data() + (static_cast<size_t>(i) * s.heads + h) * kMlaLatentDim;
        float* oi = o + ((seq.token_begin + i) * s.heads + h) * s.v_dim;
        for (int d = 0; d < s.v_dim; ++d) {
          const float* row = vb + (static_cast<size_t>(h) * s.v_dim + d) * kMlaLatentDim;
          float acc = 0.0f;
          for (int c = 0; c < kMlaLatentDim; ++c) acc += li[c] * row[c];
          oi[d] = acc;
        }
      }
    }
  }
}

void CpuOps::MoeRoute(const MoeRouting& r, const Tensor& logits, const Tensor& bias, Tensor& ids,
                      Tensor& weights) {
  MoeRouterConfig config{r.num_experts, r.top_k, r.n_group, r.topk_group, r.softmax_scoring,
                         r.norm_topk_prob, r.routed_scaling_factor};
  MoeRouteRef(config, logits.data<float>(), bias.empty() ? nullptr : bias.data<float>(),
              static_cast<int>(logits.dim(0)), ids.data<int32_t>(), weights.data<float>());
}

void CpuOps::MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                        int first_expert, const std::vector<ExpertWeights>& experts, Tensor& out) {
  std::vector<MoeExpertRef> refs;
  refs.reserve(experts.size());
  for (const auto& e : experts) refs.push_back({MoeRef(e.gate), MoeRef(e.up), MoeRef(e.down)});
  MoeExpertsRefParams p{};
  p.tokens = static_cast<int>(x.dim(0));
  p.hidden = static_cast<int>(x.dim(1));
  p.intermediate = experts.empty() ? 0 : experts[0].gate.out_features;
  p.top_k = static_cast<int>(ids.dim(1));
  p.x = x.data<float>();
  p.topk_ids = ids.data<int32_t>();
  p.topk_weights = weights.data<float>();
  p.first_expert = first_expert;
  p.num_local_experts = static_cast<int>(experts.size());
  p.experts = refs.data();
  p.out = out.data<float>();
  MoeExpertsRef(p);
}

}  // namespace mlaserve
