// The FP8 block-128 expert layout of the GPU grouped GEMM (kernels/moe/fp8_moe_layout.h) on the
// CPU: every element of the rearranged projection equals DeepSeek's dequantization as the project
// defines it (DequantizeFp8Block, kernels/linear) exactly, windows of a tensor (tensor-parallel
// shards) included; padding is zero; the kernel's register formation (Fp8PairToBf16, its host
// twin) gives bf16(fp32(e4m3 * s)) at every PTX fragment slot, the slots written out by hand here;
// shape rules and non-finite scales are errors.
#include "kernels/moe/fp8_moe_layout.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/linear/fp8_block_ref.h"

namespace mlaserve {
namespace {

// A random FP8 block tensor [rows, cols]: every finite e4m3 code (the NaN codes 0x7f / 0xff
// excluded), fp32 scales amax / 448-like over 2^-30 .. 2^2 with a random 24-bit mantissa, one
// block in 8 zero.
struct Fp8Tensor {
  int rows, cols, br, bc;
  std::vector<uint8_t> codes;
  std::vector<float> scale;
  Fp8BlockTensor View() const { return {codes.data(), scale.data(), rows, cols, br, bc}; }
};

uint8_t RandomCode(std::mt19937& rng) {
  for (;;) {
    const uint8_t c = static_cast<uint8_t>(rng());
    if ((c & 0x7f) != 0x7f) {
      return c;
    }
  }
}

Fp8Tensor RandomFp8(int rows, int cols, int br, int bc, uint32_t seed) {
  std::mt19937 rng(seed);
  Fp8Tensor t{rows, cols, br, bc};
  t.codes.resize(static_cast<size_t>(rows) * cols);
  for (auto& c : t.codes) {
    c = RandomCode(rng);
  }
  t.scale.resize(static_cast<size_t>((rows + br - 1) / br) * ((cols + bc - 1) / bc));
  for (auto& s : t.scale) {
    const uint32_t r = rng();
    s = r % 8 == 0 ? 0.0f
                   : std::ldexp(1.0f + static_cast<float>(r >> 8 & 0xffffff) / 16777216.0f,
                                -30 + static_cast<int>(r % 33));
  }
  return t;
}

// The window [row0, row0 + rows) x [col0, col0 + cols) of t as the loader hands it over: its own
// codes array, the tensor's whole grid.
struct Window {
  std::vector<uint8_t> codes;
  Fp8BlockTensor view;
};

Window WindowOf(const Fp8Tensor& t, int row0, int rows, int col0, int cols) {
  Window w;
  w.codes.resize(static_cast<size_t>(rows) * cols);
  for (int r = 0; r < rows; ++r) {
    std::memcpy(w.codes.data() + static_cast<size_t>(r) * cols,
                t.codes.data() + static_cast<size_t>(row0 + r) * t.cols + col0, cols);
  }
  w.view = {w.codes.data(),
            t.scale.data(),
            rows,
            cols,
            t.br,
            t.bc,
            row0,
            col0,
            (t.rows + t.br - 1) / t.br,
            (t.cols + t.bc - 1) / t.bc};
  return w;
}

// The window by the project's reference, on the whole tensor.
std::vector<float> Reference(const Fp8Tensor& t, int row0, int rows, int col0, int cols) {
  std::vector<float> out(static_cast<size_t>(rows) * cols);
  DequantizeFp8Block(t.View(), row0, rows, col0, cols, out.data());
  return out;
}

struct Case {
  int rows, cols, br, bc, row0, nrows, col0, ncols, rows_p, cols_p;
};

TEST(Fp8LayoutTest, RelayoutMatchesTheReferenceExactly) {
  const Case cases[] = {
      {16, 64, 128, 128, 0, 16, 0, 64, 16, 64},          // one chunk, no padding
      {24, 64, 128, 128, 0, 24, 0, 64, 32, 128},         // dsv3-tiny's gate: rows, columns padded
      {64, 24, 128, 128, 0, 64, 0, 24, 128, 128},        // dsv3-tiny's down: a partial chunk
      {300, 448, 128, 128, 0, 300, 0, 448, 304, 512},    // partial blocks at both ends
      {512, 384, 128, 128, 136, 200, 0, 384, 208, 384},  // a row window off the block grid
      {256, 512, 128, 128, 0, 256, 192, 256, 256, 256},  // a column window (a down_proj shard)
      {96, 640, 8, 64, 40, 48, 64, 448, 48, 512},        // the smallest blocks the layout takes
      {256, 768, 256, 192, 8, 240, 128, 576, 256, 576},  // blocks of 256 x 192
  };
  uint32_t seed = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "tensor " << c.rows << "x" << c.cols << " blocks " << c.br << "x" << c.bc
                 << " window rows [" << c.row0 << ", " << c.row0 + c.nrows << ") cols [" << c.col0
                 << ", " << c.col0 + c.ncols << ") padded " << c.rows_p << "x" << c.cols_p);
    const Fp8Tensor t = RandomFp8(c.rows, c.cols, c.br, c.bc, ++seed);
    const Window w = WindowOf(t, c.row0, c.nrows, c.col0, c.ncols);
    std::vector<uint8_t> codes(Fp8TiledCodeBytes(c.rows_p, c.cols_p), 0x5a);
    std::vector<uint8_t> scales(Fp8TiledScaleBytes(c.rows_p, c.cols_p), 0x5a);
    const absl::Status st = RelayoutFp8(w.view, c.rows_p, c.cols_p, codes.data(), scales.data());
    ASSERT_TRUE(st.ok()) << st;
    std::vector<float> tiled(static_cast<size_t>(c.rows_p) * c.cols_p);
    DequantizeTiledFp8(codes.data(), scales.data(), c.rows_p, c.cols_p, tiled.data());
    const std::vector<float> ref = Reference(t, c.row0, c.nrows, c.col0, c.ncols);
    // The window's own view dequantizes to the same values (ScaleOf with an origin).
    std::vector<float> own(ref.size());
    DequantizeFp8Block(w.view, 0, c.nrows, 0, c.ncols, own.data());
    int mismatches = 0, own_mismatches = 0, nonzero_pad = 0;
    for (int r = 0; r < c.rows_p; ++r) {
      for (int col = 0; col < c.cols_p; ++col) {
        const float got = tiled[static_cast<size_t>(r) * c.cols_p + col];
        if (r < c.nrows && col < c.ncols) {
          const size_t i = static_cast<size_t>(r) * c.ncols + col;
          // Bit for bit (the sign of zero included).
          mismatches += std::bit_cast<uint32_t>(got) != std::bit_cast<uint32_t>(ref[i]);
          own_mismatches += std::bit_cast<uint32_t>(own[i]) != std::bit_cast<uint32_t>(ref[i]);
        } else {
          nonzero_pad += std::bit_cast<uint32_t>(got) != 0u;  // +0: code 0, scale 0
        }
      }
    }
    EXPECT_EQ(mismatches, 0);
    EXPECT_EQ(own_mismatches, 0);
    EXPECT_EQ(nonzero_pad, 0);
  }
}

TEST(Fp8LayoutTest, GateUpInterleavesRowsByEight) {
  const int inter = 20, hidden = 192, inter_p = 24, hidden_p = 256;
  const Fp8Tensor g = RandomFp8(inter, hidden, 128, 128, 7),
                  u = RandomFp8(inter, hidden, 128, 128, 8);
  std::vector<uint8_t> codes(Fp8TiledCodeBytes(2 * inter_p, hidden_p));
  std::vector<uint8_t> scales(Fp8TiledScaleBytes(2 * inter_p, hidden_p));
  ASSERT_TRUE(
      RelayoutFp8GateUp(g.View(), u.View(), inter_p, hidden_p, codes.data(), scales.data()).ok());
  std::vector<float> tiled(static_cast<size_t>(2) * inter_p * hidden_p);
  DequantizeTiledFp8(codes.data(), scales.data(), 2 * inter_p, hidden_p, tiled.data());
  const std::vector<float> gr = Reference(g, 0, inter, 0, hidden),
                           ur = Reference(u, 0, inter, 0, hidden);
  for (int i = 0; i < inter_p; ++i) {
    const int row_g = 16 * (i / 8) + i % 8, row_u = row_g + 8;
    for (int c = 0; c < hidden_p; ++c) {
      const bool real = i < inter && c < hidden;
      ASSERT_EQ(tiled[row_g * hidden_p + c], real ? gr[i * hidden + c] : 0.0f) << i << " " << c;
      ASSERT_EQ(tiled[row_u * hidden_p + c], real ? ur[i * hidden + c] : 0.0f) << i << " " << c;
    }
  }
  // A tile's two scales are gate's and up's.
  float s[2];
  std::memcpy(s, scales.data(), 8);
  EXPECT_EQ(s[0], g.scale[0]);
  EXPECT_EQ(s[1], u.scale[0]);
}

// The decode the kernel runs (Fp8PairToBf16's host twin; the device's cvt path is checked against
// it on the GPU by fp8_moe_gpu_test) is bf16(fp32(e4m3 * s)), RNE, for every code pair: exact
// e4m3 values (Fp8BitsToFloat against common/dtype's decoder, subnormals and -0 included), one
// fp32 product, one rounding to bf16; scales include fp32 subnormals and values whose products
// tie in bf16.
TEST(Fp8LayoutTest, PairDecodeIsBf16OfTheFp32Product) {
  for (uint32_t c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) {
      EXPECT_EQ(std::fabs(Fp8BitsToFloat(c)), 480.0f);  // the bit path's reading of NaN codes
      continue;
    }
    EXPECT_EQ(std::bit_cast<uint32_t>(Fp8BitsToFloat(c)),
              std::bit_cast<uint32_t>(E4m3ToFloat(static_cast<uint8_t>(c))))
        << c;
  }
  const float scales[] = {1.0f,          0.0f,         -1.0f,           1.0f / 448.0f,
                          3.0517578e-5f, 0.00123457f,  1.0f + 0x1p-23f, 0x1.01p0f,
                          0x1p-140f,     0x1.7fp-127f, 123.456f};
  int checked = 0;
  for (float s : scales) {
    for (uint32_t pair = 0; pair < 65536; ++pair) {
      const uint8_t lo = pair & 0xff, hi = pair >> 8;
      if ((lo & 0x7f) == 0x7f || (hi & 0x7f) == 0x7f) {
        continue;
      }
      const uint32_t got = Fp8PairToBf16(pair, s);
      const uint32_t want = FloatToBf16(E4m3ToFloat(lo) * s) |
                            (static_cast<uint32_t>(FloatToBf16(E4m3ToFloat(hi) * s)) << 16);
      ASSERT_EQ(got, want) << "pair 0x" << std::hex << pair << " scale " << s;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 11 * 254 * 254);
  // RNE on ties: e4m3 1.0 (0x38) times 1 + 2^-8, halfway between bf16 1.0 and 1 + 2^-7, gives
  // the even 1.0; times 1 + 3 * 2^-8 gives the even 1 + 2^-6.
  EXPECT_EQ(Fp8PairToBf16(0x38, 1.00390625f) & 0xffff, 0x3f80u);
  EXPECT_EQ(Fp8PairToBf16(0x38, 1.01171875f) & 0xffff, 0x3f82u);
}

// Lane 4g + t, block j of a chunk: the lane's vector of half j / 2 (16 bytes at 512 (j / 2) +
// 16 lane), bytes 8 (j % 2) .. +7 = (a0, a1, a2, a3), two bytes each; a0 = (W[g][2t], W[g][2t+1]),
// a1 = (W[g+8][2t], ..), a2 = (W[g][2t+8], ..), a3 = (W[g+8][2t+8], ..) of columns 16j..16j+15
// (PTX ISA, mma.m16n8k16 A fragment, written out here without mma_fragment_layout.h). The whole
// register as the kernel forms it, with the scale of its rows (a0 / a2: the tile's first 8 rows),
// is bf16 of the reference's fp32 value.
TEST(Fp8LayoutTest, KernelDecodeFollowsThePtxFragmentLayout) {
  // Rows 0..7 and 8..15 in different blocks: blocks of 8 rows.
  const Fp8Tensor t = RandomFp8(16, 64, 8, 64, 3);
  std::vector<uint8_t> codes(1024), scales(8);
  ASSERT_TRUE(RelayoutFp8(t.View(), 16, 64, codes.data(), scales.data()).ok());
  ASSERT_NE(t.scale[0], t.scale[1]);
  const std::vector<float> ref = Reference(t, 0, 16, 0, 64);
  float sc[2];
  std::memcpy(sc, scales.data(), 8);
  EXPECT_EQ(sc[0], t.scale[0]);
  EXPECT_EQ(sc[1], t.scale[1]);
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t4 = lane % 4;
    for (int j = 0; j < 4; ++j) {
      const uint8_t* b = codes.data() + (j / 2) * 512 + lane * 16 + (j % 2) * 8;
      const int rows[4] = {g, g + 8, g, g + 8};
      const int cols[4] = {2 * t4, 2 * t4, 2 * t4 + 8, 2 * t4 + 8};
      for (int r = 0; r < 4; ++r) {
        for (int half = 0; half < 2; ++half) {
          EXPECT_EQ(b[2 * r + half], t.codes[rows[r] * 64 + 16 * j + cols[r] + half])
              << "lane " << lane << " block " << j << " a" << r << " half " << half;
        }
        const uint32_t pair = b[2 * r] | (b[2 * r + 1] << 8);
        const uint32_t got = Fp8PairToBf16(pair, sc[r % 2]);
        for (int half = 0; half < 2; ++half) {
          const float want = ref[rows[r] * 64 + 16 * j + cols[r] + half];
          EXPECT_EQ(half ? got >> 16 : got & 0xffff, FloatToBf16(want))
              << "lane " << lane << " block " << j << " a" << r << " half " << half;
        }
      }
    }
  }
}

TEST(Fp8LayoutTest, ChunkBytesByHand) {
  EXPECT_EQ(Fp8ChunkByteOf(0, 0), 0);   // lane 0, a0 low
  EXPECT_EQ(Fp8ChunkByteOf(0, 1), 1);   // lane 0, a0 high
  EXPECT_EQ(Fp8ChunkByteOf(8, 0), 2);   // a1: row g + 8
  EXPECT_EQ(Fp8ChunkByteOf(0, 8), 4);   // a2: column 2t + 8
  EXPECT_EQ(Fp8ChunkByteOf(8, 9), 7);   // a3 high
  EXPECT_EQ(Fp8ChunkByteOf(0, 2), 16);  // lane 1 (t = 1)
  EXPECT_EQ(Fp8ChunkByteOf(1, 0), 64);  // lane 4 (g = 1)
  EXPECT_EQ(Fp8ChunkByteOf(7, 7), 16 * 31 + 1);
  EXPECT_EQ(Fp8ChunkByteOf(0, 16), 8);    // block 1: the second 8 bytes of the vector
  EXPECT_EQ(Fp8ChunkByteOf(0, 32), 512);  // block 2: the second vector
  EXPECT_EQ(Fp8ChunkByteOf(15, 63), 512 + 16 * 31 + 8 + 7);
  // Every byte of the chunk is one element's.
  std::vector<int> seen(1024, 0);
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 64; ++c) {
      ++seen[Fp8ChunkByteOf(r, c)];
    }
  }
  for (int i = 0; i < 1024; ++i) {
    ASSERT_EQ(seen[i], 1) << i;
  }
}

TEST(Fp8LayoutTest, RejectsBadShapesAndScales) {
  const Fp8Tensor t = RandomFp8(256, 256, 128, 128, 5);
  std::vector<uint8_t> codes(Fp8TiledCodeBytes(256, 256)), sc(Fp8TiledScaleBytes(256, 256));
  auto relayout = [&](const Fp8BlockTensor& v, int rows_p, int cols_p) {
    return RelayoutFp8(v, rows_p, cols_p, codes.data(), sc.data());
  };
  auto contains = [](const absl::Status& st, const char* what) {
    return std::string(st.message()).find(what) != std::string::npos;
  };
  EXPECT_TRUE(relayout(t.View(), 256, 256).ok());
  // Padded shapes not on the tile grid, or smaller than the projection.
  EXPECT_FALSE(relayout(t.View(), 248, 256).ok());
  EXPECT_FALSE(relayout(t.View(), 256, 224).ok());
  // Windows off the 8-row / 64-column grid (a tensor-parallel split into odd sizes).
  const Window off_row = WindowOf(t, 4, 64, 0, 256);
  const absl::Status st_row = relayout(off_row.view, 64, 256);
  EXPECT_FALSE(st_row.ok());
  EXPECT_TRUE(contains(st_row, "row 4, column 0")) << st_row;
  const Window off_col = WindowOf(t, 0, 64, 32, 128);
  const absl::Status st_col = relayout(off_col.view, 64, 128);
  EXPECT_FALSE(st_col.ok());
  EXPECT_TRUE(contains(st_col, "multiple of 64")) << st_col;
  // Blocks the layout's scale slots cannot follow.
  Fp8Tensor b32 = RandomFp8(64, 128, 128, 32, 6);
  const absl::Status st_b = relayout(b32.View(), 64, 128);
  EXPECT_FALSE(st_b.ok());
  EXPECT_TRUE(contains(st_b, "weight_block_size [128, 32]")) << st_b;
  // A window past the scale grid.
  Window past = WindowOf(t, 0, 64, 0, 256);
  past.view.grid_rows = 1;
  past.view.origin_row = 128;
  EXPECT_FALSE(relayout(past.view, 64, 256).ok());
  // A NaN or infinite scale is named by its block.
  Fp8Tensor bad = t;
  bad.scale[1 * 2 + 1] = std::numeric_limits<float>::infinity();
  const absl::Status st = relayout(bad.View(), 256, 256);
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(contains(st, "scale block [1, 1]")) << st;
  // Gate and up of different shapes.
  const Fp8Tensor q = RandomFp8(8, 256, 128, 128, 9);
  EXPECT_FALSE(RelayoutFp8GateUp(t.View(), q.View(), 256, 256, codes.data(), sc.data()).ok());
}

}  // namespace
}  // namespace mlaserve
