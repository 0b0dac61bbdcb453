#!/usr/bin/env bash
# Same-run A/B of two MLA decode kernel variants in one binary: mla_decode_bench with
# --variant BASE,NEW, REPS runs (default 2), minimum per configuration; prints a table of
# microseconds, fractions of the run's copy bandwidth and base / new, and writes the raw CSV.
#   bench/mla/variant_ab.sh BENCH_BINARY OUT.csv BASE NEW [mla_decode_bench flags...]
# e.g. (GPU machine): bench/mla/variant_ab.sh /tmp/dist/bin/mla_decode_bench $OUT/ab.csv 2 5 \
#        --format bf16 --heads 64,128 --batch 1,8,64 --context 4096,32768,131072
# Variant indices: kernels/mla/mla_decode.cc (kVariants).
set -uo pipefail
bench="${1:?usage: variant_ab.sh BENCH OUT.csv BASE NEW [flags]}"
out="${2:?}"
base="${3:?}"
new="${4:?}"
shift 4
: >"$out"
for rep in $(seq 1 "${REPS:-2}"); do
  "$bench" --variant "$base,$new" "$@" 2>>"$out.err" | sed "s/^/$rep,/" >>"$out"
done
python3 - "$out" "$base" "$new" <<'PY'
import collections, csv, sys
path = sys.argv[1]
times = collections.defaultdict(lambda: collections.defaultdict(list))
frac = {}
order = []
for r in csv.reader(open(path)):
    if len(r) < 11 or r[1] == "impl":
        continue
    key, variant = (r[2], int(r[3]), int(r[4]), int(r[5])), r[6]
    if variant not in order:
        order.append(variant)
    times[key][variant].append(float(r[7]))
    frac[(key, variant)] = r[10]
if len(order) != 2:
    sys.exit(f"variant_ab: expected two variants in {path}, found {order} (see {path}.err)")
b, n = order
print(f"format heads batch context | {b} us (frac) | {n} us (frac) | base / new")
for key in sorted(times):
    tb, tn = min(times[key][b]), min(times[key][n])
    print(*key, f"| {tb:.1f} ({frac[(key, b)]}) | {tn:.1f} ({frac[(key, n)]}) | {tb / tn:.3f}")
PY
