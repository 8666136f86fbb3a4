#!/usr/bin/env bash
# How many client processes does `bench serve` need before the server is what it measures
# (issue 15)? One `draftgraph serve` (default flags: on a GPU the engine in its own process),
# `bench serve` at each CONC:PROCS pair (128 random 512-token prompts, 128 tokens), and the CPU
# seconds of the server's and the engine's processes over each run. Carry [".whl"].
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:$PWD/src
M=${MODEL:-random:smollm2-135m}
python3 -m draftgraph.cli serve $M --port 8123 ${SERVE_FLAGS:-} > /tmp/server.log 2>&1 &
pid=$!
for _ in $(seq 180); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
cpu() {  # CPU seconds of the server process and of its children (the engine process)
  local s=0; for p in $pid $(pgrep -P $pid); do
    s="$s $(awk '{printf "%.2f", ($14+$15)/100}' /proc/$p/stat)"; done; echo "cpu:$s"
}
for pair in ${PAIRS:-64:4 64:8 64:16 128:8 128:16}; do
  conc=${pair%:*}; procs=${pair#*:}
  echo "== concurrency $conc, $procs client processes; $(cpu)"
  timeout 200 python3 -m draftgraph.cli bench serve --base-url http://127.0.0.1:8123 \
    --dataset random --random-input-len 512 --random-output-len 128 --ignore-eos \
    --num-prompts ${NUM_PROMPTS:-128} --max-concurrency $conc --client-processes $procs \
    --result-dir "$OUT" --result-file "sweep_${conc}_$procs.json" \
    --device-label "NVIDIA H200" 2>&1 | tail -2 | head -1
  echo "   after: $(cpu)"
done
kill $pid; wait $pid 2>/dev/null
