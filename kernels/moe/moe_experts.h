// One GPU entry point for a layer's routed experts, whatever the checkpoint stores: BF16 experts
// (bf16_moe_gemm.h), NVFP4 experts (nvfp4_moe.h), compressed-tensors INT4 experts (int4_moe.h,
// held as 4 bits + a bf16 scale per 32 weights) or DeepSeek FP8 block-128 experts (fp8_moe.h,
// held as 1 byte + an fp32 scale per 8 x 64 weights), at any hidden / intermediate size (padded
// at load to the kernels' multiples of 128 with zero weights). The same function as MoeExpertsRef
// (moe_ref.h), with the rounding of a BF16 PyTorch MoE: x bf16, fp32 accumulation,
// h = silu(gate x) * (up x) rounded to bf16, down(h) in fp32 times the routing weight, the experts
// summed in fp32 in slot order (+ shared_out), the output rounded to bf16 once.
//
// This header is included by C++20 host code: no cuda_bf16.h, bf16 tensors are void pointers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/moe/moe_few_expert.h"
#include "kernels/moe/moe_router.h"

namespace mlaserve {

// One layer's local routed experts as the checkpoint stores them (host memory, read once at
// load). Expert-parallel ranks hold experts [first_expert, first_expert + num_local_experts);
// tensor-parallel ranks hold a slice of every expert's intermediate dimension (a smaller
// `intermediate`).
struct MoeExpertsHostWeights {
  int first_expert = 0, num_local_experts = 0, hidden = 0, intermediate = 0;
  // Routed experts of the whole model (all ranks), for the tile-size heuristic only (expected
  // rows per expert = tokens * top_k / num_routed_experts); 0: num_local_experts.
  int num_routed_experts = 0;
  bool nvfp4 = false;
  // compressed-tensors INT4 pack-quantized (kernels/linear/int4_group_ref.h), symmetric, one bf16
  // scale per int4_group_size columns (a multiple of 32).
  bool int4 = false;
  int int4_group_size = 32;
  // DeepSeek FP8 block (kernels/linear/fp8_block_ref.h): e4m3 codes, one fp32 weight_scale_inv per
  // fp8_block_rows x fp8_block_cols block (multiples of 8 x 64; DeepSeek's 128 x 128).
  bool fp8 = false;
  int fp8_block_rows = 128, fp8_block_cols = 128;
  struct Projection {                 // one expert's gate, up or down
    const uint16_t* bf16 = nullptr;   // bf16 bits [rows, cols] (bf16 checkpoints)
    const uint8_t* packed = nullptr;  // NVFP4: [rows, cols/2], low nibble first
    const uint8_t* scale = nullptr;   // NVFP4: e4m3 [rows, cols/16]
    float global_scale = 1.0f;        // NVFP4 weight_scale_2
    // INT4: the projection's rows of the checkpoint tensor, whole ([rows, ceil(int4_src_cols / 8)]
    // words, bf16 scales [rows, ceil(int4_src_cols / int4_group_size)]); the projection is
    // columns [int4_col0, int4_col0 + cols) of them (int4_col0 > 0: a tensor-parallel slice of
    // down_proj; a multiple of 32).
    const int32_t* int4_packed = nullptr;
    const uint16_t* int4_scale = nullptr;
    int int4_src_cols = 0;
    int int4_col0 = 0;
    // FP8: the projection's own e4m3 codes [rows, cols], the window of the checkpoint tensor at
    // (fp8_origin_row, fp8_origin_col) (> 0: a tensor-parallel shard; multiples of 8 and 64),
    // and the tensor's whole scale grid [fp8_grid_rows, fp8_grid_cols].
    const uint8_t* fp8_codes = nullptr;
    const float* fp8_scale_inv = nullptr;
    int fp8_origin_row = 0, fp8_origin_col = 0;
    int fp8_grid_rows = 0, fp8_grid_cols = 0;
  };
  // Per local expert: gate [intermediate, hidden], up [intermediate, hidden],
  // down [hidden, intermediate]. NVFP4 needs hidden and intermediate multiples of 16.
  std::vector<Projection> gate, up, down;
};

struct MoeExpertsRunParams;

// The same experts on the device in the kernels' layouts (padded to multiples of 128), owning
// its memory.
class MoeExpertsGpu {
 public:
  // Synchronous with respect to the host buffers on return (the stream is synchronized).
  static absl::StatusOr<std::unique_ptr<MoeExpertsGpu>> Upload(const MoeExpertsHostWeights& w,
                                                               cudaStream_t stream);
  ~MoeExpertsGpu();  // frees device memory
  MoeExpertsGpu(const MoeExpertsGpu&) = delete;
  MoeExpertsGpu& operator=(const MoeExpertsGpu&) = delete;

  // Bytes of the expert weights on the device (codes, scales, global scales).
  size_t device_bytes() const { return device_bytes_; }
  int first_expert() const { return first_expert_; }
  int num_local_experts() const { return num_local_experts_; }
  int hidden() const { return hidden_; }
  int intermediate() const { return intermediate_; }
  bool nvfp4() const { return nvfp4_; }
  bool int4() const { return int4_; }
  bool fp8() const { return fp8_; }
  int padded_hidden() const { return padded_hidden_; }
  int padded_intermediate() const { return padded_intermediate_; }
  int num_routed_experts() const { return num_routed_experts_; }
  // Bytes of workspace for a call with `tokens` tokens of top_k assignments (0 with no local
  // experts).
  size_t WorkspaceBytes(int tokens, int top_k) const;

 private:
  friend absl::Status InvokeMoeExperts(const MoeExpertsGpu&, const MoeExpertsRunParams&,
                                       cudaStream_t);
  MoeExpertsGpu() = default;
  // cudaMalloc, freed with the object; counted in device_bytes().
  void* Alloc(size_t bytes, cudaError_t* err);

  int first_expert_ = 0, num_local_experts_ = 0, hidden_ = 0, intermediate_ = 0;
  int num_routed_experts_ = 0;
  int padded_hidden_ = 0, padded_intermediate_ = 0;
  bool nvfp4_ = false;
  bool int4_ = false;
  bool fp8_ = false;
  size_t device_bytes_ = 0;
  std::vector<void*> allocations_;
  // BF16: gate_up [E][2Ip, Hp] and down [E][Hp, Ip] in the layout of bf16_moe_gemm.h.
  void* bf16_gate_up_ = nullptr;
  void* bf16_down_ = nullptr;
  // NVFP4: the arrays of Nvfp4MoeWeights (nvfp4_moe.h); INT4 / FP8: the codes and scales arrays
  // of Int4MoeWeights (int4_moe.h) / Fp8MoeWeights (fp8_moe.h), no global scales.
  uint8_t* gate_up_codes_ = nullptr;
  uint8_t* gate_up_scales_ = nullptr;
  float* gate_up_global_scale_ = nullptr;
  uint8_t* down_codes_ = nullptr;
  uint8_t* down_scales_ = nullptr;
  float* down_global_scale_ = nullptr;
  // The fused few-expert layer's two counters (MoeExpertsRunParams::few_expert_layer), 0 between
  // calls.
  int* layer_counters_ = nullptr;
};

struct MoeExpertsRunParams {
  int tokens = 0, top_k = 0;            // tokens <= 65535
  const void* x = nullptr;              // bf16 [tokens, hidden] contiguous (device)
  const int32_t* topk_ids = nullptr;    // [tokens, top_k] global expert ids (device)
  const float* topk_weights = nullptr;  // [tokens, top_k] (device)
  const void* shared_out = nullptr;     // bf16 [tokens, hidden] added to the result, or nullptr
  // When set, the stream waits for this event before shared_out is read (just before the
  // combine, or first thing where shared_out is padded or copied): the shared expert may run on
  // another stream beside the dispatch and the routed GEMMs.
  cudaEvent_t shared_ready = nullptr;
  // bf16 [tokens, hidden]: sum over local experts of weight * down(silu(gate x) * up x)
  // (+ shared_out). Must not alias x or shared_out.
  void* out = nullptr;
  void* workspace = nullptr;  // WorkspaceBytes(tokens, top_k), 256-byte aligned
  size_t workspace_bytes = 0;
  // The decode GEMMs' kernel for the NVFP4, INT4 and FP8 formats (moe_few_expert.h): kAuto picks
  // the few-expert kernel where few experts are active; kTile keeps every batch on the tile
  // kernel, whose K order does not depend on the batch (the deterministic mode needs that).
  MoeDecodeKernel decode_kernel = MoeDecodeKernel::kAuto;
  // Where kAuto leaves a decode step on the tile kernel: the tiles of its last wave, when that
  // wave would be less than half full, on the few-expert kernel (Nvfp4MoeGemmParams::wave_tail).
  // -1: with the device's wave, under kAuto only; 0: never; N > 0: with N tiles a wave under any
  // decode_kernel but kFewExpert (tests).
  int wave_tail = -1;
  // NVFP4 and INT4 prefill tiles (128 tokens) on the SM90 warpgroup-MMA kernel where the device has it;
  // false keeps them on the mma.sync kernel, bit-identical to the decode tiles (the deterministic
  // mode needs that).
  bool prefill_wgmma = true;
  // With the few-expert kernel chosen (decode_kernel) and 1-4 tokens: the NVFP4, INT4 and FP8
  // layers as one fused launch (moe_few_expert_layer.h; the same bits) where it applies. Off by
  // default until measured on a GPU. Calls on one MoeExpertsGpu with it on must not overlap in
  // time (they share its counters): one stream per layer's experts, as the worker runs them.
  bool few_expert_layer = false;
  // Small decode batches' dispatch launched programmatically dependent on the router, as the
  // GEMMs and the combine after it are (Nvfp4MoeParams::programmatic_dispatch); false: plainly.
  bool programmatic_dispatch = true;
  // When set, the call routes first: the router's outputs must be topk_ids and topk_weights
  // above, and it runs fused with the dispatch where InvokeMoeRouteDispatch can (route_counter:
  // its device counter, 0 between calls), else as the router's launch before the dispatch's.
  const MoeRouteParams* route = nullptr;
  int* route_counter = nullptr;
};

// No host syncs, no allocations (graph-capturable). tokens == 0 is a no-op; a rank with no local
// experts writes shared_out (or zeros). Assignments to experts of other ranks are ignored.
absl::Status InvokeMoeExperts(const MoeExpertsGpu& experts, const MoeExpertsRunParams& p,
                              cudaStream_t stream);

}  // namespace mlaserve
