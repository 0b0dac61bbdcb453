#!/usr/bin/env python3
"""Instruction mix of the weight-only (NVFP4 / INT4) GEMM kernels, the tile kernel's and the
few-expert kernel's, in a binary (run where cuobjdump exists).

Usage: sass_stats.py BINARY. Prints, per WeightOnlyMoeGemmKernel instance, the count of each opcode
in its SASS and the instructions per HMMA, the numbers that say whether decode is issue bound.
"""
import collections
import re
import subprocess
import sys

sass = subprocess.run(["cuobjdump", "-sass", sys.argv[1]], capture_output=True, text=True).stdout
func, counts = None, collections.defaultdict(collections.Counter)
for line in sass.splitlines():
    m = re.match(r"\s+Function : (\S+)", line)
    if m:
        func = m.group(1)
        continue
    m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
    if m and func and ("WeightOnlyMoeGemmKernel" in func or "FewExpertMoeGemmKernel" in func):
        counts[func][m.group(1)] += 1
for f, c in counts.items():
    total = sum(c.values())
    hmma = c.get("HMMA", 0)
    tile = re.search(r"TileConfigILi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)", f)
    if "FewExpertMoeGemmKernel" in f:
        tile = None
        f = "few-expert kMT=" + re.search(r"Lb[01]ELi(\d+)E", f).group(1) + " " + f
    fmt = "int4" if "Int4Format" in f else "nvfp4"
    print(f"{fmt} {tile.groups() if tile else f[:60]} gate_up={'Lb1E' in f}: {total} instr,"
          f" HMMA {hmma}, instr/HMMA {total / max(hmma, 1):.1f}")
    print("   " + " ".join(f"{k}:{v}" for k, v in c.most_common(24)))
