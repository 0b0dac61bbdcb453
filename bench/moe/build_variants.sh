#!/bin/bash
# Builds moe_bench variants with other tile knobs (moe_weight_only_gemm.cuh macros) into
# build-moe/variants/, for tuning runs (bench/moe/run_device.sh with VARIANTS=1). Needs build-moe.
# ONLY="NAME ..." builds a subset.
set -e
cd "$(dirname "$0")/../.."
ninja -C build-moe moe_bench moe_gpu_test > /dev/null
mkdir -p build-moe/variants
LINK=$(ninja -C build-moe -t commands moe_bench | tail -1 | sed 's/^: && //; s/ && :$//')
build() {
  name=$1; shift; files=$1; shift
  # ONLY="A B": build just the variants named.
  if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then return; fi
  objs=""
  for f in $files; do
    src=kernels/moe/nvfp4_moe_gemm_$f.cu
    case $f in fp8_*) src=kernels/moe/$f.cu ;; esac
    /usr/local/cuda/bin/nvcc -I"$PWD" -O2 -DNDEBUG --generate-code=arch=compute_90a,code=[compute_90a,sm_90a] -std=c++17 -lineinfo "$@" -c $src -o build-moe/variants/${name}_$f.o -Xptxas -v 2>&1 | grep -E "registers|spill" | sed "s/^/$name $f: /"
    objs="$objs variants/${name}_$f.o"
  done
  (cd build-moe && eval "${LINK/bench\/moe\/CMakeFiles\/moe_bench.dir\/moe_bench.cu.o -o bench\/moe\/moe_bench/bench/moe/CMakeFiles/moe_bench.dir/moe_bench.cu.o $objs -o variants/moe_bench_$name}")
}
D="gate_up_bn16 down_bn16"; P="gate_up_bn128 down_bn128"
# Decode: deeper pipeline with fewer blocks per SM; the previous 8 x 1 warp layout.
build D6 "$D" -DMLASERVE_MOE_DECODE_STAGES=6 -DMLASERVE_MOE_DECODE_MIN_BLOCKS=3
build D8W "$D" -DMLASERVE_MOE_DECODE_WARPS_M=8 -DMLASERVE_MOE_DECODE_MIN_BLOCKS=3
# Decode, more warps an SM (the kernel issues ~80 instructions per 16 x 64 weights a warp, and
# without the dequantization reads 89% of copy bandwidth): 3 stages and 5 blocks; K step 64
# with 6 stages and 5 blocks.
build D3B5 "$D" -DMLASERVE_MOE_DECODE_STAGES=3 -DMLASERVE_MOE_DECODE_MIN_BLOCKS=5
build D64S6B5 "$D" -DMLASERVE_MOE_DECODE_BK=64 -DMLASERVE_MOE_DECODE_STAGES=6 -DMLASERVE_MOE_DECODE_MIN_BLOCKS=5
# Prefill: 3 stages with the 8 x 1 warp layout (all_256 / 8192 tokens, 2026-11-29: 271.0 GEMM
# TFLOP/s against 269.2 for the default, within noise).
build P3S "$P" -DMLASERVE_MOE_PREFILL_STAGES=3
# The SM90 wgmma prefill kernel (moe_weight_only_wgmma.cuh; the default column of --prefill):
# 256-row blocks, one an SM, instead of 128-row blocks, two an SM (the default since the H200
# measured it 8-13% slower); 7 stages instead of 5.
build W2 "$P" -DMLASERVE_MOE_WGMMA_MBLOCKS=2
build W7 "$P" -DMLASERVE_MOE_WGMMA_STAGES=7
# FP8 decode (fp8_moe_gemm.cuh; run with --fp8 --decode): K step 128 with 3 stages (16 KB of codes
# a stage, 60 KB of shared memory); the bit-manipulation e4m3 decode instead of the cvt path (is
# the cvt path bound by the conversion pipe?). Neither measured yet.
F="fp8_moe_gemm_gate_up_bn16 fp8_moe_gemm_down_bn16"
build FP8_BK128 "$F" -DMLASERVE_FP8_MOE_DECODE_BK=128 -DMLASERVE_FP8_MOE_DECODE_STAGES=3 -DMLASERVE_FP8_MOE_DECODE_MIN_BLOCKS=3
build FP8_BITS "$F" -DMLASERVE_FP8_DECODE_BITS
# The few-expert kernel (moe_few_expert_gemm.cuh; its columns of moe_bench --decode): one-token
# steps on the register ring instead of the 4-chunk shared-memory ring (REGRING), or a 6-chunk
# shared-memory ring (RING6). Session 25 (H100): the 8-chunk register ring at 2 blocks an SM
# (FEW8) and an L2 bulk prefetch of each block's items (FEWL2) measured 1.00x and 0.92x; removed.
build REGRING "$D" -DMLASERVE_FEW_EXPERT_SMEM_RING=0
build RING6 "$D" -DMLASERVE_FEW_EXPERT_SMEM_RING=6
# 16 warps a block at 2 blocks an SM (64 registers): each warp's K slice halved (gate_up at K =
# 7,168: 7 chunks instead of 14), for the one-expert layer whose warps issue every ~15 cycles
# through a serial chain (session 25's ncu) while only ~2 of 3 blocks an SM hold an item.
build FEW16 "$D" -DMLASERVE_FEW_EXPERT_WARPS=16 -DMLASERVE_FEW_EXPERT_RING_MIN_BLOCKS=2 -DMLASERVE_FEW_EXPERT_WIDE_MIN_BLOCKS=2
# Diagnostic, wrong results (never for tests): NVFP4 codes and scales fed to the MMA undecoded,
# so both decode kernels read the same bytes without the dequantization work: how far the memory
# structure alone gets (H200, session 10: the tile kernel 74 -> 89% of copy bandwidth at
# all_256 x 8 tokens, the few-expert kernel 43 -> 45% at ep8 x 4 tokens; bench/RESULTS.md).
build RAW "$D" -DMLASERVE_MOE_DIAG_NO_DEQUANT
ls -la build-moe/variants/ | grep bench
