#!/usr/bin/env bash
# On the H200 (after benchmarks/serve_gpu_prepare.sh here, run with carry [".whl"]):
# `bench serve` against `draftgraph serve` on a random-weight preset at concurrency 1-64,
# with and without n-gram speculation. JSON and PNG land in $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
MODEL=${MODEL:-random:smollm2-135m}
for arm in ${ARMS:-plain ngram}; do
  extra=""; [ $arm = ngram ] && extra="--speculative ngram --num-draft-tokens 4"
  python3 -m draftgraph.cli serve "$MODEL" --port 8123 --max-num-seqs 64 $extra \
    > "/tmp/server_$arm.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
  timeout ${BENCH_TIMEOUT:-200} python3 -m draftgraph.cli bench serve --base-url http://127.0.0.1:8123 \
    --dataset random --random-input-len 512 --random-output-len 128 --ignore-eos \
    --num-prompts ${NUM_PROMPTS:-128} --max-concurrency ${CONCURRENCY:-1 4 16 32 64} --plot --result-dir "$OUT" \
    --device-label "NVIDIA H200 ($arm)" 2>&1 | tail -15
  kill $pid; wait $pid 2>/dev/null
  tail -5 "/tmp/server_$arm.log"
done
ls -la "$OUT"
