#!/usr/bin/env bash
# Issue 22 ("Multi-GPU run") on a machine with N >= 2 GPUs, in as few device calls as the steps
# allow: each step is one STEP=name call (or STEP=all), logs in $OUT (or /tmp), one summary line
# each on stdout.
#   STEP=tests|allreduce|compare|table|all bench/comm/run_multi_gpu.sh BIN_DIR [N]
# BIN_DIR holds nccl_test, peer_all_reduce_test, all_reduce_bench, mlaserve-model-bench (flat;
# lib/ beside it the libraries the machine lacks, as scripts/pack_gpu.sh packs them). N: ranks,
# one a GPU (default: every GPU). NCCL_NVLS_ENABLE=0 throughout (the device notes say why).
#
#   tests:     nccl_test and peer_all_reduce_test over N ranks (the sums on several GPUs, the one-
#              shot path through NcclCommunicator, IPC peer mappings).
#   allreduce: all_reduce_bench, NCCL's default protocol, then NCCL_PROTO=LL, then LL128: NCCL
#              against the one-shot kernel at 1-256 tokens x 7,168 bf16, eager and in graphs.
#   compare:   logits and greedy tokens of the N-rank job against the whole model on one GPU
#              (mlaserve-model-bench --mpi on --compare-single on), bf16 KV, without and with DCP
#              over the N ranks: a random transformers-made mid-size model when MIDSIZE_DIR holds
#              one (bench/model/hf_midsize.py make --layers 4), and synthetic Kimi-K2.5 cut to
#              COMPARE_LAYERS layers (default 4: the whole cut on one GPU).
#   table:     decode tokens/s of synthetic Kimi-K2.5 with TABLE_LAYERS layers (default 61) over N
#              ranks: batches 1, 64, 256 at context 1k and 1, 64 at 32k (256 x 32k does not fit),
#              without and with DCP, bf16 KV (KV=... to change), multi-rank graphs on; each 1k
#              row again with MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES=$ONE_SHOT_BYTES (default 262144)
#              when set; --phases on gives the all-reduce share (eager steps). A run whose cache
#              does not fit says so in its log and the script goes on.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin="$(cd "${1:?usage: STEP=... bench/comm/run_multi_gpu.sh BIN_DIR [N]}" && pwd)"
n="${2:-$(nvidia-smi -L | wc -l)}"
out="${OUT:-/tmp}"
step="${STEP:-all}"
export LD_LIBRARY_PATH="$bin/../lib:$bin:${LD_LIBRARY_PATH:-}"
export MLASERVE_SOURCE_DIR="$root" NCCL_NVLS_ENABLE=0 MLASERVE_NCCL_TIMEOUT_S=120
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd "$root" || exit 1
mpi=(mpirun -np "$n" --oversubscribe --bind-to none --mca btl_vader_single_copy_mechanism none
  -x LD_LIBRARY_PATH -x MLASERVE_SOURCE_DIR -x NCCL_NVLS_ENABLE -x MLASERVE_NCCL_TIMEOUT_S)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader >"$out/gpus.txt"
nvidia-smi topo -m >"$out/topology.txt" 2>&1
echo "$n ranks on $(head -1 "$out/gpus.txt" | cut -d, -f2) x $(wc -l <"$out/gpus.txt")"

want() { [[ "$step" == all || "$step" == "$1" ]]; }

if want tests; then
  for t in nccl_test peer_all_reduce_test; do
    timeout 600 "${mpi[@]}" "$bin/$t" >"$out/$t.np$n.log" 2>&1
    echo "$t np$n rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/$t.np$n.log" | sort -u | tr '\n' ' ')"
  done
fi

if want allreduce; then
  for proto in default LL LL128; do
    env=()
    [[ "$proto" != default ]] && env=(-x "NCCL_PROTO=$proto")
    timeout 300 "${mpi[@]}" "${env[@]}" "$bin/all_reduce_bench" >"$out/all_reduce_$proto.log" 2>&1
    echo "all_reduce_bench NCCL_PROTO=$proto rc=$?"
    grep -vE '^\s*$' "$out/all_reduce_$proto.log" | tail -11
  done
fi

cut_config() {  # source config dir, layers -> a temporary copy with that many layers
  local dir
  dir="$(mktemp -d)"
  cp -r "$1/." "$dir/"
  python3 - "$dir/config.json" "$2" <<'PY'
import json, sys
path, layers = sys.argv[1], int(sys.argv[2])
c = json.load(open(path))
(c.get("text_config", c))["num_hidden_layers"] = layers
json.dump(c, open(path, "w"))
PY
  echo "$dir"
}

model_bench() {  # log name, flags...
  local name="$1"
  shift
  local env=()
  [[ -n "${MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES:-}" ]] &&
    env=(-x "MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES=$MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES")
  timeout "${BENCH_TIMEOUT:-900}" "${mpi[@]}" "${env[@]}" "$bin/mlaserve-model-bench" --mpi on "$@" \
    >"$out/$name.log" 2>&1
  echo "$name rc=$?"
  grep -E '^(compare|decode|phases|mpi|kv .*NCCL)' "$out/$name.log" | cut -c1-220
}

if want compare; then
  kimi="$(cut_config bench/model/configs/kimi-k2.5 "${COMPARE_LAYERS:-4}")"
  for dcp in 1 "$n"; do
    if [[ -n "${MIDSIZE_DIR:-}" ]]; then
      model_bench "compare_midsize_dcp$dcp" --model "$MIDSIZE_DIR" --compare-single on --dcp "$dcp" \
        --kv bf16 --prefill "" --batches 1 --context 64 --steps 4 --graphs on
    fi
    model_bench "compare_kimi${COMPARE_LAYERS:-4}_dcp$dcp" --synthetic-weights "$kimi" \
      --compare-single on --dcp "$dcp" --kv bf16 --prefill "" --batches 1 --context 64 --steps 4 \
      --graphs on
  done
  rm -rf "$kimi"
fi

if want table; then
  kimi="$(cut_config bench/model/configs/kimi-k2.5 "${TABLE_LAYERS:-61}")"
  for dcp in 1 "$n"; do
    model_bench "table_kimi${TABLE_LAYERS:-61}_1k_dcp$dcp" --synthetic-weights "$kimi" --dcp "$dcp" \
      --kv "${KV:-bf16}" --prefill "" --batches 1,64,256 --context 1024 --graphs on --phases on
    if [[ -n "${ONE_SHOT_BYTES:-262144}" ]]; then
      MLASERVE_ONE_SHOT_ALL_REDUCE_BYTES="${ONE_SHOT_BYTES:-262144}" model_bench \
        "table_kimi${TABLE_LAYERS:-61}_1k_dcp${dcp}_oneshot" --synthetic-weights "$kimi" --dcp "$dcp" \
        --kv "${KV:-bf16}" --prefill "" --batches 1,64,256 --context 1024 --graphs on
    fi
    model_bench "table_kimi${TABLE_LAYERS:-61}_32k_dcp$dcp" --synthetic-weights "$kimi" --dcp "$dcp" \
      --kv "${KV:-bf16}" --prefill "" --batches 1,64 --context 32768 --graphs on
  done
  rm -rf "$kimi"
fi
