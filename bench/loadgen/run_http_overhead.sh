#!/usr/bin/env bash
# The HTTP path's cost against the ZeroMQ path, in one run: the real coordinator before
# mlaserve-null-worker (the step protocol answered at once, no model), serving the tiny
# DeepSeek-V3 folder of the build (its real tokenizer: the coordinator detokenizes every token on
# both paths), and mlaserve-openai before the same coordinator. At each concurrency the load
# generator runs once over ZeroMQ and once over HTTP/SSE (mlaserve-loadgen --http); then 1,024
# streams are held open at once. Per run it prints the loadgen report and the CPU seconds each
# process used (from /proc/PID/stat), per step and per token.
#   bench/loadgen/run_http_overhead.sh [BUILD_DIR]
#   env: CONCURRENCIES (default 256), WAVES (4), INPUT_LEN (1000), OUTPUT_LEN (256),
#        HOLD_STREAMS (1024; 0 skips), HOLD_OUTPUT_LEN (1024), OPENAI_BIN (another
#        mlaserve-openai binary, e.g. an older commit's, against the same processes)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-$root/build}"
port=${MLASERVE_PORT:-7855}
http_port=$((port + 3))
metrics="127.0.0.1:$((port + 2))"
model="$build/models/tiny-deepseek-v3"
vocab=129280  # DeepSeek-V3's tokenizer
input_len=${INPUT_LEN:-1000}
output_len=${OUTPUT_LEN:-256}
dir=$(mktemp -d)
"$build/coordinator/server/mlaserve-coordinator" --model "$model" \
  --listen "tcp://127.0.0.1:$port" --worker-listen "ipc://$dir/worker" --metrics "$metrics" \
  --max-running 1024 --max-step-tokens 1048576 --max-waiting 8192 --prefill-chunk 0 \
  >"$dir/coordinator.log" 2>&1 &
coord=$!
"$build/bench/coordinator/mlaserve-null-worker" --coordinator "ipc://$dir/worker" --vocab $vocab \
  --kv-blocks 262144 >"$dir/null-worker.log" 2>&1 &
worker=$!
"${OPENAI_BIN:-$build/coordinator/http/mlaserve-openai}" --coordinator "tcp://127.0.0.1:$port" \
  --listen "127.0.0.1:$http_port" --threads 1088 >"$dir/openai.log" 2>&1 &
front=$!
# (Each step may fail -- the null worker exits with its coordinator -- without ending the trap
# under set -e before the folder is removed, or turning a good run's status into 1.)
trap 'kill -TERM $front $coord 2>/dev/null || true; wait $front $coord 2>/dev/null || true
  kill $worker 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 100); do
  "$build/coordinator/client/mlaserve-cli" --endpoint "tcp://127.0.0.1:$port" health >/dev/null 2>&1 && break
  sleep 0.1
done
for _ in $(seq 100); do
  grep -q "listening on port" "$dir/openai.log" && break
  sleep 0.1
done
for p in $coord $worker $front; do
  if ! kill -0 $p 2>/dev/null; then
    echo "run_http_overhead: a server process exited at start:" >&2
    cat "$dir/coordinator.log" "$dir/null-worker.log" "$dir/openai.log" >&2
    exit 1
  fi
done

cpu() { awk '{printf "%.2f", ($14 + $15) / 100}' "/proc/$1/stat"; }
steps() { curl -s "http://$metrics/metrics" | awk '/^mlaserve_step_seconds_count/ {print $2}'; }
# run LABEL TOKENS LOADGEN_ARGS...: the loadgen report, then CPU per process per step and token.
run() {
  local label=$1 tokens=$2
  shift 2
  local c0 w0 f0 s0 c1 w1 f1 s1
  c0=$(cpu $coord); w0=$(cpu $worker); f0=$(cpu $front); s0=$(steps)
  "$build/bench/loadgen/mlaserve-loadgen" "$@" --metrics "$metrics"
  c1=$(cpu $coord); w1=$(cpu $worker); f1=$(cpu $front); s1=$(steps)
  awk -v l="$label" -v t="$tokens" -v c="$(echo "$c1 - $c0" | bc)" -v w="$(echo "$w1 - $w0" | bc)" \
    -v f="$(echo "$f1 - $f0" | bc)" -v s="$(echo "$s1 - $s0" | bc)" 'BEGIN {
    printf "%s CPU s: coordinator %.2f, null worker %.2f, mlaserve-openai %.2f over %d steps, %d tokens\n", l, c, w, f, s, t;
    printf "%s per step: coordinator %.1f us, mlaserve-openai %.1f us; per token: coordinator %.2f us, mlaserve-openai %.2f us\n",
      l, c / s * 1e6, f / s * 1e6, c / t * 1e6, f / t * 1e6 }'
}

waves=${WAVES:-4}
for c in ${CONCURRENCIES:-256}; do
  n=$((c * waves))
  common=(--concurrency "$c" --requests "$n" --input-len "$input_len" --output-len "$output_len" --vocab $vocab)
  echo "== concurrency $c, ZeroMQ (mlaserve-loadgen over the C++ client)"
  run "zmq" $((n * output_len)) --endpoint "tcp://127.0.0.1:$port" "${common[@]}"
  echo "== concurrency $c, HTTP/SSE (mlaserve-loadgen --http, streaming /v1/completions)"
  run "http" $((n * output_len)) --http "127.0.0.1:$http_port" "${common[@]}"
done

hold=${HOLD_STREAMS:-1024}
if ((hold > 0)); then
  hold_len=${HOLD_OUTPUT_LEN:-1024}
  echo "== $hold streams open at once over HTTP ($hold requests of $hold_len tokens)"
  (
    while kill -0 $front 2>/dev/null; do
      awk '/^Threads/ {t = $2} /^VmRSS/ {r = $2} END {print t, r}' "/proc/$front/status"
      sleep 0.2
    done
  ) >"$dir/samples" &
  sampler=$!
  run "hold" $((hold * hold_len)) --http "127.0.0.1:$http_port" --concurrency "$hold" \
    --requests "$hold" --input-len 64 --output-len "$hold_len" --vocab $vocab
  kill $sampler 2>/dev/null || true
  awk '{if ($1 > t) t = $1; if ($2 > r) r = $2} END {printf "mlaserve-openai at most %d threads, %.0f MB resident\n", t, r / 1024}' "$dir/samples"
fi
