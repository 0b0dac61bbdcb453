// The MLA input of one decode or prefill step, fused (the model's Ops::MlaKvPrep on the GPU): from
// kv_a's output row [latent 512 | k_rope 64] (bf16), the RMS-normalized latent
// (kv_a_layernorm), the rotated k_rope (transformers' DeepSeek RoPE, the arithmetic of
// kernels/rope), and the row's paged-cache write in the layer's format (kv_cache_write.cuh) -- one
// kernel where the unfused sequence is two column copies, RmsNorm, Rope and the cache write; and,
// with q set, the RoPE of q's heads in the same launch (separate blocks).
//
// Results against that sequence: k_rope and the cache's rope bytes are the same operations
// (bit-identical); the latent's sum of squares adds in another order (16 terms a lane, then a
// warp butterfly), so a latent element can differ by one bf16 rounding step, and its fp8 code by
// one e4m3 step.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/mla/kv_cache_format.h"

namespace mlaserve {

struct MlaKvPrepParams {
  int64_t rows = 0;
  const void* kv = nullptr;           // bf16 [rows, kv_stride]: latent then rope (kv_a's output)
  int64_t kv_stride = 0;              // elements, >= 576, a multiple of 8
  const float* norm_weight = nullptr;  // [512]
  float eps = 1e-6f;
  const int32_t* positions = nullptr;  // [rows]
  const float* inv_freq = nullptr;     // [32]
  float attention_scaling = 1.0f;
  bool interleaved = false;            // rope pairs (2i, 2i + 1) rather than (i, i + 32)
  void* latent_out = nullptr;          // bf16 [rows, 512]
  void* rope_out = nullptr;            // bf16 [rows, 64], rotated
  // The cache write: row r to slot slots[r] of kv_pool (skipped where slots[r] < 0).
  KvCacheFormat format = KvCacheFormat::kBf16;  // bf16, fp8 or fp8_tiled
  float fp8_scale = 1.0f;
  const int64_t* slots = nullptr;
  void* kv_pool = nullptr;
  // q's RoPE as well (Ops::MlaInputPrep), where q is set: q_heads vectors of 64 bf16 a row, vector
  // j of row r at q + r * q_row_stride + q_first_col + j * q_vec_stride, rotated in place with
  // the same positions by RopeKernel's operations (bit for bit; kernels/rope/rope.h). Vectors
  // must not overlap (q_vec_stride >= 64, row extent <= q_row_stride).
  void* q = nullptr;
  int q_heads = 0;
  int64_t q_row_stride = 0, q_first_col = 0, q_vec_stride = 0;
  // And q's absorption into the latent space (the absorbed MLA decode's first product), where
  // w_kb is set: for rows r < rows (at most kMlaPrepAbsorbMaxRows) and heads j < q_heads,
  //   q_abs[(r * q_heads + j) * 576 + n] = bf16(sum over k < absorb_nope of
  //       q[r * q_row_stride + j * q_vec_stride + k] * w_kb[(j * absorb_nope + k) * 512 + n])
  // for n < 512, products and sums in fp32 (the k order: k = kg, kg + 8, ... per k group kg,
  // then the two groups of a warp, then the four warps in order), one rounding; dims 512..575 of
  // q_abs are left alone (the decode kernel reads q's rotated RoPE dims where they are,
  // MlaDecodeParams::q_rope). q's nope dims (the absorb_nope values before q_first_col in each
  // vector's head) are read, never written, by these blocks, so they run beside the RoPE blocks.
  // Needs q set, q_first_col == absorb_nope, absorb_nope a multiple of 4 in [4,
  // kMlaPrepAbsorbMaxNope], w_kb and q_abs 4-byte aligned. Meant to replace the cuBLASLt launch
  // that absorbs q at batch 1-4 (~3.5 us of a ~75 us layer); its first two forms were slower
  // than that launch (bench/RESULTS.md, session 13), this third one takes the 16-layer Kimi
  // shard's batch-1 step from 1.27 to 1.22 ms (session 19; on in the model by default,
  // CudaOps::SetMlaAbsorbFusion).
  const void* w_kb = nullptr;  // bf16 [q_heads, absorb_nope, 512]
  int absorb_nope = 0;
  void* q_abs = nullptr;       // bf16 [rows, q_heads, 576]
  // Launch programmatically dependent on the stream's previous kernel
  // (kernels/programmatic_launch.cuh): the kernel waits for it before reading anything.
  bool programmatic = false;
};

// Limits of the absorption blocks (MlaKvPrepParams::w_kb): decode steps of a few rows, where
// the absorption's 1 MB (8 heads) of W_kb is the work; larger batches take a tensor-core GEMM.
constexpr int kMlaPrepAbsorbMaxRows = 4;
constexpr int kMlaPrepAbsorbMaxNope = 128;  // DeepSeek-V2/V3, Kimi-K2: 128

// rows = 0 is a no-op. Asynchronous; no allocation (graph-capturable).
absl::Status InvokeMlaKvPrep(const MlaKvPrepParams& p, cudaStream_t stream);

}  // namespace mlaserve
