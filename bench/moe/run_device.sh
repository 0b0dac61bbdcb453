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
  timeout 300 ./build-moe/tests/kernels/moe/moe_gpu_test ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} 2>&1 | tee "$OUT/moe_gpu_test.log" | grep -vE "^\[ (RUN|      OK) " 
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 200 ./build-moe/bench/moe/moe_bench $BENCH_ARGS 2>&1 | tee "$OUT/moe_bench.log"
  PYTHONUNBUFFERED=1 timeout 200 python3 bench/moe/bf16_peer.py $BENCH_ARGS 2>&1 | tee "$OUT/bf16_peer.log"
fi
