// The FP8 block-128 expert kernels (DeepSeek-V3 / R1's e4m3 weights with one fp32 scale per
// 128 x 128 block: kernels/moe/fp8_moe.h) against the CPU references (label gpu; skips without a
// GPU), as int4_moe_gpu_test.cc checks the INT4 ones: the device's register formation against its
// host twin for every code pair, each grouped GEMM alone at every tile size, the whole layer (GPU
// router -> dispatch -> FP8 experts -> combine + BF16 shared expert) for DeepSeek-R1-like shapes
// (all 256 experts, and 32 of 256 as on one of 8 expert-parallel ranks) and at full size, skewed
// routing, and output bits independent of batch, order and tile.
//
// The CPU references: the checkpoint's values fp32(e4m3 * s) dequantized by the project's one
// definition (DequantizeFp8Block, kernels/linear/fp8_block_ref.h), through the fp32 MoE reference
// (MoeExpertsRef) or fp64 dot products. The kernel's weights are bf16(fp32(e4m3 * s))
// (fp8_moe_layout.h), so the GEMM test also checks them against those rounded weights, where only
// the fp32 summation and h's bf16 rounding remain.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/linear/fp8_block_ref.h"
#include "kernels/moe/fp8_dense_linear.h"
#include "kernels/moe/fp8_moe.h"
#include "kernels/moe/fp8_moe_gemm.h"
#include "kernels/moe/fp8_moe_layout.h"
#include "kernels/moe/gated_mlp_bf16.h"
#include "kernels/moe/moe_ref.h"
#include "kernels/moe/moe_router.h"
#include "kernels/moe/moe_router_ref.h"
#include "kernels/moe/nvfp4_moe.h"
#include "tests/kernels/device_buffer.h"

namespace mlaserve {
namespace {

template <class T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) {
    if (cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  DevBuf(const std::vector<T>& v) : DevBuf(v.size()) {
    if (p) cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  std::vector<T> Get() const {
    std::vector<T> v(n);
    cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
  void Poison() { cudaMemset(p, 0xff, n * sizeof(T)); }  // NaN for floats, -1 for ints
};

// Runs f(begin, end) over [0, n) on all cores.
template <class F>
void ParallelFor(int n, F f) {
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  const int per = (n + threads - 1) / threads;
  for (int i = 0; i < threads; ++i) {
    const int b = i * per, e = std::min(n, b + per);
    if (b < e) pool.emplace_back(f, b, e);
  }
  for (auto& t : pool) t.join();
}

std::vector<uint16_t> RandomBf16(size_t n, std::mt19937& rng, float stddev) {
  std::normal_distribution<float> nd(0.0f, stddev);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = FloatToBf16(nd(rng));
  return v;
}

std::vector<float> Bf16ToF32(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = Bf16ToFloat(v[i]);
  return f;
}

double RelErr(const std::vector<float>& got, const std::vector<float>& ref) {
  double d = 0, r = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    d += (static_cast<double>(got[i]) - ref[i]) * (static_cast<double>(got[i]) - ref[i]);
    r += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(d / std::max(r, 1e-30));
}

// Distinct random expert ids per token, or every token's slot 0 on `hot` when hot >= 0.
std::vector<int32_t> RandomIds(int tokens, int top_k, int num_experts, std::mt19937& rng,
                               int hot = -1) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens) * top_k);
  std::vector<int> perm(num_experts);
  for (int t = 0; t < tokens; ++t) {
    for (int e = 0; e < num_experts; ++e) perm[e] = e;
    for (int j = 0; j < top_k; ++j) {
      std::uniform_int_distribution<int> d(j, num_experts - 1);
      std::swap(perm[j], perm[d(rng)]);
    }
    if (hot >= 0) {
      auto it = std::find(perm.begin(), perm.begin() + top_k, hot);
      if (it == perm.begin() + top_k) {
        perm[0] = hot;
      } else {
        std::swap(*it, perm[0]);
      }
    }
    for (int j = 0; j < top_k; ++j) ids[static_cast<size_t>(t) * top_k + j] = perm[j];
  }
  return ids;
}

// A random FP8 projection in checkpoint layout: e4m3 codes [rows, cols] uniform over the 254
// finite codes (every exponent, subnormals and both zeros), one fp32 scale per 128 x 128 block
// (partial blocks at the edges): `rms` / 100.06 (the codes' rms) x [0.5, 2) with a full 24-bit
// mantissa, 1 block in 16 zero, 1 in 32 tiny (2^-128 .. 2^-142: fp32 products and bf16 weights
// subnormal, which the kernel keeps).
struct Fp8Proj {
  int rows, cols;
  std::vector<uint8_t> codes;
  std::vector<float> scale;
  Fp8BlockTensor View() const { return {codes.data(), scale.data(), rows, cols, 128, 128}; }
};

constexpr float kFp8CodeRms = 100.06f;  // sqrt of the mean square of the 254 finite e4m3 values

Fp8Proj RandomFp8Proj(int rows, int cols, uint64_t seed, float rms) {
  Fp8Proj p{rows, cols, std::vector<uint8_t>(static_cast<size_t>(rows) * cols),
            std::vector<float>(static_cast<size_t>((rows + 127) / 128) * ((cols + 127) / 128))};
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&s] {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  };
  for (size_t i = 0; i < p.codes.size();) {
    uint64_t r = next();
    for (int b = 0; b < 8 && i < p.codes.size(); ++b, r >>= 8) {
      if ((r & 0x7f) != 0x7f) p.codes[i++] = static_cast<uint8_t>(r);
    }
  }
  for (float& v : p.scale) {
    const uint64_t r = next();
    const float m = 0.5f + 1.5f * static_cast<float>(r & 0xffffff) / 16777216.0f;
    v = rms / kFp8CodeRms * m;
    if ((r >> 24) % 32 == 1) v = std::ldexp(m, -128 - static_cast<int>((r >> 32) % 15));
    if ((r >> 40) % 16 == 3) v = 0.0f;
  }
  return p;
}

// A layer's routed experts: checkpoint-layout FP8 on the host, fp32(e4m3 * s) (the oracle's
// weights) and the rearranged copy.
struct Fp8Experts {
  int hidden, inter, num_local;
  std::vector<Fp8Proj> gate, up, down;
  std::vector<std::vector<float>> gate_f, up_f, down_f;
  std::vector<uint8_t> gu_codes, gu_scales, dn_codes, dn_scales;
};

std::vector<float> Dequantize(const Fp8Proj& p) {
  std::vector<float> out(static_cast<size_t>(p.rows) * p.cols);
  DequantizeFp8Block(p.View(), 0, p.rows, 0, p.cols, out.data());
  return out;
}

Fp8Experts MakeFp8Experts(int hidden, int inter, int num_local, uint64_t seed) {
  Fp8Experts x{hidden, inter, num_local};
  for (auto* v : {&x.gate, &x.up, &x.down}) v->resize(num_local);
  for (auto* v : {&x.gate_f, &x.up_f, &x.down_f}) v->resize(num_local);
  const size_t gu_c = Fp8TiledCodeBytes(2 * inter, hidden),
               gu_s = Fp8TiledScaleBytes(2 * inter, hidden);
  const size_t dn_c = Fp8TiledCodeBytes(hidden, inter), dn_s = Fp8TiledScaleBytes(hidden, inter);
  x.gu_codes.resize(gu_c * num_local);
  x.gu_scales.resize(gu_s * num_local);
  x.dn_codes.resize(dn_c * num_local);
  x.dn_scales.resize(dn_s * num_local);
  // Weights of rms ~0.2 / sqrt(K) keep the outputs O(1).
  const float s_in = 0.2f / std::sqrt(static_cast<float>(hidden));
  const float s_dn = 0.2f / std::sqrt(static_cast<float>(inter));
  ParallelFor(num_local, [&](int b, int e) {
    for (int i = b; i < e; ++i) {
      x.gate[i] = RandomFp8Proj(inter, hidden, seed * 1000 + 3 * i, s_in);
      x.up[i] = RandomFp8Proj(inter, hidden, seed * 1000 + 3 * i + 1, s_in * 1.5f);
      x.down[i] = RandomFp8Proj(hidden, inter, seed * 1000 + 3 * i + 2, s_dn);
      x.gate_f[i] = Dequantize(x.gate[i]);
      x.up_f[i] = Dequantize(x.up[i]);
      x.down_f[i] = Dequantize(x.down[i]);
      const bool ok1 =
          RelayoutFp8GateUp(x.gate[i].View(), x.up[i].View(), inter, hidden,
                            x.gu_codes.data() + gu_c * i, x.gu_scales.data() + gu_s * i)
              .ok();
      const bool ok2 = RelayoutFp8(x.down[i].View(), hidden, inter, x.dn_codes.data() + dn_c * i,
                                   x.dn_scales.data() + dn_s * i)
                           .ok();
      if (!ok1 || !ok2) std::abort();
    }
  });
  return x;
}

struct DeviceFp8Experts {
  DevBuf<uint8_t> gu_codes, gu_scales, dn_codes, dn_scales;
  explicit DeviceFp8Experts(const Fp8Experts& x)
      : gu_codes(x.gu_codes),
        gu_scales(x.gu_scales),
        dn_codes(x.dn_codes),
        dn_scales(x.dn_scales) {}
  Fp8MoeWeights View(const Fp8Experts& x, int first_expert) const {
    return Fp8MoeWeights{first_expert, x.num_local, x.hidden,   x.inter,
                         gu_codes.p,   gu_scales.p, dn_codes.p, dn_scales.p};
  }
};

std::vector<float> RoundedToBf16(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = Bf16ToFloat(FloatToBf16(v[i]));
  return r;
}

// ---------------------------------------------------------------------------------------------
// The register formation on the device.

// Fp8PairToBf16 on the GPU (cvt.rn.f16x2.e4m3x2, cvt.f32.f16, mul.rn.f32, cvt.rn.bf16x2.f32 on
// sm_89+) against its host twin (fp8_moe_layout_test: bf16(fp32(e4m3 * s)) for every pair) for
// all 65536 code pairs, bit for bit, at scales with full mantissas, fp32 subnormals and bf16 ties;
// the NaN codes give NaN halves on the device (the host twin reads them as +-480).
TEST(Fp8MoeGpuTest, RegisterFormationMatchesItsHostTwin) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  const float scales[] = {1.0f,          0.0f,         -1.0f,       1.0f / 448.0f,
                          3.0517578e-5f, 0.00123457f,  1.00390625f, 1.01171875f,
                          0x1p-140f,     0x1.7fp-127f, 123.456f,    2.089e-3f};
  std::vector<uint32_t> codes, want;
  std::vector<float> sc;
  for (float s : scales) {
    for (uint32_t pair = 0; pair < 65536; ++pair) {
      codes.push_back(pair);
      sc.push_back(s);
      want.push_back(Fp8PairToBf16(pair, s));
    }
  }
  DevBuf<uint32_t> d_codes(codes), d_out(codes.size());
  DevBuf<float> d_sc(sc);
  CUDA_OK(InvokeFp8PairDecodeCheck(d_codes.p, d_sc.p, d_out.p, static_cast<int>(codes.size()),
                                   nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint32_t> got = d_out.Get();
  size_t differ = 0, nan_ok = 0;
  for (size_t i = 0; i < codes.size(); ++i) {
    for (int half = 0; half < 2; ++half) {
      const uint32_t code = (codes[i] >> (8 * half)) & 0xff;
      const uint16_t g = static_cast<uint16_t>(got[i] >> (16 * half));
      const uint16_t w = static_cast<uint16_t>(want[i] >> (16 * half));
      if ((code & 0x7f) == 0x7f) {
        nan_ok += std::isnan(Bf16ToFloat(g));
        continue;
      }
      if (g != w && differ++ < 10) {
        ADD_FAILURE() << "pair 0x" << std::hex << codes[i] << " half " << half << " scale " << sc[i]
                      << ": device 0x" << g << ", host 0x" << w;
      }
    }
  }
  EXPECT_EQ(differ, 0u);
  EXPECT_EQ(nan_ok, std::size(scales) * 2 * 2 * 256);  // 2 NaN codes x 256 partners x 2 halves
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMMs alone, every tile size.

TEST(Fp8MoeGpuTest, GroupedGemmsMatchCpuForEveryTileSize) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  const int hidden = 1024, inter = 512, E = 16, top_k = 4;
  const Fp8Experts x = MakeFp8Experts(hidden, inter, E, 5);
  const DeviceFp8Experts dx(x);
  // The kernel's own weights, bf16(fp32(e4m3 * s)) (RNE, as cvt.rn.bf16x2.f32 rounds).
  std::vector<std::vector<float>> gate_b(E), up_b(E), down_b(E);
  for (int e = 0; e < E; ++e) {
    gate_b[e] = RoundedToBf16(x.gate_f[e]);
    up_b[e] = RoundedToBf16(x.up_f[e]);
    down_b[e] = RoundedToBf16(x.down_f[e]);
  }
  std::mt19937 rng(6);
  for (int tokens : {1, 7, 300}) {
    for (int tile : {kMoeTileTokensSmall, kMoeTileTokensMedium, kMoeTileTokensLarge}) {
      const std::vector<int32_t> ids = RandomIds(tokens, top_k, E, rng, tokens == 300 ? 3 : -1);
      std::vector<float> w(ids.size());
      std::uniform_real_distribution<float> ud(0.1f, 1.0f);
      for (float& v : w) v = ud(rng);
      const std::vector<uint16_t> xb = RandomBf16(static_cast<size_t>(tokens) * hidden, rng, 1.0f);
      const std::vector<float> xf = Bf16ToF32(xb);
      DevBuf<uint16_t> d_x(xb);
      DevBuf<int32_t> d_ids(ids);
      DevBuf<float> d_w(w);
      const size_t ws_bytes = Nvfp4MoeWorkspaceBytes(tokens, top_k, E, hidden, inter);
      DevBuf<uint8_t> ws(ws_bytes);
      Fp8MoeParams p{};
      p.weights = dx.View(x, 0);
      p.tokens = tokens;
      p.top_k = top_k;
      p.tile_tokens = tile;
      p.x = reinterpret_cast<const __nv_bfloat16*>(d_x.p);
      p.topk_ids = d_ids.p;
      p.topk_weights = d_w.p;
      p.workspace = ws.p;
      p.workspace_bytes = ws_bytes;
      const Nvfp4MoeWorkspace v = CarveNvfp4MoeWorkspace(ws.p, tokens, top_k, E, hidden, inter);
      const size_t rows = static_cast<size_t>(tokens) * top_k;
      CUDA_OK(cudaMemset(v.h, 0xff, rows * inter * 2));
      CUDA_OK(cudaMemset(v.y, 0xff, rows * hidden * 4));
      CUDA_OK(InvokeFp8MoeDispatchStage(p, nullptr));
      CUDA_OK(InvokeFp8MoeGateUpStage(p, nullptr));
      CUDA_OK(InvokeFp8MoeDownStage(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<int32_t> sorted(rows), offs(E + 1);
      CUDA_OK(cudaMemcpy(sorted.data(), v.sorted_assignment, rows * 4, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(offs.data(), v.expert_offsets, (E + 1) * 4, cudaMemcpyDeviceToHost));
      std::vector<uint16_t> hb(rows * inter);
      std::vector<float> y(rows * hidden);
      CUDA_OK(cudaMemcpy(hb.data(), v.h, hb.size() * 2, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(y.data(), v.y, y.size() * 4, cudaMemcpyDeviceToHost));
      ASSERT_EQ(offs[E], static_cast<int>(rows));
      // Row r's expert and token.
      std::vector<int> row_expert(rows), row_token(rows), row_slot(rows);
      for (int e = 0; e < E; ++e) {
        for (int r = offs[e]; r < offs[e + 1]; ++r) {
          ASSERT_EQ(ids[sorted[r]], e);
          row_expert[r] = e;
          row_token[r] = sorted[r] / top_k;
          row_slot[r] = sorted[r];
        }
      }
      // CPU in fp64, row by row: h from x and the weights (fp32(e4m3 * s), and its bf16); y from
      // the GPU's own h (isolates each GEMM).
      std::vector<float> h_exact(rows * inter), h_bw(rows * inter), h_gpu(rows * inter);
      std::vector<float> y_exact(rows * hidden), y_bw(rows * hidden);
      ParallelFor(static_cast<int>(rows), [&](int b, int end) {
        for (int r = b; r < end; ++r) {
          const int e = row_expert[r], t = row_token[r];
          const float* xr = xf.data() + static_cast<size_t>(t) * hidden;
          for (int i = 0; i < inter; ++i) {
            double g = 0, u = 0, gb = 0, ub = 0;
            const size_t o = static_cast<size_t>(i) * hidden;
            for (int k = 0; k < hidden; ++k) {
              g += static_cast<double>(x.gate_f[e][o + k]) * xr[k];
              u += static_cast<double>(x.up_f[e][o + k]) * xr[k];
              gb += static_cast<double>(gate_b[e][o + k]) * xr[k];
              ub += static_cast<double>(up_b[e][o + k]) * xr[k];
            }
            h_exact[r * inter + i] = static_cast<float>(g / (1 + std::exp(-g)) * u);
            h_bw[r * inter + i] = static_cast<float>(gb / (1 + std::exp(-gb)) * ub);
            h_gpu[r * inter + i] = Bf16ToFloat(hb[r * inter + i]);
          }
          for (int o = 0; o < hidden; ++o) {
            double acc = 0, acc_b = 0;
            const size_t d = static_cast<size_t>(o) * inter;
            for (int i = 0; i < inter; ++i) {
              acc += static_cast<double>(x.down_f[e][d + i]) * h_gpu[r * inter + i];
              acc_b += static_cast<double>(down_b[e][d + i]) * h_gpu[r * inter + i];
            }
            y_exact[r * hidden + o] = static_cast<float>(acc * w[row_slot[r]]);
            y_bw[r * hidden + o] = static_cast<float>(acc_b * w[row_slot[r]]);
          }
        }
      });
      // Against the kernel's weights bf16(fp32(e4m3 * s)): gate_up differs only by h's bf16
      // rounding (relative <= 2^-9 per element, ~1.65e-3 in norm here) and fp32 sums of exact
      // bf16 products (~1e-6): bound 3e-3. down: inputs identical (the GPU's h), weights
      // identical: only fp32 summation against fp64, ~sqrt(K) * 2^-24: bound 1e-5.
      const double e_h = RelErr(h_gpu, h_bw), e_y = RelErr(y, y_bw);
      // Against the checkpoint's fp32(e4m3 * s): the weights' bf16 rounding (nearly every weight
      // rounds: relative 1.65e-3 in norm) adds to h's. The same arithmetic simulated in fp64 on
      // the host with these distributions (100 tokens, 2026-12-01): h's rounding alone 1.65e-3, h
      // against fp32(e4m3 * s) 2.8-2.9e-3, y through the bf16 weights against fp32(e4m3 * s)
      // 1.64-1.70e-3. Bounds 6e-3 and 4e-3; a misplaced code or scale is O(1).
      const double e_hx = RelErr(h_gpu, h_exact), e_yx = RelErr(y, y_exact);
      EXPECT_LT(e_h, 3e-3) << "tokens " << tokens << " tile " << tile;
      EXPECT_LT(e_y, 1e-5) << "tokens " << tokens << " tile " << tile;
      EXPECT_LT(e_hx, 6e-3) << "tokens " << tokens << " tile " << tile;
      EXPECT_LT(e_yx, 4e-3) << "tokens " << tokens << " tile " << tile;
      std::printf(
          "fp8 gemms tokens %d tile %d: rel err vs bf16 weights h %.2e y %.2e | vs fp32(e4m3*s) "
          "h %.2e y %.2e\n",
          tokens, tile, e_h, e_y, e_hx, e_yx);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dense projections (fp8_dense_linear.h): the weight-only kernel's dense mode and the
// dequantized copy for large row counts.

// DeepSeek-R1 projection shapes at 8 ranks ([n, k]: kv_a [576, 7168] with n off the 128 grid,
// q_b [3072, 1536]) and one padded on both sides ([100, 64], as dsv3-tiny's): every row count
// through each tile size, against fp64 on the bf16 weights (only fp32 summation and the output's
// bf16 rounding remain: relative 2^-9 per element, ~1.1e-3 in norm; bound 2e-3) and on
// fp32(e4m3 * s) (the weights' rounding adds ~1.7e-3: bound 5e-3); a row's bits the same at every
// m; the dequantized copy equal bit for bit to the host's bf16 of DequantizeFp8Block.
TEST(Fp8MoeGpuTest, DenseProjectionsMatchCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  struct Shape {
    int n, k;
  };
  std::mt19937 rng(31);
  for (const Shape sh : {Shape{576, 7168}, Shape{3072, 1536}, Shape{100, 64}}) {
    const int n_p = (sh.n + 127) / 128 * 128, k_p = (sh.k + 127) / 128 * 128;
    const Fp8Proj w = RandomFp8Proj(sh.n, sh.k, 1000 + sh.n, 0.2f / std::sqrt(float(sh.k)));
    const std::vector<float> wf = Dequantize(w);
    const std::vector<float> wb = RoundedToBf16(wf);
    std::vector<uint8_t> codes(Fp8TiledCodeBytes(n_p, k_p)), scales(Fp8TiledScaleBytes(n_p, k_p));
    ASSERT_TRUE(RelayoutFp8(w.View(), n_p, k_p, codes.data(), scales.data()).ok());
    DevBuf<uint8_t> d_codes(codes), d_scales(scales);
    // The dequantized copy.
    DevBuf<uint16_t> d_wb(static_cast<size_t>(sh.n) * sh.k);
    CUDA_OK(InvokeFp8DenseToBf16(d_codes.p, d_scales.p, n_p, k_p, sh.n, sh.k, d_wb.p, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got_w = d_wb.Get();
    size_t w_differ = 0;
    for (size_t i = 0; i < wf.size(); ++i) w_differ += got_w[i] != FloatToBf16(wf[i]);
    EXPECT_EQ(w_differ, 0u) << sh.n << "x" << sh.k;
    const int max_m = 300;
    const std::vector<uint16_t> xb = RandomBf16(static_cast<size_t>(max_m) * sh.k, rng, 1.0f);
    std::vector<uint16_t> xp(static_cast<size_t>(max_m) * k_p, 0);  // zero-padded columns
    for (int r = 0; r < max_m; ++r) {
      std::copy_n(xb.begin() + static_cast<size_t>(r) * sh.k, sh.k,
                  xp.begin() + static_cast<size_t>(r) * k_p);
    }
    const std::vector<float> xf = Bf16ToF32(xb);
    DevBuf<uint16_t> d_x(xp);
    std::vector<uint16_t> row0;  // row 0's bits at m = 1
    for (int m : {1, 5, 16, 17, 64, 100, 300}) {
      DevBuf<uint16_t> d_out(static_cast<size_t>(m) * sh.n);
      d_out.Poison();
      Fp8DenseLinearParams p;
      p.m = m;
      p.n = sh.n;
      p.n_p = n_p;
      p.k_p = k_p;
      p.x = d_x.p;
      p.codes = d_codes.p;
      p.scales = d_scales.p;
      p.alpha = 1.0f;
      p.out = d_out.p;
      CUDA_OK(InvokeFp8DenseLinear(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint16_t> ob = d_out.Get();
      std::vector<float> got(ob.size()), ref_b(ob.size()), ref_x(ob.size());
      for (size_t i = 0; i < ob.size(); ++i) got[i] = Bf16ToFloat(ob[i]);
      ParallelFor(m, [&](int b, int e) {
        for (int r = b; r < e; ++r) {
          for (int o = 0; o < sh.n; ++o) {
            double ab = 0, ax = 0;
            for (int c = 0; c < sh.k; ++c) {
              const double xv = xf[static_cast<size_t>(r) * sh.k + c];
              ab += wb[static_cast<size_t>(o) * sh.k + c] * xv;
              ax += wf[static_cast<size_t>(o) * sh.k + c] * xv;
            }
            ref_b[static_cast<size_t>(r) * sh.n + o] = static_cast<float>(ab);
            ref_x[static_cast<size_t>(r) * sh.n + o] = static_cast<float>(ax);
          }
        }
      });
      const double e_b = RelErr(got, ref_b), e_x = RelErr(got, ref_x);
      std::printf("fp8 dense [%d, %d] m %d: rel err vs bf16 weights %.2e, vs fp32(e4m3*s) %.2e\n",
                  sh.n, sh.k, m, e_b, e_x);
      EXPECT_LT(e_b, 2e-3) << sh.n << "x" << sh.k << " m " << m;
      EXPECT_LT(e_x, 5e-3) << sh.n << "x" << sh.k << " m " << m;
      if (m == 1) {
        row0.assign(ob.begin(), ob.begin() + sh.n);
      } else {
        EXPECT_TRUE(std::equal(row0.begin(), row0.end(), ob.begin()))
            << "row 0's bits changed with m = " << m;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Whole layer.

struct LayerCase {
  const char* name;
  MoeRouterConfig router;
  int hidden, inter, shared_inter;
  int first_expert, num_local;
};

// Router on GPU (ids checked identical to the CPU's on the GPU's logits) -> INT4 experts ->
// combine with the BF16 shared expert (cuBLAS), against the fp32 CPU layer on fp32(e4m3 * s).
void RunLayer(const LayerCase& c, const Fp8Experts& x, const DeviceFp8Experts& dx, int tokens,
              std::mt19937& rng, int hot_expert, double* err_out) {
  const int H = c.hidden, E = c.router.num_experts, K = c.router.top_k, S = c.shared_inter;
  const std::vector<uint16_t> xb = RandomBf16(static_cast<size_t>(tokens) * H, rng, 1.0f);
  const std::vector<uint16_t> gate = RandomBf16(static_cast<size_t>(E) * H, rng, 0.05f);
  std::vector<float> bias(E);
  std::uniform_real_distribution<float> ud(0.0f, 0.05f);
  for (float& b : bias) b = ud(rng);
  // Favour the local experts so that expert parallelism has work; `hot` takes everything.
  for (int e = c.first_expert; e < c.first_expert + c.num_local; ++e) bias[e] += 0.3f;
  if (hot_expert >= 0) bias[hot_expert] += 10.0f;
  const std::vector<uint16_t> sgu =
      RandomBf16(static_cast<size_t>(2) * S * H, rng, 0.25f / std::sqrt(static_cast<float>(H)));
  const std::vector<uint16_t> sdn =
      RandomBf16(static_cast<size_t>(H) * S, rng, 0.25f / std::sqrt(static_cast<float>(S)));

  DevBuf<uint16_t> d_x(xb), d_gate(gate), d_sgu(sgu), d_sdn(sdn);
  DevBuf<uint16_t> d_sgu_out(static_cast<size_t>(tokens) * 2 * S),
      d_sact(static_cast<size_t>(tokens) * S), d_sout(static_cast<size_t>(tokens) * H);
  DevBuf<float> d_bias(bias), d_logits(static_cast<size_t>(tokens) * E);
  DevBuf<int32_t> d_ids(static_cast<size_t>(tokens) * K);
  DevBuf<float> d_w(static_cast<size_t>(tokens) * K), d_out(static_cast<size_t>(tokens) * H);
  d_out.Poison();
  cublasHandle_t cublas;
  ASSERT_EQ(cublasCreate(&cublas), CUBLAS_STATUS_SUCCESS);
  const auto* bx = reinterpret_cast<const __nv_bfloat16*>(d_x.p);
  MoeRouterLogitsParams lp{
      tokens, H, E, bx, reinterpret_cast<const __nv_bfloat16*>(d_gate.p), d_logits.p, cublas};
  ASSERT_EQ(InvokeMoeRouterLogits(lp, nullptr), CUBLAS_STATUS_SUCCESS);
  CUDA_OK(InvokeMoeRoute({c.router, tokens, d_logits.p, d_bias.p, d_ids.p, d_w.p}, nullptr));
  Bf16GatedMlpParams sp{tokens,
                        H,
                        S,
                        bx,
                        reinterpret_cast<const __nv_bfloat16*>(d_sgu.p),
                        reinterpret_cast<const __nv_bfloat16*>(d_sdn.p),
                        reinterpret_cast<__nv_bfloat16*>(d_sgu_out.p),
                        reinterpret_cast<__nv_bfloat16*>(d_sact.p),
                        reinterpret_cast<__nv_bfloat16*>(d_sout.p),
                        cublas};
  CUDA_OK(InvokeBf16GatedMlp(sp, nullptr));
  const size_t ws_bytes = Nvfp4MoeWorkspaceBytes(tokens, K, c.num_local, H, c.inter);
  DevBuf<uint8_t> ws(ws_bytes);
  Fp8MoeParams p{};
  p.weights = dx.View(x, c.first_expert);
  p.tokens = tokens;
  p.top_k = K;
  p.tile_tokens = ChooseMoeTileTokens(tokens, K, E);
  p.x = bx;
  p.topk_ids = d_ids.p;
  p.topk_weights = d_w.p;
  p.shared_out = reinterpret_cast<const __nv_bfloat16*>(d_sout.p);
  p.out = d_out.p;
  p.workspace = ws.p;
  p.workspace_bytes = ws_bytes;
  // An explicit stream: InvokeFp8Moe launches programmatically there (sm_90+), not on nullptr.
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  CUDA_OK(InvokeFp8Moe(p, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));
  cublasDestroy(cublas);

  // CPU: the router on the GPU's logits must give the same ids and weights.
  const std::vector<float> logits = d_logits.Get();
  std::vector<int32_t> ids(static_cast<size_t>(tokens) * K);
  std::vector<float> w(ids.size());
  MoeRouteRef(c.router, logits.data(), bias.data(), tokens, ids.data(), w.data());
  ASSERT_EQ(d_ids.Get(), ids) << c.name;
  const std::vector<float> gw = d_w.Get();
  ASSERT_EQ(std::memcmp(gw.data(), w.data(), w.size() * 4), 0) << c.name;
  const std::vector<float> xf = Bf16ToF32(xb);
  std::vector<MoeExpertRef> experts(x.num_local);
  for (int i = 0; i < x.num_local; ++i) {
    experts[i].gate.f32 = x.gate_f[i].data();
    experts[i].up.f32 = x.up_f[i].data();
    experts[i].down.f32 = x.down_f[i].data();
  }
  std::vector<float> ref(static_cast<size_t>(tokens) * H);
  ParallelFor(tokens, [&](int b, int e) {
    MoeExpertsRefParams rp{e - b,
                           H,
                           x.inter,
                           K,
                           xf.data() + static_cast<size_t>(b) * H,
                           ids.data() + static_cast<size_t>(b) * K,
                           w.data() + static_cast<size_t>(b) * K,
                           c.first_expert,
                           x.num_local,
                           experts.data(),
                           ref.data() + static_cast<size_t>(b) * H};
    MoeExpertsRef(rp);
  });
  // Shared expert in fp32 on the same bf16 weights.
  const std::vector<float> sguf = Bf16ToF32(sgu), sdnf = Bf16ToF32(sdn);
  MoeExpertRef se;
  se.gate.f32 = sguf.data();
  se.up.f32 = sguf.data() + static_cast<size_t>(S) * H;
  se.down.f32 = sdnf.data();
  std::vector<float> sref(ref.size());
  ParallelFor(tokens, [&](int b, int e) {
    GatedMlpRef(se, e - b, H, S, xf.data() + static_cast<size_t>(b) * H,
                sref.data() + static_cast<size_t>(b) * H);
  });
  for (size_t i = 0; i < ref.size(); ++i) ref[i] += sref[i];
  *err_out = RelErr(d_out.Get(), ref);
}

// Tolerance: the GPU rounds the weights to bf16 (~1.7e-3 in norm per projection, above),
// h, the shared expert's intermediates and its output to bf16 (relative 2^-9 each, random):
// ~3-4e-3 expected in norm. Bound 1e-2 (NVFP4's layer bound, whose weights are exact in bf16).
constexpr double kLayerBound = 1e-2;

TEST(Fp8MoeGpuTest, WholeLayerMatchesCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  // Reduced hidden/intermediate keep the fp32 CPU oracle fast at 8192 tokens; the kernels' code
  // paths are the same at full size (WholeLayerFullSize).
  const LayerCase cases[] = {
      {"deepseek_like_all_256", {256, 8, 8, 4, false, true, 2.5f}, 1024, 256, 256, 0, 256},
      {"deepseek_like_ep8_32_of_256", {256, 8, 8, 4, false, true, 2.5f}, 1024, 256, 256, 64, 32},
  };
  std::mt19937 rng(9);
  for (const LayerCase& c : cases) {
    const Fp8Experts x = MakeFp8Experts(c.hidden, c.inter, c.num_local, 21);
    const DeviceFp8Experts dx(x);
    for (int tokens : {1, 7, 64, 256, 1000, 8192}) {
      double err;
      RunLayer(c, x, dx, tokens, rng, -1, &err);
      EXPECT_LT(err, kLayerBound) << c.name << " tokens " << tokens;
      std::printf("fp8 layer %s tokens %d: rel err %.2e\n", c.name, tokens, err);
    }
    // Skewed: every token's first choice is one expert (the others get few or none).
    double err;
    RunLayer(c, x, dx, 1000, rng, c.first_expert + 1, &err);
    EXPECT_LT(err, kLayerBound) << c.name << " skewed";
    std::printf("fp8 layer %s skewed: rel err %.2e\n", c.name, err);
  }
}

TEST(Fp8MoeGpuTest, WholeLayerFullSize) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  // DeepSeek-R1 shapes (hidden 7168, intermediate 2048, top-8 of 256 in 8 groups, 4 chosen), 16
  // local experts (the CPU oracle holds them all in fp32: 2.8 GB).
  const LayerCase c{
      "full_size_16_of_256", {256, 8, 8, 4, false, true, 2.5f}, 7168, 2048, 2048, 32, 16};
  const Fp8Experts x = MakeFp8Experts(c.hidden, c.inter, c.num_local, 33);
  const DeviceFp8Experts dx(x);
  std::mt19937 rng(10);
  for (int tokens : {1, 8, 64, 256}) {
    double err;
    RunLayer(c, x, dx, tokens, rng, -1, &err);
    EXPECT_LT(err, kLayerBound) << "tokens " << tokens;
    std::printf("fp8 layer %s tokens %d: rel err %.2e\n", c.name, tokens, err);
  }
}

// The same token's output bits whatever else is in the batch, in any order, with any tile size
// and with or without programmatic launches (as the NVFP4 path: no split-K, fixed K order).
TEST(Fp8MoeGpuTest, OutputBitsIndependentOfBatchAndTile) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  const int hidden = 1024, inter = 256, E = 64, K = 8, tokens = 96;
  const Fp8Experts x = MakeFp8Experts(hidden, inter, E, 44);
  const DeviceFp8Experts dx(x);
  std::mt19937 rng(12);
  const std::vector<int32_t> ids = RandomIds(tokens, K, E, rng);
  std::vector<float> w(ids.size());
  std::uniform_real_distribution<float> ud(0.1f, 1.0f);
  for (float& v : w) v = ud(rng);
  const std::vector<uint16_t> xb = RandomBf16(static_cast<size_t>(tokens) * hidden, rng, 1.0f);
  // Runs a batch given as a list of token indices of the base batch, on an explicit stream as in
  // serving (programmatic launches, sm_90+, for small decode batches).
  auto run = [&](const std::vector<int>& order, int tile) {
    const int n = static_cast<int>(order.size());
    std::vector<uint16_t> bx(static_cast<size_t>(n) * hidden);
    std::vector<int32_t> bids(static_cast<size_t>(n) * K);
    std::vector<float> bw(bids.size());
    for (int i = 0; i < n; ++i) {
      std::copy_n(xb.begin() + static_cast<size_t>(order[i]) * hidden, hidden,
                  bx.begin() + static_cast<size_t>(i) * hidden);
      std::copy_n(ids.begin() + order[i] * K, K, bids.begin() + i * K);
      std::copy_n(w.begin() + order[i] * K, K, bw.begin() + i * K);
    }
    DevBuf<uint16_t> d_x(bx);
    DevBuf<int32_t> d_ids(bids);
    DevBuf<float> d_w(bw), d_out(static_cast<size_t>(n) * hidden);
    const size_t ws_bytes = Nvfp4MoeWorkspaceBytes(n, K, E, hidden, inter);
    DevBuf<uint8_t> ws(ws_bytes);
    Fp8MoeParams p{};
    p.weights = dx.View(x, 0);
    p.tokens = n;
    p.top_k = K;
    p.tile_tokens = tile;
    p.x = reinterpret_cast<const __nv_bfloat16*>(d_x.p);
    p.topk_ids = d_ids.p;
    p.topk_weights = d_w.p;
    p.out = d_out.p;
    p.workspace = ws.p;
    p.workspace_bytes = ws_bytes;
    cudaStream_t stream;
    EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    d_out.Poison();
    EXPECT_EQ(InvokeFp8Moe(p, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
    return d_out.Get();
  };
  std::vector<int> base(tokens);
  for (int i = 0; i < tokens; ++i) base[i] = i;
  const std::vector<float> ref = run(base, kMoeTileTokensLarge);
  for (float v : ref) ASSERT_TRUE(std::isfinite(v));
  std::vector<int> shuffled = base;
  std::shuffle(shuffled.begin(), shuffled.end(), rng);
  const std::vector<float> sh = run(shuffled, kMoeTileTokensSmall);
  for (int i = 0; i < tokens; ++i) {
    ASSERT_EQ(std::memcmp(sh.data() + static_cast<size_t>(i) * hidden,
                          ref.data() + static_cast<size_t>(shuffled[i]) * hidden, hidden * 4),
              0)
        << "token " << shuffled[i];
  }
  const std::vector<float> one = run({17}, kMoeTileTokensMedium);
  EXPECT_EQ(std::memcmp(one.data(), ref.data() + 17 * hidden, hidden * 4), 0);
  // A small decode batch (programmatic launches, kMoeProgrammaticMaxRows) against the large one.
  const std::vector<int> few = {shuffled[0], shuffled[1], shuffled[2]};
  const std::vector<float> few_out = run(few, kMoeTileTokensSmall);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(std::memcmp(few_out.data() + static_cast<size_t>(i) * hidden,
                          ref.data() + static_cast<size_t>(few[i]) * hidden, hidden * 4),
              0)
        << "token " << few[i];
  }
}

}  // namespace
}  // namespace mlaserve
