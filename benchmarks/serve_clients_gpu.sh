#!/usr/bin/env bash
# Is `bench serve` or the server the bottleneck at high concurrency (issue 15)? On the H200,
# one `draftgraph serve` (default flags): one client process at concurrency 64, then two
# client processes at 32 each at once, then four at 16; each run's CPU seconds per thread of
# the server process (engine thread vs event loop) from /proc. Carry [".whl"].
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:$PWD/src
M=${MODEL:-random:smollm2-135m}
python3 -m draftgraph.cli serve $M --port 8123 > /tmp/server.log 2>&1 &
pid=$!
for _ in $(seq 180); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
threads() {  # name=cpu_seconds per thread of the server
  for t in /proc/$pid/task/*; do
    awk -v n="$(cat $t/comm)" '{printf "%s=%.2f ", n, ($14+$15)/100}' $t/stat
  done; echo
}
for procs in 1 2 4; do
  conc=$(( 64 / procs ))
  echo "== $procs client process(es) x concurrency $conc"
  threads
  start=$SECONDS
  cpids=()
  for i in $(seq $procs); do
    timeout 200 python3 -m draftgraph.cli bench serve --base-url http://127.0.0.1:8123 \
      --dataset random --random-input-len 512 --random-output-len 128 --ignore-eos \
      --num-prompts $(( 256 / procs )) --seed $i --max-concurrency $conc --result-dir "$OUT" \
      --result-file "clients_${procs}_$i.json" --device-label "NVIDIA H200" 2>&1 | tail -1 &
    cpids+=($!)
  done
  for c in "${cpids[@]}"; do wait $c; done
  echo "wall $((SECONDS - start)) s"
  threads
done
kill $pid; wait $pid 2>/dev/null
