#!/usr/bin/env bash
# Runs the GPU test binaries of a build on a GPU machine and writes each log to $OUT (or /tmp):
#   scripts/gpu_check.sh BIN_DIR [test ...]
# BIN_DIR holds the test binaries (copied flat from a build's tests/); lib/ beside it may hold
# shared libraries the machine lacks (abseil, Cap'n Proto, ZeroMQ, prometheus-cpp). Prints one
# line per test with its gtest summary; exits non-zero if any failed.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$1"; shift
out="${OUT:-/tmp}"
export LD_LIBRARY_PATH="$bin/../lib:${LD_LIBRARY_PATH:-}"
export MLASERVE_SOURCE_DIR="$root"
tests=("$@")
((${#tests[@]})) || tests=(cuda_ops_test gpu_model_test elementwise_gpu_test mla_prefill_gpu_test
  mla_decode_gpu_test moe_experts_gpu_test moe_gpu_test int4_moe_gpu_test fp8_moe_gpu_test
  sampling_gpu_test)
rc=0
for t in "${tests[@]}"; do
  start=$SECONDS
  (cd "$root" && timeout "${MLASERVE_TEST_TIMEOUT:-600}" "$bin/$t" >"$out/$t.log" 2>&1)
  r=$?
  summary=$(grep -E "^\[  (PASSED|FAILED)  \]|tests? ran" "$out/$t.log" | tr '\n' ' ')
  printf '%-24s rc=%d %4ds %s\n' "$t" "$r" $((SECONDS - start)) "$summary"
  ((r == 0)) || rc=1
done
exit $rc
