// Implementation of the BF16 grouped GEMM (declared in bf16_moe_gemm.h).
//
// Orientation as in nvfp4_moe_gemm.cuh: out^T = W x^T, the weight is the mma A operand (16 weight
// rows per m-tile), the activation rows are the B operand (8 rows per n-tile), so a decode tile
// with 1..16 rows wastes MMA lanes, not weight bandwidth. Per block: kBM weight rows x kBN
// activation rows over the whole K, streamed in kBK steps through a kStages-deep cp.async
// pipeline (weight fragments and activation rows of a step land in shared memory together).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/moe/bf16_moe_gemm.h"
#include "kernels/moe/moe_tile_expert.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/resident_blocks.h"
#include "kernels/warp_ptx.cuh"

namespace mlaserve::bf16_moe_gemm {

using ptx::CpAsync16;
using ptx::CpAsyncCommit;
using ptx::CpAsyncWait;
using ptx::LdMatrixX4;
using ptx::MmaBf16;

// Bytes of one 16-row x 64-column chunk of the fragment-ordered weight.
inline constexpr int kChunkBytes = 16 * 64 * 2;

template <int kBM_, int kBN_, int kBK_, int kWarpsM_, int kWarpsN_, int kStages_, int kMinBlocks_>
struct TileConfig {
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kBM = kBM_;  // weight rows per block
  static constexpr int kBN = kBN_;  // activation rows per block (the tile_tokens)
  static constexpr int kBK = kBK_;  // K per pipeline stage
  static constexpr int kWarpsM = kWarpsM_;
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kWM = kBM / kWarpsM;
  static constexpr int kWN = kBN / kWarpsN;
  static constexpr int kMT = kWM / 16;
  static constexpr int kNT = kWN / 8;
  static constexpr int kChunksK = kBK / 64;
  static constexpr int kWBytes = kBM * kBK * 2;
  static constexpr int kXBytes = kBN * kBK * 2;
  static constexpr int kStageBytes = kWBytes + kXBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static constexpr int kXChunksPerRow = kBK / 8;  // 16-byte chunks of one activation row
  static constexpr int kXIters = kBN * kXChunksPerRow / kThreads;
  static constexpr int kWIters = kWBytes / 16 / kThreads;
  static_assert(kBM % (16 * kWarpsM) == 0 && kBN % (16 * kWarpsN) == 0, "warp tile");
  static_assert(kBK % 64 == 0 && kXChunksPerRow >= 8, "k step (the swizzle needs 8 chunks)");
  static_assert(kXIters >= 1 && kBN * kXChunksPerRow % kThreads == 0, "X load");
  static_assert(kThreads % kXChunksPerRow == 0, "X load: fixed column chunk per thread");
  static_assert(kWIters >= 1 && (kWBytes / 16) % kThreads == 0, "weight load");
  // SM120 allows 99 KB of dynamic shared memory per block.
  static_assert(kSmemBytes <= 99 * 1024, "shared memory");
};

template <class Cfg, bool kGateUp>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    Bf16MoeGemmKernel(const Bf16MoeGemmParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int kBN = Cfg::kBN, kBK = Cfg::kBK, kStages = Cfg::kStages;
  constexpr int kMT = Cfg::kMT, kNT = Cfg::kNT;

  // Expert and rows of this tile, and the programmatic-launch protocol: exactly as in
  // nvfp4_moe_gemm.cuh (gate_up waits before reading anything; down reads the dispatch offsets
  // and streams its first weight stages before waiting for h).
  if constexpr (kGateUp) {
    pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }
  const int tile = blockIdx.y;
  const int num_e = p.num_local_experts;
  if (tile >= __ldcg(p.tile_offsets + num_e)) return;
  const int e = moe_gemm::ExpertOfTile(p.tile_offsets, num_e, tile);
  const int row_begin = __ldcg(p.expert_offsets + e) + (tile - __ldcg(p.tile_offsets + e)) * kBN;
  const int row_end = min(row_begin + kBN, __ldcg(p.expert_offsets + e + 1));
  const int valid_rows = row_end - row_begin;  // 1..kBN

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / Cfg::kWarpsN, warp_n = warp % Cfg::kWarpsN;
  const int k_chunks_total = p.k / 64;
  const int mt_block = blockIdx.x * (Cfg::kBM / 16);  // first 16-row weight tile of this block

  const uint8_t* w_g = reinterpret_cast<const uint8_t*>(p.w) +
                       static_cast<size_t>(e) * p.n * p.k * 2 +
                       static_cast<size_t>(mt_block) * k_chunks_total * kChunkBytes;
  const int x_chunk = tid % Cfg::kXChunksPerRow;
  int x_row[Cfg::kXIters];  // source row of each copied activation row, -1 past the tile
#pragma unroll
  for (int i = 0; i < Cfg::kXIters; ++i) {
    const int r = row_begin + (tid + i * Cfg::kThreads) / Cfg::kXChunksPerRow;
    x_row[i] = r >= row_end ? -1 : kGateUp ? __ldg(p.sorted_assignment + r) / p.top_k : r;
  }

  // Weights: per 16-row m-tile a contiguous run of kChunksK * 2048 bytes per stage.
  auto load_weights = [&](int stage, int kt) {
    uint8_t* s_w = smem + stage * Cfg::kStageBytes;
#pragma unroll
    for (int i = 0; i < Cfg::kWIters; ++i) {
      const int c = tid + i * Cfg::kThreads;
      const int mt = c / (Cfg::kChunksK * (kChunkBytes / 16));
      const int within = c % (Cfg::kChunksK * (kChunkBytes / 16));
      const uint8_t* src =
          w_g + (static_cast<size_t>(mt) * k_chunks_total + kt * Cfg::kChunksK) * kChunkBytes +
          within * 16;
      CpAsync16(s_w + c * 16, src, true);
    }
  };
  // Activation rows, 16-byte chunks swizzled by (row & 7) against ldmatrix bank conflicts; rows
  // past the tile are not loaded (their columns of the result are never stored).
  auto load_x = [&](int stage, int kt) {
    uint8_t* s_x = smem + stage * Cfg::kStageBytes + Cfg::kWBytes;
#pragma unroll
    for (int i = 0; i < Cfg::kXIters; ++i) {
      const int row = (tid + i * Cfg::kThreads) / Cfg::kXChunksPerRow;
      uint8_t* dst = s_x + row * (kBK * 2) + ((x_chunk ^ (row & 7)) * 16);
      if (x_row[i] >= 0) {
        CpAsync16(dst, p.a + static_cast<size_t>(x_row[i]) * p.k + kt * kBK + x_chunk * 8, true);
      }
    }
  };

  float acc[kMT][kNT][4];
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

  const int k_tiles = p.k / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_weights(s, s);
  }
  if constexpr (!kGateUp) {
    pdl::WaitForPrerequisiteGrid();
    pdl::AllowDependentLaunch();
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_x(s, s);
    CpAsyncCommit();
  }

  const int ld_row_in_tile = (lane & 7) + ((lane >> 4) << 3);  // ldmatrix x4 row provider
  const int ld_chunk_hi = (lane >> 3) & 1;

  for (int kt = 0; kt < k_tiles; ++kt) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    {
      const int next = kt + kStages - 1;
      if (next < k_tiles) {
        load_weights(next % kStages, next);
        load_x(next % kStages, next);
      }
      CpAsyncCommit();
    }
    const uint8_t* s_w = smem + (kt % kStages) * Cfg::kStageBytes;
    const uint8_t* s_x = s_w + Cfg::kWBytes;
#pragma unroll
    for (int kc = 0; kc < Cfg::kChunksK; ++kc) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t b[kNT][2];
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          // Decode tiles: skip a pair of n-tiles with no row in the tile (warp-uniform).
          if (kBN <= 16 && warp_n * Cfg::kWN + np * 16 >= valid_rows) break;
          const int row = warp_n * Cfg::kWN + np * 16 + ld_row_in_tile;
          const int chunk = (kc * 64 + j * 16) / 8 + ld_chunk_hi;
          uint32_t r4[4];
          LdMatrixX4(r4, s_x + row * (kBK * 2) + ((chunk ^ (row & 7)) * 16));
          b[2 * np][0] = r4[0];
          b[2 * np][1] = r4[1];
          b[2 * np + 1][0] = r4[2];
          b[2 * np + 1][1] = r4[3];
        }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const int t16 = warp_m * kMT + mt;
          const uint4 w4 = *reinterpret_cast<const uint4*>(
              s_w + (t16 * Cfg::kChunksK + kc) * kChunkBytes + j * 512 + lane * 16);
          const uint32_t a[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            if (kBN > 16 || warp_n * Cfg::kWN + nt * 8 < valid_rows) {
              MmaBf16(acc[mt][nt], a, b[nt][0], b[nt][1]);
            }
          }
        }
      }
    }
  }
  CpAsyncWait<0>();

  // Epilogue. acc[mt][nt]: c0 (weight row g, activation row 2t), c1 (g, 2t+1), c2 (g+8, 2t),
  // c3 (g+8, 2t+1); in gate_up rows g are gate and rows g + 8 up of the same feature.
  const int g = lane >> 2, t4 = lane & 3;
  if constexpr (kGateUp) {
    const int inter = p.n / 2;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const int feature = (mt_block + warp_m * kMT + mt) * 8 + g;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = row_begin + warp_n * Cfg::kWN + nt * 8 + 2 * t4 + half;
          if (r < row_end) {
            const float gate = acc[mt][nt][half];
            const float up = acc[mt][nt][2 + half];
            const float hval = gate / (1.0f + __expf(-gate)) * up;
            p.h[static_cast<size_t>(r) * inter + feature] = __float2bfloat16_rn(hval);
          }
        }
      }
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = row_begin + warp_n * Cfg::kWN + nt * 8 + 2 * t4 + half;
        if (r < row_end) {
          const float w = __ldg(p.topk_weights + __ldg(p.sorted_assignment + r));
          float* yrow = p.y + static_cast<size_t>(r) * p.n;
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            const int o = (mt_block + warp_m * kMT + mt) * 16 + g;
            yrow[o] = acc[mt][nt][half] * w;
            yrow[o + 8] = acc[mt][nt][2 + half] * w;
          }
        }
      }
    }
  }
}

// Tile shapes by tokens per tile; shared memory 72 KB, 72 KB, 96 KB (sm_120 allows 99 KB).
// Untuned: the NVFP4 kernel's warp arrangements with K step 64 (a bf16 weight stage is 4x the
// NVFP4 one). Decode streams 16 KB of weights per stage, 3 stages in flight per block.
template <int kTileTokens>
struct TileFor;
template <>
struct TileFor<16> {
  using Cfg = TileConfig<128, 16, 64, 4, 1, 4, 3>;
};
template <>
struct TileFor<64> {
  using Cfg = TileConfig<128, 64, 64, 4, 2, 3, 2>;
};
template <>
struct TileFor<128> {
  using Cfg = TileConfig<128, 128, 64, 8, 1, 3, 2>;
};

template <bool kGateUp, int kTileTokens>
cudaError_t Launch(const Bf16MoeGemmParams& p, cudaStream_t stream) {
  using Cfg = typename TileFor<kTileTokens>::Cfg;
  auto kernel = Bf16MoeGemmKernel<Cfg, kGateUp>;
  if (p.n <= 0 || p.k <= 0 || p.n % Cfg::kBM != 0 || p.k % Cfg::kBK != 0 || p.max_tiles < 0 ||
      p.max_tiles > 65535 || p.num_local_experts < 1) {
    return cudaErrorInvalidValue;
  }
  if (p.max_tiles == 0) return cudaSuccess;
  if (cudaError_t err = OptInDynamicSmem(kernel, Cfg::kSmemBytes); err != cudaSuccess) return err;
  const dim3 grid(p.n / Cfg::kBM, p.max_tiles);
  return pdl::LaunchKernel(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream,
                                     p.programmatic, p);
}

}  // namespace mlaserve::bf16_moe_gemm
