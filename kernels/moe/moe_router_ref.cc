#include "kernels/moe/moe_router_ref.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "kernels/moe/moe_router_math.h"

namespace mlaserve {

absl::Status ValidateMoeRouterConfig(const MoeRouterConfig& c) {
  if (c.num_experts < 1 || c.num_experts > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoE router: num_experts ", c.num_experts, " outside [1, 1024]"));
  }
  if (c.n_group < 1 || c.n_group > 32 || c.num_experts % c.n_group != 0) {
    return absl::InvalidArgumentError(absl::StrCat("MoE router: n_group ", c.n_group,
                                                   " must be in [1, 32] and divide num_experts ",
                                                   c.num_experts));
  }
  if (c.topk_group < 1 || c.topk_group > c.n_group) {
    return absl::InvalidArgumentError(absl::StrCat("MoE router: topk_group ", c.topk_group,
                                                   " outside [1, n_group = ", c.n_group, "]"));
  }
  const int kept = c.topk_group * (c.num_experts / c.n_group);
  if (c.top_k < 1 || c.top_k > 32 || c.top_k > kept) {
    return absl::InvalidArgumentError(absl::StrCat("MoE router: top_k ", c.top_k,
                                                   " must be in [1, 32] and at most the ", kept,
                                                   " experts of the kept groups"));
  }
  return absl::OkStatus();
}

void MoeRouteRef(const MoeRouterConfig& c, const float* logits, const float* bias, int tokens,
                 int32_t* topk_ids, float* topk_weights) {
  namespace rm = router_math;
  if (absl::Status s = ValidateMoeRouterConfig(c); !s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    std::abort();
  }
  const int E = c.num_experts;
  const int group_size = E / c.n_group;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> score(E), choice(E), group_score(c.n_group);
  std::vector<char> group_kept(c.n_group), taken(E);
  for (int t = 0; t < tokens; ++t) {
    const float* l = logits + static_cast<size_t>(t) * E;
    if (c.softmax_scoring) {
      float m = kNegInf;
      for (int e = 0; e < E; ++e) m = std::fmax(m, l[e]);
      float partial[32] = {};
      for (int e = 0; e < E; ++e) {
        score[e] = rm::Exp(rm::Add(l[e], -m));
        partial[e % 32] = rm::Add(partial[e % 32], score[e]);
      }
      for (int o = 16; o >= 1; o /= 2) {
        float next[32];
        for (int lane = 0; lane < 32; ++lane)
          next[lane] = rm::Add(partial[lane], partial[lane ^ o]);
        for (int lane = 0; lane < 32; ++lane) partial[lane] = next[lane];
      }
      for (int e = 0; e < E; ++e) score[e] = rm::Div(score[e], partial[0]);
    } else {
      for (int e = 0; e < E; ++e) score[e] = rm::Sigmoid(l[e]);
    }
    for (int e = 0; e < E; ++e) {
      const float v = bias ? rm::Add(score[e], bias[e]) : score[e];
      choice[e] = std::isnan(v) ? kNegInf : v;
    }
    if (c.n_group > 1) {
      for (int g = 0; g < c.n_group; ++g) {
        float m1 = kNegInf, m2 = kNegInf;  // the two largest, as a multiset
        for (int e = g * group_size; e < (g + 1) * group_size; ++e) {
          if (choice[e] > m1) {
            m2 = m1;
            m1 = choice[e];
          } else if (choice[e] > m2) {
            m2 = choice[e];
          }
        }
        const float gs = c.softmax_scoring || group_size == 1 ? m1 : rm::Add(m1, m2);
        group_score[g] = std::isnan(gs) ? kNegInf : gs;
        group_kept[g] = 0;
      }
      for (int r = 0; r < c.topk_group; ++r) {
        int best = -1;
        for (int g = 0; g < c.n_group; ++g) {
          if (group_kept[g]) continue;
          if (best < 0 || rm::Better(group_score[g], g, group_score[best], best)) best = g;
        }
        group_kept[best] = 1;
      }
      for (int e = 0; e < E; ++e) {
        if (!group_kept[e / group_size]) choice[e] = kNegInf;
      }
    }
    int32_t* ids = topk_ids + static_cast<size_t>(t) * c.top_k;
    float* w = topk_weights + static_cast<size_t>(t) * c.top_k;
    for (int e = 0; e < E; ++e) taken[e] = 0;
    for (int r = 0; r < c.top_k; ++r) {
      int best = -1;
      for (int e = 0; e < E; ++e) {
        if (taken[e]) continue;
        if (best < 0 || rm::Better(choice[e], e, choice[best], best)) best = e;
      }
      taken[best] = 1;
      ids[r] = best;
      w[r] = score[best];
    }
    if (c.norm_topk_prob) {
      float sum = 0.0f;
      for (int r = 0; r < c.top_k; ++r) sum = rm::Add(sum, w[r]);
      const float denom = rm::Add(sum, 1e-20f);
      for (int r = 0; r < c.top_k; ++r) w[r] = rm::Div(w[r], denom);
    }
    for (int r = 0; r < c.top_k; ++r) w[r] = rm::Mul(w[r], c.routed_scaling_factor);
  }
}

void MoeRouterLogitsRef(const uint16_t* hidden_bf16, const uint16_t* gate_bf16, int tokens,
                        int hidden_size, int num_experts, float* logits) {
  std::vector<float> g(static_cast<size_t>(num_experts) * hidden_size);
  for (size_t i = 0; i < g.size(); ++i) g[i] = Bf16ToFloat(gate_bf16[i]);
  std::vector<float> x(hidden_size);
  for (int t = 0; t < tokens; ++t) {
    for (int k = 0; k < hidden_size; ++k) {
      x[k] = Bf16ToFloat(hidden_bf16[static_cast<size_t>(t) * hidden_size + k]);
    }
    for (int e = 0; e < num_experts; ++e) {
      const float* ge = g.data() + static_cast<size_t>(e) * hidden_size;
      float acc = 0.0f;
      for (int k = 0; k < hidden_size; ++k) acc += x[k] * ge[k];
      logits[static_cast<size_t>(t) * num_experts + e] = acc;
    }
  }
}

}  // namespace mlaserve
