#!/usr/bin/env bash
# ncu profile of one bf16 MLA decode variant beside FlashMLA's dense decode at one shape, on the
# GPU machine: the split and combine kernels' durations and stall reasons (ours and FlashMLA's),
# and per-SASS-instruction stall sampling of our split kernel as CSV (where the warps wait: the
# mbarrier loops, the named barriers, the wgmma waits). Kernel-level evidence for issue 15's
# remaining gap to FlashMLA (kernels/mla/NOTES.md, sessions 29-30).
#   bench/mla/profile_device.sh BENCH FLASHMLA_PEER|- OUT_DIR VARIANT HEADS BATCH CONTEXT
# BENCH: mla_decode_bench; FLASHMLA_PEER: the binary bench/mla/flashmla_peer.sh builds, or - to
# skip it. Writes OUT_DIR/ours.ncu-rep, ours_details.txt, ours_sass.csv, fm.txt and prints the
# durations and the largest stall reasons. Takes ~2 minutes on an H100. FORMAT=fp8 or fp8_tiled
# profiles our kernel in that cache format instead of bf16 (FlashMLA's peer stays bf16), e.g. the
# batch-1 fp8 split kernel: FORMAT=fp8 profile_device.sh BENCH - OUT -1 8 1 32768.
set -uo pipefail
bench="${1:?usage: profile_device.sh BENCH FLASHMLA_PEER|- OUT_DIR VARIANT HEADS BATCH CONTEXT}"
peer="${2:?}"
out="${3:?}"
variant="${4:?}"
heads="${5:?}"
batch="${6:?}"
context="${7:?}"
mkdir -p "$out"
stalls='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
shape=(--format "${FORMAT:-bf16}" --heads "$heads" --batch "$batch" --context "$context" --variant "$variant")
# The split kernel once, after the bench's warm-up launches, with source-level sampling.
timeout 150 ncu --kernel-name-base demangled -k 'regex:MlaDecode(Seesaw|Wgmma|Sliced)Kernel' \
  --launch-skip 6 -c 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
  --metrics "$stalls" -o "$out/ours" "$bench" "${shape[@]}" >"$out/ncu_ours.log" 2>&1
echo "ncu (ours, source) rc=$?"
ncu -i "$out/ours.ncu-rep" --page details --print-details all >"$out/ours_details.txt" 2>&1
ncu -i "$out/ours.ncu-rep" --page source --print-source sass --csv >"$out/ours_sass.csv" \
  2>"$out/ours_sass.err"
echo "SASS rows: $(wc -l <"$out/ours_sass.csv")"
# Split and combine durations, ours.
timeout 90 ncu --kernel-name-base demangled -k 'regex:MlaDecode.*Kernel' --launch-skip 6 -c 3 \
  --section SpeedOfLight "$bench" "${shape[@]}" >"$out/ours_kernels.txt" 2>&1
if [[ "$peer" != - ]]; then
  timeout 90 ncu --kernel-name-base demangled -k 'regex:splitkv|combine' --launch-skip 4 -c 2 \
    --section SpeedOfLight --section WarpStateStats --metrics "$stalls" \
    "$peer" "$heads" "$batch" "$context" >"$out/fm.txt" 2>&1
  echo "ncu (FlashMLA) rc=$?"
fi
for f in "$out/ours_details.txt" "$out/ours_kernels.txt" "$out/fm.txt"; do
  [[ -f "$f" ]] || continue
  echo "== $(basename "$f")"
  grep -E '^  [A-Za-z_].*\(|Duration|Elapsed Cycles' "$f" | head -12
  grep -E 'stalled_[a-z_]+_per_issue_active\.ratio' "$f" | awk '{print $1, $NF}' |
    sort -k2 -g -r | head -8
done
