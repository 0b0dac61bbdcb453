#include "kernels/linear/linear.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

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
  bool operator<(const PlanKey& o) const {
    return std::tie(m, n, k, x_stride, out_stride, out_dtype, align_x, align_w, align_out) <
           std::tie(o.m, o.n, o.k, o.x_stride, o.out_stride, o.out_dtype, o.align_x, o.align_w,
                    o.align_out);
  }
};

// Descriptors and algorithm of one planned shape. Column-major view of the row-major problem:
// D [n, m] (ld out_stride) = op_T(A = W as col-major [k, n], ld k) * (B = x as col-major [k, m],
// ld x_stride), i.e. out^T = W x^T.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  bool lt = false;  // false: no Lt algorithm, use cublasGemmEx
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

}  // namespace

struct LinearGemm::Impl {
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;

  ~Impl() {
    if (workspace != nullptr) cudaFree(workspace);
    if (blas != nullptr) cublasDestroy(blas);
    if (lt != nullptr) cublasLtDestroy(lt);
  }

  absl::StatusOr<const Plan*> GetPlan(const PlanKey& key);
};

absl::StatusOr<const Plan*> LinearGemm::Impl::GetPlan(const PlanKey& key) {
  if (auto it = plans.find(key); it != plans.end()) return it->second.get();
  auto plan = std::make_unique<Plan>();
  const cudaDataType_t out_type = key.out_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  const auto fail = [&](const char* what, cublasStatus_t s) {
    return absl::InternalError(absl::StrCat("LinearGemm: ", what, " failed for m ", key.m, " n ",
                                            key.n, " k ", key.k, ": ", CublasError(s)));
  };
  cublasStatus_t s = cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (s != CUBLAS_STATUS_SUCCESS) return fail("cublasLtMatmulDescCreate", s);
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  s = cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                     sizeof(trans_a));
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                       sizeof(trans_b));
  }
  if (s != CUBLAS_STATUS_SUCCESS) return fail("cublasLtMatmulDescSetAttribute", s);
  s = cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, key.k, key.n, key.k);
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, key.k, key.m, key.x_stride);
  }
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatrixLayoutCreate(&plan->d, out_type, key.n, key.m, key.out_stride);
  }
  if (s != CUBLAS_STATUS_SUCCESS) return fail("cublasLtMatrixLayoutCreate", s);

  cublasLtMatmulPreference_t pref = nullptr;
  s = cublasLtMatmulPreferenceCreate(&pref);
  if (s != CUBLAS_STATUS_SUCCESS) return fail("cublasLtMatmulPreferenceCreate", s);
  const uint64_t ws = workspace_bytes;
  // A is W, B is x, C and D are out (C is not read: beta = 0, but it shares D's layout).
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_w},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_x},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_out},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_out}};
  s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                           sizeof(ws));
  for (const auto& [attr, value] : aligns) {
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value));
    }
  }
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  if (s == CUBLAS_STATUS_SUCCESS) {
    // NOT_SUPPORTED (no algorithm for this shape and alignment) is not an error: use GemmEx.
    const cublasStatus_t h = cublasLtMatmulAlgoGetHeuristic(lt, plan->op, plan->a, plan->b, plan->d,
                                                            plan->d, pref, 1, &result, &returned);
    if (h != CUBLAS_STATUS_SUCCESS) returned = 0;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS) return fail("cublasLtMatmulPreferenceSetAttribute", s);
  plan->lt = returned > 0 && result.state == CUBLAS_STATUS_SUCCESS &&
             result.workspaceSize <= workspace_bytes;
  if (plan->lt) {
    plan->algo = result.algo;
  } else if (key.m > std::numeric_limits<int>::max() || key.n > std::numeric_limits<int>::max() ||
             key.k > std::numeric_limits<int>::max() ||
             key.x_stride > std::numeric_limits<int>::max() ||
             key.out_stride > std::numeric_limits<int>::max()) {
    return absl::UnimplementedError(
        absl::StrCat("LinearGemm: cuBLASLt has no algorithm for m ", key.m, " n ", key.n, " k ",
                     key.k, " and the cublasGemmEx fallback takes 32-bit sizes and strides"));
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
  return std::unique_ptr<LinearGemm>(new LinearGemm(std::move(impl)));
}

size_t LinearGemm::CachedPlans() const { return impl_->plans.size(); }

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
  const int64_t out_bytes = a.out_dtype == DType::kF32 ? 4 : 2;
  const PlanKey key{a.m,
                    a.n,
                    a.k,
                    a.x_stride,
                    a.out_stride,
                    a.out_dtype,
                    RowAlignment(a.x, a.x_stride * 2),
                    RowAlignment(a.w, a.k * 2),
                    RowAlignment(a.out, a.out_stride * out_bytes)};
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
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasGemmEx(impl_->blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(a.n),
                       static_cast<int>(a.m), static_cast<int>(a.k), &a.alpha, a.w, CUDA_R_16BF,
                       static_cast<int>(a.k), a.x, CUDA_R_16BF, static_cast<int>(a.x_stride), &beta,
                       a.out, a.out_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF,
                       static_cast<int>(a.out_stride), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
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
