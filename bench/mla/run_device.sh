#!/bin/bash
# One device call: GPU correctness tests, compute-sanitizer on the small case, the speed sweep of
# our kernel and of the PyTorch peer, and the plot. Binaries were built on the dev machine and
# carried in build-mla/dist (with the abseil shared libraries the GPU machine lacks).
# Usage (on the GPU machine, repository root): bench/mla/run_device.sh OUT_DIR [sweep args]
set -u
OUT=${1:?out dir}; shift
D=build-mla/dist
export LD_LIBRARY_PATH=$PWD/$D/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
{ git log -1 --format='commit %H %cd' 2>/dev/null || true; date -u; } | tee $OUT/meta.txt
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 60 $D/kv_cache_format_test --gtest_brief=1 2>&1 | tail -3
  timeout 240 $D/mla_decode_gpu_test 2>&1 > $OUT/test.log; echo "gpu test rc=$?"
  grep -E "^\[  (PASSED|FAILED|  OK) |Failure|error" $OUT/test.log | head -30
  timeout 120 compute-sanitizer --tool memcheck $D/mla_decode_gpu_test --gtest_filter='*Small:*Bytes*' \
    > $OUT/sanitizer.log 2>&1; echo "memcheck rc=$?"
  timeout 120 compute-sanitizer --tool racecheck $D/mla_decode_gpu_test --gtest_filter='*Small' \
    >> $OUT/sanitizer.log 2>&1; echo "racecheck rc=$?"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard" $OUT/sanitizer.log | head
fi
timeout ${BENCH_TIMEOUT:-200} $D/mla_decode_bench "$@" > $OUT/bench.csv 2> $OUT/bench.log
echo "bench rc=$?"; head -1 $OUT/bench.log
if [ -n "${ROWS16:-}" ]; then
  timeout 90 $D/mla_decode_bench --heads 64,128 --batch 1,32,128 --context 8192,32768 \
    --rows_per_cta 16,32 > $OUT/bench_rows.csv 2>> $OUT/bench.log; echo "rows variant rc=$?"
fi
if [ "${SKIP_TORCH:-0}" != 1 ]; then
  PYTHONUNBUFFERED=1 timeout ${TORCH_TIMEOUT:-180} python3 bench/mla/mla_decode_torch.py "$@" \
    > $OUT/torch.csv 2> $OUT/torch.log; echo "torch rc=$?"; tail -2 $OUT/torch.log
fi
python3 bench/mla/plot_mla_decode.py $OUT/mla_decode_frac_copy.png $OUT/bench.csv $OUT/torch.csv \
  2>&1 | tail -2
python3 - "$OUT" <<'PY'
import csv, sys, collections
out = sys.argv[1]
rows = list(csv.DictReader(open(f"{out}/bench.csv")))
try:
    torch = {(r["format"], r["heads"], r["batch"], r["context"]): r["frac_copy"]
             for r in csv.DictReader(open(f"{out}/torch.csv"))}
except FileNotFoundError:
    torch = {}
print("fmt       h   b  ctx     us      frac  torch")
for r in rows:
    k = (r["format"], r["heads"], r["batch"], r["context"])
    print(f"{r['format']:9s} {r['heads']:>3s} {r['batch']:>3s} {r['context']:>6s} "
          f"{float(r['us']):8.1f} {r['frac_copy']:>6s} {torch.get(k, '-')}")
PY
