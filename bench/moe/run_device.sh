#!/bin/bash
# One device call: GPU correctness tests, then the NVFP4 benchmark and its BF16 peer.
# Expects binaries built here (build-moe) and the abseil libraries in build-moe/lib (see
# bench/RESULTS.md for the command). Logs go to $OUT.
set -o pipefail
export LD_LIBRARY_PATH=$PWD/build-moe/lib:$LD_LIBRARY_PATH
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
if [ "${SKIP_TEST:-0}" != 1 ]; then
  timeout 180 ./build-moe/tests/kernels/moe/moe_gpu_test ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} 2>&1 | tee "$OUT/moe_gpu_test.log" | grep -vE "^\[ (RUN|      OK) " 
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 100 ./build-moe/bench/moe/moe_bench $BENCH_ARGS 2>&1 | tee "$OUT/moe_bench.log"
  PYTHONUNBUFFERED=1 timeout 130 python3 bench/moe/bf16_peer.py $BENCH_ARGS 2>&1 | tee "$OUT/bf16_peer.log"
fi
if [ "${VARIANTS:-0}" = 1 ]; then
  for v in build-moe/variants/moe_bench_[A-E]; do
    echo "== $v --decode"; timeout 60 $v --decode 2>&1 | grep -E "^(ep8|all)"
  done 2>&1 | tee "$OUT/variants_decode.log"
  for v in build-moe/variants/moe_bench_P*; do
    echo "== $v --prefill"; timeout 60 $v --prefill 2>&1 | grep -E "^(ep8|all)"
  done 2>&1 | tee "$OUT/variants_prefill.log"
  python3 bench/moe/sass_stats.py build-moe/bench/moe/moe_bench > "$OUT/sass_stats.txt" 2>&1
  python3 bench/moe/sass_stats.py build-moe/variants/moe_bench_A >> "$OUT/sass_stats.txt" 2>&1
  head -c 3000 "$OUT/sass_stats.txt"
fi
