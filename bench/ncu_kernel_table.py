#!/usr/bin/env python3
"""Per-kernel table of an ncu CSV (`ncu --csv --page details ...`): duration, DRAM throughput and
achieved occupancy of each profiled launch, then the time summed per kernel name.

    python3 bench/ncu_kernel_table.py ncu.csv [PARTS]

PARTS > 1 prints only the last 1/PARTS of the launches (e.g. 3 for the last of three eager steps
that `mlaserve-model-bench --phases on` profiles). The rows of `--page details` carry more fields
than its header line, so fields are read by position: ID 0, kernel name 4, grid 8, section 11,
metric name 12, unit 13, value 14.
"""
import collections
import csv
import sys

UNIT_US = {'ns': 1e-3, 'nsecond': 1e-3, 'us': 1.0, 'usecond': 1.0, 'ms': 1e3, 'msecond': 1e3}


def main():
    rows = list(csv.reader(open(sys.argv[1])))
    parts = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    launches = collections.OrderedDict()
    for r in rows:
        if len(r) < 15 or not r[0].isdigit():
            continue
        rec = launches.setdefault(r[0], {'name': r[4], 'grid': r[8], 'metrics': {}})
        rec['metrics'][r[12]] = (r[14], r[13])
    ids = list(launches)
    ids = ids[-(len(ids) // parts):] if parts > 1 else ids
    per_name = collections.defaultdict(lambda: [0.0, 0])
    total = 0.0
    for i in ids:
        rec = launches[i]
        value, unit = rec['metrics'].get('Duration', ('0', 'ns'))
        us = float(value.replace(',', '')) * UNIT_US.get(unit, 1.0)
        total += us
        name = rec['name'].split('(')[0].replace('void ', '')[-50:]
        per_name[name][0] += us
        per_name[name][1] += 1
        dram = rec['metrics'].get('DRAM Throughput', ('', ''))[0]
        occ = rec['metrics'].get('Achieved Occupancy', ('', ''))[0]
        print(f'{i:>5} {name:50} {rec["grid"]:>14} {us:8.2f} us  dram {dram:>6}%  occ {occ:>6}%')
    print(f'total {total:.1f} us over {len(ids)} launches')
    for name, (us, n) in sorted(per_name.items(), key=lambda x: -x[1][0]):
        print(f'{us:9.1f} us {n:4d}x {name}')


if __name__ == '__main__':
    main()
