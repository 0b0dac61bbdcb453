"""Fraction of copy bandwidth against context length, one panel per KV format.

Usage: plot_mla_decode.py OUT.png results.csv [more.csv ...] (CSV lines of mla_decode_bench /
mla_decode_torch.py). Lines: our kernel per head count at batch 64 (solid) and batch 1 (dashed);
PyTorch at batch 64, 16 heads (dotted grey).
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main():
    out, paths = sys.argv[1], sys.argv[2:]
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [r for r in csv.DictReader(f) if r.get("frac_copy") not in (None, "", "nan")]
    formats = ["bf16", "fp8", "fp8_tiled"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5), sharey=True)
    colors = {8: "tab:blue", 16: "tab:orange", 64: "tab:green", 128: "tab:red"}
    for ax, fmt in zip(axes, formats):
        for heads, color in colors.items():
            for batch, style in ((64, "-"), (1, "--")):
                pts = sorted((int(r["context"]), float(r["frac_copy"])) for r in rows
                             if r["impl"] == "mlaserve" and r["format"] == fmt and
                             int(r["heads"]) == heads and int(r["batch"]) == batch)
                if pts:
                    ax.plot(*zip(*pts), style, color=color, marker="o",
                            label=f"mlaserve h={heads} b={batch}")
        pts = sorted((int(r["context"]), float(r["frac_copy"])) for r in rows
                     if r["impl"] == "torch" and r["format"] == fmt and int(r["heads"]) == 16 and
                     int(r["batch"]) == 64)
        if pts:
            ax.plot(*zip(*pts), ":", color="grey", marker="x", label="PyTorch h=16 b=64")
        ax.axhline(0.9, color="black", linewidth=0.5)
        ax.set_xscale("log", base=2)
        ax.set_title(f"KV format {fmt}")
        ax.set_xlabel("context (tokens)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("fraction of device-to-device copy bandwidth")
    axes[0].legend(fontsize=7)
    fig.suptitle("MLA decode on H200 (s_q=1, cold L2, CUDA graph; bytes = KV in its format + q + out)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
