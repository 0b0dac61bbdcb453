#!/bin/bash
# Builds moe_bench variants with other decode/prefill tile knobs (nvfp4_moe_gemm.cuh macros) into
# build-moe/variants/, for tuning runs (bench/moe/run_device.sh with VARIANTS=1). Needs build-moe.
set -e
cd "$(dirname "$0")/../.."
ninja -C build-moe moe_bench moe_gpu_test nvfp4_ref_test > /dev/null
LINK=$(ninja -C build-moe -t commands moe_bench | tail -1 | sed 's/^: && //; s/ && :$//')
build() {
  name=$1; shift; files=$1; shift
  objs=""
  for f in $files; do
    /usr/local/cuda/bin/nvcc -I/work/main -O2 -DNDEBUG --generate-code=arch=compute_90a,code=[compute_90a,sm_90a] -std=c++17 -lineinfo "$@" -c kernels/moe/nvfp4_moe_gemm_$f.cu -o build-moe/variants/${name}_$f.o -Xptxas -v 2>&1 | grep -E "registers|spill" | sed "s/^/$name $f: /"
    objs="$objs variants/${name}_$f.o"
  done
  (cd build-moe && eval "${LINK/bench\/moe\/CMakeFiles\/moe_bench.dir\/moe_bench.cu.o -o bench\/moe\/moe_bench/bench/moe/CMakeFiles/moe_bench.dir/moe_bench.cu.o $objs -o variants/moe_bench_$name}")
}
D="gate_up_bn16 down_bn16"; P="gate_up_bn128 down_bn128"
build B "$D" -DMLASERVE_MOE_DECODE_BK=256 -DMLASERVE_MOE_DECODE_MIN_BLOCKS=2
build C "$D" -DMLASERVE_MOE_DECODE_STAGES=6 -DMLASERVE_MOE_DECODE_MIN_BLOCKS=2
build D "$D" -DMLASERVE_MOE_DECODE_WARPS_M=4 -DMLASERVE_MOE_DECODE_MIN_BLOCKS=4
build E "$D" -DMLASERVE_MOE_DECODE_WARPS_M=4 -DMLASERVE_MOE_DECODE_BK=256 -DMLASERVE_MOE_DECODE_STAGES=3 -DMLASERVE_MOE_DECODE_MIN_BLOCKS=2
build P1 "$P" -DMLASERVE_MOE_PREFILL_WARPS_M=2 -DMLASERVE_MOE_PREFILL_MIN_BLOCKS=1
build P2 "$P" -DMLASERVE_MOE_PREFILL_STAGES=3
build P3 "$P" -DMLASERVE_MOE_PREFILL_WARPS_M=8 -DMLASERVE_MOE_PREFILL_MIN_BLOCKS=2
ls -la build-moe/variants/ | grep bench
