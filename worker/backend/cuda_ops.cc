#include "worker/backend/cuda_ops.h"

#include <cuda_profiler_api.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "kernels/activation/silu_mul.h"
#include "kernels/embedding/embedding.h"
#include "kernels/linear/fp8_block_ref.h"
#include "kernels/linear/linear.h"
#include "kernels/linear/linear_ref.h"
#include "kernels/linear/skinny_gemm.h"
#include "kernels/linear/split_columns.h"
#include "kernels/mla/mla_dcp.h"
#include "kernels/mla/mla_decode.h"
#include "kernels/mla/mla_kv_prep.h"
#include "kernels/mla/mla_prefill.h"
#include "kernels/moe/fp8_moe_layout.h"
#include "kernels/moe/moe_experts.h"
#include "kernels/moe/moe_router.h"
#include "kernels/norm/rms_norm.h"
#include "kernels/rope/rope.h"
#include "kernels/sampling/sampling.h"

namespace mlaserve {
namespace {

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

std::string Shape(const Tensor& t) {
  return absl::StrCat(std::string(DTypeName(t.dtype())), "[", absl::StrJoin(t.shape(), ", "), "]");
}

absl::Status CudaStatus(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

// Device memory freed with the last tensor that shares it.
std::shared_ptr<void> DeviceStorage(size_t bytes, cudaError_t* err) {
  void* p = nullptr;
  *err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
  if (*err != cudaSuccess) return nullptr;
  return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
}

// A host copy of a float tensor as bf16 (checkpoints in fp32 or fp16 are rounded once).
Tensor HostBf16(const Tensor& host) {
  if (host.dtype() == DType::kBF16) return host;
  Tensor f = Tensor::Host(DType::kF32, host.shape());
  DecodeFloats(host.dtype(), host.data<void>(), static_cast<size_t>(host.numel()), f.data<float>());
  Tensor out = Tensor::Host(DType::kBF16, host.shape());
  for (int64_t i = 0; i < host.numel(); ++i)
    out.data<uint16_t>()[i] = FloatToBf16(f.data<float>()[i]);
  return out;
}

// One use of the MLA decode kernel (MlaDecode's, and MlaAttend's under DCP): num_seqs sequences
// of s_q rows of `heads` heads, their absorbed q rows at q_abs ([rows, heads, 576] bf16, the RoPE
// dims at q_rope + f * q_rope_stride for flat row f where q_rope is set), latent rows out to
// `out` ([rows, heads, 512] bf16) and, where set, their natural-log lse to `lse`.
struct MlaDecodeCall {
  const uint16_t* q_abs = nullptr;
  const uint16_t* q_rope = nullptr;
  int64_t q_rope_stride = 0;
  const int32_t* block_table = nullptr;  // [num_seqs, max_blocks]
  int max_blocks = 0;
  const int32_t* seq_lens = nullptr;  // [num_seqs]
  int num_seqs = 0, s_q = 1, heads = 0;
  uint16_t* out = nullptr;
  float* lse = nullptr;
};

}  // namespace

absl::Status CudaMemoryInfo(size_t* free_bytes, size_t* total_bytes) {
  return CudaStatus(cudaMemGetInfo(free_bytes, total_bytes), "cudaMemGetInfo");
}

struct CudaOps::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  std::unique_ptr<LinearGemm> gemm;
  bool batch_invariant = false;  // SetBatchInvariant
  bool fused_mla_input = true;  // SetFusedMlaInput
  bool moe_few_expert = true;   // SetMoeFewExpert
  bool moe_few_expert_layer = false;  // SetMoeFewExpertLayer
  bool moe_wave_tail = true;          // SetMoeWaveTail
  bool moe_prefill_wgmma = true;  // SetMoePrefillWgmma
  bool fused_prologues = false;  // SetFusedPrologues
  bool programmatic_small = true;  // SetProgrammaticSmallKernels
  bool mla_q_fusion = true;  // SetMlaQFusion
  bool mla_absorb_fusion = true;   // SetMlaAbsorbFusion
  bool moe_route_split = true;     // SetMoeRouteSplit
  bool moe_route_dispatch_fusion = true;   // SetMoeRouteDispatchFusion (1-token steps)
  int* route_counter = nullptr;            // InvokeMoeRouteDispatch\'s counter (0 between calls)
  bool programmatic_dispatch = true;  // SetProgrammaticDispatch
  bool shared_overlap = true;  // SetSharedExpertOverlap
  bool programmatic_mla_combine = true;  // SetProgrammaticMlaCombine
  int mla_min_share = 0;  // SetMlaMinShare
  bool mla_fp8_tensor_cores = true;                // SetMlaFp8TensorCores
  int merged_rows = kDefaultMergedProjectionRows;  // SetMergedProjectionRows
  uint64_t merged_count = 0;                       // merged_projections()
  // Side branches: side_stream forks from `stream` at fork_event and joins it at join_event;
  // while a branch is open, `stream` is the side stream and main_stream the main one.
  cudaStream_t side_stream = nullptr, main_stream = nullptr;
  cudaEvent_t fork_event = nullptr, join_event = nullptr;
  bool join_pending = false;
  // The main stream waits for the last side branch, if it has not yet.
  // Enqueued even after a failure (the first error is kept), so a failed step ends joined.
  void Join() {
    if (!join_pending) return;
    join_pending = false;
    Check(cudaStreamWaitEvent(stream, join_event, 0),
          [] { return std::string("side branch join"); });
  }
  absl::Status error;  // the first failure since the last check
  size_t persistent = 0;

  // Step arena: chunks of device memory; BeginStep merges them into one of their total size,
  // so the arena converges to the largest step's need and then never allocates again.
  struct Chunk {
    void* base = nullptr;
    size_t size = 0, used = 0;
  };
  std::vector<Chunk> chunks;
  size_t arena_total = 0;

  // Step metadata: pinned host staging and its device twin, one copy per step.
  void* step_host = nullptr;
  void* step_dev = nullptr;
  size_t step_capacity = 0;
  // Sampling staging (rows, penalties, masks in; ids, logprobs out).
  void* sample_host = nullptr;
  size_t sample_capacity = 0;
  // Moves of the arena or the step buffers (graphs captured before are stale), and the graphs.
  uint64_t epoch = 0;
  bool capturing = false;
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    size_t arena_used = 0;  // the bump offset after the captured ops' scratch
    uint64_t epoch = 0;
  };
  std::vector<Graph> graphs;
  // Phase timing: events recorded at Phase calls (name, event), reused across accounts.
  bool phase_timing = false;
  std::vector<std::pair<const char*, cudaEvent_t>> phase_marks;
  std::vector<cudaEvent_t> phase_events;

  bool failed() const { return !error.ok(); }
  void Fail(absl::Status s) {
    if (error.ok() && !s.ok()) error = std::move(s);
  }
  // `what` names the op and its shapes: a string, or a callable making it, which runs only on
  // failure (ops run hundreds of times a step; their messages are formatted only when needed).
  template <class What>
  static std::string Describe(const What& what) {
    if constexpr (std::is_invocable_v<const What&>) {
      return what();
    } else {
      return std::string(what);
    }
  }
  template <class What>
  void Check(cudaError_t e, const What& what) {
    if (e != cudaSuccess) Fail(CudaStatus(e, Describe(what)));
  }
  template <class What>
  void Check(const absl::Status& s, const What& what) {
    if (!s.ok()) Fail(absl::Status(s.code(), absl::StrCat(Describe(what), ": ", s.message())));
  }

  // The MLA decode kernel, the latent's expansion through W_vb and q's absorption through W_kb
  // as MlaDecode and the DCP ops use them (defined with those ops).
  template <class What>
  void RunMlaDecode(const MlaDecodeCall& c, const KvCacheLayer& cache, float softmax_scale,
                    const What& what);
  template <class What>
  void ExpandLatent(const MlaShape& s, int64_t rows, const void* latent, const Tensor& w_vb,
                    uint16_t* out, const What& what);
  template <class What>
  void AbsorbQ(const MlaShape& s, int64_t rows, const uint16_t* q, const Tensor& w_kb,
               uint16_t* q_abs, int64_t abs_stride, const What& what);

  void* ArenaAlloc(size_t bytes) {
    bytes = AlignUp(std::max<size_t>(bytes, 1));
    if (!chunks.empty() && chunks.back().used + bytes <= chunks.back().size) {
      Chunk& c = chunks.back();
      void* p = static_cast<char*>(c.base) + c.used;
      c.used += bytes;
      return p;
    }
    if (capturing) {
      // A graph must not allocate: the step that is captured ran eagerly first and grew the
      // arena to its size.
      Fail(absl::InternalError("step arena exhausted while capturing a graph"));
      return nullptr;
    }
    // A new chunk: at least the request, at least double the arena so far (few chunks).
    Chunk c;
    c.size = std::max(bytes, std::max<size_t>(arena_total, 64 << 20));
    if (cudaMalloc(&c.base, c.size) != cudaSuccess) {
      cudaGetLastError();
      Fail(absl::ResourceExhaustedError(
          absl::StrCat("out of GPU memory for step scratch: ", c.size,
                       " more bytes needed beyond the ", arena_total,
                       " the arena holds; lower --kv-blocks or --gpu-memory-fraction, or the "
                       "scheduler's tokens per step")));
      return nullptr;
    }
    c.used = bytes;
    arena_total += c.size;
    chunks.push_back(c);
    return c.base;
  }

  absl::Status ResetArena() {
    if (chunks.size() > 1) {
      // The work of the last step may still read the chunks.
      if (auto s = CudaStatus(cudaStreamSynchronize(stream), "step arena"); !s.ok()) return s;
      size_t total = 0;
      for (Chunk& c : chunks) {
        total += c.size;
        cudaFree(c.base);
      }
      chunks.clear();
      arena_total = 0;
      Chunk c;
      if (auto s = CudaStatus(cudaMalloc(&c.base, total), "step arena"); !s.ok()) return s;
      c.size = total;
      arena_total = total;
      chunks.push_back(c);
      ++epoch;
    }
    for (Chunk& c : chunks) c.used = 0;
    return absl::OkStatus();
  }

  ~Impl() {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    for (Graph& g : graphs) {
      if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
    }
    for (Chunk& c : chunks) cudaFree(c.base);
    for (cudaEvent_t e : phase_events) cudaEventDestroy(e);
    cudaFree(step_dev);
    cudaFree(route_counter);
    cudaFreeHost(step_host);
    cudaFreeHost(sample_host);
    gemm.reset();
    if (fork_event != nullptr) cudaEventDestroy(fork_event);
    if (join_event != nullptr) cudaEventDestroy(join_event);
    if (side_stream != nullptr) cudaStreamDestroy(side_stream);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

absl::StatusOr<std::unique_ptr<CudaOps>> CudaOps::Create() {
  auto impl = std::make_unique<Impl>();
  int count = 0;
  if (auto s = CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount"); !s.ok()) return s;
  if (count == 0) return absl::FailedPreconditionError("no CUDA device is visible");
  if (auto s = CudaStatus(cudaGetDevice(&impl->device), "cudaGetDevice"); !s.ok()) return s;
  if (auto s = CudaStatus(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking),
                          "cudaStreamCreate");
      !s.ok()) {
    return s;
  }
  if (auto s = CudaStatus(cudaStreamCreateWithFlags(&impl->side_stream, cudaStreamNonBlocking),
                          "cudaStreamCreate (side branches)");
      !s.ok()) {
    return s;
  }
  for (cudaEvent_t* e : {&impl->fork_event, &impl->join_event}) {
    if (auto s = CudaStatus(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate");
        !s.ok()) {
      return s;
    }
  }
  if (auto s = CudaStatus(cudaMalloc(reinterpret_cast<void**>(&impl->route_counter), sizeof(int)),
                          "router counter");
      !s.ok()) {
    return s;
  }
  if (auto s = CudaStatus(cudaMemset(impl->route_counter, 0, sizeof(int)), "router counter");
      !s.ok()) {
    return s;
  }
  auto gemm = LinearGemm::Create();
  if (!gemm.ok()) return gemm.status();
  impl->gemm = *std::move(gemm);
  impl->gemm->SetProgrammaticLaunch(true);  // SetProgrammaticLaunch's default
  impl->gemm->SetDecodeGemmRows(kDefaultDecodeGemmRows);
  return std::unique_ptr<CudaOps>(new CudaOps(std::move(impl)));
}

CudaOps::CudaOps(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaOps::~CudaOps() = default;

cudaStream_t CudaOps::stream() const { return impl_->stream; }
size_t CudaOps::persistent_bytes() const { return impl_->persistent; }
size_t CudaOps::arena_bytes() const { return impl_->arena_total; }

uint64_t CudaOps::memory_epoch() const { return impl_->epoch; }

// Phase timing also brackets a profiler range, so `ncu --profile-from-start off` (or nsys's
// capture range) records exactly the timed eager steps and none of the load, fill or graphs.
void CudaOps::SetPhaseTiming(bool on) {
  if (on != impl_->phase_timing) {
    cudaStreamSynchronize(impl_->stream);
    if (on) {
      cudaProfilerStart();
    } else {
      cudaProfilerStop();
    }
  }
  impl_->phase_timing = on;
  impl_->phase_marks.clear();
}

void CudaOps::SetProgrammaticLaunch(bool on) { impl_->gemm->SetProgrammaticLaunch(on); }
void CudaOps::SetSkinnyTensorCoreRows(int rows) { impl_->gemm->SetSkinnyTensorCoreRows(rows); }
void CudaOps::SetDecodeGemmRows(int rows) { impl_->gemm->SetDecodeGemmRows(rows); }
void CudaOps::SetMergedProjectionRows(int rows) { impl_->merged_rows = rows; }
uint64_t CudaOps::merged_projections() const { return impl_->merged_count; }
void CudaOps::SetGemmHeuristicChoice(int rank, int no_split_rows) {
  impl_->gemm->SetHeuristicChoice(rank, no_split_rows);
}
void CudaOps::SetFusedMlaInput(bool on) { impl_->fused_mla_input = on; }
void CudaOps::SetMoeFewExpert(bool on) { impl_->moe_few_expert = on; }
void CudaOps::SetMoeFewExpertLayer(bool on) { impl_->moe_few_expert_layer = on; }
void CudaOps::SetMoeWaveTail(bool on) { impl_->moe_wave_tail = on; }
void CudaOps::SetMoePrefillWgmma(bool on) { impl_->moe_prefill_wgmma = on; }
void CudaOps::SetFusedPrologues(bool on) { impl_->fused_prologues = on; }
void CudaOps::SetProgrammaticSmallKernels(bool on) { impl_->programmatic_small = on; }
void CudaOps::SetMlaQFusion(bool on) { impl_->mla_q_fusion = on; }
void CudaOps::SetMlaAbsorbFusion(bool on) { impl_->mla_absorb_fusion = on; }
void CudaOps::SetMoeRouteSplit(bool on) { impl_->moe_route_split = on; }
void CudaOps::SetMoeRouteDispatchFusion(bool on) { impl_->moe_route_dispatch_fusion = on; }
void CudaOps::SetProgrammaticDispatch(bool on) { impl_->programmatic_dispatch = on; }
void CudaOps::SetSharedExpertOverlap(bool on) { impl_->shared_overlap = on; }
void CudaOps::SetProgrammaticMlaCombine(bool on) { impl_->programmatic_mla_combine = on; }
void CudaOps::SetMlaMinShare(int units) { impl_->mla_min_share = units; }
void CudaOps::SetMlaFp8TensorCores(bool on) { impl_->mla_fp8_tensor_cores = on; }

bool CudaOps::SideBranches() const { return impl_->shared_overlap && !impl_->phase_timing; }

void CudaOps::BeginSideBranch() {
  if (impl_->failed()) return;
  if (impl_->main_stream != nullptr) {
    impl_->Fail(absl::FailedPreconditionError("BeginSideBranch inside a side branch"));
    return;
  }
  impl_->Join();
  impl_->Check(cudaEventRecord(impl_->fork_event, impl_->stream),
               [] { return std::string("side branch fork"); });
  impl_->Check(cudaStreamWaitEvent(impl_->side_stream, impl_->fork_event, 0),
               [] { return std::string("side branch fork"); });
  impl_->main_stream = impl_->stream;
  impl_->stream = impl_->side_stream;
}

void CudaOps::EndSideBranch() {
  if (impl_->main_stream == nullptr) {
    impl_->Fail(absl::FailedPreconditionError("EndSideBranch without BeginSideBranch"));
    return;
  }
  impl_->Check(cudaEventRecord(impl_->join_event, impl_->side_stream),
               [] { return std::string("side branch join"); });
  impl_->stream = impl_->main_stream;
  impl_->main_stream = nullptr;
  impl_->join_pending = true;
}

void CudaOps::Phase(const char* name) {
  if (!impl_->phase_timing || impl_->capturing) return;
  const size_t i = impl_->phase_marks.size();
  if (i == impl_->phase_events.size()) {
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) return;
    impl_->phase_events.push_back(e);
  }
  cudaEvent_t e = impl_->phase_events[i];
  cudaEventRecord(e, impl_->stream);
  impl_->phase_marks.push_back({name, e});
}

std::vector<std::pair<std::string, double>> CudaOps::PhaseTimes() {
  std::vector<std::pair<std::string, double>> out;
  Phase("end");
  cudaStreamSynchronize(impl_->stream);
  const auto& m = impl_->phase_marks;
  for (size_t i = 0; i + 1 < m.size(); ++i) {
    float ms = 0.0f;
    if (cudaEventElapsedTime(&ms, m[i].second, m[i + 1].second) != cudaSuccess) continue;
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == m[i].first; });
    if (it == out.end()) {
      out.push_back({m[i].first, ms});
    } else {
      it->second += ms;
    }
  }
  impl_->phase_marks.clear();
  return out;
}

// A mark is (number of chunks, the last chunk's bump offset); allocation only ever bumps the last
// chunk, so releasing restores that offset and empties the chunks added since.
uint64_t CudaOps::ScratchMark() {
  if (impl_->chunks.empty()) return 0;
  return (static_cast<uint64_t>(impl_->chunks.size()) << 48) | impl_->chunks.back().used;
}

void CudaOps::ScratchRelease(uint64_t mark) {
  const size_t count = static_cast<size_t>(mark >> 48);
  const size_t used = static_cast<size_t>(mark & ((uint64_t{1} << 48) - 1));
  for (size_t i = 0; i < impl_->chunks.size(); ++i) {
    if (i + 1 == count) {
      impl_->chunks[i].used = used;
    } else if (i + 1 > count) {
      impl_->chunks[i].used = 0;
    }
  }
}

absl::Status CudaOps::SetBatchInvariant(bool on) {
  impl_->batch_invariant = on;
  impl_->gemm->SetBatchInvariant(on);
  return absl::OkStatus();
}

absl::Status CudaOps::BeginCapture() {
  if (impl_->failed()) return impl_->error;
  if (auto s = CudaStatus(cudaStreamBeginCapture(impl_->stream, cudaStreamCaptureModeRelaxed),
                          "graph capture");
      !s.ok()) {
    return s;
  }
  impl_->capturing = true;
  return absl::OkStatus();
}

absl::StatusOr<int> CudaOps::EndCapture() {
  impl_->Join();  // a capture must end joined
  cudaGraph_t graph = nullptr;
  const cudaError_t e = cudaStreamEndCapture(impl_->stream, &graph);
  impl_->capturing = false;
  absl::Status s = CudaStatus(e, "graph capture");
  if (s.ok() && impl_->failed()) s = impl_->error;  // an op failed while being recorded
  Impl::Graph g;
  if (s.ok()) s = CudaStatus(cudaGraphInstantiate(&g.exec, graph, 0), "graph instantiation");
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!s.ok()) {
    cudaGetLastError();
    impl_->Fail(s);
    return s;
  }
  g.arena_used = impl_->chunks.empty() ? 0 : impl_->chunks.back().used;
  g.epoch = impl_->epoch;
  impl_->graphs.push_back(g);
  return static_cast<int>(impl_->graphs.size()) - 1;
}

absl::Status CudaOps::LaunchGraph(int graph) {
  impl_->Join();
  if (impl_->failed()) return impl_->error;
  if (graph < 0 || graph >= static_cast<int>(impl_->graphs.size()) ||
      impl_->graphs[graph].exec == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("no graph ", graph));
  }
  Impl::Graph& g = impl_->graphs[graph];
  if (g.epoch != impl_->epoch || impl_->chunks.size() != 1) {
    cudaGraphExecDestroy(g.exec);
    g.exec = nullptr;
    return absl::FailedPreconditionError("graph is stale: the step arena or buffers moved");
  }
  // The replayed ops' scratch is where it was at capture: later ops allocate after it.
  impl_->chunks.back().used = g.arena_used;
  impl_->Check(cudaGraphLaunch(g.exec, impl_->stream), "graph launch");
  return impl_->error;
}

absl::Status CudaOps::Synchronize() {
  impl_->Check(cudaStreamSynchronize(impl_->stream), "device step");
  absl::Status s = impl_->error;
  return s;
}

absl::Status CudaOps::BeginStep(const StepLayout& L, StepTensors* step) {
  impl_->Join();
  if (impl_->failed()) return impl_->error;
  if (auto s = impl_->ResetArena(); !s.ok()) return s;
  // Pack the arrays, each 256-B aligned, into one host buffer; one copy to the device.
  struct Part {
    const void* data;
    size_t bytes;
    Tensor* dst;
    DType dtype;
    int64_t count;
  };
  const int64_t P = L.prefill.num_seqs > 0 ? L.prefill.num_seqs + 1 : 0;
  std::vector<Part> parts = {
      {L.tokens.data(), L.tokens.size() * 4, &step->tokens, DType::kI32, L.num_tokens},
      {L.positions.data(), L.positions.size() * 4, &step->positions, DType::kI32, L.num_tokens},
      {L.slots.data(), L.slots.size() * 8, &step->slots, DType::kI64, L.num_tokens},
      {L.logits_rows.data(), L.logits_rows.size() * 4, &step->logits_rows, DType::kI32,
       static_cast<int64_t>(L.logits_rows.size())},
      {L.block_tables.data(), L.block_tables.size() * 4, &step->block_tables, DType::kI32,
       static_cast<int64_t>(L.block_tables.size())},
      {L.seq_lens.data(), L.seq_lens.size() * 4, &step->seq_lens, DType::kI32, L.num_seqs},
      {L.context_lens.data(), L.context_lens.size() * 4, &step->context_lens, DType::kI32,
       L.num_seqs},
      {L.prefill.q_begin.data(), L.prefill.q_begin.size() * 4, &step->prefill_q_begin, DType::kI32,
       P},
      {L.prefill.kv_begin.data(), L.prefill.kv_begin.size() * 4, &step->prefill_kv_begin,
       DType::kI32, P},
      {L.attend_lens.data(), L.attend_lens.size() * 4, &step->attend_lens, DType::kI32,
       static_cast<int64_t>(L.attend_lens.size())},
  };
  size_t total = 0;
  for (const Part& p : parts) total += AlignUp(p.bytes);
  if (total > impl_->step_capacity) {
    // Grows to twice the need (the step buffers' address changes only while the batch grows).
    if (impl_->step_capacity > 0) {
      if (auto s = CudaStatus(cudaStreamSynchronize(impl_->stream), "step buffers"); !s.ok())
        return s;
    }
    cudaFree(impl_->step_dev);
    cudaFreeHost(impl_->step_host);
    impl_->step_dev = impl_->step_host = nullptr;
    impl_->step_capacity = 0;
    ++impl_->epoch;
    const size_t cap = std::max<size_t>(2 * total, 1 << 20);
    if (auto s = CudaStatus(cudaMalloc(&impl_->step_dev, cap), "step buffers"); !s.ok()) return s;
    if (auto s = CudaStatus(cudaMallocHost(&impl_->step_host, cap), "step buffers"); !s.ok())
      return s;
    impl_->step_capacity = cap;
  } else {
    // The previous step's upload must have left the staging buffer before it is rewritten.
    if (auto s = CudaStatus(cudaStreamSynchronize(impl_->stream), "step buffers"); !s.ok())
      return s;
  }
  size_t off = 0;
  char* host = static_cast<char*>(impl_->step_host);
  char* dev = static_cast<char*>(impl_->step_dev);
  for (const Part& p : parts) {
    if (p.bytes > 0) std::memcpy(host + off, p.data, p.bytes);
    *p.dst = Tensor(p.dtype, {p.count}, nullptr, dev + off, Device::kCuda);
    off += AlignUp(p.bytes);
  }
  step->layout = &L;
  step->block_tables = step->block_tables.Reshaped({L.num_seqs, L.max_blocks});
  if (off > 0) {
    if (auto s = CudaStatus(cudaMemcpyAsync(dev, host, off, cudaMemcpyHostToDevice, impl_->stream),
                            "step upload");
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

Tensor CudaOps::Activation(std::vector<int64_t> shape, DType dtype) {
  Tensor t(dtype, std::move(shape), nullptr, nullptr, Device::kCuda);
  void* p = impl_->ArenaAlloc(t.nbytes());
  return Tensor(dtype, t.shape(), nullptr, p, Device::kCuda);
}

absl::StatusOr<Tensor> CudaOps::Allocate(DType dtype, std::vector<int64_t> shape) {
  Tensor t(dtype, std::move(shape), nullptr, nullptr, Device::kCuda);
  cudaError_t e;
  auto storage = DeviceStorage(t.nbytes(), &e);
  if (!storage) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("out of GPU memory allocating ", t.nbytes(), " bytes for ", Shape(t)));
  }
  if (auto s = CudaStatus(cudaMemset(storage.get(), 0, t.nbytes()), "cudaMemset"); !s.ok())
    return s;
  impl_->persistent += t.nbytes();
  return Tensor(dtype, t.shape(), storage, storage.get(), Device::kCuda);
}

absl::StatusOr<Tensor> CudaOps::Upload(const Tensor& host) {
  auto dev = Allocate(host.dtype(), host.shape());
  if (!dev.ok()) return dev.status();
  if (auto s = CudaStatus(
          cudaMemcpy(dev->data<void>(), host.data<void>(), host.nbytes(), cudaMemcpyHostToDevice),
          "weight upload");
      !s.ok()) {
    return s;
  }
  return dev;
}

absl::StatusOr<LinearWeight> CudaOps::UploadLinear(const LinearWeight& host) {
  if (host.int4()) {
    return absl::UnimplementedError(
        "a packed INT4 weight outside the routed experts: the CUDA backend has no dense INT4 GEMM "
        "(the loader dequantizes such modules to bf16)");
  }
  if (host.fp8()) {
    // DeepSeek FP8 projections (attention, dense and shared MLPs; routed experts go through
    // UploadExperts and stay FP8) are held in bf16: bf16(fp32(e4m3 * s)), the values DeepSeek's
    // own weight_dequant gives, read by the bf16 GEMM. Measured on the H200 (bench/RESULTS.md,
    // "FP8 projections", fp8_block_bench on DeepSeek-R1's shapes at 8-way TP, 1-2048 rows):
    // cuBLASLt's block-scaled FP8 with activations quantized per 1 x 128 (SM90 only) runs at
    // 0.46-0.98x bf16's speed at 1-512 rows (the dense MLP's gate_up: 1.02-1.09x at 8-64 rows),
    // 0.87-1.20x at 2048; the FP8 expert kernel's weight-only dense mode at 0.13-1.01x (one
    // weight leaves most SMs idle, no split-K), better only for kv_b at 1-8 rows (1.19-1.25x),
    // which runs through Linear in prefill alone. The price is 1 byte a weight more: 2,410 MiB a
    // DeepSeek-R1 rank of 8 (worker/model/memory_plan.cc).
    if (host.fp8_codes.dtype() != DType::kF8E4M3 || host.fp8_scale_inv.dtype() != DType::kF32 ||
        host.fp8_scale_inv.shape().size() != 2) {
      return absl::InvalidArgumentError(
          "an FP8 projection without F8_E4M3 codes and a 2-D F32 scale grid");
    }
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
    std::vector<float> f32(static_cast<size_t>(host.out_features) * host.in_features);
    DequantizeFp8Block(t, 0, host.out_features, 0, host.in_features, f32.data());
    Tensor b = Tensor::Host(DType::kBF16, {host.out_features, host.in_features});
    uint16_t* bits = b.data<uint16_t>();
    for (size_t i = 0; i < f32.size(); ++i) bits[i] = FloatToBf16(f32[i]);
    LinearWeight w = host;
    w.fp8_codes = w.fp8_scale_inv = w.block_scale = Tensor();
    auto dev = Upload(b);
    if (!dev.ok()) return dev.status();
    w.weight = *std::move(dev);
    return w;
  }
  LinearWeight w = host;
  w.block_scale = Tensor();
  if (host.nvfp4()) {
    // e2m1 * e4m3 block scale is exact in bf16 (at most 2 + 4 significant bits);
    // weight_scale_2 multiplies the GEMM's fp32 result.
    Tensor b = Tensor::Host(DType::kBF16, {host.out_features, host.in_features});
    DequantizeNvfp4ToBf16Unscaled(host.weight.data<uint8_t>(), host.block_scale.data<uint8_t>(),
                                  host.out_features, host.in_features, b.data<uint16_t>());
    w.alpha = host.alpha * host.global_scale;
    auto dev = Upload(b);
    if (!dev.ok()) return dev.status();
    w.weight = *dev;
    return w;
  }
  auto dev = Upload(HostBf16(host.weight));
  if (!dev.ok()) return dev.status();
  w.weight = *dev;
  return w;
}

absl::StatusOr<RoutedExperts> CudaOps::UploadExperts(int first_expert, int num_routed_experts,
                                                     const std::vector<ExpertWeights>& host) {
  RoutedExperts r;
  r.first_expert = first_expert;
  r.count = static_cast<int>(host.size());
  if (host.empty()) return r;
  r.hidden = host[0].gate.in_features;
  r.intermediate = host[0].gate.out_features;
  MoeExpertsHostWeights w;
  w.first_expert = first_expert;
  w.num_routed_experts = num_routed_experts;
  w.num_local_experts = r.count;
  w.hidden = r.hidden;
  w.intermediate = r.intermediate;
  w.nvfp4 = host[0].gate.nvfp4();
  w.int4 = host[0].gate.int4();
  w.int4_group_size = host[0].gate.int4_group;
  w.fp8 = host[0].gate.fp8();
  w.fp8_block_rows = host[0].gate.fp8_block_rows;
  w.fp8_block_cols = host[0].gate.fp8_block_cols;
  std::vector<Tensor> keep;  // bf16 copies of fp32/fp16 experts (or of non-bf16 INT4 scales)
  auto proj = [&](const LinearWeight& lw) -> absl::StatusOr<MoeExpertsHostWeights::Projection> {
    MoeExpertsHostWeights::Projection p;
    if (lw.nvfp4() != w.nvfp4 || lw.int4() != w.int4 || lw.fp8() != w.fp8 ||
        (w.int4 && lw.int4_group != w.int4_group_size) ||
        (w.fp8 &&
         (lw.fp8_block_rows != w.fp8_block_rows || lw.fp8_block_cols != w.fp8_block_cols))) {
      return absl::InvalidArgumentError(
          "routed experts mix NVFP4, INT4, FP8 (or INT4 group sizes, FP8 block sizes) and dense "
          "projections in one layer; the GPU grouped GEMM takes one format per layer");
    }
    if (w.fp8) {
      if (lw.fp8_codes.dtype() != DType::kF8E4M3 || lw.fp8_scale_inv.dtype() != DType::kF32 ||
          lw.fp8_codes.shape() != std::vector<int64_t>{lw.out_features, lw.in_features} ||
          lw.fp8_scale_inv.shape().size() != 2 || lw.fp8_origin_row > (1 << 30) ||
          lw.fp8_origin_col > (1 << 30) || lw.fp8_scale_inv.dim(0) > (1 << 30) ||
          lw.fp8_scale_inv.dim(1) > (1 << 30)) {
        return absl::InvalidArgumentError(
            "an FP8 expert projection without F8_E4M3 [out, in] codes and a 2-D F32 scale grid");
      }
      p.fp8_codes = lw.fp8_codes.data<uint8_t>();
      p.fp8_scale_inv = lw.fp8_scale_inv.data<float>();
      p.fp8_origin_row = static_cast<int>(lw.fp8_origin_row);
      p.fp8_origin_col = static_cast<int>(lw.fp8_origin_col);
      p.fp8_grid_rows = static_cast<int>(lw.fp8_scale_inv.dim(0));
      p.fp8_grid_cols = static_cast<int>(lw.fp8_scale_inv.dim(1));
      return p;
    }
    if (w.int4) {
      if (lw.int4_packed.dtype() != DType::kI32 || lw.int4_packed.shape().size() != 2 ||
          lw.int4_scale.shape().size() != 2 || lw.int4_in > (1 << 30) ||
          lw.int4_col0 > lw.int4_in) {
        return absl::InvalidArgumentError(
            "an INT4 expert projection without I32 [rows, words] packed rows and 2-D scales");
      }
      p.int4_packed = lw.int4_packed.data<int32_t>();
      p.int4_src_cols = static_cast<int>(lw.int4_in);
      p.int4_col0 = static_cast<int>(lw.int4_col0);
      if (lw.int4_scale.dtype() == DType::kBF16) {
        p.int4_scale = lw.int4_scale.data<uint16_t>();
        return p;
      }
      // F16 / F32 scales: the kernel multiplies by bf16 scales, so they must be bf16 values.
      Tensor b = HostBf16(lw.int4_scale);
      Tensor f = Tensor::Host(DType::kF32, lw.int4_scale.shape());
      DecodeFloats(lw.int4_scale.dtype(), lw.int4_scale.data<void>(),
                   static_cast<size_t>(lw.int4_scale.numel()), f.data<float>());
      for (int64_t i = 0; i < f.numel(); ++i) {
        if (Bf16ToFloat(b.data<uint16_t>()[i]) != f.data<float>()[i]) {
          return absl::InvalidArgumentError(absl::StrCat(
              "INT4 expert scale ", i, " (", f.data<float>()[i], ", ",
              std::string(DTypeName(lw.int4_scale.dtype())),
              ") is not a bf16 value; the GPU INT4 expert GEMM takes bf16 scales (Kimi's "
              "checkpoints store bf16): convert the checkpoint's weight_scale tensors to bf16"));
        }
      }
      keep.push_back(std::move(b));
      p.int4_scale = keep.back().data<uint16_t>();
      return p;
    }
    if (w.nvfp4) {
      p.packed = lw.weight.data<uint8_t>();
      p.scale = lw.block_scale.data<uint8_t>();
      p.global_scale = lw.global_scale;
    } else {
      keep.push_back(HostBf16(lw.weight));
      p.bf16 = keep.back().data<uint16_t>();
    }
    return p;
  };
  for (const ExpertWeights& e : host) {
    for (auto [dst, src] : {std::pair{&w.gate, &e.gate}, {&w.up, &e.up}, {&w.down, &e.down}}) {
      auto p = proj(*src);
      if (!p.ok()) return p.status();
      dst->push_back(*p);
    }
  }
  auto gpu = MoeExpertsGpu::Upload(w, impl_->stream);
  if (!gpu.ok()) return gpu.status();
  r.bytes = (*gpu)->device_bytes();
  impl_->persistent += r.bytes;
  r.device = std::shared_ptr<MoeExpertsGpu>(std::move(*gpu));
  return r;
}

absl::Status CudaOps::CopyToHost(const Tensor& src, void* dst) {
  impl_->Join();
  if (!impl_->failed()) {
    impl_->Check(
        cudaMemcpyAsync(dst, src.data<void>(), src.nbytes(), cudaMemcpyDeviceToHost, impl_->stream),
        [&] { return absl::StrCat("copy of ", Shape(src), " to the host"); });
  }
  return Synchronize();
}

#define MLASERVE_SKIP_IF_FAILED() \
  if (impl_->failed()) return

void CudaOps::Embed(const Tensor& table, int64_t vocab_begin, const StepTensors& step,
                    Tensor& out) {
  MLASERVE_SKIP_IF_FAILED();
  GatherRowsParams p;
  p.src = table.data<void>();
  p.src_dtype = table.dtype();
  p.src_rows = table.dim(0);
  p.src_stride = table.dim(1);
  p.cols = static_cast<int>(table.dim(1));
  p.ids = step.tokens.data<int32_t>();
  p.count = static_cast<int>(step.tokens.numel());
  p.id_offset = vocab_begin;
  p.out = out.data<void>();
  p.out_dtype = out.dtype();
  p.out_stride = out.dim(1);
  impl_->Check(InvokeGatherRows(p, impl_->stream),
               [&] { return absl::StrCat("Embed ", Shape(table), " -> ", Shape(out)); });
}

void CudaOps::RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& out) {
  MLASERVE_SKIP_IF_FAILED();
  RmsNormParams p;
  p.dim = static_cast<int>(weight.numel());
  p.rows = x.numel() / p.dim;
  p.eps = eps;
  p.x = x.data<void>();
  p.x_dtype = x.dtype();
  p.x_stride = p.dim;
  p.weight = weight.data<float>();
  p.out = out.data<void>();
  p.out_stride = p.dim;
  p.programmatic = impl_->programmatic_small;
  impl_->Check(InvokeRmsNorm(p, impl_->stream), [&] { return absl::StrCat("RmsNorm ", Shape(x)); });
}

void CudaOps::AddRmsNorm(const Tensor& delta, Tensor& residual, const Tensor& weight, float eps,
                         Tensor& out) {
  MLASERVE_SKIP_IF_FAILED();
  AddRmsNormParams p;
  p.dim = static_cast<int>(weight.numel());
  p.rows = residual.numel() / p.dim;
  p.eps = eps;
  p.residual = residual.data<float>();
  p.delta = delta.data<void>();
  p.weight = weight.data<float>();
  p.out = out.data<void>();
  p.programmatic = impl_->programmatic_small;
  impl_->Check(InvokeAddRmsNorm(p, impl_->stream),
               [&] { return absl::StrCat("AddRmsNorm ", Shape(residual)); });
}

namespace {

// The arguments of out = x W^T for a bf16 weight [n, k] held as CudaOps uploads it.
LinearGemm::Args LinearArgs(const Tensor& x, const LinearWeight& w, Tensor& out) {
  LinearGemm::Args a;
  a.k = w.in_features;
  a.n = w.out_features;
  a.m = x.numel() / a.k;
  a.x = x.data<void>();
  a.x_stride = a.k;
  a.w = w.weight.data<void>();
  a.alpha = w.alpha;
  a.out = out.data<void>();
  a.out_dtype = out.dtype();
  a.out_stride = a.n;
  return a;
}

}  // namespace

void CudaOps::Linear(const Tensor& x, const LinearWeight& w, Tensor& out) {
  MLASERVE_SKIP_IF_FAILED();
  impl_->Check(impl_->gemm->Run(LinearArgs(x, w, out), impl_->stream), [&] {
    return absl::StrCat("Linear ", Shape(x), " x ", Shape(w.weight), "^T -> ", Shape(out));
  });
}

namespace {

// A dense bf16 weight [out_features, in_features] as UploadLinear leaves it.
bool DenseBf16(const LinearWeight& w) {
  return !w.nvfp4() && !w.int4() && !w.fp8() && !w.weight.empty() &&
         w.weight.device() == Device::kCuda && w.weight.dtype() == DType::kBF16 &&
         w.weight.numel() == int64_t{w.out_features} * w.in_features;
}

}  // namespace

absl::Status CudaOps::AdjoinLinears(std::initializer_list<LinearWeight*> weights) {
  if (weights.size() < 2) return absl::OkStatus();
  const LinearWeight& first = **weights.begin();
  int64_t rows = 0;
  for (const LinearWeight* w : weights) {
    if (!DenseBf16(*w) || w->in_features != first.in_features) return absl::OkStatus();
    rows += w->out_features;
  }
  auto joined = Allocate(DType::kBF16, {rows, first.in_features});
  if (!joined.ok()) return joined.status();
  int64_t row = 0;
  for (LinearWeight* w : weights) {
    Tensor part = joined->Rows(row, w->out_features);
    if (auto s = CudaStatus(cudaMemcpy(part.data<void>(), w->weight.data<void>(),
                                       w->weight.nbytes(), cudaMemcpyDeviceToDevice),
                            "AdjoinLinears copy");
        !s.ok()) {
      return s;
    }
    row += w->out_features;
  }
  row = 0;
  for (LinearWeight* w : weights) {
    impl_->persistent -= w->weight.nbytes();  // freed with the last reference below
    w->weight = joined->Rows(row, w->out_features);
    row += w->out_features;
  }
  return absl::OkStatus();
}

bool CudaOps::MergedLinears(const Tensor& x, std::initializer_list<LinearOut> outs) {
  const int64_t T = x.dim(0);
  if (impl_->batch_invariant || outs.size() < 2 ||
      outs.size() > static_cast<size_t>(kSplitColumnsMaxSegments) || T <= kSkinnyMaxRows ||
      T > impl_->merged_rows || x.dtype() != DType::kBF16) {
    return false;
  }
  const LinearWeight& first = *outs.begin()->w;
  const char* next = first.weight.data<char>();
  SplitColumnsParams sp;
  int64_t n = 0;
  for (const LinearOut& o : outs) {
    const LinearWeight& w = *o.w;
    const Tensor& out = *o.out;
    if (!DenseBf16(w) || w.in_features != first.in_features || w.weight.data<char>() != next ||
        x.numel() != T * w.in_features || out.numel() != T * w.out_features ||
        (out.dtype() != DType::kBF16 && out.dtype() != DType::kF32)) {
      return false;
    }
    next += w.weight.nbytes();
    SplitColumnsParams::Segment& g = sp.seg[sp.num_segments++];
    g.cols = w.out_features;
    g.out = o.out->data<void>();
    g.dtype = out.dtype();
    g.out_stride = w.out_features;
    g.alpha = w.alpha;
    n += w.out_features;
  }
  LinearWeight merged;
  merged.out_features = static_cast<int>(n);
  merged.in_features = first.in_features;
  merged.weight = Tensor(DType::kBF16, {n, first.in_features}, nullptr,
                         const_cast<void*>(first.weight.data<void>()), Device::kCuda);
  Tensor sums = Activation({T, n}, DType::kF32);
  Linear(x, merged, sums);
  sp.rows = T;
  sp.src = sums.data<float>();
  sp.src_stride = n;
  sp.programmatic = impl_->programmatic_small;
  impl_->Check(InvokeSplitColumns(sp, impl_->stream), [&] {
    return absl::StrCat("SplitColumns of the merged projection ", Shape(x), " x ", n);
  });
  ++impl_->merged_count;
  return true;
}

void CudaOps::Linears(const Tensor& x, std::initializer_list<LinearOut> outs) {
  MLASERVE_SKIP_IF_FAILED();
  if (MergedLinears(x, outs)) return;
  LinearGemm::Args list[kSkinnyMaxSegments];
  if (outs.size() > kSkinnyMaxSegments) {
    for (const LinearOut& o : outs) Linear(x, *o.w, *o.out);
    return;
  }
  int n = 0;
  for (const LinearOut& o : outs) list[n++] = LinearArgs(x, *o.w, *o.out);
  impl_->Check(impl_->gemm->RunShared(list, n, impl_->stream), [&] {
    std::string what = absl::StrCat("Linears ", Shape(x), " x");
    for (const LinearOut& o : outs) absl::StrAppend(&what, " ", Shape(o.w->weight), "^T");
    return what;
  });
}


bool CudaOps::LinearWithPrologue(const Tensor& x, const LinearWeight& w, Tensor& out,
                                 const SkinnyPrologueArgs& prologue, const char* what) {
  absl::StatusOr<bool> ran =
      impl_->gemm->RunWithPrologue(LinearArgs(x, w, out), prologue, impl_->stream);
  if (ran.ok() && !*ran) return false;
  impl_->Check(ran.status(),
               [&] { return absl::StrCat(what, " ", Shape(x), " x ", Shape(w.weight), "^T"); });
  return true;
}

void CudaOps::RmsNormLinear(Tensor& x, const Tensor& norm_weight, float eps,
                            const LinearWeight& w, Tensor& out) {
  MLASERVE_SKIP_IF_FAILED();
  if (impl_->fused_prologues && x.dtype() == DType::kBF16 && norm_weight.dtype() == DType::kF32 &&
      norm_weight.numel() == w.in_features && !w.weight.empty()) {
    SkinnyPrologueArgs pro;
    pro.kind = SkinnyPrologue::kRmsNorm;
    pro.norm_weight = norm_weight.data<float>();
    pro.eps = eps;
    if (LinearWithPrologue(x, w, out, pro, "RmsNormLinear")) return;
  }
  Ops::RmsNormLinear(x, norm_weight, eps, w, out);
}

void CudaOps::SiluMulLinear(Tensor& gate, const Tensor& up, const LinearWeight& w, Tensor& out) {
  MLASERVE_SKIP_IF_FAILED();
  if (impl_->fused_prologues && gate.dtype() == DType::kBF16 && up.dtype() == DType::kBF16 &&
      up.numel() == gate.numel() && !w.weight.empty()) {
    SkinnyPrologueArgs pro;
    pro.kind = SkinnyPrologue::kSiluMul;
    pro.up = up.data<void>();
    pro.up_stride = w.in_features;
    if (LinearWithPrologue(gate, w, out, pro, "SiluMulLinear")) return;
  }
  Ops::SiluMulLinear(gate, up, w, out);
}

void CudaOps::SiluMul(const Tensor& gate, const Tensor& up, Tensor& out) {
  MLASERVE_SKIP_IF_FAILED();
  SiluMulParams p;
  p.rows = gate.dim(0);
  p.cols = static_cast<int>(gate.numel() / p.rows);
  p.gate = gate.data<void>();
  p.up = up.data<void>();
  p.in_stride = p.cols;
  p.out = out.data<void>();
  p.out_stride = p.cols;
  p.programmatic = impl_->programmatic_small;
  impl_->Check(InvokeSiluMul(p, impl_->stream),
               [&] { return absl::StrCat("SiluMul ", Shape(gate)); });
}

void CudaOps::Columns(const Tensor& x, int64_t begin, Tensor& out) {
  MLASERVE_SKIP_IF_FAILED();
  const int64_t rows = x.dim(0);
  if (rows == 0) return;
  const size_t es = DTypeBits(x.dtype()) / 8;
  const int64_t in_cols = x.numel() / rows, n = out.numel() / rows;
  impl_->Check(
      cudaMemcpy2DAsync(out.data<void>(), n * es, x.data<char>() + begin * es, in_cols * es, n * es,
                        rows, cudaMemcpyDeviceToDevice, impl_->stream),
      [&] { return absl::StrCat("Columns ", Shape(x), " from ", begin, " -> ", Shape(out)); });
}

void CudaOps::CopyColumns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                          int64_t cols) {
  MLASERVE_SKIP_IF_FAILED();
  const int64_t rows = src.dim(0);
  if (rows == 0) return;
  const size_t es = DTypeBits(src.dtype()) / 8;
  const int64_t sc = src.numel() / rows, dc = dst.numel() / rows;
  impl_->Check(
      cudaMemcpy2DAsync(dst.data<char>() + dst_col * es, dc * es, src.data<char>() + src_col * es,
                        sc * es, cols * es, rows, cudaMemcpyDeviceToDevice, impl_->stream),
      [&] { return absl::StrCat("CopyColumns ", Shape(src), " -> ", Shape(dst)); });
}

void CudaOps::LogitsRows(const Tensor& x, const StepTensors& step, Tensor& out) {
  MLASERVE_SKIP_IF_FAILED();
  GatherRowsParams p;
  p.src = x.data<void>();
  p.src_dtype = x.dtype();
  p.src_rows = x.dim(0);
  p.cols = static_cast<int>(x.numel() / std::max<int64_t>(x.dim(0), 1));
  p.src_stride = p.cols;
  p.ids = step.logits_rows.data<int32_t>();
  p.count = static_cast<int>(step.logits_rows.numel());
  p.id_offset = 0;
  p.out = out.data<void>();
  p.out_dtype = out.dtype();
  p.out_stride = p.cols;
  impl_->Check(InvokeGatherRows(p, impl_->stream),
               [&] { return absl::StrCat("LogitsRows ", Shape(x)); });
}

void CudaOps::Rope(Tensor& x, int64_t first_col, int per_row, int64_t stride, int dim,
                   const StepTensors& step, const Tensor& inv_freq, float attention_scaling,
                   bool interleaved) {
  MLASERVE_SKIP_IF_FAILED();
  RopeParams p;
  p.x = x.data<void>();
  p.rows = x.dim(0);
  p.row_stride = x.numel() / std::max<int64_t>(p.rows, 1);
  p.first_col = first_col;
  p.per_row = per_row;
  p.vec_stride = stride;
  p.dim = dim;
  p.positions = step.positions.data<int32_t>();
  p.inv_freq = inv_freq.data<float>();
  p.attention_scaling = attention_scaling;
  p.interleaved = interleaved;
  p.programmatic = impl_->programmatic_small;
  impl_->Check(InvokeRope(p, impl_->stream), [&] { return absl::StrCat("Rope ", Shape(x)); });
}

void CudaOps::KvWrite(const Tensor& latent, const Tensor& k_rope, const StepTensors& step,
                      KvCacheLayer& cache) {
  MLASERVE_SKIP_IF_FAILED();
  KvCacheWriteParams p;
  p.format = cache.format;
  p.fp8_scale = cache.fp8_scale;
  p.latent = latent.data<void>();
  p.rope = k_rope.data<void>();
  p.latent_stride = kMlaLatentDim;
  p.rope_stride = kMlaRopeDim;
  p.slots = step.slots.data<int64_t>();
  p.n = static_cast<int>(latent.dim(0));
  p.kv_pool = cache.pool.data<void>();
  impl_->Check(InvokeKvCacheWrite(p, impl_->stream), [&] {
    return absl::StrCat("KvWrite ", std::string(KvCacheFormatName(cache.format)), " ",
                        Shape(latent));
  });
}

void CudaOps::MlaKvPrep(const Tensor& kv, const Tensor& norm_weight, float eps,
                        const StepTensors& step, const Tensor& inv_freq, float attention_scaling,
                        bool interleaved, KvCacheLayer& cache, Tensor& latent, Tensor& k_rope) {
  MLASERVE_SKIP_IF_FAILED();
  if (!FusedMlaInput(kv, norm_weight, eps, step, inv_freq, attention_scaling, interleaved, cache,
                     latent, k_rope, nullptr, 0, 0, 0)) {
    Ops::MlaKvPrep(kv, norm_weight, eps, step, inv_freq, attention_scaling, interleaved, cache,
                   latent, k_rope);
  }
}

void CudaOps::MlaInputPrep(const Tensor& kv, const Tensor& norm_weight, float eps,
                           const StepTensors& step, const Tensor& inv_freq,
                           float attention_scaling, bool interleaved, KvCacheLayer& cache,
                           Tensor& latent, Tensor& k_rope, Tensor& q, int64_t q_first_col,
                           int q_heads, int64_t q_stride, const Tensor& w_kb, Tensor& q_abs) {
  MLASERVE_SKIP_IF_FAILED();
  const int64_t T = kv.dim(0);
  // q's rows: T rows of q_heads vectors of 64 bf16 (RopeKernel's checks, for one rope width).
  const bool q_fits = impl_->mla_q_fusion && q.dtype() == DType::kBF16 && q.dim(0) == T &&
                      T > 0 && q_heads > 0 && q_first_col >= 0 && q_stride >= kMlaRopeDim &&
                      q_first_col + (q_heads - 1) * q_stride + kMlaRopeDim <= q.numel() / T;
  // q's absorption as well (SetMlaAbsorbFusion): decode-only steps of at most
  // kMlaPrepAbsorbMaxRows rows, where it replaces a cuBLASLt launch of ~1 MB a layer; not in the
  // batch-invariant mode, where the absorption's bits must not depend on the batch's size.
  const bool absorb =
      q_fits && impl_->mla_absorb_fusion && !impl_->batch_invariant && !w_kb.empty() &&
      w_kb.dtype() == DType::kBF16 && step.layout->prefill.num_seqs == 0 &&
      T <= kMlaPrepAbsorbMaxRows && q_first_col % 4 == 0 && q_first_col >= 4 &&
      q_first_col <= kMlaPrepAbsorbMaxNope && q_stride == q_first_col + kMlaRopeDim &&
      w_kb.numel() == int64_t{q_heads} * q_first_col * kMlaLatentDim;
  Tensor absorbed;
  if (absorb) absorbed = Activation({T, q_heads, kMlaQkDim});
  MLASERVE_SKIP_IF_FAILED();
  if (q_fits && FusedMlaInput(kv, norm_weight, eps, step, inv_freq, attention_scaling,
                              interleaved, cache, latent, k_rope, &q, q_first_col, q_heads,
                              q_stride, absorb ? &w_kb : nullptr, absorb ? &absorbed : nullptr)) {
    if (absorb) q_abs = absorbed;
    return;
  }
  Ops::MlaInputPrep(kv, norm_weight, eps, step, inv_freq, attention_scaling, interleaved, cache,
                    latent, k_rope, q, q_first_col, q_heads, q_stride, w_kb, q_abs);
}

bool CudaOps::FusedMlaInput(const Tensor& kv, const Tensor& norm_weight, float eps,
                            const StepTensors& step, const Tensor& inv_freq,
                            float attention_scaling, bool interleaved, KvCacheLayer& cache,
                            Tensor& latent, Tensor& k_rope, Tensor* q, int64_t q_first_col,
                            int q_heads, int64_t q_stride, const Tensor* w_kb, Tensor* q_abs) {
  const int64_t T = kv.dim(0);
  const bool fused = impl_->fused_mla_input && T > 0 && kv.dtype() == DType::kBF16 &&
                     kv.numel() == T * (kMlaLatentDim + kMlaRopeDim) &&
                     latent.numel() == T * kMlaLatentDim && k_rope.numel() == T * kMlaRopeDim &&
                     latent.dtype() == DType::kBF16 && k_rope.dtype() == DType::kBF16 &&
                     norm_weight.numel() == kMlaLatentDim && inv_freq.numel() >= kMlaRopeDim / 2 &&
                     cache.format != KvCacheFormat::kF32;
  if (!fused) return false;
  MlaKvPrepParams p;
  p.rows = T;
  p.kv = kv.data<void>();
  p.kv_stride = kMlaLatentDim + kMlaRopeDim;
  p.norm_weight = norm_weight.data<float>();
  p.eps = eps;
  p.positions = step.positions.data<int32_t>();
  p.inv_freq = inv_freq.data<float>();
  p.attention_scaling = attention_scaling;
  p.interleaved = interleaved;
  p.latent_out = latent.data<void>();
  p.rope_out = k_rope.data<void>();
  p.format = cache.format;
  p.fp8_scale = cache.fp8_scale;
  p.slots = step.slots.data<int64_t>();
  p.kv_pool = cache.pool.data<void>();
  if (q != nullptr) {
    p.q = q->data<void>();
    p.q_heads = q_heads;
    p.q_row_stride = q->numel() / T;
    p.q_first_col = q_first_col;
    p.q_vec_stride = q_stride;
    if (w_kb != nullptr) {
      p.w_kb = w_kb->data<void>();
      p.absorb_nope = static_cast<int>(q_first_col);
      p.q_abs = q_abs->data<void>();
    }
  }
  p.programmatic = impl_->programmatic_small;
  impl_->Check(InvokeMlaKvPrep(p, impl_->stream), [&] {
    return absl::StrCat(q != nullptr ? "MlaInputPrep " : "MlaKvPrep ", Shape(kv),
                        w_kb != nullptr ? " (q absorbed) " : " ",
                        std::string(KvCacheFormatName(cache.format)));
  });
  return true;
}

void CudaOps::MlaPrefill(const MlaShape& s, const Tensor& q, const Tensor& latent,
                         const Tensor& k_rope, const LinearWeight& kv_b, const KvCacheLayer& cache,
                         const StepTensors& step, Tensor& out) {
  MLASERVE_SKIP_IF_FAILED();
  const StepLayout::PrefillGroup& P = step.layout->prefill;
  if (P.num_seqs == 0) return;
  const auto what = [&] {
    return absl::StrCat("MlaPrefill ", P.num_seqs, " sequences, ", P.num_rows, " new tokens, ",
                        P.total_kv, " keys, ", s.heads, " heads, ",
                        std::string(KvCacheFormatName(cache.format)));
  };
  const int qk = s.qk_nope + s.qk_rope;
  Tensor keys = Activation({P.total_kv, kMlaLatentDim});
  Tensor keys_rope = Activation({P.total_kv, kMlaRopeDim});
  Tensor kv = Activation({P.total_kv, static_cast<int64_t>(s.heads) * (s.qk_nope + s.v_dim)});
  MLASERVE_SKIP_IF_FAILED();
  MlaPrefillGatherParams g;
  g.format = cache.format;
  g.fp8_scale = cache.fp8_scale;
  g.kv_pool = cache.pool.data<void>();
  g.max_blocks_per_seq = step.layout->max_blocks;
  g.block_table = step.block_tables.data<int32_t>() +
                  static_cast<int64_t>(P.seq_begin) * step.layout->max_blocks;
  g.context_lens = step.context_lens.data<int32_t>() + P.seq_begin;
  g.q_begin = step.prefill_q_begin.data<int32_t>();
  g.kv_begin = step.prefill_kv_begin.data<int32_t>();
  g.new_latent = latent.data<uint16_t>() + static_cast<int64_t>(P.row_begin) * kMlaLatentDim;
  g.latent_stride = kMlaLatentDim;
  g.new_rope = k_rope.data<uint16_t>() + static_cast<int64_t>(P.row_begin) * kMlaRopeDim;
  g.rope_stride = kMlaRopeDim;
  g.num_seqs = P.num_seqs;
  g.total_kv = P.total_kv;
  g.out_latent = keys.data<void>();
  g.out_rope = keys_rope.data<void>();
  impl_->Check(InvokeMlaPrefillGather(g, impl_->stream), [&] { return what() + " (gather)"; });
  Linear(keys, kv_b, kv);
  MLASERVE_SKIP_IF_FAILED();
  MlaPrefillParams a;
  a.num_seqs = P.num_seqs;
  a.heads = s.heads;
  a.qk_nope = s.qk_nope;
  a.qk_rope = s.qk_rope;
  a.v_dim = s.v_dim;
  a.q = q.data<uint16_t>() + static_cast<int64_t>(P.row_begin) * s.heads * qk;
  a.kv = kv.data<void>();
  a.k_rope = keys_rope.data<void>();
  a.q_begin = g.q_begin;
  a.kv_begin = g.kv_begin;
  a.context_lens = g.context_lens;
  a.total_q = P.num_rows;
  a.max_q_len = P.max_q_len;
  a.softmax_scale = s.softmax_scale;
  a.out = out.data<uint16_t>() + static_cast<int64_t>(P.row_begin) * s.heads * s.v_dim;
  impl_->Check(InvokeMlaPrefill(a, impl_->stream), what);
}

// Plans and launches the decode kernel for `c`. Batch-invariant: the fixed-piece schedule, for
// sequences as long as the block tables allow, in slices of sequences whose partials fit
// kPerTokenAttentionWorkspaceBytes (a slice's bits are those of any other grouping: that is what
// invariance means).
template <class What>
void CudaOps::Impl::RunMlaDecode(const MlaDecodeCall& c, const KvCacheLayer& cache,
                                 float softmax_scale, const What& what) {
  const bool invariant = batch_invariant;
  const int max_len = c.max_blocks * kKvBlockTokens;
  int slice = c.num_seqs;
  absl::StatusOr<MlaDecodePlan> plan = PlanMlaDecode(slice, c.s_q, c.heads, cache.format, -1, 0,
                                                     invariant ? max_len : 0, mla_fp8_tensor_cores);
  if (invariant && plan.ok()) {
    auto one = PlanMlaDecode(1, c.s_q, c.heads, cache.format, -1, 0, max_len, mla_fp8_tensor_cores);
    if (!one.ok()) {
      plan = one.status();
    } else {
      slice = static_cast<int>(std::clamp<size_t>(
          kPerTokenAttentionWorkspaceBytes / std::max<size_t>(one->workspace_bytes, 1), 1,
          static_cast<size_t>(c.num_seqs)));
      plan =
          PlanMlaDecode(slice, c.s_q, c.heads, cache.format, -1, 0, max_len, mla_fp8_tensor_cores);
    }
  }
  if (!plan.ok()) {
    Check(plan.status(), what);
    return;
  }
  void* workspace = ArenaAlloc(plan->workspace_bytes);
  if (failed()) return;
  for (int first = 0; first < c.num_seqs; first += slice) {
    const int n = std::min(slice, c.num_seqs - first);
    const int64_t flat0 = static_cast<int64_t>(first) * c.s_q * c.heads;  // first flat q row
    MlaDecodeParams p;
    p.q = c.q_abs + flat0 * kMlaQkDim;
    if (c.q_rope != nullptr) {
      p.q_rope = c.q_rope + flat0 * c.q_rope_stride;
      p.q_rope_stride = c.q_rope_stride;
    }
    p.kv_pool = cache.pool.data<void>();
    p.block_table = c.block_table + static_cast<int64_t>(first) * c.max_blocks;
    p.max_blocks_per_seq = c.max_blocks;
    p.seq_lens = c.seq_lens + first;
    p.batch = n;
    p.s_q = c.s_q;
    p.heads = c.heads;
    p.format = cache.format;
    p.kv_scale = cache.fp8_scale;
    p.softmax_scale = softmax_scale;
    p.out = c.out + flat0 * kMlaLatentDim;
    p.lse = c.lse != nullptr ? c.lse + flat0 : nullptr;
    p.workspace = workspace;
    p.workspace_bytes = plan->workspace_bytes;
    p.invariant_max_seq_len = invariant ? max_len : 0;
    p.programmatic_combine = programmatic_mla_combine;
    p.min_share = mla_min_share;
    Check(InvokeMlaDecode(p, stream), what);
    if (failed()) return;
  }
}

// out[r, h, :v] = latent[r, h, :] W_vb[h]^T for `rows` rows of `heads` heads (W_vb[h] is
// [v, 512]; latent [rows, heads, 512] bf16, out rows of heads * v).
template <class What>
void CudaOps::Impl::ExpandLatent(const MlaShape& s, int64_t rows, const void* latent,
                                 const Tensor& w_vb, uint16_t* out, const What& what) {
  LinearGemm::Args expand;
  expand.m = rows;
  expand.n = s.v_dim;
  expand.k = kMlaLatentDim;
  expand.x = latent;
  expand.x_stride = static_cast<int64_t>(s.heads) * kMlaLatentDim;
  expand.w = w_vb.data<void>();
  expand.out = out;
  expand.out_stride = static_cast<int64_t>(s.heads) * s.v_dim;
  expand.batch = s.heads;
  expand.x_batch_stride = kMlaLatentDim;
  expand.w_batch_stride = static_cast<int64_t>(s.v_dim) * kMlaLatentDim;
  expand.out_batch_stride = s.v_dim;
  Check(gemm->Run(expand, stream), [&] { return Describe(what) + " (v expand)"; });
}

// q_abs[r, h, :512] = q_nope[r, h, :] W_kb[h] for `rows` rows of s.heads heads (W_kb[h] is
// [nope, 512]); q rows of heads * (nope + rope), q_abs rows of abs_stride elements.
template <class What>
void CudaOps::Impl::AbsorbQ(const MlaShape& s, int64_t rows, const uint16_t* q, const Tensor& w_kb,
                            uint16_t* q_abs, int64_t abs_stride, const What& what) {
  const int qk = s.qk_nope + s.qk_rope;
  LinearGemm::Args absorb;
  absorb.m = rows;
  absorb.n = kMlaLatentDim;
  absorb.k = s.qk_nope;
  absorb.x = q;
  absorb.x_stride = static_cast<int64_t>(s.heads) * qk;
  absorb.w = w_kb.data<void>();
  absorb.w_kn = true;
  absorb.out = q_abs;
  absorb.out_stride = abs_stride;
  absorb.batch = s.heads;
  absorb.x_batch_stride = qk;
  absorb.w_batch_stride = static_cast<int64_t>(s.qk_nope) * kMlaLatentDim;
  absorb.out_batch_stride = kMlaQkDim;
  Check(gemm->Run(absorb, stream), [&] { return Describe(what) + " (q absorb)"; });
}

void CudaOps::MlaDecode(const MlaShape& s, const Tensor& q, const Tensor& w_kb, const Tensor& w_vb,
                        const KvCacheLayer& cache, const StepTensors& step, int group,
                        Tensor& out, const Tensor& absorbed) {
  MLASERVE_SKIP_IF_FAILED();
  const StepLayout::DecodeGroup& g = step.layout->decode[group];
  const int H = s.heads, qk = s.qk_nope + s.qk_rope;
  const auto what = [&] {
    return absl::StrCat("MlaDecode ", g.num_seqs, " sequences x ", g.s_q, " tokens, ", H,
                        " heads, ", std::string(KvCacheFormatName(cache.format)));
  };
  if (g.s_q > kMaxDecodeTokens) {
    impl_->Fail(
        absl::InvalidArgumentError(absl::StrCat(what(), ": the GPU decode kernel takes at most ",
                                                kMaxDecodeTokens, " tokens per sequence")));
    return;
  }
  const int rows = g.num_seqs * g.s_q;
  // q absorbed by MlaInputPrep (every row of the step), or here.
  const bool have_abs = !absorbed.empty();
  if (have_abs &&
      (absorbed.dtype() != DType::kBF16 || absorbed.numel() != q.dim(0) * H * kMlaQkDim)) {
    impl_->Fail(absl::InvalidArgumentError(
        absl::StrCat(what(), ": the absorbed q is ", Shape(absorbed), ", not [", q.dim(0), ", ", H,
                     ", ", kMlaQkDim, "] bf16")));
    return;
  }
  Tensor q_abs = have_abs ? absorbed.Rows(g.row_begin, rows) : Activation({rows, H, kMlaQkDim});
  Tensor latent_out = Activation({rows, H, kMlaLatentDim});
  MLASERVE_SKIP_IF_FAILED();
  const uint16_t* q_rows = q.data<uint16_t>() + static_cast<int64_t>(g.row_begin) * H * qk;
  if (!have_abs) {
    impl_->AbsorbQ(s, rows, q_rows, w_kb, q_abs.data<uint16_t>(),
                   static_cast<int64_t>(H) * kMlaQkDim, what);
  }
  // The rope part of q: read by the decode kernel where it is (q_rope), or copied to columns
  // 512..575 of each head of q_abs.
  const uint16_t* q_rope = q_rows + s.qk_nope;
  const bool rope_in_place = impl_->mla_q_fusion && s.qk_rope == kMlaRopeDim &&
                             reinterpret_cast<uintptr_t>(q_rope) % 16 == 0 && qk % 8 == 0;
  if (!rope_in_place) {
    impl_->Check(cudaMemcpy2DAsync(q_abs.data<uint16_t>() + kMlaLatentDim, kMlaQkDim * 2, q_rope,
                                   qk * 2, kMlaRopeDim * 2, static_cast<size_t>(rows) * H,
                                   cudaMemcpyDeviceToDevice, impl_->stream),
                 [&] { return what() + " (q rope copy)"; });
  }
  MlaDecodeCall c;
  c.q_abs = q_abs.data<uint16_t>();
  if (rope_in_place) {
    c.q_rope = q_rope;
    c.q_rope_stride = qk;
  }
  c.block_table = step.block_tables.data<int32_t>() +
                  static_cast<int64_t>(g.seq_begin) * step.layout->max_blocks;
  c.max_blocks = step.layout->max_blocks;
  c.seq_lens = step.seq_lens.data<int32_t>() + g.seq_begin;
  c.num_seqs = g.num_seqs;
  c.s_q = g.s_q;
  c.heads = H;
  c.out = latent_out.data<uint16_t>();
  impl_->RunMlaDecode(c, cache, s.softmax_scale, what);
  MLASERVE_SKIP_IF_FAILED();
  impl_->ExpandLatent(s, rows, latent_out.data<void>(), w_vb,
                      out.data<uint16_t>() + static_cast<int64_t>(g.row_begin) * H * s.v_dim, what);
}

// Decode context parallelism (Ops::MlaAbsorb / MlaAttend / MlaMergeExpand). The tensors that
// travel between the group's ranks are by rank ([ranks, T, slots, ...], all-gathers); the decode
// kernel reads a token's ranks * slots heads together, so MlaAttend moves q into that layout and
// the outputs back (kernels/mla/mla_dcp.h's strided block copy). The partial latents travel in
// bf16 (the activation dtype; MlaDecode's latent output is bf16 as well), lse in fp32.
void CudaOps::MlaAbsorb(const MlaShape& s, const DcpShape& d, const Tensor& q, const Tensor& w_kb,
                        Tensor& q_abs) {
  MLASERVE_SKIP_IF_FAILED();
  const int64_t T = q.dim(0);
  const int qk = s.qk_nope + s.qk_rope;
  const auto what = [&] {
    return absl::StrCat("MlaAbsorb ", T, " tokens, ", s.heads, " heads in ", d.heads_per_rank,
                        " slots");
  };
  if (d.heads_per_rank < s.heads || s.qk_rope != kMlaRopeDim || q.dtype() != DType::kBF16 ||
      q.numel() != T * s.heads * qk || q_abs.dtype() != DType::kBF16 ||
      q_abs.numel() != T * d.heads_per_rank * kMlaQkDim) {
    impl_->Fail(absl::InvalidArgumentError(absl::StrCat(
        what(), ": q must be bf16 [", T, ", ", s.heads * qk, "] (got ", Shape(q), "), q_abs bf16 [",
        T, ", ", d.heads_per_rank, ", ", kMlaQkDim, "] (got ", Shape(q_abs),
        "), the slots at least the heads and the RoPE width ", kMlaRopeDim)));
    return;
  }
  if (T == 0) return;
  const int64_t abs_row = static_cast<int64_t>(d.heads_per_rank) * kMlaQkDim;
  // The slots past this rank's heads travel as zeros.
  if (d.heads_per_rank > s.heads) {
    impl_->Check(cudaMemsetAsync(q_abs.data<void>(), 0, q_abs.nbytes(), impl_->stream),
                 [&] { return what() + " (zero slots)"; });
  }
  impl_->AbsorbQ(s, T, q.data<uint16_t>(), w_kb, q_abs.data<uint16_t>(), abs_row, what);
  // The RoPE dims: q's [T, heads, nope | rope] -> q_abs's columns 512..575 of each head.
  StridedBlockCopy rope;
  rope.src = q.data<uint16_t>() + s.qk_nope;
  rope.dst = q_abs.data<uint16_t>() + kMlaLatentDim;
  rope.outer = T;
  rope.inner = s.heads;
  rope.block_bytes = kMlaRopeDim * 2;
  rope.src_outer = static_cast<int64_t>(s.heads) * qk * 2;
  rope.src_inner = static_cast<int64_t>(qk) * 2;
  rope.dst_outer = abs_row * 2;
  rope.dst_inner = kMlaQkDim * 2;
  impl_->Check(InvokeStridedBlockCopy(rope, impl_->stream), [&] { return what() + " (q rope)"; });
}

void CudaOps::MlaAttend(const MlaShape& s, const DcpShape& d, const Tensor& q_all,
                        const KvCacheLayer& cache, const StepTensors& step, int group,
                        Tensor& latent, Tensor& lse) {
  MLASERVE_SKIP_IF_FAILED();
  const StepLayout& L = *step.layout;
  const StepLayout::DecodeGroup& g = L.decode[group];
  const int64_t T = L.num_tokens;
  const int N = d.ranks, slots = d.heads_per_rank, H = N * slots;
  const auto what = [&] {
    return absl::StrCat("MlaAttend ", g.num_seqs, " tokens, ", N, " ranks x ", slots,
                        " head slots, ", std::string(KvCacheFormatName(cache.format)));
  };
  if (g.s_q != 1 || step.attend_lens.numel() != L.num_seqs || H > 128 ||
      q_all.dtype() != DType::kBF16 || q_all.numel() != N * T * slots * kMlaQkDim ||
      latent.dtype() != DType::kBF16 || latent.numel() != N * T * slots * kMlaLatentDim ||
      lse.dtype() != DType::kF32 || lse.numel() != N * T * slots) {
    impl_->Fail(absl::InvalidArgumentError(absl::StrCat(
        what(),
        ": needs one-token sequences with their keys on this rank (a DCP step layout), at "
        "most 128 heads in all (the decode kernel's limit; got ",
        H, "), q_all bf16 [", N, ", ", T, ", ", slots, ", ", kMlaQkDim, "] (got ", Shape(q_all),
        "), latent bf16 [", N, ", ", T, ", ", slots, ", ", kMlaLatentDim, "] (got ", Shape(latent),
        "), lse f32 [", N, ", ", T, ", ", slots, "] (got ", Shape(lse), ")")));
    return;
  }
  const int64_t n = g.num_seqs, row0 = g.row_begin;  // one row a sequence
  if (n == 0) return;
  Tensor q = Activation({n, H, kMlaQkDim});
  Tensor out = Activation({n, H, kMlaLatentDim});
  Tensor out_lse = Activation({n, H}, DType::kF32);
  MLASERVE_SKIP_IF_FAILED();
  // Rank r's slots of token row0 + i <-> heads r * slots .. of row i: blocks (r, i) of `by_rank`
  // ([N, T, slots] units) and of `by_token` ([n, H] units).
  const auto layout_copy = [&](const void* by_rank, void* by_token, int64_t unit_bytes,
                               bool to_token) {
    const int64_t block = slots * unit_bytes;
    char* rank_base = static_cast<char*>(const_cast<void*>(by_rank)) + row0 * block;
    StridedBlockCopy c;
    c.outer = N;
    c.inner = n;
    c.block_bytes = block;
    const int64_t rank_outer = T * block, rank_inner = block, token_outer = block,
                  token_inner = H * unit_bytes;
    c.src = to_token ? static_cast<const void*>(rank_base) : by_token;
    c.dst = to_token ? by_token : static_cast<void*>(rank_base);
    c.src_outer = to_token ? rank_outer : token_outer;
    c.src_inner = to_token ? rank_inner : token_inner;
    c.dst_outer = to_token ? token_outer : rank_outer;
    c.dst_inner = to_token ? token_inner : rank_inner;
    return c;
  };
  impl_->Check(
      InvokeStridedBlockCopy(layout_copy(q_all.data<void>(), q.data<void>(), kMlaQkDim * 2, true),
                             impl_->stream),
      [&] { return what() + " (q by token)"; });
  MlaDecodeCall c;
  c.q_abs = q.data<uint16_t>();
  c.block_table =
      step.block_tables.data<int32_t>() + static_cast<int64_t>(g.seq_begin) * L.max_blocks;
  c.max_blocks = L.max_blocks;
  c.seq_lens = step.attend_lens.data<int32_t>() + g.seq_begin;  // may be 0: zeros, lse -inf
  c.num_seqs = static_cast<int>(n);
  c.s_q = 1;
  c.heads = H;
  c.out = out.data<uint16_t>();
  c.lse = out_lse.data<float>();
  impl_->RunMlaDecode(c, cache, s.softmax_scale, what);
  MLASERVE_SKIP_IF_FAILED();
  impl_->Check(InvokeStridedBlockCopy(
                   layout_copy(latent.data<void>(), out.data<void>(), kMlaLatentDim * 2, false),
                   impl_->stream),
               [&] { return what() + " (latent by rank)"; });
  impl_->Check(
      InvokeStridedBlockCopy(
          layout_copy(lse.data<void>(), out_lse.data<void>(), sizeof(float), false), impl_->stream),
      [&] { return what() + " (lse by rank)"; });
}

void CudaOps::MlaMergeExpand(const MlaShape& s, const DcpShape& d, const Tensor& latent_all,
                             const Tensor& lse_all, const Tensor& w_vb, Tensor& out) {
  MLASERVE_SKIP_IF_FAILED();
  const int64_t T = out.dim(0);
  const int N = d.ranks, slots = d.heads_per_rank;
  const auto what = [&] {
    return absl::StrCat("MlaMergeExpand ", T, " tokens, ", s.heads, " heads, ", N, " ranks");
  };
  if (d.rank < 0 || d.rank >= N || slots < s.heads || latent_all.dtype() != DType::kBF16 ||
      latent_all.numel() != int64_t{N} * T * slots * kMlaLatentDim ||
      lse_all.dtype() != DType::kF32 || lse_all.numel() != int64_t{N} * T * slots ||
      out.numel() != T * s.heads * s.v_dim) {
    impl_->Fail(absl::InvalidArgumentError(
        absl::StrCat(what(), " (rank ", d.rank, ", ", slots, " slots): latent_all must be bf16 [",
                     N, ", ", T, ", ", slots, ", ", kMlaLatentDim, "] (got ", Shape(latent_all),
                     "), lse_all f32 [", N, ", ", T, ", ", slots, "] (got ", Shape(lse_all),
                     "), out [", T, ", ", s.heads * s.v_dim, "] (got ", Shape(out), ")")));
    return;
  }
  if (T == 0) return;
  Tensor merged = Activation({T, s.heads, kMlaLatentDim});
  MLASERVE_SKIP_IF_FAILED();
  // Source src's partials for this rank's head slots: [src][t][slot].
  MlaDcpMergeParams m;
  m.latent = latent_all.data<void>();
  m.lse = lse_all.data<float>();
  m.src_stride = T * slots;
  m.sources = N;
  m.tokens = static_cast<int>(T);
  m.heads = s.heads;
  m.slots = slots;
  m.out = merged.data<void>();
  impl_->Check(InvokeMlaDcpMerge(m, impl_->stream), what);
  MLASERVE_SKIP_IF_FAILED();
  impl_->ExpandLatent(s, T, merged.data<void>(), w_vb, out.data<uint16_t>(), what);
}

namespace {
MoeRouteParams RouteParams(const MoeRouting& r, const Tensor& logits, const Tensor& bias,
                           Tensor& ids, Tensor& weights, bool programmatic, bool split) {
  MoeRouteParams p;
  p.config = {r.num_experts,          r.top_k,           r.n_group,
              r.topk_group,           r.softmax_scoring, r.norm_topk_prob,
              r.routed_scaling_factor};
  p.tokens = static_cast<int>(logits.dim(0));
  p.logits = logits.data<float>();
  p.bias = bias.empty() ? nullptr : bias.data<float>();
  p.topk_ids = ids.data<int32_t>();
  p.topk_weights = weights.data<float>();
  p.programmatic = programmatic;
  p.split = split;
  return p;
}
}  // namespace

void CudaOps::MoeRoute(const MoeRouting& r, const Tensor& logits, const Tensor& bias, Tensor& ids,
                       Tensor& weights) {
  MLASERVE_SKIP_IF_FAILED();
  const MoeRouteParams p =
      RouteParams(r, logits, bias, ids, weights, impl_->programmatic_small, impl_->moe_route_split);
  impl_->Check(InvokeMoeRoute(p, impl_->stream),
               [&] { return absl::StrCat("MoeRoute ", Shape(logits)); });
}

void CudaOps::MoeRouteExperts(const MoeRouting& r, const Tensor& logits, const Tensor& bias,
                              const Tensor& x, const RoutedExperts& experts, const Tensor& shared,
                              Tensor& ids, Tensor& weights, Tensor& out) {
  // The fused kernel's last block places every assignment alone: measured on the H200 (16
  // layers of Kimi-K2.5's shard, bench/RESULTS.md "Session 16") it wins at one token (1.28 ->
  // 1.26 ms a step) and loses at eight (2.86-2.91 -> 3.11 ms); 2-4 tokens are unmeasured.
  constexpr int64_t kRouteDispatchFusionMaxTokens = 1;
  if (!impl_->moe_route_dispatch_fusion || impl_->phase_timing || !experts.device ||
      x.dim(0) == 0 || x.dim(0) > kRouteDispatchFusionMaxTokens) {
    Ops::MoeRouteExperts(r, logits, bias, x, experts, shared, ids, weights, out);
    return;
  }
  MLASERVE_SKIP_IF_FAILED();
  const MoeRouteParams p =
      RouteParams(r, logits, bias, ids, weights, impl_->programmatic_small, impl_->moe_route_split);
  RunMoeExperts(x, ids, weights, experts, shared, out, &p);
}

void CudaOps::MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                         const RoutedExperts& experts, const Tensor& shared, Tensor& out) {
  RunMoeExperts(x, ids, weights, experts, shared, out, nullptr);
}

void CudaOps::RunMoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                            const RoutedExperts& experts, const Tensor& shared, Tensor& out,
                            const MoeRouteParams* route) {
  MLASERVE_SKIP_IF_FAILED();
  const int tokens = static_cast<int>(x.dim(0)), top_k = static_cast<int>(ids.dim(1));
  const auto what = [&] {
    return absl::StrCat("MoeExperts ", Shape(x), ", ", experts.count, " local experts from ",
                        experts.first_expert);
  };
  // The shared expert may come from a side branch (the model's Mlp): the experts wait for it
  // just before they read `shared` (MoeExpertsRunParams::shared_ready), everything else here
  // first thing.
  const bool pass_join = impl_->join_pending && tokens > 0 && experts.device;
  if (!pass_join) impl_->Join();
  if (tokens == 0) return;
  if (!experts.device) {
    // No local experts on this rank: the shared experts' output (or zeros) is its share.
    if (shared.empty()) {
      impl_->Check(cudaMemsetAsync(out.data<void>(), 0, out.nbytes(), impl_->stream), what);
    } else {
      impl_->Check(cudaMemcpyAsync(out.data<void>(), shared.data<void>(), out.nbytes(),
                                   cudaMemcpyDeviceToDevice, impl_->stream),
                   what);
    }
    return;
  }
  const auto& gpu = *static_cast<const MoeExpertsGpu*>(experts.device.get());
  MoeExpertsRunParams p;
  p.tokens = tokens;
  p.top_k = top_k;
  p.x = x.data<void>();
  p.topk_ids = ids.data<int32_t>();
  p.topk_weights = weights.data<float>();
  p.shared_out = shared.empty() ? nullptr : shared.data<void>();
  p.out = out.data<void>();
  p.decode_kernel = impl_->moe_few_expert && !impl_->batch_invariant ? MoeDecodeKernel::kAuto
                                                                       : MoeDecodeKernel::kTile;
  p.prefill_wgmma = impl_->moe_prefill_wgmma && !impl_->batch_invariant;
  p.few_expert_layer = impl_->moe_few_expert_layer;
  p.wave_tail = impl_->moe_wave_tail ? -1 : 0;  // -1: only under kAuto (never invariant)
  p.programmatic_dispatch = impl_->programmatic_dispatch;
  if (pass_join) p.shared_ready = impl_->join_event;
  p.route = route;
  p.route_counter = impl_->route_counter;
  p.workspace_bytes = gpu.WorkspaceBytes(tokens, top_k);
  p.workspace = impl_->ArenaAlloc(p.workspace_bytes);
  if (!impl_->failed()) impl_->Check(InvokeMoeExperts(gpu, p, impl_->stream), what);
  // Joined by the experts' wait, unless they failed before enqueuing it: then here, so that no
  // side-branch work of a failed step outlives it (its scratch is reused by the next step).
  if (impl_->failed()) {
    impl_->Join();
  } else {
    impl_->join_pending = false;
  }
}

absl::Status CudaOps::Sample(const Tensor& logits, const SamplingBatch& batch,
                             std::vector<SampledOutput>* out) {
  impl_->Join();
  out->clear();
  if (impl_->failed()) return impl_->error;
  const int R = static_cast<int>(batch.rows.size());
  const int vocab = static_cast<int>(logits.dim(1));
  if (R == 0) return Synchronize();
  // Host side: each row's parameters, its history's distinct tokens with their output counts
  // (penalties) and the ids masked while min_tokens is not reached.
  std::vector<SamplingRow> rows(R);
  std::vector<SamplingPenaltyEntry> penalties;
  std::vector<int32_t> masks;
  bool any_sampled = false;
  for (int r = 0; r < R; ++r) {
    const SamplingBatch::Row& b = batch.rows[r];
    const SequenceSampling& s = *b.params;
    SamplingRow& row = rows[r];
    row.temperature = s.base.temperature;
    row.top_k = s.base.top_k;
    row.top_p = s.base.top_p;
    row.min_p = s.base.min_p;
    row.seed = s.base.seed;
    row.step = static_cast<uint64_t>(b.generated);
    row.repetition_penalty = s.repetition_penalty;
    row.presence_penalty = s.presence_penalty;
    row.frequency_penalty = s.frequency_penalty;
    row.top_logprobs = std::min(s.top_logprobs, kMaxTopLogprobs);
    row.want_logprob = s.want_logprobs ? 1 : 0;
    any_sampled = any_sampled || row.temperature > 0.0f;
    row.penalty_begin = static_cast<int32_t>(penalties.size());
    if (s.repetition_penalty != 1.0f || s.presence_penalty != 0.0f || s.frequency_penalty != 0.0f) {
      std::unordered_map<int32_t, int32_t> counts;  // token -> occurrences in the output
      std::vector<int32_t> order;
      const std::vector<int32_t>& h = *b.history;
      const size_t prompt = std::min<size_t>(b.prompt_len, h.size());
      for (size_t i = 0; i < h.size(); ++i) {
        if (h[i] < 0 || h[i] >= vocab) continue;
        auto [it, fresh] = counts.try_emplace(h[i], 0);
        if (fresh) order.push_back(h[i]);
        if (i >= prompt) ++it->second;
      }
      for (int32_t t : order) penalties.push_back({t, counts[t]});
    }
    row.penalty_count = static_cast<int32_t>(penalties.size()) - row.penalty_begin;
    row.mask_begin = static_cast<int32_t>(masks.size());
    if (b.generated < s.min_tokens) {
      for (int32_t t : s.eos_ids) masks.push_back(t);
      for (int32_t t : s.stop_ids) masks.push_back(t);
    }
    row.mask_count = static_cast<int32_t>(masks.size()) - row.mask_begin;
  }
  const size_t in_bytes = AlignUp(rows.size() * sizeof(SamplingRow)) +
                          AlignUp(penalties.size() * sizeof(SamplingPenaltyEntry)) +
                          AlignUp(masks.size() * 4);
  const size_t out_bytes = AlignUp(R * 4) + AlignUp(R * 4) + 2 * AlignUp(R * kMaxTopLogprobs * 4);
  if (in_bytes + out_bytes > impl_->sample_capacity) {
    cudaFreeHost(impl_->sample_host);
    impl_->sample_host = nullptr;
    impl_->sample_capacity = 0;
    const size_t cap = 2 * (in_bytes + out_bytes);
    if (auto s = CudaStatus(cudaMallocHost(&impl_->sample_host, cap), "sampling staging");
        !s.ok()) {
      return s;
    }
    impl_->sample_capacity = cap;
  }
  char* host = static_cast<char*>(impl_->sample_host);
  char* dev = static_cast<char*>(impl_->ArenaAlloc(in_bytes + out_bytes));
  const size_t ws_bytes = SamplingWorkspaceBytes(R, vocab);
  void* ws = impl_->ArenaAlloc(ws_bytes);
  if (impl_->failed()) return impl_->error;
  size_t off = 0;
  auto stage = [&](const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(host + off, src, bytes);
    void* d = dev + off;
    off += AlignUp(bytes);
    return d;
  };
  SamplingParams p;
  p.rows = R;
  p.vocab = vocab;
  p.logits = logits.data<float>();
  p.logits_stride = vocab;
  p.row_params =
      static_cast<const SamplingRow*>(stage(rows.data(), rows.size() * sizeof(SamplingRow)));
  p.penalties = static_cast<const SamplingPenaltyEntry*>(
      stage(penalties.data(), penalties.size() * sizeof(SamplingPenaltyEntry)));
  p.masks = static_cast<const int32_t*>(stage(masks.data(), masks.size() * 4));
  p.any_sampled = any_sampled;
  const size_t out_off = off;
  p.tokens = reinterpret_cast<int32_t*>(dev + off);
  off += AlignUp(R * 4);
  p.logprobs = reinterpret_cast<float*>(dev + off);
  off += AlignUp(R * 4);
  p.top_ids = reinterpret_cast<int32_t*>(dev + off);
  off += AlignUp(R * kMaxTopLogprobs * 4);
  p.top_logprobs = reinterpret_cast<float*>(dev + off);
  off += AlignUp(R * kMaxTopLogprobs * 4);
  p.workspace = ws;
  p.workspace_bytes = ws_bytes;
  const auto what = [&] { return absl::StrCat("Sample ", R, " rows of ", vocab); };
  impl_->Check(cudaMemcpyAsync(dev, host, out_off, cudaMemcpyHostToDevice, impl_->stream), what);
  if (!impl_->failed()) impl_->Check(InvokeSampling(p, impl_->stream), what);
  if (!impl_->failed()) {
    impl_->Check(cudaMemcpyAsync(host + out_off, dev + out_off, off - out_off,
                                 cudaMemcpyDeviceToHost, impl_->stream),
                 what);
  }
  if (auto s = Synchronize(); !s.ok()) return s;
  const int32_t* tokens = reinterpret_cast<const int32_t*>(host + out_off);
  const float* logprobs = reinterpret_cast<const float*>(host + out_off + AlignUp(R * 4));
  const int32_t* top_ids = reinterpret_cast<const int32_t*>(host + out_off + 2 * AlignUp(R * 4));
  const float* top_lp = reinterpret_cast<const float*>(host + out_off + 2 * AlignUp(R * 4) +
                                                       AlignUp(R * kMaxTopLogprobs * 4));
  for (int r = 0; r < R; ++r) {
    SampledOutput o;
    o.token = tokens[r];
    o.logprob = logprobs[r];
    for (int j = 0; j < rows[r].top_logprobs; ++j) {
      o.top.emplace_back(top_ids[r * kMaxTopLogprobs + j], top_lp[r * kMaxTopLogprobs + j]);
    }
    out->push_back(std::move(o));
  }
  return absl::OkStatus();
}

#undef MLASERVE_SKIP_IF_FAILED

}  // namespace mlaserve
