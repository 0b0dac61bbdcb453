// Warp-level PTX wrappers shared by the CUDA kernels (kernels/mla, kernels/moe): cp.async copies,
// ldmatrix, shared loads and mma.sync m16n8k16 (bf16 / f16 in, fp32 accumulate). Everything here
// runs on SM80 through SM120. Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16 with
// floating point type".
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mlaserve::ptx {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy. src-size 0 when !valid zero-fills and reads nothing (rows past a
// sequence's end read as 0, never as stale NaN bytes).
__device__ __forceinline__ void CpAsync16(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  CpAsync16(SmemAddr(smem), gmem, valid);
}
// 8-byte copy (through L1: .ca is the only cache mode for sizes below 16).
__device__ __forceinline__ void CpAsync8(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void CpAsync8(void* smem, const void* gmem, bool valid) {
  CpAsync8(SmemAddr(smem), gmem, valid);
}
// 4-byte copy (through L1, as the 8-byte one).
__device__ __forceinline__ void CpAsync4(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 4 : 0));
}
// The %globaltimer (ns, the same clock for every SM and kernel): bounded waits and the kernels'
// timeline stamps.
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kN>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kN));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem));
}
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem) {
  LdMatrixX4(r, SmemAddr(smem));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem));
}

__device__ __forceinline__ uint32_t Lds32(uint32_t smem) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(smem));
  return v;
}
__device__ __forceinline__ float LdsF32(uint32_t smem) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(smem));
  return v;
}

// d += a * b, m16n8k16, fp32 accumulators.
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void MmaF16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// e4m3 x e4m3 -> f32 (sm_89+; native on SM 8.9 and 12.x, emulated through f16 by ptxas on
// SM90: NVIDIA/cutlass#1986). PTX ISA "Matrix Fragments for mma.m16n8k16 with integer type" (the
// same section covers .e4m3 and m16n8k32): A register r holds 4 consecutive k (byte i = k
// 4c + i) of row g (r even) or g + 8 (r odd), the second pair of registers k + 16 (k32 only);
// B register r holds k 4c + i (+ 16 r) of column g; g = lane / 4, c = lane % 4.
__device__ __forceinline__ void MmaE4m3K32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                           uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void MmaE4m3K16(float (&d)[4], const uint32_t (&a)[2], uint32_t b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(b));
}

}  // namespace mlaserve::ptx
