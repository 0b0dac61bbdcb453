// SM90a split-KV MLA decode on e4m3 tensor cores with 64-token tiles split by tokens between the
// warpgroups (kernels/mla/NOTES.md, session 34): the fp8 and fp8_tiled cache formats, 64 query
// rows a block. The arithmetic is mla_decode_fp8mma.cuh's (the form MlaDecodeRef emulates with
// fp8_mma = kQkPv: q in e4m3 with a power-of-two scale a row, each 128-dim group of the q.k summed
// on its own and promoted in fp32, P x 256 in e4m3); what changes is who does which work.
//
// Why: the 32-token kernel (mla_decode_fp8mma.cuh) splits a tile's q.k by dims between its two
// warpgroups, so every tile exchanges 64 x 32 partial scores through shared memory, both
// warpgroups run the same softmax on them, and every 32 tokens cost two block barriers; ncu put it
// at 1.5-1.6x the instructions of the f16-converting kernel, issue-bound (session 33). Here a tile
// is one 64-token cache block and warpgroup g owns tokens [32g, 32g + 32):
// * q.k: warpgroup g's 32 tokens over all 576 dims (m64n32k32 e4m3, 4 k-steps a 128-dim group;
//   fp8_tiled's bf16 RoPE as 4 m64n32k16 steps), the five groups in three accumulators that take
//   turns (S, A, B: each group waited for and added in fp32 while the next runs). No partial
//   scores cross warpgroups.
// * softmax: each warpgroup on its own 32 tokens (half the work of a duplicated one); the running
//   max is shared through shared memory (one barrier), so both warpgroups rescale O alike; row
//   sums stay a thread's own until the piece ends. P x 256 = exp2(s x scale - max + 8) in one FFMA
//   and one MUFU a score.
// * P.V: warpgroup g multiplies all 64 tokens into O's columns [256g, 256g + 256): its own P from
//   registers (the A fragment as the accumulator has it, mla_decode_fp8mma.cuh's token order) and
//   the other warpgroup's P from shared memory (the same fragment words stored as a no-swizzle
//   K-major A tile), against V^T of the tile (both halves, transposed as in the 32-token kernel).
//   fp8_tiled: one P a 128-column group (P x the token's tile scale / the group's running largest
//   scale rs); each warpgroup tracks all four rs alike and stores the two P the other needs.
// * Barriers: three a 64-token tile (tile landed; max exchange; P exchange), against four a 64
//   tokens in the 32-token kernel. The P.V is waited for at the next tile's top, behind the next
//   copy; the ring holds kStages whole tiles ahead.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mla/mla_decode_fp8mma.cuh"

namespace mlaserve::mla {

namespace f8mma64 {

constexpr int kTile = 64;  // One cache block.
static_assert(kTile == kKvBlockTokens, "a tile is a cache block");

template <KvCacheFormat kFormat, int kStages>
struct Config {
  static constexpr bool kTiled = kFormat == KvCacheFormat::kFp8Tiled;
  static constexpr int kRowBytes = static_cast<int>(KvCacheBytesPerToken(kFormat));
  static constexpr int kQBytes = f8mma::kQkBlocks * f8mma::kRows * 128;  // 40,960
  static constexpr int kKBlockBytes = kTile * 128;                       // 8,192
  static constexpr int kKBytes = f8mma::kQkBlocks * kKBlockBytes;        // 40,960: a ring slot
  static constexpr int kScBytes = kTiled ? kTile * 16 : 0;  // fp8_tiled: a slot's tile scales
  static constexpr int kVtHalfBytes = kMlaLatentDim * 32;   // V^T of a warpgroup's 32 tokens
  static constexpr int kPBytes = f8mma::kRows * 32;         // a 64 x 32 e4m3 P tile
  static constexpr int kPCount = kTiled ? 2 : 1;            // P tiles a warpgroup hands over
  static constexpr int kQOff = 0;
  static constexpr int kKOff = kQOff + kQBytes;
  static constexpr int kScOff = kKOff + kStages * kKBytes;
  static constexpr int kVtOff = kScOff + kStages * kScBytes;
  static constexpr int kPOff = kVtOff + 2 * kVtHalfBytes;
  static constexpr int kXOff = kPOff + 2 * kPCount * kPBytes;
  // Exchange floats: row maxima [2][64], tile-scale maxima [2][4], row sums [2][64].
  static constexpr int kXmOff = kXOff, kXsOff = kXmOff + 2 * 64 * 4, kXlOff = kXsOff + 2 * 4 * 4;
  static constexpr int kQScaleOff = kXlOff + 2 * 64 * 4;  // 64 floats
  static constexpr int kSchedOff = kQScaleOff + 4 * f8mma::kRows;
  static constexpr int kSchedBytes = 4 * (kInlineScheduleMaxBatch + 2);
  static constexpr int kSmemBytes = kSchedOff + kSchedBytes + 1024;  // + alignment slack
  static_assert(kFormat == KvCacheFormat::kFp8 || kTiled, "the fp8 formats");
  static_assert(kStages >= 2, "need a ring");
  static_assert(kKOff % 1024 == 0 && kKBytes % 1024 == 0, "swizzle atoms 1024-B aligned");
  static_assert(kSmemBytes <= 227 * 1024, "H100 / H200: 227 KB per block");
};

}  // namespace f8mma64

template <KvCacheFormat kFormat, int kStages>
__global__ void __launch_bounds__(f8mma::kThreads, 1)
    MlaDecodeFp8Mma64Kernel(const MlaDecodeKernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl::AllowDependentLaunch();
  using f8mma::kRows;
  using f8mma::kThreads;
  using Cfg = f8mma64::Config<kFormat, kStages>;
  constexpr int kTile = f8mma64::kTile;
  constexpr bool kTiled = Cfg::kTiled;
  constexpr int kRowBytes = Cfg::kRowBytes;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem_raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (smem_raw_addr + 1023u) & ~1023u;  // swizzle atoms 1024-B aligned
  uint8_t* smem = smem_raw + (base - smem_raw_addr);
  const uint32_t q_smem = base + Cfg::kQOff, k_smem = base + Cfg::kKOff;
  const uint32_t vt_smem = base + Cfg::kVtOff, p_smem = base + Cfg::kPOff;
  float* qscale = reinterpret_cast<float*>(smem + Cfg::kQScaleOff);
  float* xm = reinterpret_cast<float*>(smem + Cfg::kXmOff);
  float* xs = reinterpret_cast<float*>(smem + Cfg::kXsOff);
  float* xl = reinterpret_cast<float*>(smem + Cfg::kXlOff);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform (uniform registers)
  const int tw = tid & 127;
  const int wq = tw >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int row_tiles = (p.rows + kRows - 1) / kRows;
  const int worker = blockIdx.x / row_tiles, mt = blockIdx.x % row_tiles;

  const int32_t* prefix = p.schedule;
  if (p.inline_schedule) {
    prefix = InlineSchedule<kThreads>(p, reinterpret_cast<int32_t*>(smem + Cfg::kSchedOff));
  }
  const int total = prefix[p.batch], share = prefix[p.batch + 1];
  const int cost_begin = worker * share;
  const int cost_end = min(cost_begin + share, total);
  if (cost_begin >= cost_end) return;
  const int first_seq = FirstSequence(prefix, p.batch, cost_begin);

  const int lrow_lo = 16 * wq + g, lrow_hi = lrow_lo + 8;
  const int row_lo = mt * kRows + lrow_lo, row_hi = mt * kRows + lrow_hi;

  // Tile copy: thread (row ct, 16-B chunk cch) copies, for tokens ct and ct + 32, chunks cch + 8j
  // (j = 0..3: latent block j) and the RoPE block's chunk cch (fp8: cch < 4, the block's other
  // 64 B zero-filled). Swizzled destination; token ct + 32 has ct's swizzle.
  const int ct = tid >> 3, cch = tid & 7;
  const uint32_t op_off = ct * 128 + ((cch ^ (ct & 7)) << 4);

  // Transpose (mla_decode_fp8mma.cuh's, with 64-row blocks): lane (c, b, r) of warp w takes dim
  // quads dq = 8 (2w + sp) + 2r + b (sp = 0, 1) of a 16-token quarter, tokens {2c, 2c + 1, 8 + 2c,
  // 9 + 2c} of it; conflict-free loads and stores (see there).
  const int tb = (lane >> 2) & 1, tr = lane >> 3;
  const uint32_t sel1_a = (tr & 2) ? 0x7362u : 0x5140u, sel1_b = (tr & 2) ? 0x5140u : 0x7362u;
  const uint32_t sel_a = (tr & 1) ? 0x7632u : 0x5410u, sel_b = (tr & 1) ? 0x5410u : 0x7632u;
  uint32_t t_ld[2][2], t_st[2];
#pragma unroll
  for (int sp = 0; sp < 2; ++sp) {
    const int dqi = 8 * (2 * warp + sp) + 2 * tr + tb;  // 0..127
    const int chunk = (dqi >> 2) & 7;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      t_ld[sp][e] = k_smem + (dqi >> 5) * Cfg::kKBlockBytes + (dqi & 3) * 4 + (2 * c + e) * 128 +
                    ((chunk ^ (2 * c + e)) << 4);
    }
    t_st[sp] = vt_smem + (dqi >> 1) * 256 + tb * 64 + 4 * c;
  }
  const uint32_t t_x = tr * 16;

  // This thread's P fragment words in a 64 x 32 no-swizzle K-major A tile (8-row x 16-B core
  // matrices, 128 B apart in K, 256 B apart in rows): register r is row group 2 wq + (r & 1), K
  // half r >> 1, row g, bytes 4c .. 4c + 3.
  const uint32_t p_st = p_smem + wgi * Cfg::kPCount * Cfg::kPBytes + 2 * wq * 256 + g * 16 + 4 * c;

  const wgmma::Desc dq = wgmma::Desc128B(q_smem, 16, 1024);
  // This warpgroup's tokens: rows [32 wgi, 32 wgi + 32) of each K block (a whole swizzle atom).
  const wgmma::Desc dk = wgmma::Desc128B(k_smem + wgi * 32 * 128, 16, 1024);
  // V^T of the own and the other token half, this warpgroup's 256 columns (dims).
  const wgmma::Desc dv_own =
      wgmma::DescNoSwizzle(vt_smem + wgi * Cfg::kVtHalfBytes + wgi * (256 / 8) * 256, 128, 256);
  const wgmma::Desc dv_oth = wgmma::DescNoSwizzle(
      vt_smem + (1 - wgi) * Cfg::kVtHalfBytes + wgi * (256 / 8) * 256, 128, 256);
  const wgmma::Desc dp_oth =
      wgmma::DescNoSwizzle(p_smem + (1 - wgi) * Cfg::kPCount * Cfg::kPBytes, 128, 256);

  for (int b = first_seq; b < p.batch && prefix[b] < cost_end; ++b) {
    const SeqPiece piece = PieceOfSequence(p, prefix, b, cost_begin, cost_end);
    const int len = piece.len, tok_begin = piece.tok_begin, tok_end = piece.tok_end;
    const bool whole = piece.whole;
    const int t_begin = tok_begin / kTile;
    const int n_tiles = tok_end > tok_begin ? (tok_end + kTile - 1) / kTile - t_begin : 0;
    const int32_t* __restrict__ blocks =
        p.block_table + static_cast<size_t>(b) * p.max_blocks_per_seq;
    // Rows past the sequence's end are zero-filled (src-size 0), never stale bytes.
    auto copy_tile = [&](int t, int slot) {
      const uint8_t* src0 =
          p.kv_pool + (static_cast<size_t>(blocks[t]) * kKvBlockTokens + ct) * kRowBytes + cch * 16;
      const uint32_t dst0 = k_smem + slot * Cfg::kKBytes + op_off;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint8_t* src = src0 + h * 32 * kRowBytes;
        const uint32_t dst = dst0 + h * 32 * 128;
        const bool valid = t * kTile + 32 * h + ct < len;
#pragma unroll
        for (int kb = 0; kb < 4; ++kb) {
          ptx::CpAsync16(dst + kb * Cfg::kKBlockBytes, src + kb * 128, valid);
        }
        if constexpr (kTiled) {  // bf16 RoPE (128 B), and the 4 tile scales
          ptx::CpAsync16(dst + 4 * Cfg::kKBlockBytes, src + kFp8TiledRopeOffset, valid);
          if (cch == 0) {
            ptx::CpAsync16(base + Cfg::kScOff + slot * Cfg::kScBytes + (32 * h + ct) * 16,
                           src + kFp8TiledScaleOffset, valid);
          }
        } else {  // e4m3 RoPE (64 B), the block's other 64 B zero-filled
          ptx::CpAsync16(dst + 4 * Cfg::kKBlockBytes, src + kMlaLatentDim, valid && cch < 4);
        }
      }
    };
    // V^T of the slot's 16-token quarter q4 (V^T half q4 / 2, K chunk q4 % 2). All 8 words are
    // loaded before the first store: Lds32 / Sts32 are volatile with a memory clobber, so the
    // compiler keeps their source order, and loads written after a store wait behind it (session
    // 35, H100: 0.98-1.06x the store-between form, median 1.014).
    auto transpose = [&](int slot, int q4) {
      const uint32_t so = slot * Cfg::kKBytes + 16 * q4 * 128;
      const uint32_t vo = (q4 >> 1) * Cfg::kVtHalfBytes + (q4 & 1) * 128;
      uint32_t w[2][4];
#pragma unroll
      for (int sp = 0; sp < 2; ++sp) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          w[sp][i] = f8mma::Lds32(t_ld[sp][i & 1] + so + 8 * (i >> 1) * 128);
        }
      }
#pragma unroll
      for (int sp = 0; sp < 2; ++sp) {
        const uint32_t a01 = __byte_perm(w[sp][0], w[sp][1], sel1_a);
        const uint32_t b01 = __byte_perm(w[sp][0], w[sp][1], sel1_b);
        const uint32_t a23 = __byte_perm(w[sp][2], w[sp][3], sel1_a);
        const uint32_t b23 = __byte_perm(w[sp][2], w[sp][3], sel1_b);
        const uint32_t out[4] = {__byte_perm(a01, a23, sel_a), __byte_perm(a01, a23, sel_b),
                                 __byte_perm(b01, b23, sel_a), __byte_perm(b01, b23, sel_b)};
#pragma unroll
        for (int j = 0; j < 4; ++j) f8mma::Sts32(t_st[sp] + vo + ((16u * j) ^ t_x), out[j]);
      }
    };

#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      if (s < n_tiles) copy_tile(t_begin + s, s);
      ptx::CpAsyncCommit();
    }
    f8mma::StoreQ<kTiled>(p, b, mt, q_smem, qscale, tid);

    const int lim_lo = min(row_lo < p.rows ? len - p.s_q + row_lo / p.heads : len - 1, tok_end - 1);
    const int lim_hi = min(row_hi < p.rows ? len - p.s_q + row_hi / p.heads : len - 1, tok_end - 1);
    const int lim_min = min(lim_lo, lim_hi);

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;
    // m: the running max (log2 units, shared by both warpgroups); l: this thread's share of the
    // row sums of P x 256 (its own tokens), summed over the quad and the warpgroups at the end.
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
    float qd_lo = 1.0f, qd_hi = 1.0f;
    float rs[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // fp8_tiled: running largest tile scale a group
    uint32_t pa[Cfg::kPCount][4];            // own P, live until its P.V retires
#pragma unroll
    for (int i = 0; i < Cfg::kPCount; ++i) pa[i][0] = pa[i][1] = pa[i][2] = pa[i][3] = 0u;
    float s[16], a[16], bb[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = a[i] = bb[i] = 0.0f;

    // The ring slot's offset in 16-B units, broadcast from lane 0 so the compiler sees it
    // warp-uniform: the descriptors stay in uniform registers (as wgi above).
    auto slot_units = [&](int slot) {
      return __shfl_sync(0xffffffffu, static_cast<uint32_t>(slot * Cfg::kKBytes) >> 4, 0);
    };
    auto qk_group = [&](float(&acc)[16], int kb, uint32_t kunits) {  // dims [128 kb, + 128)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t qoff = (kb * (kRows * 128) + 32 * k) >> 4;
        const uint32_t koff = (kb * Cfg::kKBlockBytes + 32 * k) >> 4;
        wgmma::WgmmaM64N32K32E4m3SS(acc, dq.lo + qoff, dq.hi, dk.lo + kunits + koff, dk.hi, k);
      }
    };
    auto qk_rope = [&](float(&acc)[16], uint32_t kunits) {
      if constexpr (kTiled) {  // bf16, 4 k16 steps
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t qoff = (4 * (kRows * 128) + 32 * k) >> 4;
          const uint32_t koff = (4 * Cfg::kKBlockBytes + 32 * k) >> 4;
          wgmma::WgmmaM64N32K16SS<false>(acc, dq.lo + qoff, dq.hi, dk.lo + kunits + koff, dk.hi, k);
        }
      } else {  // e4m3, 2 k32 steps (the block's other 64 B are zeros)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const uint32_t qoff = (4 * (kRows * 128) + 32 * k) >> 4;
          const uint32_t koff = (4 * Cfg::kKBlockBytes + 32 * k) >> 4;
          wgmma::WgmmaM64N32K32E4m3SS(acc, dq.lo + qoff, dq.hi, dk.lo + kunits + koff, dk.hi, k);
        }
      }
    };
    // The q.k's first three groups (latent blocks 0-2 in S, A, B), one commit group each; the
    // later groups wait for an accumulator's last sum.
    auto issue_qk_first = [&](uint32_t kunits) {
      wgmma::FenceRegs(s);
      wgmma::FenceRegs(a);
      wgmma::FenceRegs(bb);
      wgmma::Fence();
      qk_group(s, 0, kunits);
      wgmma::Commit();
      qk_group(a, 1, kunits);
      wgmma::Commit();
      qk_group(bb, 2, kunits);
      wgmma::Commit();
    };
    for (int it = 0; it < n_tiles; ++it) {
      const int slot = it % kStages;
      const uint32_t kunits = slot_units(slot);
      // Tile it landed (kStages tiles were in flight); this warpgroup's P.V of tile it - 1
      // retired, and after the barrier both warpgroups' (V^T, P and the slot it read are free).
      ptx::CpAsyncWait<kStages - 1>();
      wgmma::Wait<0>();
      wgmma::FenceRegs(o);
      wgmma::UseRegs(pa);
      wgmma::FenceProxyAsyncShared();
      __syncthreads();
      if (it == 0) {
        qd_lo = qscale[lrow_lo];
        qd_hi = qscale[lrow_hi];
      }
      issue_qk_first(kunits);
      // fp8_tiled: the tile scales of this thread's 8 tokens (columns 8j + 2c + e of its
      // warpgroup's 32; zero-filled rows: 0).
      const float* scs = reinterpret_cast<const float*>(smem + Cfg::kScOff + slot * Cfg::kScBytes) +
                         (32 * wgi + 2 * c) * 4;
      auto scale2 = [&](int j, int e, int pair) {  // groups 2 pair, 2 pair + 1
        return *reinterpret_cast<const float2*>(scs + (8 * j + e) * 4 + 2 * pair);
      };

      transpose(slot, 0);
      wgmma::Wait<1>();
      wgmma::FenceRegs(s);
      wgmma::FenceRegs(a);
      if constexpr (kTiled) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = scale2(j, e & 1, 0);
            s[4 * j + e] = fmaf(a[4 * j + e], f.y, s[4 * j + e] * f.x);
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) s[i] += a[i];
      }
      wgmma::FenceRegs(a);
      wgmma::Fence();
      qk_group(a, 3, kunits);
      wgmma::Commit();
      transpose(slot, 1);
      wgmma::Wait<1>();
      wgmma::FenceRegs(bb);
      // S += a group's sums (fp8_tiled: times scale(j, token parity), the tokens' tile scales of
      // the group; fp8: as they are, scale unused).
      auto add_scaled = [&](const float(&acc)[16], auto scale) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if constexpr (kTiled) {
              s[4 * j + e] = fmaf(acc[4 * j + e], scale(j, e & 1), s[4 * j + e]);
            } else {
              s[4 * j + e] += acc[4 * j + e];
            }
          }
        }
      };
      float2 f23[4][2];  // fp8_tiled: groups 2 and 3's scales
      if constexpr (kTiled) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) f23[j][e] = scale2(j, e, 1);
        }
      }
      add_scaled(bb, [&](int j, int e) { return f23[j][e].x; });
      wgmma::FenceRegs(bb);
      wgmma::Fence();
      qk_rope(bb, kunits);
      wgmma::Commit();
      transpose(slot, 2);
      wgmma::Wait<1>();
      wgmma::FenceRegs(a);
      add_scaled(a, [&](int j, int e) { return f23[j][e].y; });
      transpose(slot, 3);
      wgmma::Wait<0>();
      wgmma::FenceRegs(bb);
      if constexpr (kTiled) {  // q's row scale times the latent sum, plus the bf16 RoPE sum
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[4 * j + e] = fmaf(s[4 * j + e], e < 2 ? qd_lo : qd_hi, bb[4 * j + e]);
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) s[i] += bb[i];
      }

      // Softmax of this warpgroup's 32 tokens (log2 domain, exact running max shared by both).
      const int tok0 = (t_begin + it) * kTile + 32 * wgi;
      if (!(tok0 >= tok_begin && tok0 + 31 <= lim_min)) {  // edge tiles only
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int pos = tok0 + 8 * j + 2 * c + (e & 1);
            if (pos < tok_begin || pos > (e >= 2 ? lim_hi : lim_lo)) s[4 * j + e] = -INFINITY;
          }
        }
      }
      // fp8: q's row scale is applied here (fp8_tiled's is in S already).
      const float sl_lo = (kTiled ? 1.0f : qd_lo) * p.score_scale_log2;
      const float sl_hi = (kTiled ? 1.0f : qd_hi) * p.score_scale_log2;
      float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mx_lo = fmaxf(mx_lo, fmaxf(s[4 * j + 0], s[4 * j + 1]));
        mx_hi = fmaxf(mx_hi, fmaxf(s[4 * j + 2], s[4 * j + 3]));
      }
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      mx_lo *= sl_lo;  // (sl > 0: -inf stays -inf)
      mx_hi *= sl_hi;
      if (c == 0) {
        xm[wgi * 64 + lrow_lo] = mx_lo;
        xm[wgi * 64 + lrow_hi] = mx_hi;
      }
      float4 sc4[4][2];  // fp8_tiled: the 4 groups' scales of the thread's 8 tokens
      if constexpr (kTiled) {
        float tm[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            sc4[j][e] = *reinterpret_cast<const float4*>(scs + (8 * j + e) * 4);
            tm[0] = fmaxf(tm[0], sc4[j][e].x);
            tm[1] = fmaxf(tm[1], sc4[j][e].y);
            tm[2] = fmaxf(tm[2], sc4[j][e].z);
            tm[3] = fmaxf(tm[3], sc4[j][e].w);
          }
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          tm[q] = fmaxf(tm[q], __shfl_xor_sync(0xffffffffu, tm[q], 1));
          tm[q] = fmaxf(tm[q], __shfl_xor_sync(0xffffffffu, tm[q], 2));  // the warpgroup's 32
        }
        if (tw == 0)
          *reinterpret_cast<float4*>(xs + 4 * wgi) = make_float4(tm[0], tm[1], tm[2], tm[3]);
      }
      wgmma::FenceProxyAsyncShared();  // V^T (generic writes) for the P.V's async reads
      __syncthreads();
      const float mn_lo = fmaxf(m_lo, fmaxf(mx_lo, xm[(1 - wgi) * 64 + lrow_lo]));
      const float mn_hi = fmaxf(m_hi, fmaxf(mx_hi, xm[(1 - wgi) * 64 + lrow_hi]));
      const float base_lo = mn_lo == -INFINITY ? 0.0f : mn_lo;
      const float base_hi = mn_hi == -INFINITY ? 0.0f : mn_hi;
      const float alpha_lo = exp2f(m_lo - base_lo), alpha_hi = exp2f(m_hi - base_hi);
      m_lo = mn_lo;
      m_hi = mn_hi;
      // P x 256 (kPScale = 2^8) = exp2(s x sl - base + 8).
      const float nb_lo = 8.0f - base_lo, nb_hi = 8.0f - base_hi;
      float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[4 * j + 0] = exp2f(fmaf(s[4 * j + 0], sl_lo, nb_lo));
        s[4 * j + 1] = exp2f(fmaf(s[4 * j + 1], sl_lo, nb_lo));
        s[4 * j + 2] = exp2f(fmaf(s[4 * j + 2], sl_hi, nb_hi));
        s[4 * j + 3] = exp2f(fmaf(s[4 * j + 3], sl_hi, nb_hi));
        sum_lo += s[4 * j + 0] + s[4 * j + 1];
        sum_hi += s[4 * j + 2] + s[4 * j + 3];
      }
      l_lo = fmaf(l_lo, alpha_lo, sum_lo);
      l_hi = fmaf(l_hi, alpha_hi, sum_hi);
      if (__any_sync(0xffffffffu, alpha_lo != 1.0f || alpha_hi != 1.0f)) {
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          o[4 * n + 0] *= alpha_lo;
          o[4 * n + 1] *= alpha_lo;
          o[4 * n + 2] *= alpha_hi;
          o[4 * n + 3] *= alpha_hi;
        }
      }
      // P in e4m3 as the A fragment (mla_decode_fp8mma.cuh's token order): register 0 row lo
      // columns {2c, 2c + 1, 8 + 2c, 9 + 2c}, register 1 the same of row hi, 2-3 at + 16.
      auto pack = [](const float(&w)[16], uint32_t(&r)[4]) {
        r[0] = f8mma::E4m3x4(w[0], w[1], w[4], w[5]);
        r[1] = f8mma::E4m3x4(w[2], w[3], w[6], w[7]);
        r[2] = f8mma::E4m3x4(w[8], w[9], w[12], w[13]);
        r[3] = f8mma::E4m3x4(w[10], w[11], w[14], w[15]);
      };
      auto store_p = [&](const uint32_t(&r)[4], int pi) {  // for the other warpgroup
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          f8mma::Sts32(p_st + pi * Cfg::kPBytes + (q & 1) * 256 + (q >> 1) * 128, r[q]);
        }
      };
      if constexpr (kTiled) {
        // One P a 128-column group: P x 256 x the token's tile scale / the group's running
        // largest scale (the same four rs in both warpgroups; O's own group columns scaled down
        // when theirs grows), so O's columns hold sum P x V x 256 / rs.
        const float4 ot = *reinterpret_cast<const float4*>(xs + 4 * (1 - wgi));
        const float4 mine = *reinterpret_cast<const float4*>(xs + 4 * wgi);
        const float tmax[4] = {fmaxf(mine.x, ot.x), fmaxf(mine.y, ot.y), fmaxf(mine.z, ot.z),
                               fmaxf(mine.w, ot.w)};
#pragma unroll
        for (int gi = 0; gi < 4; ++gi) {
          if (tmax[gi] > rs[gi]) {  // the same in every thread
            if (gi >> 1 == wgi) {
              const float f = rs[gi] / tmax[gi];
#pragma unroll
              for (int i = 0; i < 64; ++i) o[64 * (gi & 1) + i] *= f;
            }
            rs[gi] = tmax[gi];
          }
          const float inv_rs = rs[gi] > 0.0f ? 1.0f / rs[gi] : 0.0f;
          float w[16];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float4 f4 = sc4[j][e & 1];
              const float f = gi == 0 ? f4.x : gi == 1 ? f4.y : gi == 2 ? f4.z : f4.w;
              w[4 * j + e] = s[4 * j + e] * (f * inv_rs);
            }
          }
          if (gi >> 1 == wgi) {
            pack(w, pa[gi & 1]);
          } else {
            uint32_t r[4];
            pack(w, r);
            store_p(r, gi & 1);
          }
        }
      } else {
        pack(s, pa[0]);
        store_p(pa[0], 0);
      }
      wgmma::FenceProxyAsyncShared();  // P (generic writes) for the other warpgroup's P.V
      __syncthreads();
      wgmma::FenceRegs(o);
      wgmma::Fence();
      if constexpr (kTiled) {
        constexpr uint32_t kHalfCols = ((128 / 8) * 256) >> 4;  // 128 columns of V^T, 16-B units
        float(&o0)[64] = *reinterpret_cast<float(*)[64]>(o);
        float(&o1)[64] = *reinterpret_cast<float(*)[64]>(o + 64);
        wgmma::WgmmaM64N128K32E4m3RS(o0, pa[0], dv_own.lo, dv_own.hi, 1);
        wgmma::WgmmaM64N128K32E4m3RS(o1, pa[1], dv_own.lo + kHalfCols, dv_own.hi, 1);
        wgmma::WgmmaM64N128K32E4m3SS(o0, dp_oth.lo, dp_oth.hi, dv_oth.lo, dv_oth.hi, 1);
        wgmma::WgmmaM64N128K32E4m3SS(o1, dp_oth.lo + (Cfg::kPBytes >> 4), dp_oth.hi,
                                     dv_oth.lo + kHalfCols, dv_oth.hi, 1);
      } else {
        wgmma::WgmmaM64N256K32E4m3RS(o, pa[0], dv_own.lo, dv_own.hi, 1);
        wgmma::WgmmaM64N256K32E4m3SS(o, dp_oth.lo, dp_oth.hi, dv_oth.lo, dv_oth.hi, 1);
      }
      wgmma::Commit();
      // Beside the P.V: tile it + kStages into this tile's slot (its q.k, V^T reads and scales
      // were done everywhere before the last barrier).
      const int tn = it + kStages;
      if (tn < n_tiles) copy_tile(t_begin + tn, slot);
      ptx::CpAsyncCommit();
    }
    wgmma::Wait<0>();
    wgmma::FenceRegs(o);
    wgmma::UseRegs(pa);
    ptx::CpAsyncWait<0>();
    // Row sums: the quad's, then the other warpgroup's tokens. The barrier also ends the piece:
    // the next piece's prologue reuses Q, the ring, V^T and P.
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    if (c == 0) {
      xl[wgi * 64 + lrow_lo] = l_lo;
      xl[wgi * 64 + lrow_hi] = l_hi;
    }
    __syncthreads();
    l_lo += xl[(1 - wgi) * 64 + lrow_lo];
    l_hi += xl[(1 - wgi) * 64 + lrow_hi];
    // l summed P x 256; the epilogue takes the sum of P (an exact division).
    // (Selected, not indexed by wgi: a register array indexed at run time goes to local memory.)
    const float rs_own[2] = {wgi ? rs[2] : rs[0], wgi ? rs[3] : rs[1]};
    f8mma::StoreRows<kTiled>(p, o, rs_own, b, worker, whole, row_lo, row_hi, m_lo, m_hi,
                             l_lo * (1.0f / f8mma::kPScale), l_hi * (1.0f / f8mma::kPScale), wgi,
                             c);
  }
#endif
}

// 1 on an SM90 device (one block an SM), 0 elsewhere: the plan then refuses the variant.
template <KvCacheFormat kFormat, int kStages>
int MlaDecodeFp8Mma64BlocksPerSm() {
  static const int blocks = [] {
    if (!wgmma::CurrentDeviceIsSm90()) return 0;
    return DecodeKernelBlocksPerSm(
        reinterpret_cast<const void*>(&MlaDecodeFp8Mma64Kernel<kFormat, kStages>), f8mma::kThreads,
        f8mma64::Config<kFormat, kStages>::kSmemBytes);
  }();
  return blocks;
}

template <KvCacheFormat kFormat, int kStages>
cudaError_t LaunchMlaDecodeFp8Mma64(const MlaDecodeKernelParams& p, int grid, cudaStream_t stream) {
  if (MlaDecodeFp8Mma64BlocksPerSm<kFormat, kStages>() == 0) return cudaErrorInvalidConfiguration;
  MlaDecodeFp8Mma64Kernel<kFormat, kStages>
      <<<grid, f8mma::kThreads, f8mma64::Config<kFormat, kStages>::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

#define MLASERVE_INSTANTIATE_MLA_DECODE_FP8MMA64(FORMAT, STAGES)                                  \
  template cudaError_t LaunchMlaDecodeFp8Mma64<FORMAT, STAGES>(const MlaDecodeKernelParams&, int, \
                                                               cudaStream_t);                     \
  template int MlaDecodeFp8Mma64BlocksPerSm<FORMAT, STAGES>();

}  // namespace mlaserve::mla
