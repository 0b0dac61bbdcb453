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
  timeout 120 compute-sanitizer --tool racecheck $D/mla_decode_gpu_test --gtest_filter='*.Small' \
    >> $OUT/sanitizer.log 2>&1; echo "racecheck rc=$?"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard" $OUT/sanitizer.log | head
fi
if [ -n "${TUNE:-}" ]; then
  # Every variant on a subset, then the full sweep per (format, heads) with the variant that had
  # the highest mean fraction of copy bandwidth on the subset (written to tuned.txt).
  timeout 60 $D/mla_decode_bench --batch 64 --context 32768 --variant 0,1,2 \
    > $OUT/variants.csv 2>> $OUT/bench.log; echo "variant sweep rc=$?"
  timeout 60 $D/mla_decode_bench --batch 1 --context 131072 --variant 0,1,2 \
    2>> $OUT/bench.log | tail -n +2 >> $OUT/variants.csv; echo "variant sweep 2 rc=$?"
  python3 - $OUT/variants.csv > $OUT/tuned.txt <<'PY'
import csv, sys, collections
acc = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    acc[(r["format"], r["heads"], r["variant"])].append(float(r["frac_copy"]))
best = {}
for (f, h, v), xs in acc.items():
    m = sum(xs) / len(xs)
    if (f, h) not in best or m > best[(f, h)][1]:
        best[(f, h)] = (v, m)
names = ["sliced_tile32_shallow", "sliced_tile32_deep", "wgmma_rows64_tile32"]  # variant indices (mla_decode.cc)
for (f, h), (v, m) in sorted(best.items()):
    print(f, h, names.index(v), v, f"{m:.3f}")
PY
  cat $OUT/tuned.txt
  first=1
  while read f h idx name m; do
    timeout 60 $D/mla_decode_bench --format $f --heads $h --variant $idx "$@" > $OUT/part.csv \
      2>> $OUT/bench.log
    if [ $first = 1 ]; then cat $OUT/part.csv; first=0; else tail -n +2 $OUT/part.csv; fi
  done < $OUT/tuned.txt > $OUT/bench.csv
  rm -f $OUT/part.csv
else
  timeout ${BENCH_TIMEOUT:-200} $D/mla_decode_bench "$@" > $OUT/bench.csv 2> $OUT/bench.log
  echo "bench rc=$?"
fi
head -1 $OUT/bench.log
if [ "${SKIP_TORCH:-0}" != 1 ]; then
  PYTHONUNBUFFERED=1 timeout ${TORCH_TIMEOUT:-180} python3 bench/mla/mla_decode_torch.py ${TORCH_ARGS:-} \
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
print("fmt       h   b  ctx     us      frac  torch  variant")
for r in rows:
    k = (r["format"], r["heads"], r["batch"], r["context"])
    print(f"{r['format']:9s} {r['heads']:>3s} {r['batch']:>3s} {r['context']:>6s} "
          f"{float(r['us']):8.1f} {r['frac_copy']:>6s} {torch.get(k, '-'):>6s} {r['variant']}")
PY
