#!/usr/bin/env bash
# Where the server's host time goes (issue 15), on the H200: `bench serve` at concurrency
# 16 / 64 / 128 against `draftgraph serve` (default flags) in arms: asyncio + h11 (the bare
# uvicorn the wheels give), uvloop + httptools (uvicorn's standard extras), each with the GIL
# switch interval at Python's 5 ms and at 0.5 ms. Carry [".whl", ".whl_extra"].
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site_extra .whl_extra/*.whl || exit 1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
M=${MODEL:-random:smollm2-135m}
for arm in ${ARMS:-bare bare_si standard standard_si}; do
  site=/tmp/site; [[ $arm == standard* ]] && site=/tmp/site_extra:/tmp/site
  si=""; [[ $arm == *_si ]] && si=0.0005
  PYTHONPATH=$site:$PWD/src DRAFTGRAPH_SWITCH_INTERVAL=$si python3 -m draftgraph.cli serve $M \
    --port 8123 > "/tmp/server_$arm.log" 2>&1 &
  pid=$!
  for _ in $(seq 180); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
  PYTHONPATH=/tmp/site:$PWD/src timeout 200 python3 -m draftgraph.cli bench serve \
    --base-url http://127.0.0.1:8123 --dataset random --random-input-len 512 \
    --random-output-len 128 --ignore-eos --num-prompts ${NUM_PROMPTS:-256} \
    --max-concurrency ${CONCURRENCY:-16 64 128} --result-dir "$OUT" \
    --result-file "serve_host_${arm}.json" --device-label "NVIDIA H200 ($arm)" 2>&1 | tail -4
  kill $pid; wait $pid 2>/dev/null
done
