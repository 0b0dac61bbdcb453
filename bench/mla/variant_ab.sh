#!/usr/bin/env bash
# Same-run A/B of two MLA decode kernel variants: mla_decode_bench with --variant BASE,NEW in one
# binary, or (BASE / NEW written BINARY@INDEX) each side from its own binary, the two run one
# after the other in every rep (a change measured against the build before it). REPS runs
# (default 2), minimum per configuration; prints a table of microseconds, fractions of the run's
# copy bandwidth and base / new, and writes the raw CSV (first column the rep, then the side).
#   bench/mla/variant_ab.sh BENCH_BINARY OUT.csv BASE NEW [mla_decode_bench flags...]
# e.g. (GPU machine): bench/mla/variant_ab.sh /tmp/dist/bin/mla_decode_bench $OUT/ab.csv 2 5 \
#        --format bf16 --heads 64,128 --batch 1,8,64 --context 4096,32768,131072
#      bench/mla/variant_ab.sh - $OUT/ab.csv /tmp/old/dist/bin/mla_decode_bench@8 \
#        /tmp/new/dist/bin/mla_decode_bench@8 --format fp8 --heads 64,128 --batch 1,64
# (BENCH_BINARY is unused, and may be -, when both sides name their binary.)
# Variant indices: kernels/mla/mla_decode.cc (kVariants).
set -uo pipefail
bench="${1:?usage: variant_ab.sh BENCH OUT.csv BASE NEW [flags]}"
out="${2:?}"
base="${3:?}"
new="${4:?}"
shift 4
: >"$out"
for rep in $(seq 1 "${REPS:-2}"); do
  if [[ "$base" == *@* || "$new" == *@* ]]; then
    for side in base new; do
      spec="${!side}"
      bin="$bench" variant="$spec"
      if [[ "$spec" == *@* ]]; then bin="${spec%@*}" variant="${spec##*@}"; fi
      "$bin" --variant "$variant" "$@" 2>>"$out.err" | sed "s/^/$rep,$side,/" >>"$out"
    done
  else
    "$bench" --variant "$base,$new" "$@" 2>>"$out.err" | sed "s/^/$rep,-,/" >>"$out"
  fi
done
python3 - "$out" <<'PY'
import collections, csv, sys
path = sys.argv[1]
times = collections.defaultdict(lambda: collections.defaultdict(list))
frac = {}
order = []
for r in csv.reader(open(path)):
    if len(r) < 12 or r[2] == "impl":
        continue
    # rep, side, impl, format, heads, batch, context, variant, us, bytes, gbps, frac_copy, ...
    key = (r[3], int(r[4]), int(r[5]), int(r[6]))
    label = r[7] if r[1] == "-" else f"{r[1]}:{r[7]}"
    if label not in order:
        order.append(label)
    times[key][label].append(float(r[8]))
    frac[(key, label)] = r[11]
if len(order) != 2:
    sys.exit(f"variant_ab: expected two sides in {path}, found {order} (see {path}.err)")
b, n = order
print(f"format heads batch context | {b} us (frac) | {n} us (frac) | base / new")
for key in sorted(times):
    if b not in times[key] or n not in times[key]:
        continue
    tb, tn = min(times[key][b]), min(times[key][n])
    print(*key, f"| {tb:.1f} ({frac[(key, b)]}) | {tn:.1f} ({frac[(key, n)]}) | {tb / tn:.3f}")
PY
