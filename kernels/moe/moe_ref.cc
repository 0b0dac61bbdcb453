#include "kernels/moe/moe_ref.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

#include "kernels/moe/nvfp4_ref.h"

namespace mlaserve {
namespace {

// Weights of one projection as fp32, dequantizing NVFP4 into `storage` when needed.
const float* AsFloat(const MoeLinearRef& w, int rows, int cols, std::vector<float>& storage) {
  if (w.f32 != nullptr) return w.f32;
  if (w.nvfp4_packed == nullptr || w.nvfp4_scale == nullptr) {
    std::fprintf(stderr, "MoeLinearRef: neither fp32 nor NVFP4 weights set\n");
    std::abort();
  }
  storage.resize(static_cast<size_t>(rows) * cols);
  DequantizeNvfp4(w.nvfp4_packed, w.nvfp4_scale, w.nvfp4_global_scale, rows, cols, storage.data());
  return storage.data();
}

float Dot(const float* a, const float* b, int n) {
  float acc = 0.0f;
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

struct ExpertF32 {
  std::vector<float> gate_s, up_s, down_s;
  const float* gate;
  const float* up;
  const float* down;
};

void Load(const MoeExpertRef& w, int hidden, int inter, ExpertF32& e) {
  e.gate = AsFloat(w.gate, inter, hidden, e.gate_s);
  e.up = AsFloat(w.up, inter, hidden, e.up_s);
  e.down = AsFloat(w.down, hidden, inter, e.down_s);
}

// y = down(silu(gate x) * up x); h is scratch [inter].
void ExpertForward(const ExpertF32& e, int hidden, int inter, const float* x, float* h, float* y) {
  for (int i = 0; i < inter; ++i) {
    const float g = Dot(e.gate + static_cast<size_t>(i) * hidden, x, hidden);
    const float u = Dot(e.up + static_cast<size_t>(i) * hidden, x, hidden);
    h[i] = g / (1.0f + std::exp(-g)) * u;
  }
  for (int o = 0; o < hidden; ++o) y[o] = Dot(e.down + static_cast<size_t>(o) * inter, h, inter);
}

}  // namespace

void MoeExpertsRef(const MoeExpertsRefParams& p) {
  std::map<int, ExpertF32> cache;  // local expert -> fp32 weights, dequantized once per call
  std::vector<float> h(p.intermediate), y(p.hidden);
  for (int t = 0; t < p.tokens; ++t) {
    float* out = p.out + static_cast<size_t>(t) * p.hidden;
    for (int o = 0; o < p.hidden; ++o) out[o] = 0.0f;
    const float* x = p.x + static_cast<size_t>(t) * p.hidden;
    for (int j = 0; j < p.top_k; ++j) {
      const int local = p.topk_ids[static_cast<size_t>(t) * p.top_k + j] - p.first_expert;
      if (local < 0 || local >= p.num_local_experts) continue;
      auto it = cache.find(local);
      if (it == cache.end()) {
        it = cache.emplace(local, ExpertF32{}).first;
        Load(p.experts[local], p.hidden, p.intermediate, it->second);
      }
      ExpertForward(it->second, p.hidden, p.intermediate, x, h.data(), y.data());
      const float w = p.topk_weights[static_cast<size_t>(t) * p.top_k + j];
      for (int o = 0; o < p.hidden; ++o) out[o] += w * y[o];
    }
  }
}

void GatedMlpRef(const MoeExpertRef& weights, int tokens, int hidden, int intermediate,
                 const float* x, float* out) {
  ExpertF32 e;
  Load(weights, hidden, intermediate, e);
  std::vector<float> h(intermediate);
  for (int t = 0; t < tokens; ++t) {
    ExpertForward(e, hidden, intermediate, x + static_cast<size_t>(t) * hidden, h.data(),
                  out + static_cast<size_t>(t) * hidden);
  }
}

}  // namespace mlaserve
