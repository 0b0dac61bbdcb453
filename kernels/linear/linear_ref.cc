#include "kernels/linear/linear_ref.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "kernels/moe/nvfp4_ref.h"

namespace mlaserve {
namespace {

// One output row of W as fp32.
void WeightRow(const LinearRefWeight& w, int row, float* dst) {
  const int in = w.in_features;
  if (w.f32 != nullptr) {
    std::copy(w.f32 + static_cast<int64_t>(row) * in, w.f32 + static_cast<int64_t>(row + 1) * in,
              dst);
  } else if (w.bf16 != nullptr) {
    const uint16_t* src = w.bf16 + static_cast<int64_t>(row) * in;
    for (int i = 0; i < in; ++i) dst[i] = Bf16ToFloat(src[i]);
  } else {
    DequantizeNvfp4(w.nvfp4_packed + static_cast<int64_t>(row) * (in / 2),
                    w.nvfp4_scale + static_cast<int64_t>(row) * (in / 16), w.nvfp4_global_scale,
                    /*rows=*/1, in, dst);
  }
}

void Rows(const float* x, int64_t tokens, const LinearRefWeight& w, float* out, int row_begin,
          int row_end) {
  std::vector<float> wrow(w.in_features);
  for (int r = row_begin; r < row_end; ++r) {
    WeightRow(w, r, wrow.data());
    for (int64_t t = 0; t < tokens; ++t) {
      const float* xt = x + t * w.in_features;
      float acc = 0.0f;
      for (int i = 0; i < w.in_features; ++i) acc += xt[i] * wrow[i];
      out[t * w.out_features + r] = acc;
    }
  }
}

}  // namespace

void LinearRef(const float* x, int64_t tokens, const LinearRefWeight& w, float* out, int threads) {
  const int64_t work = tokens * w.out_features * static_cast<int64_t>(w.in_features);
  threads = std::max(1, std::min<int>(threads, w.out_features));
  if (threads == 1 || work < (1 << 20)) {
    Rows(x, tokens, w, out, 0, w.out_features);
    return;
  }
  std::vector<std::thread> pool;
  const int per = (w.out_features + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const int b = t * per, e = std::min(w.out_features, b + per);
    if (b < e) pool.emplace_back(Rows, x, tokens, std::cref(w), out, b, e);
  }
  for (auto& th : pool) th.join();
}

void DequantizeNvfp4ToBf16Unscaled(const uint8_t* packed, const uint8_t* scale_e4m3, int64_t rows,
                                   int64_t cols, uint16_t* out_bf16) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* p = packed + r * (cols / 2);
    const uint8_t* s = scale_e4m3 + r * (cols / kNvfp4BlockSize);
    uint16_t* o = out_bf16 + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t code = (c % 2 == 0) ? (p[c / 2] & 0x0f) : (p[c / 2] >> 4);
      o[c] = FloatToBf16(E2m1ToFloat(code) * E4m3ToFloat(s[c / kNvfp4BlockSize]));
    }
  }
}

}  // namespace mlaserve
