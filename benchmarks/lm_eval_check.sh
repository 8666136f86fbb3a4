#!/usr/bin/env bash
# lm-evaluation-harness end to end against `draftgraph serve` (issue 20), no network: its
# `local-completions` model runs a 32-question multiple-choice task (loglikelihood: echo +
# logprobs) and a 20-question generate task (greedy, exact match) from benchmarks/lm_eval_tasks/
# and benchmarks/data/; then lm_eval_check.py makes the same requests to the engine in process
# and checks the scores are equal (accuracies identical, loglikelihoods within 1e-4, generated
# text identical). JSON to benchmarks/results/lm_eval_check_<device>_<dtype>.json; exit 1 on
# any mismatch.
#   usage: benchmarks/lm_eval_check.sh [MODEL] [ENGINE FLAGS...]    (default: default --device cpu)
#   env:   LMEVAL_VENV (/tmp/draftgraph-lmeval-venv: made with lm-eval[api] on first use),
#          BATCH_SIZE (8: prompts per request), NUM_CONCURRENT (1: requests in flight),
#          PORT (8931), OUT (results JSON path)
# It tests the tree it lives in (PYTHONPATH=<repo>/src), whatever draftgraph is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
COMMAND="benchmarks/lm_eval_check.sh${*:+ $*}"
if [ $# -eq 0 ]; then set -- default --device cpu; fi
VENV=${LMEVAL_VENV:-/tmp/draftgraph-lmeval-venv}
LMEVAL_VERSION=0.4.13
BATCH_SIZE=${BATCH_SIZE:-8}
NUM_CONCURRENT=${NUM_CONCURRENT:-1}
PORT=${PORT:-8931}
WORK=$(mktemp -d /tmp/draftgraph-lmeval.XXXXXX)
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
# lm-eval reads the local JSON files through `datasets`: nothing may go to the network
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if ! "$VENV/bin/python" -c "import lm_eval, aiohttp, tenacity" 2>/dev/null; then
  echo "making $VENV with lm-eval[api]==$LMEVAL_VERSION" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "lm-eval[api]==$LMEVAL_VERSION"
fi

python3 -m draftgraph.cli serve "$@" --host 127.0.0.1 --port "$PORT" --served-model-name dg \
  --log-level warning > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { echo "server did not start" >&2; exit 1; }

LMEVAL=("$VENV/bin/lm_eval" --model local-completions
  --model_args "base_url=http://127.0.0.1:$PORT/v1/completions,model=dg,num_concurrent=$NUM_CONCURRENT,max_retries=1"
  --batch_size "$BATCH_SIZE" --tasks draftgraph_mc,draftgraph_gen
  --include_path benchmarks/lm_eval_tasks --output_path "$WORK/lm_eval" --log_samples)
START=$(date +%s.%N)
if ! "${LMEVAL[@]}" > "$WORK/lm_eval.log" 2>&1; then
  tail -40 "$WORK/lm_eval.log" >&2; exit 1
fi
SECONDS_LMEVAL=$(python3 -c "print(round($(date +%s.%N) - $START, 2))")
grep -E '^\|' "$WORK/lm_eval.log"
kill $SERVER; wait $SERVER 2>/dev/null || true  # the in-process engine gets the cores

DEVICE=$(python3 - "$@" <<'PY'
import sys
args = sys.argv[1:]
device = args[args.index("--device") + 1] if "--device" in args else "cuda"
dtype = args[args.index("--dtype") + 1] if "--dtype" in args else ("float32" if device == "cpu" else "bfloat16")
print(f"{device}_{ {'float32': 'fp32', 'bfloat16': 'bf16', 'float16': 'fp16'}[dtype] }")
PY
)
python3 benchmarks/lm_eval_check.py --lm-eval-output "$WORK/lm_eval" \
  --lm-eval-seconds "$SECONDS_LMEVAL" --lm-eval-command "${LMEVAL[*]}" --command "$COMMAND" \
  --out "${OUT:-benchmarks/results/lm_eval_check_$DEVICE.json}" "$@"
