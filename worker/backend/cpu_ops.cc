#include "worker/backend/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/activation/silu_mul_ref.h"
#include "kernels/linear/fp8_block_ref.h"
#include "kernels/linear/int4_group_ref.h"
#include "kernels/linear/linear_ref.h"
#include "kernels/mla/mla_decode_ref.h"
#include "kernels/mla/mla_prefill_ref.h"
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

namespace {

// A non-owning view of a layout array as a CPU tensor.
template <class T>
Tensor View(const std::vector<T>& v, DType dtype) {
  return Tensor(dtype, {static_cast<int64_t>(v.size())}, nullptr,
                const_cast<T*>(v.data()), Device::kCpu);
}

}  // namespace

absl::Status CpuOps::BeginStep(const StepLayout& layout, StepTensors* step) {
  step->layout = &layout;
  step->tokens = View(layout.tokens, DType::kI32);
  step->positions = View(layout.positions, DType::kI32);
  step->slots = View(layout.slots, DType::kI64);
  step->logits_rows = View(layout.logits_rows, DType::kI32);
  step->block_tables = View(layout.block_tables, DType::kI32);
  step->seq_lens = View(layout.seq_lens, DType::kI32);
  step->context_lens = View(layout.context_lens, DType::kI32);
  step->prefill_q_begin = View(layout.prefill.q_begin, DType::kI32);
  step->prefill_kv_begin = View(layout.prefill.kv_begin, DType::kI32);
  step->attend_lens = View(layout.attend_lens, DType::kI32);
  return absl::OkStatus();
}

Tensor CpuOps::Activation(std::vector<int64_t> shape, DType dtype) {
  return Tensor::Host(dtype, std::move(shape));
}

absl::StatusOr<Tensor> CpuOps::Allocate(DType dtype, std::vector<int64_t> shape) {
  return Tensor::Host(dtype, std::move(shape));
}

absl::StatusOr<Tensor> CpuOps::Upload(const Tensor& host) {
  if (host.dtype() != DType::kBF16 && host.dtype() != DType::kF16) return host;
  Tensor out = Tensor::Host(DType::kF32, host.shape());
  DecodeFloats(host.dtype(), host.data<void>(), static_cast<size_t>(host.numel()), out.data<float>());
  return out;
}

absl::StatusOr<LinearWeight> CpuOps::UploadLinear(const LinearWeight& host) {
  LinearWeight w = host;
  if (host.int4()) {
    // Packed INT4 (routed experts): q * scale, exact in fp32 (int4_group_ref.h).
    w.int4_packed = w.int4_scale = Tensor();
    Tensor scale = Tensor::Host(DType::kF32, host.int4_scale.shape());
    DecodeFloats(host.int4_scale.dtype(), host.int4_scale.data<void>(),
                 static_cast<size_t>(host.int4_scale.numel()), scale.data<float>());
    w.weight = Tensor::Host(DType::kF32, {host.out_features, host.in_features});
    DequantizeInt4Group({host.int4_packed.data<int32_t>(), scale.data<float>(), host.out_features,
                         host.int4_in, host.int4_group},
                        0, host.out_features, host.int4_col0, host.in_features,
                        w.weight.data<float>());
    return w;
  }
  if (host.fp8()) {
    // Packed FP8 (routed experts): fp32(e4m3 * s) of the window, as the loader's dequantization of
    // other FP8 modules (fp8_block_ref.h).
    w.fp8_codes = w.fp8_scale_inv = Tensor();
    w.weight = Tensor::Host(DType::kF32, {host.out_features, host.in_features});
    const Fp8BlockTensor t{host.fp8_codes.data<uint8_t>(),
                           host.fp8_scale_inv.data<float>(),
                           host.out_features,
                           host.in_features,
                           host.fp8_block_rows,
                           host.fp8_block_cols,
                           host.fp8_origin_row,
                           host.fp8_origin_col,
                           host.fp8_scale_inv.dim(0),
                           host.fp8_scale_inv.dim(1)};
    DequantizeFp8Block(t, 0, host.out_features, 0, host.in_features, w.weight.data<float>());
    return w;
  }
  auto weight = Upload(host.weight);
  if (!weight.ok()) return weight.status();
  w.weight = *std::move(weight);
  return w;
}

absl::StatusOr<RoutedExperts> CpuOps::UploadExperts(int first_expert, int num_routed_experts,
                                                    const std::vector<ExpertWeights>& host) {
  (void)num_routed_experts;
  RoutedExperts r;
  r.first_expert = first_expert;
  r.count = static_cast<int>(host.size());
  if (!host.empty()) {
    r.hidden = host[0].gate.in_features;
    r.intermediate = host[0].gate.out_features;
  }
  for (const ExpertWeights& e : host) {
    ExpertWeights d;
    for (auto [dst, src] : {std::pair{&d.gate, &e.gate}, {&d.up, &e.up}, {&d.down, &e.down}}) {
      auto w = UploadLinear(*src);
      if (!w.ok()) return w.status();
      *dst = *std::move(w);
      r.bytes += dst->weight.nbytes() + dst->block_scale.nbytes();
    }
    r.weights.push_back(std::move(d));
  }
  return r;
}

absl::Status CpuOps::CopyToHost(const Tensor& src, void* dst) {
  std::memcpy(dst, src.data<void>(), src.nbytes());
  return absl::OkStatus();
}

void CpuOps::Embed(const Tensor& table, int64_t vocab_begin, const StepTensors& step,
                   Tensor& out) {
  const int64_t rows = table.dim(0), hidden = table.dim(1);
  const std::vector<int32_t>& ids = step.layout->tokens;
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

void CpuOps::AddRmsNorm(const Tensor& delta, Tensor& residual, const Tensor& weight, float eps,
                        Tensor& out) {
  const float* a = delta.data<float>();
  float* b = residual.data<float>();
  for (int64_t i = 0; i < residual.numel(); ++i) b[i] += a[i];
  RmsNorm(residual, weight, eps, out);
}

void CpuOps::Linear(const Tensor& x, const LinearWeight& w, Tensor& out) {
  LinearRef(x.data<float>(), x.numel() / w.in_features, RefWeight(w), out.data<float>(), threads_);
  if (w.alpha != 1.0f) {
    for (int64_t i = 0; i < out.numel(); ++i) out.data<float>()[i] *= w.alpha;
  }
}

void CpuOps::SiluMul(const Tensor& gate, const Tensor& up, Tensor& out) {
  SiluMulRef(gate.data<float>(), up.data<float>(), gate.numel(), out.data<float>());
}

void CpuOps::Columns(const Tensor& x, int64_t begin, Tensor& out) {
  const int64_t rows = x.dim(0), in_cols = x.numel() / rows, n = out.numel() / rows;
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out.data<float>() + r * n, x.data<float>() + r * in_cols + begin, n * sizeof(float));
  }
}

void CpuOps::CopyColumns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                         int64_t cols) {
  const int64_t rows = src.dim(0);
  if (rows == 0) return;
  const size_t es = DTypeBits(src.dtype()) / 8;
  const int64_t sc = src.numel() / rows, dc = dst.numel() / rows;
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst.data<uint8_t>() + (r * dc + dst_col) * es,
                src.data<uint8_t>() + (r * sc + src_col) * es, cols * es);
  }
}

void CpuOps::LogitsRows(const Tensor& x, const StepTensors& step, Tensor& out) {
  const int64_t cols = x.numel() / x.dim(0);
  const std::vector<int32_t>& rows = step.layout->logits_rows;
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(out.data<float>() + i * cols, x.data<float>() + rows[i] * cols,
                cols * sizeof(float));
  }
}

void CpuOps::Rope(Tensor& x, int64_t first_col, int per_row, int64_t stride, int dim,
                  const StepTensors& step, const Tensor& inv_freq, float attention_scaling,
                  bool interleaved) {
  const int64_t rows = x.dim(0), cols = x.numel() / rows;
  const std::vector<int32_t>& positions = step.layout->positions;
  for (int64_t r = 0; r < rows; ++r) {
    RopeRef(x.data<float>() + r * cols + first_col, per_row, stride, per_row, &positions[r],
            inv_freq.data<float>(), dim, attention_scaling, interleaved);
  }
}

void CpuOps::KvWrite(const Tensor& latent, const Tensor& k_rope, const StepTensors& step,
                     KvCacheLayer& cache) {
  const std::vector<int64_t>& slots = step.layout->slots;
  KvCacheWriteRef(cache.format, cache.fp8_scale, latent.data<float>(), k_rope.data<float>(),
                  slots.data(), static_cast<int>(slots.size()), cache.pool.data<uint8_t>());
}

void CpuOps::MlaPrefill(const MlaShape& s, const Tensor& q, const Tensor& latent,
                        const Tensor& k_rope, const LinearWeight& kv_b, const KvCacheLayer& cache,
                        const StepTensors& step, Tensor& out) {
  const StepLayout& L = *step.layout;
  const StepLayout::PrefillGroup& P = L.prefill;
  if (P.num_seqs == 0) return;
  const int qk = s.qk_nope + s.qk_rope;
  const int kv_cols = s.qk_nope + s.v_dim;
  const size_t row_bytes = KvCacheBytesPerToken(cache.format);
  // Every sequence's keys: its cached prefix rows (dequantized as the decode kernels see them),
  // then its new tokens' rows as computed in this step.
  std::vector<float> keys(static_cast<size_t>(P.total_kv) * kMlaLatentDim);
  std::vector<float> rope(static_cast<size_t>(P.total_kv) * kMlaRopeDim);
  std::vector<float> row(kMlaQkDim);
  for (int i = 0; i < P.num_seqs; ++i) {
    const SequenceSlice& seq = L.seqs[P.seq_begin + i];
    const int64_t base = P.kv_begin[i];
    for (int j = 0; j < seq.context_len; ++j) {
      const int64_t slot =
          static_cast<int64_t>(seq.block_table[j / kKvBlockTokens]) * kKvBlockTokens +
          j % kKvBlockTokens;
      KvCacheDecodeRow(cache.format, cache.pool.data<uint8_t>() + slot * row_bytes,
                       cache.fp8_scale, row.data());
      std::copy(row.begin(), row.begin() + kMlaLatentDim, keys.begin() + (base + j) * kMlaLatentDim);
      std::copy(row.begin() + kMlaLatentDim, row.end(), rope.begin() + (base + j) * kMlaRopeDim);
    }
    for (int j = 0; j < seq.num_tokens; ++j) {
      const int64_t t = seq.token_begin + j, k = base + seq.context_len + j;
      std::memcpy(keys.data() + k * kMlaLatentDim, latent.data<float>() + t * kMlaLatentDim,
                  kMlaLatentDim * sizeof(float));
      std::memcpy(rope.data() + k * kMlaRopeDim, k_rope.data<float>() + t * kMlaRopeDim,
                  kMlaRopeDim * sizeof(float));
    }
  }
  // Keys' nope part and values of every key: [total_kv, heads, nope + v].
  std::vector<float> kv(static_cast<size_t>(P.total_kv) * s.heads * kv_cols);
  LinearRef(keys.data(), P.total_kv, RefWeight(kv_b), kv.data(), threads_);
  if (kv_b.alpha != 1.0f) {
    for (float& v : kv) v *= kv_b.alpha;
  }
  MlaPrefillRef(P.num_seqs, s.heads, s.qk_nope, s.qk_rope, s.v_dim,
                q.data<float>() + static_cast<int64_t>(P.row_begin) * s.heads * qk, kv.data(),
                rope.data(), P.q_begin.data(), P.kv_begin.data(),
                L.context_lens.data() + P.seq_begin, s.softmax_scale,
                out.data<float>() + static_cast<int64_t>(P.row_begin) * s.heads * s.v_dim);
}

void CpuOps::MlaDecode(const MlaShape& s, const Tensor& q, const Tensor& w_kb,
                       const Tensor& w_vb, const KvCacheLayer& cache, const StepTensors& step,
                       int group, Tensor& out, const Tensor& /*q_abs: never set on the CPU*/) {
  const StepLayout& L = *step.layout;
  const StepLayout::DecodeGroup& g = L.decode[group];
  const int qk = s.qk_nope + s.qk_rope;
  const float* qd = q.data<float>();
  const float* kb = w_kb.data<float>();
  const float* vb = w_vb.data<float>();
  float* o = out.data<float>();
  for (int c = g.seq_begin; c < g.seq_begin + g.num_seqs; ++c) {
    const SequenceSlice& seq = L.seqs[c];
    const int n = seq.num_tokens;
    // q_abs [n, heads, 576]: latent part = q_nope · W_kb[h] (nope x 512), then the rope part.
    std::vector<float> q_abs(static_cast<size_t>(n) * s.heads * kMlaQkDim, 0.0f);
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < s.heads; ++h) {
        const float* qi = qd + ((seq.token_begin + i) * s.heads + h) * qk;
        float* dst = q_abs.data() + (static_cast<size_t>(i) * s.heads + h) * kMlaQkDim;
        for (int d = 0; d < s.qk_nope; ++d) {
          const float* row = kb + (static_cast<size_t>(h) * s.qk_nope + d) * kMlaLatentDim;
          for (int c2 = 0; c2 < kMlaLatentDim; ++c2) dst[c2] += qi[d] * row[c2];
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
    p.fp8_mma = mla_fp8_mma_;
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
          for (int c2 = 0; c2 < kMlaLatentDim; ++c2) acc += li[c2] * row[c2];
          oi[d] = acc;
        }
      }
    }
  }
}

void CpuOps::MlaAbsorb(const MlaShape& s, const DcpShape& dcp, const Tensor& q, const Tensor& w_kb,
                       Tensor& q_abs) {
  const int64_t T = q.dim(0);
  const int qk = s.qk_nope + s.qk_rope, slots = dcp.heads_per_rank;
  const float* qd = q.data<float>();
  const float* kb = w_kb.data<float>();
  float* out = q_abs.data<float>();
  std::fill(out, out + static_cast<size_t>(T) * slots * kMlaQkDim, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int h = 0; h < s.heads; ++h) {
      const float* qi = qd + (t * s.heads + h) * qk;
      float* dst = out + (t * slots + h) * kMlaQkDim;
      for (int d = 0; d < s.qk_nope; ++d) {
        const float* row = kb + (static_cast<size_t>(h) * s.qk_nope + d) * kMlaLatentDim;
        for (int c = 0; c < kMlaLatentDim; ++c) dst[c] += qi[d] * row[c];
      }
      std::copy(qi + s.qk_nope, qi + qk, dst + kMlaLatentDim);
    }
  }
}

void CpuOps::MlaAttend(const MlaShape& s, const DcpShape& dcp, const Tensor& q_all,
                       const KvCacheLayer& cache, const StepTensors& step, int group,
                       Tensor& latent, Tensor& lse) {
  const StepLayout& L = *step.layout;
  const StepLayout::DecodeGroup& g = L.decode[group];
  const int64_t T = L.num_tokens;
  const int H = dcp.ranks * dcp.heads_per_rank;  // every head slot of the DCP group
  const float* qa = q_all.data<float>();
  float* lat = latent.data<float>();
  float* ls = lse.data<float>();
  std::vector<float> q(static_cast<size_t>(H) * kMlaQkDim), o(static_cast<size_t>(H) * kMlaLatentDim),
      l(H);
  // Head slot (r, hl) of token t lives at [r][t][hl] in q_all, latent and lse.
  auto at = [&](int r, int64_t t, int hl) {
    return (static_cast<size_t>(r) * T + t) * dcp.heads_per_rank + hl;
  };
  for (int c = g.seq_begin; c < g.seq_begin + g.num_seqs; ++c) {
    const SequenceSlice& seq = L.seqs[c];
    const int64_t t = seq.token_begin;
    const int32_t keys = L.attend_lens.empty() ? seq.context_len + 1 : L.attend_lens[c];
    for (int r = 0; r < dcp.ranks; ++r) {
      for (int hl = 0; hl < dcp.heads_per_rank; ++hl) {
        const int h = r * dcp.heads_per_rank + hl;
        std::copy(qa + at(r, t, hl) * kMlaQkDim, qa + (at(r, t, hl) + 1) * kMlaQkDim,
                  q.data() + static_cast<size_t>(h) * kMlaQkDim);
      }
    }
    if (keys == 0) {
      std::fill(o.begin(), o.end(), 0.0f);
      std::fill(l.begin(), l.end(), -std::numeric_limits<float>::infinity());
    } else {
      MlaDecodeRefParams p{};
      p.q = q.data();
      p.kv_pool = cache.pool.data<uint8_t>();
      p.block_table = seq.block_table.data();
      p.max_blocks_per_seq = static_cast<int>(seq.block_table.size());
      p.seq_lens = &keys;
      p.batch = 1;
      p.s_q = 1;
      p.heads = H;
      p.format = cache.format;
      p.kv_scale = cache.fp8_scale;
      p.softmax_scale = s.softmax_scale;
      p.fp8_mma = mla_fp8_mma_;
      p.out = o.data();
      p.lse = l.data();
      MlaDecodeRef(p);
    }
    for (int r = 0; r < dcp.ranks; ++r) {
      for (int hl = 0; hl < dcp.heads_per_rank; ++hl) {
        const int h = r * dcp.heads_per_rank + hl;
        std::copy(o.data() + static_cast<size_t>(h) * kMlaLatentDim,
                  o.data() + static_cast<size_t>(h + 1) * kMlaLatentDim,
                  lat + at(r, t, hl) * kMlaLatentDim);
        ls[at(r, t, hl)] = l[h];
      }
    }
  }
}

void CpuOps::MlaMergeExpand(const MlaShape& s, const DcpShape& dcp, const Tensor& latent_all,
                            const Tensor& lse_all, const Tensor& w_vb, Tensor& out) {
  const int64_t T = out.dim(0);
  const int N = dcp.ranks, slots = dcp.heads_per_rank;
  const float* lat = latent_all.data<float>();
  const float* ls = lse_all.data<float>();
  const float* vb = w_vb.data<float>();
  float* o = out.data<float>();
  // Source rank src's partial for this rank's head slot hl of token t.
  auto at = [&](int src, int64_t t, int hl) {
    return (static_cast<size_t>(src) * T + t) * slots + hl;
  };
  std::vector<double> merged(kMlaLatentDim);
  for (int64_t t = 0; t < T; ++t) {
    for (int hl = 0; hl < s.heads; ++hl) {
      double mx = -std::numeric_limits<double>::infinity();
      for (int src = 0; src < N; ++src) mx = std::max(mx, static_cast<double>(ls[at(src, t, hl)]));
      std::fill(merged.begin(), merged.end(), 0.0);
      double wsum = 0.0;
      if (mx > -std::numeric_limits<double>::infinity()) {
        for (int src = 0; src < N; ++src) {
          const double w = std::exp(static_cast<double>(ls[at(src, t, hl)]) - mx);
          if (w == 0.0) continue;
          wsum += w;
          const float* part = lat + at(src, t, hl) * kMlaLatentDim;
          for (int c = 0; c < kMlaLatentDim; ++c) merged[c] += w * part[c];
        }
      }
      float* oi = o + (t * s.heads + hl) * s.v_dim;
      for (int d = 0; d < s.v_dim; ++d) {
        const float* row = vb + (static_cast<size_t>(hl) * s.v_dim + d) * kMlaLatentDim;
        float acc = 0.0f;
        for (int c = 0; c < kMlaLatentDim; ++c) {
          acc += static_cast<float>(wsum > 0.0 ? merged[c] / wsum : 0.0) * row[c];
        }
        oi[d] = acc;
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
                        const RoutedExperts& experts, const Tensor& shared, Tensor& out) {
  std::vector<MoeExpertRef> refs;
  refs.reserve(experts.weights.size());
  for (const auto& e : experts.weights) refs.push_back({MoeRef(e.gate), MoeRef(e.up), MoeRef(e.down)});
  MoeExpertsRefParams p{};
  p.tokens = static_cast<int>(x.dim(0));
  p.hidden = static_cast<int>(x.dim(1));
  p.intermediate = experts.weights.empty() ? 0 : experts.weights[0].gate.out_features;
  p.top_k = static_cast<int>(ids.dim(1));
  p.x = x.data<float>();
  p.topk_ids = ids.data<int32_t>();
  p.topk_weights = weights.data<float>();
  p.first_expert = experts.first_expert;
  p.num_local_experts = static_cast<int>(experts.weights.size());
  p.experts = refs.data();
  p.out = out.data<float>();
  MoeExpertsRef(p);
  if (!shared.empty()) {
    const float* a = shared.data<float>();
    float* b = out.data<float>();
    for (int64_t i = 0; i < out.numel(); ++i) b[i] += a[i];
  }
}

absl::Status CpuOps::Sample(const Tensor& logits, const SamplingBatch& batch,
                            std::vector<SampledOutput>* out) {
  const int vocab = static_cast<int>(logits.dim(1));
  out->clear();
  for (size_t r = 0; r < batch.rows.size(); ++r) {
    const SamplingBatch::Row& row = batch.rows[r];
    out->push_back(SampleToken(logits.data<float>() + r * vocab, vocab, *row.params, *row.history,
                               row.prompt_len, row.generated));
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
