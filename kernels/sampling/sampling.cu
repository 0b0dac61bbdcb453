// GPU sampler (sampling.h). Three launches per step:
//   1. SamplingPrepareKernel, one block per row: log-softmax normaliser and top-n of the original
//      logits; the penalised, masked logits as 64-bit sort keys; greedy rows' argmax; the race
//      (sampling_race.h) over the whole vocabulary of sampled rows without a filter.
//   2. cub::DeviceSegmentedRadixSort over the keys of sampled rows with a filter (top-k, top-p,
//      min-p); every other row is an empty segment. Skipped when no row samples.
//   3. SamplingDrawKernel, one block per filtered sampled row: SampleRef's softmax / min-p /
//      top-p deciding the kept prefix of the sorted candidates, then the race over that prefix.
// Exactness: every fp32 and double operation that decides the kept set is the CPU's operation,
// in the CPU's order, with explicit round-to-nearest intrinsics (no FMA contraction, no
// fast-math): the penalties (sampler.cc) in fp32, logit / temperature in fp32, the softmax in
// double with its sums accumulated serially in candidate order (one thread, over chunks the
// block computes in parallel), as SampleRef does. The race scores are computed per candidate in
// parallel and reduced by a block max with the CPU's total order (score, then lower id), so the
// reduction order cannot matter. The one difference is the device's double exp() and log(),
// within 1 ulp of glibc's but not always identical: a probability may move by ~1e-16 relative
// (the kept set changes only if a cumulative sum lands within that of top_p or a min_p
// threshold), and a score by ~1e-15 (the pick changes only if the two best scores are that close;
// see SamplingRaceScore).
#include <cfloat>
#include <cstdint>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "absl/strings/str_cat.h"
#include "kernels/sampling/sampling.h"
#include "kernels/sampling/sampling_race.h"

namespace mlaserve {
namespace {

constexpr int kPrepareThreads = 1024;
constexpr int kDrawThreads = 512;
constexpr int kDrawChunk = 2048;  // doubles staged in shared memory per serial step (16 KiB)

size_t AlignUp(size_t x) { return (x + 255) / 256 * 256; }

// Bits that hold a token id in the sort key: vocab <= 2^IdBits(vocab).
int IdBits(int vocab) {
  int b = 1;
  while ((int64_t{1} << b) < vocab) ++b;
  return b;
}

// Sort key: (fp32 order of the logit) << id_bits | (id_mask - id). Larger key = larger logit,
// ties = lower id: exactly the CPU's candidate order (stable sort by `a > b`, where -0.0 == +0.0;
// hence -0.0 is folded onto +0.0). A total order, so the sort's stability does not matter.
__device__ __forceinline__ uint32_t OrderedBits(float f) {
  uint32_t b = __float_as_uint(f);
  if (b == 0x80000000u) b = 0;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float FromOrderedBits(uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
__device__ __forceinline__ uint64_t MakeKey(float v, int id, int id_bits) {
  const uint64_t id_mask = (uint64_t{1} << id_bits) - 1;
  return (uint64_t{OrderedBits(v)} << id_bits) | (id_mask - static_cast<uint64_t>(id));
}
__device__ __forceinline__ int KeyId(uint64_t key, int id_bits) {
  const uint64_t id_mask = (uint64_t{1} << id_bits) - 1;
  return static_cast<int>(id_mask - (key & id_mask));
}
__device__ __forceinline__ float KeyValue(uint64_t key, int id_bits) {
  return FromOrderedBits(static_cast<uint32_t>(key >> id_bits));
}

struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};
struct MinOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a < b ? a : b;
  }
};
struct SumOp {
  __device__ double operator()(double a, double b) const { return __dadd_rn(a, b); }
};

// Reduction over the block, result in every thread. `scratch`: 32 elements of shared memory.
// Ends with a barrier, so scratch can be reused by the next call.
template <typename T, typename Op>
__device__ T BlockReduce(T v, Op op, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < warps; ++w) v = op(v, scratch[w]);
  __syncthreads();
  return v;
}

// The best candidate of a race so far; {-inf, INT32_MAX} is "none", as in SampleRef.
struct RaceBest {
  double score;
  int32_t id;
};

__device__ __forceinline__ void RaceOffer(RaceBest* best, double score, int32_t id) {
  if (SamplingRaceBeats(score, id, best->score, best->id)) {
    best->score = score;
    best->id = id;
  }
}

// Block maximum under SamplingRaceBeats, result in every thread. NaN scores never enter a
// RaceBest, and on the rest the order is total, so the tree finds SampleRef's serial winner.
// `scratch`: 32 elements of shared memory. Ends with a barrier, as BlockReduce.
__device__ RaceBest BlockRaceMax(RaceBest v, RaceBest* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const double score = __shfl_xor_sync(0xffffffffu, v.score, o);
    const int32_t id = __shfl_xor_sync(0xffffffffu, v.id, o);
    RaceOffer(&v, score, id);
  }
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < warps; ++w) RaceOffer(&v, scratch[w].score, scratch[w].id);
  __syncthreads();
  return v;
}

struct PrepareArgs {
  SamplingParams p;
  int id_bits;
  uint64_t* keys;  // [rows, vocab]
  int* seg_begin;  // [rows]
  int* seg_end;    // [rows]
  float* log_z;    // [rows]
};

__global__ void __launch_bounds__(kPrepareThreads) SamplingPrepareKernel(PrepareArgs a) {
  __shared__ uint64_t s_u64[32];
  __shared__ float s_f32[32];
  __shared__ double s_f64[32];
  __shared__ RaceBest s_race[32];
  const SamplingParams& p = a.p;
  const int row = blockIdx.x;
  const int vocab = p.vocab;
  const SamplingRow rp = p.row_params[row];
  const float* x = p.logits + static_cast<int64_t>(row) * p.logits_stride;
  uint64_t* keys = a.keys + static_cast<int64_t>(row) * vocab;

  // log_z = max + log(sum exp(l - max)): (l - max) in fp32 then exp in double, as sampler.cc.
  // Only rows that report a logprob need it: a vocabulary of double exp() on one block took 29 us
  // of a batch-1 decode step (H200, Kimi-K2.5's 163,840 ids).
  const int n_top = min(max(rp.top_logprobs, 0), min(kMaxTopLogprobs, vocab));
  const bool want_logprob = rp.want_logprob != 0;
  float log_z = 0.0f;
  if (want_logprob || n_top > 0) {
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, x[i]);
    mx = BlockReduce(mx, MaxOp(), s_f32);
    double sum = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      sum = __dadd_rn(sum, exp(static_cast<double>(__fsub_rn(x[i], mx))));
    }
    sum = BlockReduce(sum, SumOp(), s_f64);
    log_z = __fadd_rn(mx, static_cast<float>(log(sum)));
  }
  if (threadIdx.x == 0) a.log_z[row] = log_z;

  // Top-n of the original logits, best first (ties: lower id): n rounds of a block max over the
  // keys below the previous winner.
  uint64_t prev = ~uint64_t{0};
  for (int r = 0; r < kMaxTopLogprobs; ++r) {
    int id = -1;
    if (r < n_top) {
      uint64_t best = 0;
      for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const uint64_t k = MakeKey(x[i], i, a.id_bits);
        if (k < prev && k > best) best = k;
      }
      best = BlockReduce(best, MaxOp(), s_u64);
      prev = best;
      id = KeyId(best, a.id_bits);
    }
    if (threadIdx.x == 0) {
      const int64_t o = static_cast<int64_t>(row) * kMaxTopLogprobs + r;
      if (p.top_ids != nullptr) p.top_ids[o] = id;
      if (p.top_logprobs != nullptr) p.top_logprobs[o] = id >= 0 ? __fsub_rn(x[id], log_z) : 0.0f;
    }
  }

  // The working logits as keys: copy, penalties (each entry's token is one thread's), masks.
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) keys[i] = MakeKey(x[i], i, a.id_bits);
  __syncthreads();
  const bool rep = rp.repetition_penalty != 1.0f;
  const bool pres = rp.presence_penalty != 0.0f || rp.frequency_penalty != 0.0f;
  if ((rep || pres) && p.penalties != nullptr) {
    for (int j = threadIdx.x; j < rp.penalty_count; j += blockDim.x) {
      const SamplingPenaltyEntry e = p.penalties[rp.penalty_begin + j];
      if (e.token < 0 || e.token >= vocab) continue;
      float w = x[e.token];
      if (rep) {
        w = w > 0 ? __fdiv_rn(w, rp.repetition_penalty) : __fmul_rn(w, rp.repetition_penalty);
      }
      if (pres && e.output_count > 0) {
        // sampler.cc: work[t] -= presence + frequency * n (float * int in fp32, then the sum).
        w = __fsub_rn(
            w, __fadd_rn(rp.presence_penalty,
                         __fmul_rn(rp.frequency_penalty, static_cast<float>(e.output_count))));
      }
      keys[e.token] = MakeKey(w, e.token, a.id_bits);
    }
  }
  __syncthreads();
  if (p.masks != nullptr) {
    for (int j = threadIdx.x; j < rp.mask_count; j += blockDim.x) {
      const int t = p.masks[rp.mask_begin + j];
      if (t >= 0 && t < vocab) keys[t] = MakeKey(-INFINITY, t, a.id_bits);
    }
  }
  __syncthreads();

  const bool sampled = rp.temperature > 0.0f;
  const bool filtered = sampled && SamplingRowFiltered(rp.top_k, rp.top_p, rp.min_p, vocab);
  if (threadIdx.x == 0) {
    const int begin = row * vocab;
    a.seg_begin[row] = begin;
    a.seg_end[row] = filtered ? begin + vocab : begin;  // only filtered rows need the sort
  }
  if (sampled && !filtered) {
    // The race over every id (SampleRef's unfiltered candidates), on the working logits.
    const uint64_t step_key = SamplingStepKey(rp.seed, rp.step);
    RaceBest best{-INFINITY, INT32_MAX};
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      const float scaled = __fdiv_rn(KeyValue(keys[i], a.id_bits), rp.temperature);
      RaceOffer(&best, SamplingRaceScore(scaled, step_key, i), i);
    }
    best = BlockRaceMax(best, s_race);
    if (threadIdx.x == 0) {
      const int token = best.id != INT32_MAX ? best.id : 0;  // 0: every logit NaN
      p.tokens[row] = token;
      if (p.logprobs != nullptr) p.logprobs[row] = want_logprob ? __fsub_rn(x[token], log_z) : 0.0f;
    }
  }
  if (!sampled) {
    // Greedy: the largest key is the first maximum of the working logits.
    uint64_t best = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) best = max(best, keys[i]);
    best = BlockReduce(best, MaxOp(), s_u64);
    if (threadIdx.x == 0) {
      const int token = KeyId(best, a.id_bits);
      p.tokens[row] = token;
      if (p.logprobs != nullptr) p.logprobs[row] = want_logprob ? __fsub_rn(x[token], log_z) : 0.0f;
    }
  }
}

struct DrawArgs {
  SamplingParams p;
  int id_bits;
  const uint64_t* sorted;  // [rows, vocab] keys, descending per filtered sampled row
  const float* log_z;      // [rows]
};

// exp(l_i / T - mx) of candidate i, as SampleRef: l_i / T in fp32, the rest in double.
__device__ __forceinline__ double Weight(const uint64_t* sorted, int i, int id_bits, float t,
                                         double mx) {
  return exp(__dsub_rn(static_cast<double>(__fdiv_rn(KeyValue(sorted[i], id_bits), t)), mx));
}

// SampleRef's serial loops over candidates 0..keep-1 accumulating `cum += probs[i]` (probs[i] =
// w_i / sum when `normalise`, else w_i), stopping after the first i where cum >= bound. Returns
// the number consumed (i + 1 at the stop, else keep); *cum_out gets cum. The block stages each
// chunk's probabilities in shared memory; thread 0 adds them in order.
__device__ int SerialScan(const uint64_t* sorted, int keep, int id_bits, float t, double mx,
                          double sum, bool normalise, double bound, double* buf, double* cum_out) {
  __shared__ double s_cum;
  __shared__ int s_count;
  __shared__ int s_stop;
  if (threadIdx.x == 0) {
    s_cum = 0.0;
    s_count = keep;
    s_stop = 0;
  }
  __syncthreads();
  for (int base = 0; base < keep; base += kDrawChunk) {
    const int n = min(kDrawChunk, keep - base);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      const double w = Weight(sorted, base + j, id_bits, t, mx);
      buf[j] = normalise ? __ddiv_rn(w, sum) : w;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double cum = s_cum;
      for (int j = 0; j < n; ++j) {
        cum = __dadd_rn(cum, buf[j]);
        if (cum >= bound) {
          s_count = base + j + 1;
          s_stop = 1;
          break;
        }
      }
      s_cum = cum;
    }
    __syncthreads();
    if (s_stop) break;
  }
  const int count = s_count;
  *cum_out = s_cum;
  __syncthreads();
  return count;
}

__global__ void __launch_bounds__(kDrawThreads) SamplingDrawKernel(DrawArgs a) {
  __shared__ double buf[kDrawChunk];
  __shared__ int s_i32[32];
  __shared__ RaceBest s_race[32];
  const SamplingParams& p = a.p;
  const int row = blockIdx.x;
  const SamplingRow rp = p.row_params[row];
  const int vocab = p.vocab;
  // Greedy and unfiltered rows: written by the prepare kernel (their segments were not sorted).
  if (!(rp.temperature > 0.0f) || !SamplingRowFiltered(rp.top_k, rp.top_p, rp.min_p, vocab)) {
    return;
  }
  const uint64_t* sorted = a.sorted + static_cast<int64_t>(row) * vocab;
  const float t = rp.temperature;
  int keep = vocab;
  if (rp.top_k > 0) keep = min(keep, rp.top_k);

  if (rp.min_p > 0.0f || rp.top_p < 1.0f) {
    const double mx = static_cast<double>(__fdiv_rn(KeyValue(sorted[0], a.id_bits), t));
    double sum = 0.0;
    SerialScan(sorted, keep, a.id_bits, t, mx, 0.0, false, INFINITY, buf, &sum);
    if (rp.min_p > 0.0f) {
      // First candidate with probs[k] < min_p * probs[0] (SampleRef's while loop), found in
      // parallel: the comparison of each candidate is independent.
      const double threshold = __dmul_rn(static_cast<double>(rp.min_p),
                                         __ddiv_rn(Weight(sorted, 0, a.id_bits, t, mx), sum));
      int first = keep;
      for (int i = threadIdx.x; i < keep; i += blockDim.x) {
        if (!(__ddiv_rn(Weight(sorted, i, a.id_bits, t, mx), sum) >= threshold)) {
          first = i;
          break;  // later i of this thread are larger
        }
      }
      first = BlockReduce(first, MinOp(), s_i32);
      keep = max(1, first);
    }
    if (rp.top_p < 1.0f) {
      double unused = 0.0;
      const int k = SerialScan(sorted, keep, a.id_bits, t, mx, sum, true,
                               static_cast<double>(rp.top_p), buf, &unused);
      keep = max(1, k);
    }
  }

  // The race over the kept prefix: candidate order does not matter, only (score, id).
  const uint64_t step_key = SamplingStepKey(rp.seed, rp.step);
  RaceBest best{-INFINITY, INT32_MAX};
  for (int i = threadIdx.x; i < keep; i += blockDim.x) {
    const int id = KeyId(sorted[i], a.id_bits);
    RaceOffer(&best, SamplingRaceScore(__fdiv_rn(KeyValue(sorted[i], a.id_bits), t), step_key, id),
              id);
  }
  best = BlockRaceMax(best, s_race);
  if (threadIdx.x == 0) {
    // No winner only if every kept logit is NaN: the first kept id, as SampleRef.
    const int token = best.id != INT32_MAX ? best.id : KeyId(sorted[0], a.id_bits);
    p.tokens[row] = token;
    if (p.logprobs != nullptr) {
      const float* x = p.logits + static_cast<int64_t>(row) * p.logits_stride;
      p.logprobs[row] =
          p.row_params[row].want_logprob != 0 ? __fsub_rn(x[token], a.log_z[row]) : 0.0f;
    }
  }
}

struct Layout {
  size_t keys_a = 0, keys_b = 0, seg_begin = 0, seg_end = 0, log_z = 0, temp = 0;
  size_t temp_bytes = 0, total = 0;
};

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("sampling: ", what, ": ", cudaGetErrorString(err)));
}

absl::Status CheckShape(int rows, int vocab) {
  if (rows < 1 || vocab < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling: rows and vocab must be positive, got rows=", rows, " vocab=", vocab));
  }
  if (IdBits(vocab) > kSamplingMaxVocabLog2) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: vocab ", vocab, " exceeds 2^", kSamplingMaxVocabLog2));
  }
  if (int64_t{rows} * vocab > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling: rows * vocab = ", int64_t{rows} * vocab, " exceeds the sort's 2^31 - 1 items"));
  }
  return absl::OkStatus();
}

absl::Status MakeLayout(int rows, int vocab, Layout* l) {
  if (absl::Status s = CheckShape(rows, vocab); !s.ok()) return s;
  const size_t n = static_cast<size_t>(rows) * vocab;
  cub::DoubleBuffer<uint64_t> keys(nullptr, nullptr);
  int* offsets = nullptr;  // the same instantiation as InvokeSampling's sort
  if (absl::Status s = CudaStatus(cub::DeviceSegmentedRadixSort::SortKeysDescending(
                                      nullptr, l->temp_bytes, keys, static_cast<int>(n), rows,
                                      offsets, offsets, 0, 32 + IdBits(vocab)),
                                  "sort workspace query");
      !s.ok()) {
    return s;
  }
  size_t off = 0;
  l->keys_a = off;
  off += AlignUp(n * sizeof(uint64_t));
  l->keys_b = off;
  off += AlignUp(n * sizeof(uint64_t));
  l->seg_begin = off;
  off += AlignUp(rows * sizeof(int));
  l->seg_end = off;
  off += AlignUp(rows * sizeof(int));
  l->log_z = off;
  off += AlignUp(rows * sizeof(float));
  l->temp = off;
  off += AlignUp(l->temp_bytes);
  l->total = off;
  return absl::OkStatus();
}

}  // namespace

size_t SamplingWorkspaceBytes(int rows, int vocab) {
  Layout l;
  if (!MakeLayout(rows, vocab, &l).ok()) return 0;
  return l.total;
}

absl::Status InvokeSampling(const SamplingParams& p, cudaStream_t stream) {
  Layout l;
  if (absl::Status s = MakeLayout(p.rows, p.vocab, &l); !s.ok()) return s;
  if (p.logits == nullptr || p.row_params == nullptr || p.tokens == nullptr ||
      p.workspace == nullptr) {
    return absl::InvalidArgumentError(
        "sampling: logits, row_params, tokens and workspace are required");
  }
  if (p.logits_stride < p.vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: logits_stride ", p.logits_stride, " < vocab ", p.vocab));
  }
  if (p.workspace_bytes < l.total || reinterpret_cast<uintptr_t>(p.workspace) % 256 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling: workspace needs ", l.total, " bytes, 256-B aligned; got ", p.workspace_bytes,
        " bytes at ", reinterpret_cast<uintptr_t>(p.workspace) % 256, " mod 256"));
  }
  char* ws = static_cast<char*>(p.workspace);
  PrepareArgs pa;
  pa.p = p;
  pa.id_bits = IdBits(p.vocab);
  pa.keys = reinterpret_cast<uint64_t*>(ws + l.keys_a);
  pa.seg_begin = reinterpret_cast<int*>(ws + l.seg_begin);
  pa.seg_end = reinterpret_cast<int*>(ws + l.seg_end);
  pa.log_z = reinterpret_cast<float*>(ws + l.log_z);
  SamplingPrepareKernel<<<p.rows, kPrepareThreads, 0, stream>>>(pa);
  if (absl::Status s = CudaStatus(cudaGetLastError(), "prepare kernel launch"); !s.ok()) return s;
  if (!p.any_sampled) return absl::OkStatus();

  cub::DoubleBuffer<uint64_t> keys(pa.keys, reinterpret_cast<uint64_t*>(ws + l.keys_b));
  size_t temp_bytes = l.temp_bytes;
  if (absl::Status s = CudaStatus(cub::DeviceSegmentedRadixSort::SortKeysDescending(
                                      ws + l.temp, temp_bytes, keys, p.rows * p.vocab, p.rows,
                                      pa.seg_begin, pa.seg_end, 0, 32 + pa.id_bits, stream),
                                  "segmented radix sort");
      !s.ok()) {
    return s;
  }
  DrawArgs da;
  da.p = p;
  da.id_bits = pa.id_bits;
  da.sorted = keys.Current();
  da.log_z = pa.log_z;
  SamplingDrawKernel<<<p.rows, kDrawThreads, 0, stream>>>(da);
  return CudaStatus(cudaGetLastError(), "draw kernel launch");
}

}  // namespace mlaserve
