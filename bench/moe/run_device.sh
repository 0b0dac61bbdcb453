#!/bin/bash
# One device call: GPU correctness tests, then the NVFP4 benchmark: the current build and, when
# build-moe/before/moe_bench exists (the previous kernels built with this bench source), that
# build in the same run; tile variants (VARIANTS=1, from bench/moe/build_variants.sh), and the
# BF16 peer (PEER_ARGS=--prefill or --decode for one regime). Expects binaries built here
# (build-moe) and the abseil libraries in build-moe/lib (see bench/RESULTS.md for the command).
# Logs go to $OUT.
set -o pipefail
export LD_LIBRARY_PATH=$PWD/build-moe/lib:$LD_LIBRARY_PATH
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
B=./build-moe/bench/moe/moe_bench
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,driver_version --format=csv | tee "$OUT/gpu.txt"
if [ "${SKIP_TEST:-0}" != 1 ]; then
  timeout 240 ./build-moe/tests/kernels/moe/moe_gpu_test ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} 2>&1 | tee "$OUT/moe_gpu_test.log" | grep -E "^\[  (PASSED|FAILED) |^\[==========\]|FAILED|Failure"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  if [ -x build-moe/before/moe_bench ]; then
    timeout 150 build-moe/before/moe_bench $BENCH_ARGS > "$OUT/before.log" 2>&1
  fi
  timeout 150 $B $BENCH_ARGS > "$OUT/after.log" 2>&1
fi
if [ "${VARIANTS:-0}" = 1 ]; then
  for v in build-moe/variants/moe_bench_D*; do
    echo "== $v --decode"; timeout 60 $v --decode 2>&1 | grep -E "^(ep8|all)"
  done > "$OUT/variants.log" 2>&1
  for v in build-moe/variants/moe_bench_P*; do
    echo "== $v --prefill"; timeout 60 $v --prefill 2>&1 | grep -E "^(ep8|all)"
  done >> "$OUT/variants.log" 2>&1
  for v in build-moe/variants/moe_bench_FP8*; do
    echo "== $v --fp8 --decode"; timeout 60 $v --fp8 --decode 2>&1 | grep -E "^r1.* fp8 "
  done >> "$OUT/variants.log" 2>&1
fi
if [ "${SKIP_PEER:-0}" != 1 ]; then
  PYTHONUNBUFFERED=1 timeout 200 python3 bench/moe/bf16_peer.py $PEER_ARGS > "$OUT/bf16_peer.log" 2>&1
fi
# Compact summary last (the tool returns the tail of the output).
for f in before after variants bf16_peer; do
  [ -f "$OUT/$f.log" ] && { echo "===== $f"; grep -vE "^(us:|GB/s:|$)" "$OUT/$f.log" | cut -c1-230; }
done
