// The prefill (128-token tile) weight-only grouped GEMM of the routed experts on SM90a warpgroup
// MMA (wgmma), for the 4-bit formats (NVFP4, INT4: FourBitLanes). Same function, inputs, tiles and
// epilogues as WeightOnlyMoeGemmKernel (moe_weight_only_gemm.cuh), which stays the path on every
// other architecture, for decode tiles, and in the batch-invariant mode (the two paths add a row's
// products in different orders).
//
// Why: the mma.sync kernel reaches ~300 GEMM TFLOP/s at 8k-32k tokens (bench/RESULTS.md, issue 4),
// 0.70-0.89x a cuBLAS BF16 grouped peer. Its 8 warps each read all 128 activation rows of a stage
// through ldmatrix (128 KB of shared-memory reads per 16 KB stage) and issue 16 mma.sync per
// 16-column block. Here:
//
// * Orientation as the mma.sync kernel: out^T = W x^T, so weight rows are wgmma's M and the tile's
//   tokens its N. A warpgroup owns kMT blocks of 64 weight rows; warp w of it rows 16w .. 16w + 15
//   of each, which is exactly one 16-row tile of the NVFP4 layout (nvfp4_moe_layout.h). wgmma
//   takes a 16-bit A from registers in mma.m16n8k16's A layout, one 16-row slice per warp (PTX
//   ISA, wgmma register fragments; the MLA decode wgmma kernel feeds P the same way, and moe_gpu_test
//   checks this kernel against the CPU), and Format::Fragment produces exactly that layout from
//   the code and scale vectors: the weights are dequantized in registers as before and never
//   staged as bf16 in shared memory.
// * B (the tile's activation rows, [128 tokens][64 k] bf16 per stage) is read by the tensor cores
//   straight from shared memory: the rows are 128 B with 16-B chunks XOR-swizzled by (row & 7),
//   which is the canonical K-major 128-byte-swizzle layout (kernels/wgmma_ptx.cuh) once each
//   stage's activation block is 1024-B aligned. k16 step j of a stage is the descriptor's start
//   address + 32 j bytes.
// * Pipeline: kStages ring of (activations, codes, scales) stages filled by cp.async
//   kStages - 2 ahead; each warpgroup keeps up to kMT wgmma groups (one per m-block) in flight,
//   also across the block barrier; an m-block's fragments are rewritten only once its previous
//   group has completed (wgmma.wait_group), and a stage is refilled only after the groups that
//   read it (two iterations back) have completed. cp.async writes are made visible to the async
//   proxy (fence.proxy.async) before the barrier.
// * Tiles with at most 64 rows (an expert's last tile) run m64n64 instead of m64n128.
//
// Registers: kMT x kN / 2 fp32 accumulators plus the A fragments of the groups in flight.
// Shared memory: kStages x (16 KB activations + codes + scales), 98 KB at the default one m-block
// (two blocks an SM on an H100 / H200).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/moe/moe_tile_expert.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/warp_ptx.cuh"
#include "kernels/wgmma_ptx.cuh"

namespace mlaserve::moe_gemm {

// Tuning knobs (bench/moe/build_variants.sh builds moe_bench with others).
#ifndef MLASERVE_MOE_WGMMA_STAGES
#define MLASERVE_MOE_WGMMA_STAGES 5
#endif
#ifndef MLASERVE_MOE_WGMMA_MBLOCKS
#define MLASERVE_MOE_WGMMA_MBLOCKS 1
#endif

template <int kMT_>
struct WgmmaTileConfig {
  static constexpr int kMT = kMT_;          // 64-row m-blocks per warpgroup
  static constexpr int kThreads = 256;      // two warpgroups
  static constexpr int kBM = 2 * 64 * kMT;  // weight rows per block
  static constexpr int kBN = 128;           // tokens per tile (kMoeTileTokensLarge)
  static constexpr int kBK = 64;            // one layout chunk (16 x 64) per stage
  static constexpr int kStages = MLASERVE_MOE_WGMMA_STAGES;
  static constexpr int kTiles16 = kBM / 16;          // 16-row layout tiles
  static constexpr int kXBytes = kBN * kBK * 2;      // 16 KB, 128-B rows
  static constexpr int kCodeBytes = kTiles16 * 512;  // 4-bit layouts' chunk bytes
  static constexpr int kScaleBytes = kTiles16 * 64;
  static constexpr int kStageBytes = (kXBytes + kCodeBytes + kScaleBytes + 1023) / 1024 * 1024;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + base alignment slack
  static constexpr int kXIters = kBN * 8 / kThreads;               // 16-B activation copies
  static constexpr int kCodeIters = kCodeBytes / 16 / kThreads;
  static constexpr int kScaleCopies = kScaleBytes / 16;
  static_assert(kXIters * kThreads == kBN * 8, "activation copies");
  static_assert(kCodeIters >= 1 && kCodeIters * kThreads * 16 == kCodeBytes, "code copies");
  static_assert(kScaleCopies <= kThreads, "scale copies");
  static_assert(kSmemBytes <= 227 * 1024, "H100/H200: 227 KB per block");
};

// The m-blocks per warpgroup of the launched instantiations: one, so 128 weight rows a block,
// 124-126 registers and two blocks per SM (one block's barrier waits, epilogue and pipeline fill
// overlap the other's MMAs). Measured on the H200 against two m-blocks (256 rows, 216 registers,
// one block per SM, which halves the L2 reads of the activation stages): layer time 1.08-1.13x
// faster at 8k and 32k tokens for Kimi-K2.5 EP8 and DeepSeek all-256 (bench/RESULTS.md, "NVFP4
// MoE prefill on warpgroup MMA"); 7 stages instead of 5 gained nothing.
inline constexpr int kWgmmaPrefillMBlocks = MLASERVE_MOE_WGMMA_MBLOCKS;

// Mainloop and epilogue for kN (128 or 64) token columns; the kernel below picks kN per tile.
template <class Format, bool kGateUp, int kMT, int kN>
__device__ __forceinline__ void WgmmaTileBody(const typename Format::Params& p, uint8_t* smem,
                                              uint32_t smem_addr, int e, int row_begin,
                                              int row_end) {
  using Cfg = WgmmaTileConfig<kMT>;
  static_assert(Format::kChunkCodeBytes == 512 && Format::kChunkScaleBytes == 64,
                "the 4-bit layouts' 16 x 64 chunks (FourBitLanes)");
  constexpr int kStages = Cfg::kStages;
  constexpr int kAcc = kN / 2;  // fp32 accumulators per thread per m-block
  const int tid = threadIdx.x, lane = tid & 31;
  // Warpgroup index broadcast from lane 0: warp-uniform for the compiler (uniform registers).
  const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int wq = (tid >> 5) & 3;  // warp in warpgroup
  const int g = lane >> 2, t4 = lane & 3;
  const int k_chunks = p.k / 64;
  const int t16_block = blockIdx.x * Cfg::kTiles16;  // first 16-row layout tile of the block

  const size_t expert_code_bytes = static_cast<size_t>(p.n) * p.k / 2;
  const uint8_t* codes_g =
      p.w_codes + e * expert_code_bytes + static_cast<size_t>(t16_block) * k_chunks * 512;
  const uint8_t* scales_g =
      p.w_scales + e * (expert_code_bytes / 8) + static_cast<size_t>(t16_block) * k_chunks * 64;

  // Each thread copies 16-B chunk x_chunk of rows tid / 8 + 32 i; rows past the tile are not
  // loaded (their columns of the product are never stored).
  const int x_chunk = tid & 7;
  const __nv_bfloat16* x_src[Cfg::kXIters];
#pragma unroll
  for (int i = 0; i < Cfg::kXIters; ++i) {
    const int r = row_begin + (tid >> 3) + 32 * i;
    x_src[i] = nullptr;
    if (r < row_end) {
      const int src_row = kGateUp ? __ldg(p.sorted_assignment + r) / p.top_k : r;
      x_src[i] = p.a + static_cast<size_t>(src_row) * p.k + x_chunk * 8;
    }
  }

  auto load_stage = [&](int stage, int kt) {
    uint8_t* s_x = smem + stage * Cfg::kStageBytes;
    uint8_t* s_codes = s_x + Cfg::kXBytes;
    uint8_t* s_scales = s_codes + Cfg::kCodeBytes;
#pragma unroll
    for (int i = 0; i < Cfg::kXIters; ++i) {
      const int row = (tid >> 3) + 32 * i;
      if (x_src[i] != nullptr) {
        ptx::CpAsync16(s_x + row * 128 + ((x_chunk ^ (row & 7)) << 4), x_src[i] + kt * 64, true);
      }
    }
    // Codes: tile t16's chunk kt is 512 contiguous bytes (32 copies of 16 B).
#pragma unroll
    for (int i = 0; i < Cfg::kCodeIters; ++i) {
      const int c = tid + i * Cfg::kThreads;
      const int t16 = c >> 5, within = c & 31;
      ptx::CpAsync16(s_codes + c * 16,
                     codes_g + (static_cast<size_t>(t16) * k_chunks + kt) * 512 + within * 16,
                     true);
    }
    if (tid < Cfg::kScaleCopies) {
      const int t16 = tid >> 2, within = tid & 3;
      ptx::CpAsync16(s_scales + tid * 16,
                     scales_g + (static_cast<size_t>(t16) * k_chunks + kt) * 64 + within * 16,
                     true);
    }
  };

  // Written first by the k-step-0 wgmma with scale-d = 0 (no zeroing by ordinary instructions:
  // ptxas then serializes the wgmma pipeline, warning C7515).
  float acc[kMT][kAcc];

#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < k_chunks) load_stage(s, s);
    ptx::CpAsyncCommit();
  }
  // Activation descriptor of stage 0 (K-major, 128-B swizzle; SBO = 1024 B between 8-row groups);
  // stage s and k16 step j add (s * kStageBytes + 32 j) >> 4 to the low half.
  const wgmma::Desc dx = wgmma::Desc128B(smem_addr, 16, 1024);

  // The A fragments of each m-block's group in flight. PTX leaves it undefined to write registers
  // that a pending wgmma reads as A, and the compiler sees them dead after the wgmma statement:
  // they are kept in one array across iterations, overwritten only after wgmma.wait_group has
  // retired the group that read them, and "used" right after that wait (UseRegs) so that nothing
  // else is allocated to them while the group is in flight. (Without this the m64n128 down GEMM
  // read overwritten fragments on the H200: wrong rows, some inf.)
  uint32_t a[kMT][4][4];

  for (int kt = 0; kt < k_chunks; ++kt) {
    ptx::CpAsyncWait<kStages - 3>();  // this thread's copies of stage kt
    wgmma::FenceProxyAsyncShared();   // ... visible to the tensor cores' reads
    wgmma::Wait<kMT>();               // this warpgroup's groups of iteration kt - 2 are done
    __syncthreads();                  // everyone's copies of kt; nobody still reads kt - 2
    {
      const int next = kt + kStages - 2;
      if (next < k_chunks) load_stage(next % kStages, next);
      ptx::CpAsyncCommit();
    }
    const int stage = kt % kStages;
    const uint8_t* s_codes = smem + stage * Cfg::kStageBytes + Cfg::kXBytes;
    const uint8_t* s_scales = s_codes + Cfg::kCodeBytes;
    const uint32_t x_lo = dx.lo + ((stage * Cfg::kStageBytes) >> 4);
#pragma unroll
    for (int mb = 0; mb < kMT; ++mb) {
      const int t16 = (wgi * kMT + mb) * 4 + wq;
      const typename Format::Codes cw = Format::LoadCodes(s_codes + t16 * 512, lane);
      const typename Format::Scales sw = Format::LoadScales(s_scales + t16 * 64, g);
      // Pending now at most: m-block mb's group of iteration kt - 1 and the kMT - 1 groups
      // issued after it; waiting down to kMT - 1 retires it.
      wgmma::Wait<kMT - 1>();
      wgmma::UseRegs(a[mb]);
#pragma unroll
      for (int j = 0; j < 4; ++j) Format::Fragment(cw, sw, j, a[mb][j]);
      wgmma::Fence();
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int accumulate = kt > 0 || j > 0;
        if constexpr (kN == 128) {
          wgmma::WgmmaM64N128K16RS<false>(acc[mb], a[mb][j], x_lo + 2 * j, dx.hi, accumulate);
        } else {
          wgmma::WgmmaM64N64K16RS<false>(acc[mb], a[mb][j], x_lo + 2 * j, dx.hi, accumulate);
        }
      }
      wgmma::Commit();
    }
  }
  wgmma::Wait<0>();
#pragma unroll
  for (int mb = 0; mb < kMT; ++mb) {
    wgmma::FenceRegs(acc[mb]);
    wgmma::UseRegs(a[mb]);
  }
  ptx::CpAsyncWait<0>();

  // Epilogue. acc[mb][4 nt + q]: weight row 16 wq + g (+ 8 for q >= 2) of m-block mb, token
  // column 8 nt + 2 t4 + (q & 1) of the tile (the mma.sync kernel's c0..c3 per 8 columns).
  if constexpr (kGateUp) {
    const float alpha_gate = Format::GateAlpha(p, e);
    const float alpha_up = Format::UpAlpha(p, e);
    const int inter = p.n / 2;
#pragma unroll
    for (int mb = 0; mb < kMT; ++mb) {
      const int feature = (t16_block + (wgi * kMT + mb) * 4 + wq) * 8 + g;
#pragma unroll
      for (int nt = 0; nt < kN / 8; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = row_begin + nt * 8 + 2 * t4 + half;
          if (r < row_end) {
            const float gate = acc[mb][4 * nt + half] * alpha_gate;
            const float up = acc[mb][4 * nt + 2 + half] * alpha_up;
            const float hval = gate / (1.0f + __expf(-gate)) * up;
            p.h[static_cast<size_t>(r) * inter + feature] = __float2bfloat16_rn(hval);
          }
        }
      }
    }
  } else {
    const float alpha = Format::DownAlpha(p, e);
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = row_begin + nt * 8 + 2 * t4 + half;
        if (r < row_end) {
          const float w = __ldg(p.topk_weights + __ldg(p.sorted_assignment + r)) * alpha;
          float* yrow = p.y + static_cast<size_t>(r) * p.n;
#pragma unroll
          for (int mb = 0; mb < kMT; ++mb) {
            const int o = (t16_block + (wgi * kMT + mb) * 4 + wq) * 16 + g;
            yrow[o] = acc[mb][4 * nt + half] * w;
            yrow[o + 8] = acc[mb][4 * nt + 2 + half] * w;
          }
        }
      }
    }
  }
}

// Grid: (n / kBM weight-row blocks, max_tiles row tiles), as WeightOnlyMoeGemmKernel.
template <class Format, bool kGateUp, int kMT>
__global__ void __launch_bounds__(256, kMT == 1 ? 2 : 1)
    WeightOnlyMoeGemmWgmmaKernel(const typename Format::Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = WgmmaTileConfig<kMT>;
  constexpr int kBN = Cfg::kBN;
  // Launched plainly in prefill; the waits are no-ops then (same contract as the mma.sync
  // kernel's programmatic launch otherwise).
  pdl::WaitForPrerequisiteGrid();
  pdl::AllowDependentLaunch();
  extern __shared__ uint8_t smem_raw[];
  // 1024-B aligned base: the 128-byte-swizzle atoms of the activation stages must be.
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_addr);

  // The expert and rows of this row tile (as WeightOnlyMoeGemmKernel).
  const int tile = blockIdx.y;
  const int num_e = p.num_local_experts;
  if (tile >= __ldcg(p.tile_offsets + num_e)) return;
  const int e = ExpertOfTile(p.tile_offsets, num_e, tile);
  const int row_begin = __ldcg(p.expert_offsets + e) + (tile - __ldcg(p.tile_offsets + e)) * kBN;
  const int row_end = min(row_begin + kBN, __ldcg(p.expert_offsets + e + 1));
  if (row_end - row_begin > 64) {
    WgmmaTileBody<Format, kGateUp, kMT, 128>(p, smem, base, e, row_begin, row_end);
  } else {
    WgmmaTileBody<Format, kGateUp, kMT, 64>(p, smem, base, e, row_begin, row_end);
  }
#endif
}

// Whether the wgmma kernel can run here: an SM 9.0 device (the sm_90a image; other images of it
// are empty) with its shared memory available. Checked once per process.
template <class Format, bool kGateUp, int kMT>
bool WgmmaMoeGemmAvailable() {
  static const bool ok = [] {
    if (!wgmma::CurrentDeviceIsSm90()) return false;
    auto* kernel = WeightOnlyMoeGemmWgmmaKernel<Format, kGateUp, kMT>;
    const int smem = WgmmaTileConfig<kMT>::kSmemBytes;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        cudaSuccess) {
      return false;
    }
    int blocks = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 256, smem) ==
               cudaSuccess &&
           blocks > 0;
  }();
  return ok;
}

// Launches the wgmma kernel where it applies (available, n a multiple of its kBM, k of 64);
// returns false (launching nothing) otherwise, so the caller runs the mma.sync kernel.
template <class Format, bool kGateUp, int kMT>
bool LaunchWeightOnlyMoeGemmWgmma(const typename Format::Params& p, cudaStream_t stream,
                                  cudaError_t* err) {
  using Cfg = WgmmaTileConfig<kMT>;
  if (p.n % Cfg::kBM != 0 || p.k % Cfg::kBK != 0 || p.max_tiles <= 0 || p.max_tiles > 65535 ||
      !WgmmaMoeGemmAvailable<Format, kGateUp, kMT>()) {
    return false;
  }
  *err = pdl::LaunchKernel(WeightOnlyMoeGemmWgmmaKernel<Format, kGateUp, kMT>,
                           dim3(p.n / Cfg::kBM, p.max_tiles), dim3(Cfg::kThreads), Cfg::kSmemBytes,
                           stream, p.programmatic, p);
  return true;
}

}  // namespace mlaserve::moe_gemm
