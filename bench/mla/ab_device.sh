#!/bin/bash
# A/B: dist-base (HEAD) vs dist (working tree), alternating, same run.
OUT=$1; shift
export LD_LIBRARY_PATH=$PWD/build-mla/dist/lib
for rep in 1 2; do
  for v in base new; do
    B=build-mla/dist/mla_decode_bench; [ $v = base ] && B=build-mla/dist-base/mla_decode_bench
    timeout 120 $B "$@" 2>/dev/null | tail -n +2 | sed "s/^/$v,$rep,/" >> $OUT/ab.csv
  done
done
python3 - $OUT/ab.csv <<'PY'
import csv, sys, collections
d = collections.defaultdict(dict)
for r in csv.reader(open(sys.argv[1])):
    v, rep, impl, fmt, h, b, ctx, var, us = r[:9]
    d[(fmt, h, b, ctx)].setdefault(v, []).append(float(us))
print("fmt h b ctx base_us new_us ratio(base/new)")
for k, x in sorted(d.items()):
    bb, nn = min(x.get("base", [0])), min(x.get("new", [0]))
    print(*k, f"{bb:.1f} {nn:.1f} {bb/nn if nn else 0:.3f}")
PY
