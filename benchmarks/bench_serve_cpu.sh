#!/usr/bin/env bash
# CPU serving benchmark of the default model (SmolLM2-135M-Instruct), with and without n-gram
# speculation, at concurrency 1, 4 and 16. JSON (and PNG) under benchmarks/results/.
#   usage: benchmarks/bench_serve_cpu.sh [NUM_PROMPTS] [OUTPUT_LEN]
set -euo pipefail
NUM_PROMPTS=${1:-16}
OUTPUT_LEN=${2:-64}
PORT=${PORT:-8123}
for SPEC in "" "--speculative ngram"; do
  draftgraph serve default --device cpu --port "$PORT" --log-level warning $SPEC &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null || true' EXIT
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 1; done
  draftgraph bench serve --base-url "http://127.0.0.1:$PORT" --dataset humaneval \
    --num-prompts "$NUM_PROMPTS" --output-len "$OUTPUT_LEN" --max-concurrency 1 4 16 \
    --num-warmups 2 --plot --result-dir benchmarks/results
  kill "$SERVER"; wait "$SERVER" 2>/dev/null || true
done
