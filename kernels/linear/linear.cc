#include "kernels/linear/linear.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/linear/decode_gemm.h"
#include "kernels/linear/skinny_gemm.h"

namespace mlaserve {
namespace {

std::string CublasError(cublasStatus_t s) {
  return absl::StrCat(cublasGetStatusName(s), " (", cublasGetStatusString(s), ")");
}

// The alignment (bytes, a power of two <= 256) every row of a matrix starts at: the base
// pointer's alignment and the row pitch's.
uint32_t RowAlignment(const void* ptr, int64_t pitch_bytes) {
  const uint64_t bits =
      reinterpret_cast<uintptr_t>(ptr) | static_cast<uint64_t>(pitch_bytes) | 256u;
  return static_cast<uint32_t>(bits & (~bits + 1));  // lowest set bit
}

// Everything the algorithm choice depends on.
struct PlanKey {
  int64_t m, n, k, x_stride, out_stride;
  DType out_dtype;
  uint32_t align_x, align_w, align_out;
  bool w_kn;
  int batch;
  int64_t x_batch_stride, w_batch_stride, out_batch_stride;
  bool invariant;
  auto Tie() const {
    return std::tie(m, n, k, x_stride, out_stride, out_dtype, align_x, align_w, align_out, w_kn,
                    batch, x_batch_stride, w_batch_stride, out_batch_stride, invariant);
  }
  bool operator<(const PlanKey& o) const { return Tie() < o.Tie(); }
};

// Descriptors and algorithm of one planned shape. Column-major view of the row-major problem:
// D [n, m] (ld out_stride) = op(A) * (B = x as col-major [k, m], ld x_stride), i.e.
// out^T = W x^T, where A is W [n, k] row-major = col-major [k, n] (ld k) transposed, or W [k, n]
// row-major = col-major [n, k] (ld n) as it is.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  bool lt = false;  // false: no Lt algorithm, use cublasGemm(StridedBatched)Ex
  cublasLtMatmulAlgo_t algo{};
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

// The split-K factor an algorithm is configured with (1: none).
uint32_t SplitK(const cublasLtMatmulAlgo_t& algo) {
  uint32_t v = 1;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &v, sizeof(v),
                                           &written) != CUBLAS_STATUS_SUCCESS ||
      written != sizeof(v)) {
    return 1;
  }
  return v == 0 ? 1 : v;
}

}  // namespace

struct LinearGemm::Impl {
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool invariant = false;
  bool programmatic = false;
  int mma_rows = 0;  // SetSkinnyTensorCoreRows
  int decode_rows = 0;     // SetDecodeGemmRows
  int heuristic_rank = 0;  // SetHeuristicChoice
  int no_split_rows = 0;   // SetHeuristicChoice
  int sm_count = 132;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
  // Batch-invariant algorithms by their key at m = kInvariantPlanRows.
  std::map<PlanKey, cublasLtMatmulAlgo_t> invariant_algos;

  ~Impl() {
    if (workspace != nullptr) cudaFree(workspace);
    if (blas != nullptr) cublasDestroy(blas);
    if (lt != nullptr) cublasLtDestroy(lt);
  }

  absl::Status Describe(const PlanKey& key, Plan* plan);
  absl::StatusOr<const Plan*> GetPlan(const PlanKey& key);
  // Up to `want` heuristic results for the described plan (split-K excluded when `no_split`).
  int Heuristic(const PlanKey& key, const Plan& plan, bool no_split,
                cublasLtMatmulHeuristicResult_t* results, int want);
};

absl::Status LinearGemm::Impl::Describe(const PlanKey& key, Plan* plan) {
  const cudaDataType_t out_type = key.out_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  const auto fail = [&](const char* what, cublasStatus_t s) {
    return absl::InternalError(absl::StrCat("LinearGemm: ", what, " failed for m ", key.m, " n ",
                                            key.n, " k ", key.k, ": ", CublasError(s)));
  };
  cublasStatus_t s = cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (s != CUBLAS_STATUS_SUCCESS) return fail("cublasLtMatmulDescCreate", s);
  const cublasOperation_t trans_a = key.w_kn ? CUBLAS_OP_N : CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  s = cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                     sizeof(trans_a));
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                       sizeof(trans_b));
  }
  if (s != CUBLAS_STATUS_SUCCESS) return fail("cublasLtMatmulDescSetAttribute", s);
  if (key.w_kn) {
    s = cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, key.n, key.k, key.n);
  } else {
    s = cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, key.k, key.n, key.k);
  }
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, key.k, key.m, key.x_stride);
  }
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatrixLayoutCreate(&plan->d, out_type, key.n, key.m, key.out_stride);
  }
  if (s != CUBLAS_STATUS_SUCCESS) return fail("cublasLtMatrixLayoutCreate", s);
  if (key.batch > 1) {
    const int32_t count = key.batch;
    const std::pair<cublasLtMatrixLayout_t, int64_t> layouts[] = {
        {plan->a, key.w_batch_stride}, {plan->b, key.x_batch_stride},
        {plan->d, key.out_batch_stride}};
    for (const auto& [layout, stride] : layouts) {
      if (s == CUBLAS_STATUS_SUCCESS) {
        s = cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                             sizeof(count));
      }
      if (s == CUBLAS_STATUS_SUCCESS) {
        s = cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                             &stride, sizeof(stride));
      }
    }
    if (s != CUBLAS_STATUS_SUCCESS) return fail("cublasLtMatrixLayoutSetAttribute (batch)", s);
  }
  return absl::OkStatus();
}

int LinearGemm::Impl::Heuristic(const PlanKey& key, const Plan& plan, bool no_split,
                                cublasLtMatmulHeuristicResult_t* results, int want) {
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return 0;
  const uint64_t ws = workspace_bytes;
  // A is W, B is x, C and D are out (C is not read: beta = 0, but it shares D's layout).
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_w},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_x},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_out},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_out}};
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  for (const auto& [attr, value] : aligns) {
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value));
    }
  }
  if (s == CUBLAS_STATUS_SUCCESS && no_split) {
    // No split-K reduction of any kind (in place, in the compute type, in the output type).
    const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE;
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                             &mask, sizeof(mask));
  }
  int returned = 0;
  if (s == CUBLAS_STATUS_SUCCESS) {
    // NOT_SUPPORTED (no algorithm for this shape and alignment) is not an error: returned = 0.
    if (cublasLtMatmulAlgoGetHeuristic(lt, plan.op, plan.a, plan.b, plan.d, plan.d, pref, want,
                                       results, &returned) != CUBLAS_STATUS_SUCCESS) {
      returned = 0;
    }
  }
  cublasLtMatmulPreferenceDestroy(pref);
  return returned;
}

absl::StatusOr<const Plan*> LinearGemm::Impl::GetPlan(const PlanKey& key) {
  if (auto it = plans.find(key); it != plans.end()) return it->second.get();
  auto plan = std::make_unique<Plan>();
  if (auto s = Describe(key, plan.get()); !s.ok()) return s;
  const auto shape = [&] {
    return absl::StrCat("m ", key.m, " n ", key.n, " k ", key.k, " batch ", key.batch);
  };
  if (key.invariant) {
    // One algorithm for every m: chosen at kInvariantPlanRows rows, then checked at this m.
    PlanKey ref = key;
    ref.m = kInvariantPlanRows;
    auto it = invariant_algos.find(ref);
    if (it == invariant_algos.end()) {
      Plan ref_plan;
      if (auto s = Describe(ref, &ref_plan); !s.ok()) return s;
      cublasLtMatmulHeuristicResult_t results[8] = {};
      const int n = Heuristic(ref, ref_plan, /*no_split=*/true, results, 8);
      int pick = -1;
      for (int i = 0; i < n && pick < 0; ++i) {
        if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= workspace_bytes &&
            SplitK(results[i].algo) == 1) {
          pick = i;
        }
      }
      if (pick < 0) {
        return absl::UnimplementedError(absl::StrCat(
            "LinearGemm (batch-invariant): cuBLASLt offers no algorithm without split-K for ",
            shape()));
      }
      it = invariant_algos.emplace(ref, results[pick].algo).first;
    }
    cublasLtMatmulHeuristicResult_t check{};
    const cublasStatus_t c = cublasLtMatmulAlgoCheck(lt, plan->op, plan->a, plan->b, plan->d,
                                                     plan->d, &it->second, &check);
    if (c != CUBLAS_STATUS_SUCCESS || check.workspaceSize > workspace_bytes) {
      return absl::UnimplementedError(absl::StrCat(
          "LinearGemm (batch-invariant): the algorithm chosen for ", kInvariantPlanRows,
          " rows cannot run ", shape(), " (", CublasError(c), ")"));
    }
    plan->lt = true;
    plan->algo = it->second;
  } else {
    // The heuristic's first usable algorithm, or its heuristic_rank-th (SetHeuristicChoice), among
    // those without split-K from no_split_rows rows up where there are any.
    constexpr int kWant = 16;
    cublasLtMatmulHeuristicResult_t results[kWant] = {};
    const auto pick = [&](bool no_split) {
      const int returned = Heuristic(key, *plan, no_split, results, kWant);
      int usable[kWant], count = 0;
      for (int i = 0; i < returned; ++i) {
        if (results[i].state == CUBLAS_STATUS_SUCCESS &&
            results[i].workspaceSize <= workspace_bytes) {
          usable[count++] = i;
        }
      }
      if (count > 0) {
        plan->lt = true;
        plan->algo = results[usable[std::min(heuristic_rank, count - 1)]].algo;
      }
    };
    if (no_split_rows > 0 && key.m >= no_split_rows) pick(/*no_split=*/true);
    if (!plan->lt) pick(/*no_split=*/false);
  }
  if (!plan->lt &&
      (key.m > std::numeric_limits<int>::max() || key.n > std::numeric_limits<int>::max() ||
       key.k > std::numeric_limits<int>::max() ||
       key.x_stride > std::numeric_limits<int>::max() ||
       key.out_stride > std::numeric_limits<int>::max())) {
    return absl::UnimplementedError(
        absl::StrCat("LinearGemm: cuBLASLt has no algorithm for ", shape(),
                     " and the cublasGemmEx fallback takes 32-bit sizes and strides"));
  }
  const Plan* raw = plan.get();
  plans.emplace(key, std::move(plan));
  return raw;
}

LinearGemm::LinearGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LinearGemm::~LinearGemm() = default;

absl::StatusOr<std::unique_ptr<LinearGemm>> LinearGemm::Create(size_t workspace_bytes) {
  auto impl = std::make_unique<Impl>();
  if (cublasStatus_t s = cublasLtCreate(&impl->lt); s != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("LinearGemm: cublasLtCreate: ", CublasError(s)));
  }
  if (cublasStatus_t s = cublasCreate(&impl->blas); s != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("LinearGemm: cublasCreate: ", CublasError(s)));
  }
  if (workspace_bytes > 0) {
    if (cudaError_t e = cudaMalloc(&impl->workspace, workspace_bytes); e != cudaSuccess) {
      impl->workspace = nullptr;
      return absl::ResourceExhaustedError(absl::StrCat("LinearGemm: cudaMalloc of a ",
                                                       workspace_bytes,
                                                       "-byte workspace: ", cudaGetErrorString(e)));
    }
  }
  impl->workspace_bytes = workspace_bytes;
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
      sms > 0) {
    impl->sm_count = sms;
  }
  return std::unique_ptr<LinearGemm>(new LinearGemm(std::move(impl)));
}

size_t LinearGemm::CachedPlans() const { return impl_->plans.size(); }

void LinearGemm::SetBatchInvariant(bool on) { impl_->invariant = on; }
void LinearGemm::SetProgrammaticLaunch(bool on) { impl_->programmatic = on; }
void LinearGemm::SetSkinnyTensorCoreRows(int rows) {
  impl_->mma_rows = std::clamp(rows, 0, kSkinnyMmaMaxRows);
}
bool LinearGemm::batch_invariant() const { return impl_->invariant; }
void LinearGemm::SetDecodeGemmRows(int rows) {
  impl_->decode_rows = std::clamp(rows, 0, kDecodeGemmMaxRows);
}
void LinearGemm::SetHeuristicChoice(int rank, int no_split_rows) {
  impl_->heuristic_rank = std::max(rank, 0);
  impl_->no_split_rows = std::max(no_split_rows, 0);
  // Later calls plan again; the invariant mode's algorithms do not depend on the choice.
  for (auto it = impl_->plans.begin(); it != impl_->plans.end();) {
    it = it->first.invariant ? std::next(it) : impl_->plans.erase(it);
  }
}

absl::Status LinearGemm::RunShared(const Args* list, int count, cudaStream_t stream) {
  const bool mma = count >= 1 && list[0].m > kSkinnyMaxRows && list[0].m <= impl_->mma_rows;
  bool shared = !impl_->invariant && count >= 1 && count <= kSkinnyMaxSegments &&
                list[0].m >= 1 && (list[0].m <= kSkinnyMaxRows || mma);
  SkinnyGemmArgs s;
  if (shared) {
    const Args& a0 = list[0];
    s.mma = mma;
    s.m = static_cast<int>(a0.m);
    s.k = a0.k;
    s.x = a0.x;
    s.x_stride = a0.x_stride;
    s.num_segments = count;
    s.sm_count = impl_->sm_count;
    s.programmatic = impl_->programmatic;
    for (int i = 0; i < count && shared; ++i) {
      const Args& a = list[i];
      shared = a.m == a0.m && a.k == a0.k && a.x == a0.x && a.x_stride == a0.x_stride &&
               a.batch == 1 && !a.w_kn && a.n > 0 && a.out_stride >= a.n &&
               (a.out_dtype == DType::kBF16 || a.out_dtype == DType::kF32);
      s.seg[i] = {a.w, a.n, a.alpha, a.out, a.out_dtype, a.out_stride};
    }
    shared = shared && SkinnyGemmSupports(s);
  }
  if (!shared) {
    for (int i = 0; i < count; ++i) {
      if (absl::Status st = Run(list[i], stream); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  if (cudaError_t e = InvokeSkinnyGemm(s, stream); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("LinearGemm::RunShared: skinny kernel for m ", s.m,
                                            ", k ", s.k, ", ", count, " weights: ",
                                            cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

namespace {

// The skinny kernels' arguments for one product (one segment).
SkinnyGemmArgs SkinnyArgs(const LinearGemm::Args& a, int sm_count, bool programmatic) {
  SkinnyGemmArgs s;
  s.m = static_cast<int>(a.m);
  s.k = a.k;
  s.x = a.x;
  s.x_stride = a.x_stride;
  s.w_kn = a.w_kn;
  s.num_segments = 1;
  s.seg[0] = {a.w, a.n, a.alpha, a.out, a.out_dtype, a.out_stride};
  s.batch = a.batch;
  s.x_batch_stride = a.x_batch_stride;
  s.w_batch_stride = a.w_batch_stride;
  s.out_batch_stride = a.out_batch_stride;
  s.sm_count = sm_count;
  s.programmatic = programmatic;
  return s;
}

// The decode GEMM's arguments for one product; its K split's partials in `workspace`.
DecodeGemmArgs DecodeArgs(const LinearGemm::Args& a, void* workspace, size_t workspace_bytes,
                          int sm_count, bool programmatic) {
  DecodeGemmArgs d;
  d.m = static_cast<int>(a.m);
  d.n = a.n;
  d.k = a.k;
  d.x = a.x;
  d.x_stride = a.x_stride;
  d.w = a.w;
  d.alpha = a.alpha;
  d.out = a.out;
  d.out_dtype = a.out_dtype;
  d.out_stride = a.out_stride;
  d.workspace = workspace;
  d.workspace_bytes = workspace_bytes;
  d.sm_count = sm_count;
  d.programmatic = programmatic;
  return d;
}

}  // namespace

absl::StatusOr<bool> LinearGemm::RunWithPrologue(const Args& a, const SkinnyPrologueArgs& prologue,
                                                  cudaStream_t stream) {
  if (impl_->invariant || a.m < 1 || a.m > kSkinnyMaxRows) return false;
  SkinnyGemmArgs s = SkinnyArgs(a, impl_->sm_count, impl_->programmatic);
  s.prologue = prologue;  // SkinnyGemmSupports: one segment, batch 1, W [n, k]
  if (!SkinnyGemmSupports(s)) return false;
  if (cudaError_t e = InvokeSkinnyGemm(s, stream); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("LinearGemm::RunWithPrologue: skinny kernel for m ",
                                            a.m, " n ", a.n, " k ", a.k, ": ",
                                            cudaGetErrorString(e)));
  }
  return true;
}

namespace {

// The plan key of a product (Run's path past the skinny kernels).
PlanKey KeyOf(const LinearGemm::Args& a, bool invariant) {
  const int64_t out_bytes = a.out_dtype == DType::kF32 ? 4 : 2;
  uint32_t align_x = RowAlignment(a.x, a.x_stride * 2);
  uint32_t align_w = RowAlignment(a.w, (a.w_kn ? a.n : a.k) * 2);
  uint32_t align_out = RowAlignment(a.out, a.out_stride * out_bytes);
  if (a.batch > 1) {
    align_x = std::min(align_x, RowAlignment(nullptr, a.x_batch_stride * 2));
    align_w = std::min(align_w, RowAlignment(nullptr, a.w_batch_stride * 2));
    align_out = std::min(align_out, RowAlignment(nullptr, a.out_batch_stride * out_bytes));
  }
  if (invariant) {
    // The algorithm must not change with where a step's scratch happens to start: alignments
    // above 16 B (what the kernels need at most) are not told to the heuristic.
    align_x = std::min(align_x, 16u);
    align_w = std::min(align_w, 16u);
    align_out = std::min(align_out, 16u);
  }
  const PlanKey key{a.m,
                    a.n,
                    a.k,
                    a.x_stride,
                    a.out_stride,
                    a.out_dtype,
                    align_x,
                    align_w,
                    align_out,
                    a.w_kn,
                    a.batch,
                    a.batch > 1 ? a.x_batch_stride : 0,
                    a.batch > 1 ? a.w_batch_stride : 0,
                    a.batch > 1 ? a.out_batch_stride : 0,
                    invariant};
  return key;
}

// An algorithm's configuration in words, for benchmarks.
std::string AlgoSummary(const cublasLtMatmulAlgo_t& algo) {
  const auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) {
    uint32_t v = 0;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written);
    return v;
  };
  return absl::StrCat("algo ", get(CUBLASLT_ALGO_CONFIG_ID), " tile ",
                      get(CUBLASLT_ALGO_CONFIG_TILE_ID), " stages ",
                      get(CUBLASLT_ALGO_CONFIG_STAGES_ID), " split-k ", SplitK(algo), " reduction ",
                      get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME));
}

}  // namespace

absl::StatusOr<std::string> LinearGemm::PlanSummary(const Args& a) {
  absl::StatusOr<const Plan*> plan = impl_->GetPlan(KeyOf(a, impl_->invariant));
  if (!plan.ok()) return plan.status();
  return (*plan)->lt ? AlgoSummary((*plan)->algo) : std::string("cublasGemmEx");
}

absl::Status LinearGemm::Run(const Args& a, cudaStream_t stream) {
  if (a.m < 0 || a.n <= 0 || a.k <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LinearGemm::Run: need m >= 0, n > 0, k > 0, got m ", a.m, " n ", a.n, " k ", a.k));
  }
  if (a.m == 0) return absl::OkStatus();
  if (a.out_dtype != DType::kBF16 && a.out_dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("LinearGemm::Run: out_dtype must be BF16 or F32, got ",
                     std::string(DTypeName(a.out_dtype))));
  }
  if (a.x_stride < a.k || a.out_stride < a.n) {
    return absl::InvalidArgumentError(
        absl::StrCat("LinearGemm::Run: need x_stride >= k (", a.x_stride, " < ", a.k,
                     "?) and out_stride >= n (", a.out_stride, " < ", a.n, "?)"));
  }
  if (a.x == nullptr || a.w == nullptr || a.out == nullptr) {
    return absl::InvalidArgumentError("LinearGemm::Run: x, w and out must be non-null");
  }
  if (a.batch < 1 || (a.batch > 1 && (a.x_batch_stride < 0 || a.w_batch_stride < 0 ||
                                       a.out_batch_stride < 0))) {
    return absl::InvalidArgumentError(
        absl::StrCat("LinearGemm::Run: batch ", a.batch, " needs batch >= 1 and strides >= 0"));
  }
  // A few rows (decode at small batches): the skinny kernels, outside the invariant mode.
  const bool mma = a.m > kSkinnyMaxRows && a.m <= impl_->mma_rows;
  if (!impl_->invariant && (a.m <= kSkinnyMaxRows || mma)) {
    SkinnyGemmArgs s = SkinnyArgs(a, impl_->sm_count, impl_->programmatic);
    s.mma = mma;
    if (SkinnyGemmSupports(s)) {
      if (cudaError_t e = InvokeSkinnyGemm(s, stream); e != cudaSuccess) {
        return absl::InternalError(absl::StrCat("LinearGemm::Run: skinny kernel for m ", a.m,
                                                " n ", a.n, " k ", a.k, ": ",
                                                cudaGetErrorString(e)));
      }
      return absl::OkStatus();
    }
  }
  // 5..decode_rows rows: the split-K tensor-core kernel (decode_gemm.h), outside the invariant
  // mode, where it takes the product (W [n, k], batch 1, k a multiple of 64, aligned rows).
  if (!impl_->invariant && a.m > kSkinnyMaxRows && a.m <= impl_->decode_rows && a.batch == 1 &&
      !a.w_kn) {
    const DecodeGemmArgs d = DecodeArgs(a, impl_->workspace, impl_->workspace_bytes,
                                        impl_->sm_count, impl_->programmatic);
    if (DecodeGemmSupports(d)) {
      if (cudaError_t e = InvokeDecodeGemm(d, stream); e != cudaSuccess) {
        return absl::InternalError(absl::StrCat("LinearGemm::Run: decode GEMM for m ", a.m, " n ",
                                                a.n, " k ", a.k, ": ", cudaGetErrorString(e)));
      }
      return absl::OkStatus();
    }
  }
  const PlanKey key = KeyOf(a, impl_->invariant);
  absl::StatusOr<const Plan*> plan = impl_->GetPlan(key);
  if (!plan.ok()) return plan.status();
  const float beta = 0.0f;
  cublasStatus_t s;
  if ((*plan)->lt) {
    s = cublasLtMatmul(impl_->lt, (*plan)->op, &a.alpha, a.w, (*plan)->a, a.x, (*plan)->b, &beta,
                       a.out, (*plan)->d, a.out, (*plan)->d, &(*plan)->algo, impl_->workspace,
                       impl_->workspace_bytes, stream);
  } else {
    // cublasSetStream resets the workspace to cuBLAS's own pool, so the workspace is set after
    // it: no allocation at call time.
    s = cublasSetStream(impl_->blas, stream);
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasSetWorkspace(impl_->blas, impl_->workspace, impl_->workspace_bytes);
    }
    const cublasOperation_t trans_a = a.w_kn ? CUBLAS_OP_N : CUBLAS_OP_T;
    const int lda = static_cast<int>(a.w_kn ? a.n : a.k);
    const cudaDataType_t out_type = a.out_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
    if (s == CUBLAS_STATUS_SUCCESS && a.batch == 1) {
      s = cublasGemmEx(impl_->blas, trans_a, CUBLAS_OP_N, static_cast<int>(a.n),
                       static_cast<int>(a.m), static_cast<int>(a.k), &a.alpha, a.w, CUDA_R_16BF,
                       lda, a.x, CUDA_R_16BF, static_cast<int>(a.x_stride), &beta, a.out, out_type,
                       static_cast<int>(a.out_stride), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    } else if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasGemmStridedBatchedEx(
          impl_->blas, trans_a, CUBLAS_OP_N, static_cast<int>(a.n), static_cast<int>(a.m),
          static_cast<int>(a.k), &a.alpha, a.w, CUDA_R_16BF, lda, a.w_batch_stride, a.x,
          CUDA_R_16BF, static_cast<int>(a.x_stride), a.x_batch_stride, &beta, a.out, out_type,
          static_cast<int>(a.out_stride), a.out_batch_stride, a.batch, CUBLAS_COMPUTE_32F,
          CUBLAS_GEMM_DEFAULT);
    }
  }
  if (s != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("LinearGemm::Run: ", (*plan)->lt ? "cublasLtMatmul" : "cublasGemmEx",
                     " failed for m ", a.m, " n ", a.n, " k ", a.k, ": ", CublasError(s)));
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
