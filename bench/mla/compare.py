#!/usr/bin/env python3
"""Same-run comparison of mla_decode_bench rows that differ only in the variant column's name
(a variant, or one variant with knob suffixes such as /cw or /l2h1): the minimum over repeated runs
per configuration, and each name's time as a speedup over the first name seen.
  bench/mla/compare.py RUN.csv [RUN2.csv ...]
Rows may carry a leading repetition column (variant_ab.sh writes `rep,impl,...`)."""
import collections
import csv
import sys

times = collections.defaultdict(lambda: collections.defaultdict(list))
frac = {}
order = []
for path in sys.argv[1:]:
    for r in csv.reader(open(path)):
        if r and r[0] != "mlaserve":
            r = r[1:]  # repetition column
        if len(r) < 11 or r[0] != "mlaserve":
            continue
        key = (r[1], int(r[2]), int(r[3]), int(r[4]))
        name = r[5].replace("auto:", "")
        if name not in order:
            order.append(name)
        t = float(r[6])
        times[key][name].append(t)
        if t <= min(times[key][name]):
            frac[(key, name)] = float(r[9])  # the fraction of the fastest run
if not order:
    sys.exit("compare.py: no mla_decode_bench rows")
base = order[0]
print("format heads batch context | " + " | ".join(f"{n} us (frac, x {base})" for n in order))
for key in sorted(times):
    cells = []
    tb = min(times[key][base]) if times[key][base] else None
    for n in order:
        if not times[key][n]:
            cells.append("-")
            continue
        t = min(times[key][n])
        ratio = f", {tb / t:.3f}" if tb else ""
        cells.append(f"{t:.1f} ({frac[(key, n)]:.3f}{ratio})")
    print(*key, "| " + " | ".join(cells))
