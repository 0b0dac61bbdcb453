#include "kernels/linear/fp8_block_gemm.h"

#include <cublasLt.h>

#include <map>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace mlaserve {
namespace {

constexpr int64_t kBlock = 128;

std::string LtError(cublasStatus_t s) {
  return absl::StrCat(cublasGetStatusName(s), " (", cublasGetStatusString(s), ")");
}

size_t Align256(size_t v) { return (v + 255) / 256 * 256; }

uint32_t Alignment(const void* ptr, int64_t pitch_bytes) {
  const uint64_t bits =
      reinterpret_cast<uintptr_t>(ptr) | static_cast<uint64_t>(pitch_bytes) | 256u;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

struct Key {
  int64_t m, n, k, out_stride;
  uint32_t align_out;
  bool operator<(const Key& o) const {
    return std::tie(m, n, k, out_stride, align_out) <
           std::tie(o.m, o.n, o.k, o.out_stride, o.align_out);
  }
};

// Column-major view, as in kernels/linear/linear.cc: D [n, m] = op(A) B with A = W (col-major
// [k, n], transposed) and B = xq (col-major [k, m]).
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

struct Fp8BlockGemm::Impl {
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::map<Key, std::unique_ptr<Plan>> plans;

  ~Impl() {
    if (workspace != nullptr) cudaFree(workspace);
    if (lt != nullptr) cublasLtDestroy(lt);
  }

  // w_scale / x_scale: the first call's scale pointers, set before the heuristic query (with
  // block scale modes and no pointers cuBLASLt answers INVALID_VALUE); Run sets each call's.
  absl::StatusOr<const Plan*> GetPlan(const Key& key, const float* w_scale, const float* x_scale) {
    if (auto it = plans.find(key); it != plans.end()) return it->second.get();
    auto plan = std::make_unique<Plan>();
    const auto shape = [&] { return absl::StrCat("m ", key.m, " n ", key.n, " k ", key.k); };
    cublasStatus_t s = cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const int8_t fast_accum = 0;  // the block modes take no fast accumulation
    auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t size) {
      if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(plan->op, attr, v, size);
    };
    set(CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    set(CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode));
    set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode));
    set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum));
    set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof(w_scale));
    set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale, sizeof(x_scale));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_8F_E4M3, key.k, key.n, key.k);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_8F_E4M3, key.k, key.m, key.k);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatrixLayoutCreate(&plan->d, CUDA_R_16BF, key.n, key.m, key.out_stride);
    if (s != CUBLAS_STATUS_SUCCESS) {
      return absl::InternalError(absl::StrCat("Fp8BlockGemm: describing ", shape(), ": ", LtError(s)));
    }
    cublasLtMatmulPreference_t pref = nullptr;
    s = cublasLtMatmulPreferenceCreate(&pref);
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &workspace_bytes, sizeof(workspace_bytes));
    }
    const uint32_t align_c = key.align_out;
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                               &align_c, sizeof(align_c));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasLtMatmulAlgoGetHeuristic(lt, plan->op, plan->a, plan->b, plan->d, plan->d, pref, 1,
                                         &result, &returned);
    }
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS || returned == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
      return absl::UnimplementedError(absl::StrCat(
          "Fp8BlockGemm: cuBLASLt offers no block-scaled FP8 algorithm for ", shape(), " (",
          s != CUBLAS_STATUS_SUCCESS ? LtError(s) : std::string("no result"), ")"));
    }
    plan->algo = result.algo;
    return plans.emplace(key, std::move(plan)).first->second.get();
  }
};

bool Fp8BlockGemm::Supported(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return prop.major == 9 && cublasLtGetVersion() >= 120900;
}

absl::StatusOr<std::unique_ptr<Fp8BlockGemm>> Fp8BlockGemm::Create(size_t workspace_bytes) {
  auto impl = std::make_unique<Impl>();
  if (cublasStatus_t s = cublasLtCreate(&impl->lt); s != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasLtCreate: ", LtError(s)));
  }
  if (workspace_bytes > 0) {
    if (cudaError_t e = cudaMalloc(&impl->workspace, workspace_bytes); e != cudaSuccess) {
      return absl::ResourceExhaustedError(
          absl::StrCat("Fp8BlockGemm workspace of ", workspace_bytes, " bytes: ", cudaGetErrorString(e)));
    }
  }
  impl->workspace_bytes = workspace_bytes;
  return std::unique_ptr<Fp8BlockGemm>(new Fp8BlockGemm(std::move(impl)));
}

Fp8BlockGemm::Fp8BlockGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Fp8BlockGemm::~Fp8BlockGemm() = default;

namespace {
int64_t PaddedRows(int64_t m) {
  return (m + Fp8BlockGemm::kRowMultiple - 1) / Fp8BlockGemm::kRowMultiple *
         Fp8BlockGemm::kRowMultiple;
}
}  // namespace

size_t Fp8BlockGemm::ScratchBytes(int64_t m, int64_t n, int64_t k) {
  const int64_t mp = PaddedRows(m);
  return Align256(static_cast<size_t>(mp * k)) +
         Align256(static_cast<size_t>((k / kBlock) * mp) * sizeof(float)) +
         (mp != m ? Align256(static_cast<size_t>(mp * n) * 2) : 0);
}

absl::Status Fp8BlockGemm::Run(const Args& a, cudaStream_t stream) {
  if (a.m == 0) return absl::OkStatus();
  if (a.m < 0 || a.n <= 0 || a.k <= 0 || a.k % (4 * kBlock) != 0 || a.x_stride < a.k ||
      a.out_stride < a.n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Fp8BlockGemm: m ", a.m, " n ", a.n, " k ", a.k, " x_stride ", a.x_stride, " out_stride ",
        a.out_stride, " (k must be a positive multiple of 512: 128-column blocks, and rows of "
        "block scales 16-byte aligned)"));
  }
  if (a.x == nullptr || a.w == nullptr || a.w_scale == nullptr || a.out == nullptr ||
      a.scratch == nullptr) {
    return absl::InvalidArgumentError("Fp8BlockGemm: a null pointer");
  }
  const int64_t mp = PaddedRows(a.m);
  uint8_t* xq = static_cast<uint8_t*>(a.scratch);
  float* x_scale = reinterpret_cast<float*>(xq + Align256(static_cast<size_t>(mp * a.k)));
  void* d = a.out;
  int64_t d_stride = a.out_stride;
  cudaError_t e = cudaSuccess;
  if (mp != a.m) {
    // Zero rows (codes 0, scales 0: their products are 0) up to the multiple cuBLASLt takes.
    d = reinterpret_cast<char*>(x_scale) + Align256(static_cast<size_t>((a.k / kBlock) * mp) * 4);
    d_stride = a.n;
    e = cudaMemsetAsync(xq + a.m * a.k, 0, static_cast<size_t>((mp - a.m) * a.k), stream);
    if (e == cudaSuccess) {
      e = cudaMemsetAsync(x_scale, 0, static_cast<size_t>((a.k / kBlock) * mp) * 4, stream);
    }
  }
  if (e == cudaSuccess) {
    e = QuantizeActivationsFp8Block(a.x, a.x_stride, a.m, a.k, xq, x_scale, mp, stream);
  }
  if (e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("Fp8BlockGemm: activation quantization m ", a.m, " k ",
                                            a.k, ": ", cudaGetErrorString(e)));
  }
  const Key key{mp, a.n, a.k, d_stride, Alignment(d, d_stride * 2)};
  absl::StatusOr<const Plan*> plan = impl_->GetPlan(key, a.w_scale, x_scale);
  if (!plan.ok()) return plan.status();
  const Plan& p = **plan;
  cublasStatus_t s = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                    &a.w_scale, sizeof(a.w_scale));
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale,
                                       sizeof(x_scale));
  }
  const float alpha = 1.0f, beta = 0.0f;
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmul(impl_->lt, p.op, &alpha, a.w, p.a, xq, p.b, &beta, d, p.d, d, p.d, &p.algo,
                       impl_->workspace, impl_->workspace_bytes, stream);
  }
  if (s != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("Fp8BlockGemm: cublasLtMatmul m ", a.m, " n ", a.n,
                                            " k ", a.k, ": ", LtError(s)));
  }
  if (d != a.out) {
    e = cudaMemcpy2DAsync(a.out, a.out_stride * 2, d, d_stride * 2, a.n * 2, a.m,
                          cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("Fp8BlockGemm: copying the padded output: ",
                                              cudaGetErrorString(e)));
    }
  }
  return absl::OkStatus();
}

}  // namespace mlaserve
