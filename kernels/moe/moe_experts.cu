// Load-time upload (padding, relayout) and the per-layer launch sequence of moe_experts.h.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/moe/bf16_moe_gemm.h"
#include "kernels/moe/fp8_moe.h"
#include "kernels/moe/fp8_moe_layout.h"
#include "kernels/moe/int4_moe.h"
#include "kernels/moe/int4_moe_layout.h"
#include "kernels/moe/moe_combine.h"
#include "kernels/moe/moe_dispatch.h"
#include "kernels/moe/moe_experts.h"
#include "kernels/moe/moe_few_expert_layer.h"
#include "kernels/moe/nvfp4_moe.h"
#include "kernels/moe/nvfp4_moe_gemm.h"
#include "kernels/moe/nvfp4_moe_layout.h"

namespace mlaserve {
namespace {

// The grouped GEMMs tile weight rows by 128 and K by 64 or 128.
constexpr int kPadMultiple = 128;
// InvokeMoeDispatch's limit on local experts (one thread block).
constexpr int kMaxLocalExperts = 1024;

int RoundUp(int x, int m) { return (x + m - 1) / m * m; }
size_t Align256(size_t x) { return (x + 255) / 256 * 256; }

absl::Status CudaStatus(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("MoE experts: ", what, ": ", cudaGetErrorName(e), " (",
                                          cudaGetErrorString(e), ")"));
}

// Device scratch freed on scope exit (load time only).
struct ScopedDeviceBuffer {
  void* p = nullptr;
  ~ScopedDeviceBuffer() { cudaFree(p); }
};

// Copies an NVFP4 [rows, cols] projection into a zero [rows_p, cols_p] one (cols % 16 == 0):
// zero scale bytes make the padded blocks dequantize to zero (nvfp4_moe_layout.h).
void PadNvfp4(const uint8_t* packed, const uint8_t* scale, int rows, int cols, int rows_p,
              int cols_p, std::vector<uint8_t>* packed_p, std::vector<uint8_t>* scale_p) {
  packed_p->assign(static_cast<size_t>(rows_p) * cols_p / 2, 0);
  scale_p->assign(static_cast<size_t>(rows_p) * cols_p / 16, 0);
  for (int r = 0; r < rows; ++r) {
    std::memcpy(packed_p->data() + static_cast<size_t>(r) * cols_p / 2,
                packed + static_cast<size_t>(r) * cols / 2, cols / 2);
    std::memcpy(scale_p->data() + static_cast<size_t>(r) * cols_p / 16,
                scale + static_cast<size_t>(r) * cols / 16, cols / 16);
  }
}

absl::Status Validate(const MoeExpertsHostWeights& w) {
  const int E = w.num_local_experts;
  if (E < 0 || E > kMaxLocalExperts || w.first_expert < 0 || w.num_routed_experts < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MoE experts: need 0 <= num_local_experts <= ", kMaxLocalExperts,
        ", first_expert >= 0 and num_routed_experts >= 0; got num_local_experts ", E,
        ", first_expert ", w.first_expert, ", num_routed_experts ", w.num_routed_experts));
  }
  if (E == 0) return absl::OkStatus();
  if (w.hidden <= 0 || w.intermediate <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("MoE experts: hidden ", w.hidden,
                                                   " and intermediate ", w.intermediate,
                                                   " must be positive"));
  }
  if (static_cast<int>(w.gate.size()) != E || static_cast<int>(w.up.size()) != E ||
      static_cast<int>(w.down.size()) != E) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoE experts: expected ", E, " gate, up and down projections, got ",
                     w.gate.size(), ", ", w.up.size(), ", ", w.down.size()));
  }
  if (static_cast<int>(w.nvfp4) + static_cast<int>(w.int4) + static_cast<int>(w.fp8) > 1) {
    return absl::InvalidArgumentError(
        "MoE experts: more than one of nvfp4, int4 and fp8 set; one format a layer");
  }
  if (w.fp8 && (w.fp8_block_rows <= 0 || w.fp8_block_cols <= 0 || w.fp8_block_rows % 8 != 0 ||
                w.fp8_block_cols % 64 != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MoE experts: FP8 weight_block_size [", w.fp8_block_rows, ", ", w.fp8_block_cols,
        "] is not a multiple of [8, 64], which the GPU layout's scales (one per 8 rows x 64 "
        "columns) need (DeepSeek's is [128, 128])"));
  }
  if (w.int4 && (w.int4_group_size <= 0 || w.int4_group_size % kInt4ScaleSlotCols != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MoE experts: INT4 group size ", w.int4_group_size,
        " is not a multiple of 32, which the GPU layout's scale slots need (Kimi's is 32)"));
  }
  if (w.nvfp4 && (w.hidden % 16 != 0 || w.intermediate % 16 != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MoE experts: NVFP4 weights need hidden and intermediate multiples of 16 (one e4m3 scale "
        "per 16 columns); got hidden ",
        w.hidden, ", intermediate ", w.intermediate));
  }
  const char* names[3] = {"gate", "up", "down"};
  for (int i = 0; i < E; ++i) {
    const MoeExpertsHostWeights::Projection* proj[3] = {&w.gate[i], &w.up[i], &w.down[i]};
    for (int k = 0; k < 3; ++k) {
      const auto& pr = *proj[k];
      const bool ok =
          w.nvfp4  ? pr.packed != nullptr && pr.scale != nullptr && std::isfinite(pr.global_scale)
          : w.int4 ? pr.int4_packed != nullptr && pr.int4_scale != nullptr && pr.int4_src_cols > 0
          : w.fp8  ? pr.fp8_codes != nullptr && pr.fp8_scale_inv != nullptr &&
                        pr.fp8_grid_rows > 0 && pr.fp8_grid_cols > 0
                  : pr.bf16 != nullptr;
      if (!ok) {
        return absl::InvalidArgumentError(
            absl::StrCat("MoE experts: expert ", w.first_expert + i, " ", names[k], ": ",
                         w.nvfp4  ? "NVFP4 needs packed, scale and a finite global_scale"
                         : w.int4 ? "INT4 needs int4_packed, int4_scale and int4_src_cols"
                         : w.fp8  ? "FP8 needs fp8_codes, fp8_scale_inv and its grid's shape"
                                  : "bf16 weights missing (bf16 == nullptr)"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

namespace {
// Expected active local experts at `tokens` (uniform routing), in [1, min(local, rows)].
double ExpectedActiveExperts(int local_experts, int routed_experts, int tokens, int top_k) {
  const long long rows = static_cast<long long>(tokens) * top_k;
  const double p_miss = std::pow(1.0 - static_cast<double>(top_k) / std::max(routed_experts, 1),
                                 tokens);
  return std::clamp(local_experts * (1.0 - p_miss), 1.0,
                    static_cast<double>(std::max<long long>(1, std::min<long long>(local_experts, rows))));
}
}  // namespace

int MoeExpectedDecodeTiles(int local_experts, int routed_experts, int tokens, int top_k) {
  if (local_experts <= 0 || static_cast<long long>(tokens) * top_k > 4LL * routed_experts) return 0;
  return static_cast<int>(
      std::lround(ExpectedActiveExperts(local_experts, routed_experts, tokens, top_k)));
}

bool ChooseMoeFewExpert(int local_experts, int routed_experts, int tokens, int top_k) {
  const long long rows = static_cast<long long>(tokens) * top_k;
  if (rows > 64 || local_experts <= 0) return false;
  if (ChooseMoeTileTokens(tokens, top_k, routed_experts) != kMoeTileTokensSmall) return false;
  return ExpectedActiveExperts(local_experts, routed_experts, tokens, top_k) <=
         kMoeFewExpertMaxActive;
}

void* MoeExpertsGpu::Alloc(size_t bytes, cudaError_t* err) {
  void* p = nullptr;
  *err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
  if (*err != cudaSuccess) return nullptr;
  allocations_.push_back(p);
  device_bytes_ += bytes;
  return p;
}

MoeExpertsGpu::~MoeExpertsGpu() {
  for (void* p : allocations_) cudaFree(p);
}

absl::StatusOr<std::unique_ptr<MoeExpertsGpu>> MoeExpertsGpu::Upload(const MoeExpertsHostWeights& w,
                                                                     cudaStream_t stream) {
  if (absl::Status st = Validate(w); !st.ok()) return st;
  std::unique_ptr<MoeExpertsGpu> g(new MoeExpertsGpu());
  const int E = w.num_local_experts, H = w.hidden, I = w.intermediate;
  g->first_expert_ = w.first_expert;
  g->num_local_experts_ = E;
  g->hidden_ = H;
  g->intermediate_ = I;
  g->num_routed_experts_ = w.num_routed_experts > 0 ? w.num_routed_experts : E;
  g->nvfp4_ = w.nvfp4;
  g->int4_ = w.int4;
  g->fp8_ = w.fp8;
  if (E == 0) return g;
  const int Hp = RoundUp(H, kPadMultiple), Ip = RoundUp(I, kPadMultiple);
  g->padded_hidden_ = Hp;
  g->padded_intermediate_ = Ip;
  cudaError_t err = cudaSuccess;
  const std::string what =
      absl::StrCat("upload of experts ", w.first_expert, "..", w.first_expert + E - 1, " (hidden ",
                   H, ", intermediate ", I, ")");

  if (!w.nvfp4 && !w.int4 && !w.fp8) {
    const size_t gu_elems = static_cast<size_t>(2) * Ip * Hp,
                 dn_elems = static_cast<size_t>(Hp) * Ip;
    g->bf16_gate_up_ = g->Alloc(gu_elems * 2 * E, &err);
    if (err != cudaSuccess) return CudaStatus(err, what + ": cudaMalloc gate_up");
    g->bf16_down_ = g->Alloc(dn_elems * 2 * E, &err);
    if (err != cudaSuccess) return CudaStatus(err, what + ": cudaMalloc down");
    // The checkpoint's row-major projections of one expert, rearranged on the device.
    const size_t proj_bytes = static_cast<size_t>(I) * H * 2;
    ScopedDeviceBuffer stage;
    err = cudaMalloc(&stage.p, 3 * proj_bytes);
    if (err != cudaSuccess) return CudaStatus(err, what + ": cudaMalloc staging");
    auto* s_gate = static_cast<__nv_bfloat16*>(stage.p);
    __nv_bfloat16* s_up = s_gate + static_cast<size_t>(I) * H;
    __nv_bfloat16* s_down = s_up + static_cast<size_t>(I) * H;
    for (int i = 0; i < E; ++i) {
      const std::string ew = absl::StrCat(what, ": expert ", w.first_expert + i);
      // Pageable sources: each copy returns once the host buffer has been read; the staging
      // buffer is reused only after the previous expert's relayout kernels in stream order.
      const std::pair<const uint16_t*, __nv_bfloat16*> copies[3] = {
          {w.gate[i].bf16, s_gate}, {w.up[i].bf16, s_up}, {w.down[i].bf16, s_down}};
      for (const auto& c : copies) {
        err = cudaMemcpyAsync(c.second, c.first, proj_bytes, cudaMemcpyHostToDevice, stream);
        if (err != cudaSuccess) return CudaStatus(err, ew + ": copy to device");
      }
      Bf16MoeRelayoutParams gu{s_gate,
                               s_up,
                               I,
                               H,
                               2 * Ip,
                               Hp,
                               static_cast<__nv_bfloat16*>(g->bf16_gate_up_) + gu_elems * i};
      if (err = InvokeRelayoutBf16MoeWeight(gu, stream); err != cudaSuccess) {
        return CudaStatus(err, ew + ": gate_up relayout");
      }
      Bf16MoeRelayoutParams dn{
          s_down, nullptr, H, I, Hp, Ip, static_cast<__nv_bfloat16*>(g->bf16_down_) + dn_elems * i};
      if (err = InvokeRelayoutBf16MoeWeight(dn, stream); err != cudaSuccess) {
        return CudaStatus(err, ew + ": down relayout");
      }
    }
    if (err = cudaStreamSynchronize(stream); err != cudaSuccess) return CudaStatus(err, what);
    return g;
  }

  // NVFP4, INT4 and FP8: rearranged on the host into the kernels' layout (padding included),
  // copied.
  auto code_bytes = w.fp8 ? Fp8TiledCodeBytes : w.int4 ? Int4TiledCodeBytes : Nvfp4TiledCodeBytes;
  auto scale_bytes = w.fp8    ? Fp8TiledScaleBytes
                     : w.int4 ? Int4TiledScaleBytes
                              : Nvfp4TiledScaleBytes;
  const size_t gu_c = code_bytes(2 * Ip, Hp), gu_s = scale_bytes(2 * Ip, Hp);
  const size_t dn_c = code_bytes(Hp, Ip), dn_s = scale_bytes(Hp, Ip);
  g->gate_up_codes_ = static_cast<uint8_t*>(g->Alloc(gu_c * E, &err));
  if (err == cudaSuccess) g->gate_up_scales_ = static_cast<uint8_t*>(g->Alloc(gu_s * E, &err));
  if (err == cudaSuccess) g->down_codes_ = static_cast<uint8_t*>(g->Alloc(dn_c * E, &err));
  if (err == cudaSuccess) g->down_scales_ = static_cast<uint8_t*>(g->Alloc(dn_s * E, &err));
  if (w.nvfp4 && err == cudaSuccess) {
    g->gate_up_global_scale_ = static_cast<float*>(g->Alloc(sizeof(float) * 2 * E, &err));
  }
  if (w.nvfp4 && err == cudaSuccess) {
    g->down_global_scale_ = static_cast<float*>(g->Alloc(sizeof(float) * E, &err));
  }
  if (err == cudaSuccess) g->layer_counters_ = static_cast<int*>(g->Alloc(2 * sizeof(int), &err));
  if (err == cudaSuccess) err = cudaMemsetAsync(g->layer_counters_, 0, 2 * sizeof(int), stream);
  if (err != cudaSuccess) return CudaStatus(err, what + ": cudaMalloc");
  const bool pad = H != Hp || I != Ip;
  std::vector<float> gu_global(2 * E), dn_global(E);
  // Experts are rearranged on the host in waves, one thread each (the relayout is per element:
  // 2.1 G weights a MoE layer on a Kimi-K2.5 rank), then copied wave by wave.
  struct Slot {
    std::vector<uint8_t> gp, gs, up, us, dp, ds;  // NVFP4: padded checkpoint layout
    std::vector<uint8_t> gu_c, gu_s, dn_c, dn_s;  // tiled
    std::string error;                            // empty: rearranged
  };
  const int wave =
      std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, std::min(E, 16));
  std::vector<Slot> slots(wave);
  for (Slot& sl : slots) {
    sl.gu_c.resize(gu_c);
    sl.gu_s.resize(gu_s);
    sl.dn_c.resize(dn_c);
    sl.dn_s.resize(dn_s);
  }
  // INT4 pads while it rearranges (int4_moe_layout.h): gate / up [I, H] are whole checkpoint
  // rows, down [H, I] a column window of them.
  auto relayout_int4 = [&](int i, Slot& sl, const std::string& ew) {
    const auto &wg = w.gate[i], &wu = w.up[i], &wd = w.down[i];
    const int gs = w.int4_group_size;
    const Int4SourceRows gate{
        wg.int4_packed, wg.int4_scale, I, wg.int4_src_cols, gs, wg.int4_col0, H};
    const Int4SourceRows up{
        wu.int4_packed, wu.int4_scale, I, wu.int4_src_cols, gs, wu.int4_col0, H};
    const Int4SourceRows down{
        wd.int4_packed, wd.int4_scale, H, wd.int4_src_cols, gs, wd.int4_col0, I};
    const absl::Status gu = RelayoutInt4GateUp(gate, up, Ip, Hp, sl.gu_c.data(), sl.gu_s.data());
    if (!gu.ok()) {
      sl.error = absl::StrCat(ew, " gate/up: ", gu.message());
      return;
    }
    const absl::Status dn = RelayoutInt4(down, Hp, Ip, sl.dn_c.data(), sl.dn_s.data());
    if (!dn.ok()) sl.error = absl::StrCat(ew, " down: ", dn.message());
  };
  // FP8 pads while it rearranges too (fp8_moe_layout.h): each projection is its window of the
  // checkpoint tensor, with the tensor's scale grid.
  auto relayout_fp8 = [&](int i, Slot& sl, const std::string& ew) {
    auto view = [&](const MoeExpertsHostWeights::Projection& p, int rows, int cols) {
      return Fp8BlockTensor{p.fp8_codes,
                            p.fp8_scale_inv,
                            rows,
                            cols,
                            w.fp8_block_rows,
                            w.fp8_block_cols,
                            p.fp8_origin_row,
                            p.fp8_origin_col,
                            p.fp8_grid_rows,
                            p.fp8_grid_cols};
    };
    const absl::Status gu = RelayoutFp8GateUp(view(w.gate[i], I, H), view(w.up[i], I, H), Ip, Hp,
                                              sl.gu_c.data(), sl.gu_s.data());
    if (!gu.ok()) {
      sl.error = absl::StrCat(ew, " gate/up: ", gu.message());
      return;
    }
    const absl::Status dn =
        RelayoutFp8(view(w.down[i], H, I), Hp, Ip, sl.dn_c.data(), sl.dn_s.data());
    if (!dn.ok()) sl.error = absl::StrCat(ew, " down: ", dn.message());
  };
  auto relayout = [&](int i, Slot& sl) {
    const std::string ew = absl::StrCat(what, ": expert ", w.first_expert + i);
    sl.error.clear();
    if (w.int4) {
      relayout_int4(i, sl, ew);
      return;
    }
    if (w.fp8) {
      relayout_fp8(i, sl, ew);
      return;
    }
    const auto &wg = w.gate[i], &wu = w.up[i], &wd = w.down[i];
    const uint8_t *g_p = wg.packed, *g_s = wg.scale, *u_p = wu.packed, *u_s = wu.scale;
    const uint8_t *d_p = wd.packed, *d_s = wd.scale;
    if (pad) {
      PadNvfp4(wg.packed, wg.scale, I, H, Ip, Hp, &sl.gp, &sl.gs);
      PadNvfp4(wu.packed, wu.scale, I, H, Ip, Hp, &sl.up, &sl.us);
      PadNvfp4(wd.packed, wd.scale, H, I, Hp, Ip, &sl.dp, &sl.ds);
      g_p = sl.gp.data(), g_s = sl.gs.data(), u_p = sl.up.data(), u_s = sl.us.data();
      d_p = sl.dp.data(), d_s = sl.ds.data();
    }
    const absl::Status gu =
        RelayoutNvfp4GateUp(g_p, g_s, u_p, u_s, Ip, Hp, sl.gu_c.data(), sl.gu_s.data());
    if (!gu.ok()) {
      sl.error = absl::StrCat(ew, " gate/up: ", gu.message());
      return;
    }
    const absl::Status dn = RelayoutNvfp4(d_p, d_s, Hp, Ip, sl.dn_c.data(), sl.dn_s.data());
    if (!dn.ok()) sl.error = absl::StrCat(ew, " down: ", dn.message());
  };
  for (int first = 0; first < E; first += wave) {
    const int n = std::min(wave, E - first);
    if (n == 1) {
      relayout(first, slots[0]);
    } else {
      std::vector<std::thread> pool;
      for (int t = 0; t < n; ++t) pool.emplace_back(relayout, first + t, std::ref(slots[t]));
      for (auto& th : pool) th.join();
    }
    for (int t = 0; t < n; ++t) {
      const int i = first + t;
      const Slot& sl = slots[t];
      if (!sl.error.empty()) return absl::InvalidArgumentError(sl.error);
      const std::string ew = absl::StrCat(what, ": expert ", w.first_expert + i);
      gu_global[2 * i] = w.gate[i].global_scale;
      gu_global[2 * i + 1] = w.up[i].global_scale;
      dn_global[i] = w.down[i].global_scale;
      // The tiled host buffers are reused by the next wave: synchronous copies.
      const std::pair<void*, const std::vector<uint8_t>*> copies[4] = {
          {g->gate_up_codes_ + gu_c * i, &sl.gu_c},
          {g->gate_up_scales_ + gu_s * i, &sl.gu_s},
          {g->down_codes_ + dn_c * i, &sl.dn_c},
          {g->down_scales_ + dn_s * i, &sl.dn_s}};
      for (const auto& c : copies) {
        err = cudaMemcpyAsync(c.first, c.second->data(), c.second->size(), cudaMemcpyHostToDevice,
                              stream);
        if (err != cudaSuccess) return CudaStatus(err, ew + ": copy to device");
      }
    }
    if (err = cudaStreamSynchronize(stream); err != cudaSuccess) return CudaStatus(err, what);
  }
  if (!w.nvfp4) return g;  // INT4 and FP8 have no global scales
  err = cudaMemcpyAsync(g->gate_up_global_scale_, gu_global.data(), sizeof(float) * 2 * E,
                        cudaMemcpyHostToDevice, stream);
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(g->down_global_scale_, dn_global.data(), sizeof(float) * E,
                          cudaMemcpyHostToDevice, stream);
  }
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return CudaStatus(err, what + ": global scales");
  return g;
}

namespace {

// Workspace: the dispatch/GEMM/combine region of nvfp4_moe.h (used by every path), then, when
// hidden is padded, x, shared_out and the output at the padded width [tokens, Hp] bf16.
struct Workspace {
  void* core;
  size_t core_bytes;
  __nv_bfloat16* x_padded;
  __nv_bfloat16* shared_padded;
  __nv_bfloat16* out_padded;
};

size_t CoreBytes(const MoeExpertsGpu& g, int tokens, int top_k) {
  return Align256(Nvfp4MoeWorkspaceBytes(tokens, top_k, g.num_local_experts(), g.padded_hidden(),
                                         g.padded_intermediate()));
}

size_t PaddedBytes(const MoeExpertsGpu& g, int tokens) {
  return Align256(static_cast<size_t>(tokens) * g.padded_hidden() * 2);
}

Workspace CarveWorkspace(const MoeExpertsGpu& g, void* workspace, int tokens, int top_k) {
  Workspace ws{};
  ws.core = workspace;
  ws.core_bytes = CoreBytes(g, tokens, top_k);
  char* p = static_cast<char*>(workspace) + ws.core_bytes;
  if (g.padded_hidden() != g.hidden()) {
    const size_t b = PaddedBytes(g, tokens);
    ws.x_padded = reinterpret_cast<__nv_bfloat16*>(p);
    ws.shared_padded = reinterpret_cast<__nv_bfloat16*>(p + b);
    ws.out_padded = reinterpret_cast<__nv_bfloat16*>(p + 2 * b);
    p += 3 * b;
  }
  return ws;
}

// dst [tokens, Hp] <- src [tokens, hidden], pad columns zeroed.
cudaError_t PadRows(void* dst, const void* src, int tokens, int hidden, int hp,
                    cudaStream_t stream) {
  const size_t row = static_cast<size_t>(hidden) * 2, row_p = static_cast<size_t>(hp) * 2;
  cudaError_t e =
      cudaMemset2DAsync(static_cast<char*>(dst) + row, row_p, 0, row_p - row, tokens, stream);
  if (e != cudaSuccess) return e;
  return cudaMemcpy2DAsync(dst, row_p, src, row, row, tokens, cudaMemcpyDeviceToDevice, stream);
}

}  // namespace

size_t MoeExpertsGpu::WorkspaceBytes(int tokens, int top_k) const {
  if (num_local_experts_ == 0 || tokens <= 0 || top_k <= 0) return 0;
  size_t bytes = CoreBytes(*this, tokens, top_k);
  if (padded_hidden_ != hidden_) bytes += 3 * PaddedBytes(*this, tokens);
  return bytes;
}

absl::Status InvokeMoeExperts(const MoeExpertsGpu& g, const MoeExpertsRunParams& p,
                              cudaStream_t stream) {
  if (p.tokens < 0 || p.tokens > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoE experts: tokens ", p.tokens, " outside [0, 65535]; split the batch"));
  }
  if (p.tokens == 0) return absl::OkStatus();
  if (p.top_k < 1 || p.x == nullptr || p.topk_ids == nullptr || p.topk_weights == nullptr ||
      p.out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MoE experts: need top_k >= 1 and x, topk_ids, topk_weights, out set; got top_k ", p.top_k,
        p.x ? "" : ", x null", p.topk_ids ? "" : ", topk_ids null",
        p.topk_weights ? "" : ", topk_weights null", p.out ? "" : ", out null"));
  }
  if (p.route != nullptr &&
      (p.route->topk_ids != p.topk_ids || p.route->topk_weights != p.topk_weights ||
       p.route->tokens != p.tokens || p.route->config.top_k != p.top_k)) {
    return absl::InvalidArgumentError(
        "MoE experts: the router's outputs must be this call's topk_ids and topk_weights, for its "
        "tokens and top_k");
  }
  const int H = g.hidden(), Hp = g.padded_hidden(), E = g.num_local_experts();
  const size_t out_bytes = static_cast<size_t>(p.tokens) * H * 2;
  // shared_out read first thing (copied, or padded), or by the combine (shared_ready below).
  const bool early_shared = E == 0 || Hp != H;
  if (early_shared && p.shared_ready != nullptr) {
    if (cudaError_t e = cudaStreamWaitEvent(stream, p.shared_ready, 0); e != cudaSuccess) {
      return CudaStatus(e, "waiting for the shared expert");
    }
  }
  const cudaEvent_t shared_ready = early_shared ? nullptr : p.shared_ready;
  if (E == 0) {
    if (p.route != nullptr) {  // nothing to dispatch; the ids are still this call's outputs
      if (cudaError_t e = InvokeMoeRoute(*p.route, stream); e != cudaSuccess) {
        return CudaStatus(e, "router");
      }
    }
    const cudaError_t e =
        p.shared_out != nullptr
            ? cudaMemcpyAsync(p.out, p.shared_out, out_bytes, cudaMemcpyDeviceToDevice, stream)
            : cudaMemsetAsync(p.out, 0, out_bytes, stream);
    return CudaStatus(e, "rank without local experts: output");
  }
  const long long rows = static_cast<long long>(p.tokens) * p.top_k;
  const int tile = ChooseMoeTileTokens(p.tokens, p.top_k, g.num_routed_experts_);
  const long long max_tiles = rows / tile + std::min<long long>(E, rows);
  if (rows > (1ll << 30) || max_tiles > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("MoE experts: ", p.tokens, " tokens x top_k ",
                                                   p.top_k, " need ", max_tiles, " row tiles of ",
                                                   tile, " (at most 65535); split the batch"));
  }
  const size_t need = g.WorkspaceBytes(p.tokens, p.top_k);
  if (p.workspace == nullptr || reinterpret_cast<uintptr_t>(p.workspace) % 256 != 0 ||
      p.workspace_bytes < need) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoE experts: workspace must be 256-byte aligned and at least WorkspaceBytes(",
                     p.tokens, ", ", p.top_k, ") = ", need,
                     " bytes; got ", p.workspace_bytes, " bytes at ",
                     reinterpret_cast<uintptr_t>(p.workspace)));
  }
  const Workspace ws = CarveWorkspace(g, p.workspace, p.tokens, p.top_k);
  const bool padded = Hp != H;
  // The few-expert kernel (moe_few_expert.h) for the 4-bit and FP8 decode GEMMs.
  const bool few_expert =
      tile == kMoeTileTokensSmall &&
      (p.decode_kernel == MoeDecodeKernel::kFewExpert ||
       (p.decode_kernel == MoeDecodeKernel::kAuto &&
        ChooseMoeFewExpert(E, g.num_routed_experts(), p.tokens, p.top_k)));
  const int wave_tail = tile != kMoeTileTokensSmall || few_expert                      ? 0
                        : p.wave_tail > 0                                              ? p.wave_tail
                        : p.wave_tail < 0 && p.decode_kernel == MoeDecodeKernel::kAuto ? -1
                                                                                       : 0;
  const int expected_tiles =
      wave_tail < 0 ? MoeExpectedDecodeTiles(E, g.num_routed_experts(), p.tokens, p.top_k) : 0;
  // The layer as one launch (moe_few_expert_layer.h): it reads the routing ids itself.
  const bool layer_fused = few_expert && p.few_expert_layer && (g.nvfp4() || g.int4() || g.fp8()) &&
                           FewExpertLayerApplies(p.tokens, p.top_k, Hp, g.padded_intermediate());
  int* const layer_counters = layer_fused ? g.layer_counters_ : nullptr;
  const auto* x = static_cast<const __nv_bfloat16*>(p.x);
  const auto* shared = static_cast<const __nv_bfloat16*>(p.shared_out);
  auto* out = static_cast<__nv_bfloat16*>(p.out);
  if (padded) {
    if (cudaError_t e = PadRows(ws.x_padded, p.x, p.tokens, H, Hp, stream); e != cudaSuccess) {
      return CudaStatus(e, "padding x");
    }
    x = ws.x_padded;
    if (shared != nullptr) {
      if (cudaError_t e = PadRows(ws.shared_padded, p.shared_out, p.tokens, H, Hp, stream);
          e != cudaSuccess) {
        return CudaStatus(e, "padding shared_out");
      }
      shared = ws.shared_padded;
    }
    out = ws.out_padded;
  }
  // Small decode batches run programmatically: dispatch, gate_up, down and combine.
  const bool pdl = tile == kMoeTileTokensSmall && rows <= kMoeProgrammaticMaxRows;
  // The dispatch into the workspace's first arrays (every format's workspace starts with the NVFP4
  // sequence's): here with the router where it runs in this call (MoeExpertsRunParams::route,
  // fused where InvokeMoeRouteDispatch can), else by the format's own sequence below.
  const Nvfp4MoeWorkspace dw =
      CarveNvfp4MoeWorkspace(ws.core, p.tokens, p.top_k, E, Hp, g.padded_intermediate());
  MoeDispatchParams d{};
  d.tokens = p.tokens;
  d.top_k = p.top_k;
  d.first_expert = g.first_expert();
  d.num_local_experts = E;
  d.tile_tokens = tile;
  d.topk_ids = p.topk_ids;
  d.expert_counts = dw.expert_counts;
  d.expert_offsets = dw.expert_offsets;
  d.tile_offsets = dw.tile_offsets;
  d.sorted_assignment = dw.sorted_assignment;
  d.assignment_row = dw.assignment_row;
  d.programmatic = pdl && p.programmatic_dispatch;
  if (p.route != nullptr && layer_fused) {
    if (cudaError_t e = InvokeMoeRoute(*p.route, stream); e != cudaSuccess) {
      return CudaStatus(e, "router");
    }
  } else if (p.route != nullptr) {
    if (cudaError_t e = InvokeMoeRouteDispatch(*p.route, d, p.route_counter, stream);
        e != cudaSuccess) {
      return CudaStatus(e, "router and dispatch");
    }
  }
  const bool dispatched = p.route != nullptr;

  if (g.nvfp4()) {
    Nvfp4MoeParams np{};
    np.weights = Nvfp4MoeWeights{g.first_expert(),
                                 E,
                                 Hp,
                                 g.padded_intermediate(),
                                 g.gate_up_codes_,
                                 g.gate_up_scales_,
                                 g.gate_up_global_scale_,
                                 g.down_codes_,
                                 g.down_scales_,
                                 g.down_global_scale_};
    np.tokens = p.tokens;
    np.top_k = p.top_k;
    np.tile_tokens = tile;
    np.plain_launches = false;
    np.programmatic_dispatch = p.programmatic_dispatch;
    np.dispatched = dispatched;
    np.x = x;
    np.topk_ids = p.topk_ids;
    np.topk_weights = p.topk_weights;
    np.shared_out = shared;
    np.shared_ready = shared_ready;
    np.out = nullptr;
    np.out_bf16 = out;
    np.workspace = ws.core;
    np.workspace_bytes = ws.core_bytes;
    np.few_expert = few_expert;
    np.wave_tail = wave_tail;
    np.expected_tiles = expected_tiles;
    np.few_expert_layer_counters = layer_counters;
    np.prefill_wgmma = p.prefill_wgmma;
    if (cudaError_t e = InvokeNvfp4Moe(np, stream); e != cudaSuccess) {
      return CudaStatus(e, "NVFP4 experts");
    }
  } else if (g.int4()) {
    Int4MoeParams ip{};
    ip.weights = Int4MoeWeights{g.first_expert(),
                                E,
                                Hp,
                                g.padded_intermediate(),
                                g.gate_up_codes_,
                                g.gate_up_scales_,
                                g.down_codes_,
                                g.down_scales_};
    ip.tokens = p.tokens;
    ip.top_k = p.top_k;
    ip.tile_tokens = tile;
    ip.plain_launches = false;
    ip.programmatic_dispatch = p.programmatic_dispatch;
    ip.dispatched = dispatched;
    ip.x = x;
    ip.topk_ids = p.topk_ids;
    ip.topk_weights = p.topk_weights;
    ip.shared_out = shared;
    ip.shared_ready = shared_ready;
    ip.out = nullptr;
    ip.out_bf16 = out;
    ip.workspace = ws.core;
    ip.workspace_bytes = ws.core_bytes;
    ip.few_expert = few_expert;
    ip.wave_tail = wave_tail;
    ip.expected_tiles = expected_tiles;
    ip.few_expert_layer_counters = layer_counters;
    ip.prefill_wgmma = p.prefill_wgmma;
    if (cudaError_t e = InvokeInt4Moe(ip, stream); e != cudaSuccess) {
      return CudaStatus(e, "INT4 experts");
    }
  } else if (g.fp8()) {
    Fp8MoeParams fp{};
    fp.weights = Fp8MoeWeights{g.first_expert(),
                               E,
                               Hp,
                               g.padded_intermediate(),
                               g.gate_up_codes_,
                               g.gate_up_scales_,
                               g.down_codes_,
                               g.down_scales_};
    fp.tokens = p.tokens;
    fp.top_k = p.top_k;
    fp.tile_tokens = tile;
    fp.plain_launches = false;
    fp.programmatic_dispatch = p.programmatic_dispatch;
    fp.dispatched = dispatched;
    fp.x = x;
    fp.topk_ids = p.topk_ids;
    fp.topk_weights = p.topk_weights;
    fp.shared_out = shared;
    fp.shared_ready = shared_ready;
    fp.out = nullptr;
    fp.out_bf16 = out;
    fp.workspace = ws.core;
    fp.workspace_bytes = ws.core_bytes;
    fp.few_expert = few_expert;
    fp.wave_tail = wave_tail;
    fp.expected_tiles = expected_tiles;
    fp.few_expert_layer_counters = layer_counters;
    if (cudaError_t e = InvokeFp8Moe(fp, stream); e != cudaSuccess) {
      return CudaStatus(e, "FP8 experts");
    }
  } else {
    // The NVFP4 sequence (nvfp4_moe.cu) with the BF16 GEMMs: dispatch, gate_up, down and combine
    // programmatically in small decode batches.
    const int Ip = g.padded_intermediate();
    const Nvfp4MoeWorkspace& w = dw;
    if (!dispatched) {
      if (cudaError_t e = InvokeMoeDispatch(d, stream); e != cudaSuccess) {
        return CudaStatus(e, "dispatch");
      }
    }
    Bf16MoeGemmParams gm{};
    gm.tile_tokens = tile;
    gm.programmatic = pdl;
    gm.num_local_experts = E;
    gm.max_tiles = static_cast<int>(max_tiles);
    gm.expert_offsets = w.expert_offsets;
    gm.tile_offsets = w.tile_offsets;
    gm.sorted_assignment = w.sorted_assignment;
    gm.top_k = p.top_k;
    gm.topk_weights = p.topk_weights;
    gm.h = w.h;
    gm.y = w.y;
    gm.n = 2 * Ip;
    gm.k = Hp;
    gm.a = x;
    gm.w = static_cast<const __nv_bfloat16*>(g.bf16_gate_up_);
    if (cudaError_t e = InvokeBf16MoeGateUp(gm, stream); e != cudaSuccess) {
      return CudaStatus(e, "BF16 gate_up GEMM");
    }
    gm.n = Hp;
    gm.k = Ip;
    gm.a = w.h;
    gm.w = static_cast<const __nv_bfloat16*>(g.bf16_down_);
    if (cudaError_t e = InvokeBf16MoeDown(gm, stream); e != cudaSuccess) {
      return CudaStatus(e, "BF16 down GEMM");
    }
    MoeCombineParams c{};
    c.tokens = p.tokens;
    c.hidden = Hp;
    c.top_k = p.top_k;
    c.assignment_row = w.assignment_row;
    c.y = w.y;
    c.shared_out = shared;
    c.out = nullptr;
    c.out_bf16 = out;
    c.programmatic = pdl;
    if (shared_ready != nullptr) {
      if (cudaError_t e = cudaStreamWaitEvent(stream, shared_ready, 0); e != cudaSuccess) {
        return CudaStatus(e, "waiting for the shared expert");
      }
    }
    if (cudaError_t e = InvokeMoeCombine(c, stream); e != cudaSuccess) {
      return CudaStatus(e, "combine");
    }
  }
  if (padded) {
    const size_t row = static_cast<size_t>(H) * 2;
    if (cudaError_t e = cudaMemcpy2DAsync(p.out, row, ws.out_padded, static_cast<size_t>(Hp) * 2,
                                          row, p.tokens, cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess) {
      return CudaStatus(e, "unpadding the output");
    }
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
