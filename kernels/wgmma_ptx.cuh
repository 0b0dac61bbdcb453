// Warpgroup-level (wgmma) PTX wrappers for SM90a kernels: shared-memory matrix descriptors, fences
// and the mma_async shapes the kernels use. Compiled to nothing outside sm_90a (the callers check
// the device before launching; see kernels/mla/mla_decode_wgmma.cuh).
//
// Facts (PTX ISA 8.x, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions"):
// * Descriptor (64 bits): bits 0-13 start address >> 4, 16-29 leading-dimension byte offset >> 4,
//   32-45 stride-dimension byte offset >> 4, 49-51 base offset (0 when every swizzle atom is
//   1024-B aligned), 62-63 swizzle mode (1 = 128-byte swizzle).
// * 128-byte swizzle: within each 1024-B atom of 8 rows x 128 B, the 16-B chunk index (address
//   bits 4-6) is XORed with the row index (bits 7-9). Canonical layouts (CUTLASS
//   cute/atom/mma_traits_sm90_gmma.hpp, make_gmma_desc), T = 8 16-bit elements:
//     K-major : Swizzle<3,4,3> o ((8,m),(T,2k)) : ((8T,SBO),(1,T))  -> rows of 64 elements (128 B),
//               SBO = 1024 B between 8-row groups, LBO unused (1); a k16 step inside the 128-B
//               row is the start address + 32 B per step.
//     MN-major: Swizzle<3,4,3> o ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO)) -> 64 contiguous MN
//               elements per 128-B row, LBO = bytes between 64-element MN blocks, SBO = 1024 B
//               between 8-row K groups.
//   So one array of [tokens][64 dims] 128-B rows per 64-dim block serves both as a K-major B
//   operand (S = Q K^T, N = tokens) and as an MN-major B operand (O = P V, N = dims).
// * Accumulator fragment of m64nNk16 (f32): warp w of the warpgroup owns rows 16w .. 16w + 15;
//   d[4j + e]: row 16w + lane/4 + 8 (e >= 2), column 8j + 2 (lane % 4) + (e & 1). The register A
//   fragment of a k16 step is mma.m16n8k16's A layout per warp, so accumulator columns 16kk ..
//   16kk + 15 repacked in pairs are the A operand of k-step kk (no shuffles).
// * wgmma.fence before the first mma_async of a batch whose registers (accumulators, A) were
//   written by ordinary instructions; commit_group / wait_group N to wait; st.shared writes read
//   by mma_async need fence.proxy.async.shared::cta before the barrier that publishes them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mlaserve::wgmma {

// Host: whether the current device is SM 9.0, the only architecture the sm_90a images of the
// wgmma kernels run on (their images for other architectures are empty).
inline bool CurrentDeviceIsSm90() {
  int device = 0, major = 0, minor = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
         major == 9 && minor == 0;
}

// 128-byte-swizzle descriptor as (low, high) 32-bit halves; addresses and offsets in bytes
// (shared window). The low half holds the start address (>> 4) and the leading byte offset, so a
// k-step's offset is added to the low half (addresses below 256 KB never carry out of the field).
struct Desc {
  uint32_t lo, hi;
};
__device__ __forceinline__ Desc Desc128B(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  return {((smem_addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16), (sbo >> 4) | (1u << 30)};
}

// No-swizzle ("interleave") descriptor: 8-row x 16-B core matrices of 128 contiguous bytes; lbo =
// bytes between core matrices adjacent in K, sbo = bytes between 8-row groups (CUTLASS
// cute/atom/mma_traits_sm90_gmma.hpp, Layout_K_INTER_Atom: ((8,m),(T,2k)) : ((T,SBO),(1,LBO)),
// T = 16 bytes of elements); layout-type bits 62-63 = 0.
__device__ __forceinline__ Desc DescNoSwizzle(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  return {((smem_addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16), sbo >> 4};
}

__device__ __forceinline__ void Fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void Commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void Wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Generic-proxy shared-memory writes made visible to the async proxy (wgmma operand reads).
__device__ __forceinline__ void FenceProxyAsyncShared() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving accumulator reads/writes across an mma_async in flight.
template <int N>
__device__ __forceinline__ void FenceRegs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Keeps registers live, and unmodified by anything else, up to this point: after the
// wgmma.wait_group that retires the last wgmma reading them as A (their writes before that are
// undefined behaviour, and the compiler would otherwise treat them as dead after the wgmma).
template <int N>
__device__ __forceinline__ void UseRegs(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// Accumulator operand lists of the shapes below (generated; 16 and 128 fp32 registers).
#define MLASERVE_WGMMA_D16                                               \
  "{"                                                                    \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
  "}"
#define MLASERVE_WGMMA_D16_OUT                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15])
#define MLASERVE_WGMMA_D128                                                                        \
  "{"                                                                                              \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "               \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "               \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "               \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "               \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "               \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "   \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
  "}"
#define MLASERVE_WGMMA_D128_OUT                                                                   \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),  \
      "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),  \
      "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),  \
      "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),  \
      "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]),  \
      "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),          \
      "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]),         \
      "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]),         \
      "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]),         \
      "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// D[64 x 32] (+)= A[64 x 16] * B[16 x 32], A and B from shared memory (K-major); descriptors
// as (low, high) 32-bit halves (only the low half's address field varies per k-step). T is the
// input type, "f16" or "bf16".
#define MLASERVE_WGMMA_M64N32K16_SS(T)                                              \
  asm volatile(                                                                     \
      "{\n .reg .pred p;\n .reg .b64 da, db;\n setp.ne.b32 p, %20, 0;\n"            \
      " mov.b64 da, {%16, %17};\n mov.b64 db, {%18, %19};\n"                        \
      " wgmma.mma_async.sync.aligned.m64n32k16.f32." T "." T " " MLASERVE_WGMMA_D16 \
      ", da, db, p, 1, 1, 0, 0;\n}\n"                                               \
      : MLASERVE_WGMMA_D16_OUT                                                      \
      : "r"(a_lo), "r"(a_hi), "r"(b_lo), "r"(b_hi), "r"(accumulate))
template <bool kF16>
__device__ __forceinline__ void WgmmaM64N32K16SS(float (&d)[16], uint32_t a_lo, uint32_t a_hi,
                                                 uint32_t b_lo, uint32_t b_hi, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kF16) {
    MLASERVE_WGMMA_M64N32K16_SS("f16");
  } else {
    MLASERVE_WGMMA_M64N32K16_SS("bf16");
  }
#endif
}

// D[64 x 256] (+)= A[64 x 16] * B[16 x 256], A from registers (mma.m16n8k16 A layout per warp),
// B from shared memory, MN-major (imm-trans-b = 1; 16-bit types only).
#define MLASERVE_WGMMA_M64N256K16_RS_TRANS_B(T)                                       \
  asm volatile(                                                                       \
      "{\n .reg .pred p;\n .reg .b64 db;\n setp.ne.b32 p, %134, 0;\n"                 \
      " mov.b64 db, {%132, %133};\n"                                                  \
      " wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " " MLASERVE_WGMMA_D128 \
      ", {%128, %129, %130, %131}, db, p, 1, 1, 1;\n}\n"                              \
      : MLASERVE_WGMMA_D128_OUT                                                       \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_lo), "r"(b_hi), "r"(accumulate))
template <bool kF16>
__device__ __forceinline__ void WgmmaM64N256K16RSTransB(float (&d)[128], const uint32_t (&a)[4],
                                                        uint32_t b_lo, uint32_t b_hi,
                                                        int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kF16) {
    MLASERVE_WGMMA_M64N256K16_RS_TRANS_B("f16");
  } else {
    MLASERVE_WGMMA_M64N256K16_RS_TRANS_B("bf16");
  }
#endif
}

// Accumulator operand lists of m64n64 (32 fp32 registers) and m64n128 (64).
#define MLASERVE_WGMMA_D32                                                         \
  "{"                                                                              \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}"
#define MLASERVE_WGMMA_D32_OUT                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define MLASERVE_WGMMA_D64                                                           \
  "{"                                                                                \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"   \
  "}"
#define MLASERVE_WGMMA_D64_OUT                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// D[64 x 128] (+)= A[64 x 16] * B[16 x 128], A from registers (mma.m16n8k16 A layout per warp),
// B from shared memory, K-major (imm-trans-b = 0): B[k][j] is element k of row j of a
// [128 rows][16-bit K] array, e.g. the activation rows of the weight-only MoE GEMM.
#define MLASERVE_WGMMA_M64N128K16_RS(T)                                              \
  asm volatile(                                                                      \
      "{\n .reg .pred p;\n .reg .b64 db;\n setp.ne.b32 p, %70, 0;\n"                 \
      " mov.b64 db, {%68, %69};\n"                                                   \
      " wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " " MLASERVE_WGMMA_D64 \
      ", {%64, %65, %66, %67}, db, p, 1, 1, 0;\n}\n"                                 \
      : MLASERVE_WGMMA_D64_OUT                                                       \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_lo), "r"(b_hi), "r"(accumulate))
template <bool kF16>
__device__ __forceinline__ void WgmmaM64N128K16RS(float (&d)[64], const uint32_t (&a)[4],
                                                  uint32_t b_lo, uint32_t b_hi, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kF16) {
    MLASERVE_WGMMA_M64N128K16_RS("f16");
  } else {
    MLASERVE_WGMMA_M64N128K16_RS("bf16");
  }
#endif
}

// D[64 x 64] (+)= A[64 x 16] * B[16 x 64], A from registers (mma.m16n8k16 A layout per warp),
// B from shared memory, K-major (imm-trans-b = 0): B[k][j] is element k of row j of a
// [64 rows][16-bit K] array, e.g. the activation rows of the weight-only MoE GEMM.
#define MLASERVE_WGMMA_M64N64K16_RS(T)                                              \
  asm volatile(                                                                     \
      "{\n .reg .pred p;\n .reg .b64 db;\n setp.ne.b32 p, %38, 0;\n"                \
      " mov.b64 db, {%36, %37};\n"                                                  \
      " wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " " MLASERVE_WGMMA_D32 \
      ", {%32, %33, %34, %35}, db, p, 1, 1, 0;\n}\n"                                \
      : MLASERVE_WGMMA_D32_OUT                                                      \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_lo), "r"(b_hi), "r"(accumulate))
template <bool kF16>
__device__ __forceinline__ void WgmmaM64N64K16RS(float (&d)[32], const uint32_t (&a)[4],
                                                 uint32_t b_lo, uint32_t b_hi, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kF16) {
    MLASERVE_WGMMA_M64N64K16_RS("f16");
  } else {
    MLASERVE_WGMMA_M64N64K16_RS("bf16");
  }
#endif
}

// D[64 x 64] (+)= A[64 x 16] * B[16 x 64], A and B from shared memory, both K-major (the MLA
// seesaw kernel's q.k: Q rows against 64 cache tokens).
#define MLASERVE_WGMMA_M64N64K16_SS(T)                                              \
  asm volatile(                                                                     \
      "{\n .reg .pred p;\n .reg .b64 da, db;\n setp.ne.b32 p, %36, 0;\n"            \
      " mov.b64 da, {%32, %33};\n mov.b64 db, {%34, %35};\n"                        \
      " wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " " MLASERVE_WGMMA_D32 \
      ", da, db, p, 1, 1, 0, 0;\n}\n"                                               \
      : MLASERVE_WGMMA_D32_OUT                                                      \
      : "r"(a_lo), "r"(a_hi), "r"(b_lo), "r"(b_hi), "r"(accumulate))
template <bool kF16>
__device__ __forceinline__ void WgmmaM64N64K16SS(float (&d)[32], uint32_t a_lo, uint32_t a_hi,
                                                 uint32_t b_lo, uint32_t b_hi, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kF16) {
    MLASERVE_WGMMA_M64N64K16_SS("f16");
  } else {
    MLASERVE_WGMMA_M64N64K16_SS("bf16");
  }
#endif
}

// D[64 x 256] (+)= A[64 x 16] * B[16 x 256], A from shared memory (K-major), B from shared
// memory, MN-major (imm-trans-b = 1; 16-bit types only): the MLA seesaw kernel's P.V with the
// other warpgroup's P.
#define MLASERVE_WGMMA_M64N256K16_SS_TRANS_B(T)                                       \
  asm volatile(                                                                       \
      "{\n .reg .pred p;\n .reg .b64 da, db;\n setp.ne.b32 p, %132, 0;\n"             \
      " mov.b64 da, {%128, %129};\n mov.b64 db, {%130, %131};\n"                      \
      " wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " " MLASERVE_WGMMA_D128 \
      ", da, db, p, 1, 1, 0, 1;\n}\n"                                                 \
      : MLASERVE_WGMMA_D128_OUT                                                       \
      : "r"(a_lo), "r"(a_hi), "r"(b_lo), "r"(b_hi), "r"(accumulate))
template <bool kF16>
__device__ __forceinline__ void WgmmaM64N256K16SSTransB(float (&d)[128], uint32_t a_lo,
                                                        uint32_t a_hi, uint32_t b_lo, uint32_t b_hi,
                                                        int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kF16) {
    MLASERVE_WGMMA_M64N256K16_SS_TRANS_B("f16");
  } else {
    MLASERVE_WGMMA_M64N256K16_SS_TRANS_B("bf16");
  }
#endif
}

// e4m3 x e4m3 shapes (the MLA decode kernel's FP8 tensor-core form, mla_decode_fp8mma.cuh). PTX
// ISA, wgmma .e4m3: K = 32 a step; both operands K-major (no transpose operands for 8-bit types:
// ptxas rejects them, tile-ai/tilelang pull request 3224); the register A fragment of a k32 step
// is mma.m16n8k32's 8-bit A layout per warp: register 0 row lane/4, bytes = columns 4 (lane % 4)
// .. + 3; register 1 row + 8; registers 2 and 3 the same at columns + 16.

// D[64 x 32] (+)= A[64 x 32] * B[32 x 32], e4m3, A and B from shared memory (K-major).
__device__ __forceinline__ void WgmmaM64N32K32E4m3SS(float (&d)[16], uint32_t a_lo, uint32_t a_hi,
                                                     uint32_t b_lo, uint32_t b_hi, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n .reg .pred p;\n .reg .b64 da, db;\n setp.ne.b32 p, %20, 0;\n"
      " mov.b64 da, {%16, %17};\n mov.b64 db, {%18, %19};\n"
      " wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 " MLASERVE_WGMMA_D16
      ", da, db, p, 1, 1;\n}\n"
      : MLASERVE_WGMMA_D16_OUT
      : "r"(a_lo), "r"(a_hi), "r"(b_lo), "r"(b_hi), "r"(accumulate));
#endif
}

// D[64 x 256] (+)= A[64 x 32] * B[32 x 256], e4m3, A from registers, B from shared memory
// (K-major: B[k][j] is byte k of row j).
__device__ __forceinline__ void WgmmaM64N256K32E4m3RS(float (&d)[128], const uint32_t (&a)[4],
                                                      uint32_t b_lo, uint32_t b_hi,
                                                      int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n .reg .pred p;\n .reg .b64 db;\n setp.ne.b32 p, %134, 0;\n"
      " mov.b64 db, {%132, %133};\n"
      " wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 " MLASERVE_WGMMA_D128
      ", {%128, %129, %130, %131}, db, p, 1, 1;\n}\n"
      : MLASERVE_WGMMA_D128_OUT
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_lo), "r"(b_hi), "r"(accumulate));
#endif
}

// D[64 x 128] (+)= A[64 x 32] * B[32 x 128], e4m3, A from registers, B from shared memory
// (K-major).
__device__ __forceinline__ void WgmmaM64N128K32E4m3RS(float (&d)[64], const uint32_t (&a)[4],
                                                      uint32_t b_lo, uint32_t b_hi,
                                                      int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n .reg .pred p;\n .reg .b64 db;\n setp.ne.b32 p, %70, 0;\n"
      " mov.b64 db, {%68, %69};\n"
      " wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MLASERVE_WGMMA_D64
      ", {%64, %65, %66, %67}, db, p, 1, 1;\n}\n"
      : MLASERVE_WGMMA_D64_OUT
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_lo), "r"(b_hi), "r"(accumulate));
#endif
}

// D[64 x 256] (+)= A[64 x 32] * B[32 x 256], e4m3, A and B from shared memory (K-major).
__device__ __forceinline__ void WgmmaM64N256K32E4m3SS(float (&d)[128], uint32_t a_lo, uint32_t a_hi,
                                                      uint32_t b_lo, uint32_t b_hi,
                                                      int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n .reg .pred p;\n .reg .b64 da, db;\n setp.ne.b32 p, %132, 0;\n"
      " mov.b64 da, {%128, %129};\n mov.b64 db, {%130, %131};\n"
      " wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 " MLASERVE_WGMMA_D128
      ", da, db, p, 1, 1;\n}\n"
      : MLASERVE_WGMMA_D128_OUT
      : "r"(a_lo), "r"(a_hi), "r"(b_lo), "r"(b_hi), "r"(accumulate));
#endif
}

// D[64 x 128] (+)= A[64 x 32] * B[32 x 128], e4m3, A and B from shared memory (K-major).
__device__ __forceinline__ void WgmmaM64N128K32E4m3SS(float (&d)[64], uint32_t a_lo, uint32_t a_hi,
                                                      uint32_t b_lo, uint32_t b_hi,
                                                      int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n .reg .pred p;\n .reg .b64 da, db;\n setp.ne.b32 p, %68, 0;\n"
      " mov.b64 da, {%64, %65};\n mov.b64 db, {%66, %67};\n"
      " wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MLASERVE_WGMMA_D64
      ", da, db, p, 1, 1;\n}\n"
      : MLASERVE_WGMMA_D64_OUT
      : "r"(a_lo), "r"(a_hi), "r"(b_lo), "r"(b_hi), "r"(accumulate));
#endif
}

}  // namespace mlaserve::wgmma
