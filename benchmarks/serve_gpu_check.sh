#!/usr/bin/env bash
# Serving against offline on the H200 (issue 15; after benchmarks/serve_gpu_prepare.sh here,
# carry [".whl"]): per model and arm (ARMS), `draftgraph serve` and `bench serve` at
# concurrency 1 / 16 / 64 / 128 (512 random 512-token prompts, 128 output tokens: at 64 and
# above a run of 128 prompts lasted about a second, too short to time; timed by the
# streamed token ids), then the same prompts through LLMEngine in process at the same
# concurrency levels (benchmarks/serve_offline.py). JSON and PNG land in $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
# SRC: the engine's source tree (an older one for an A/B: `git archive REV src | tar -x -C .old`
# here, carry .old too, SRC=$PWD/.old/src); NO_OFFLINE=1 skips the offline runs
export PYTHONPATH=/tmp/site:${SRC:-$PWD/src}:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
CONC=${CONCURRENCY:-1 16 64 128}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)  # e.g. NVIDIA H100 80GB HBM3
GTAG=$(echo "$GPU" | grep -o -i -E "h100|h200" | tr A-Z a-z | head -1)
for m in ${MODELS:-smollm2-135m llama-3.2-1b}; do
  for arm in ${ARMS:-plain}; do
    # arms: plain (the defaults: on a GPU the engine in its own process), thread (the engine
    # on a thread of the server process), ngram, api<N> (plain with N API-server
    # processes: --api-server-count N), pg<N> (plain with --prefill-graph-tokens N),
    # mixed (--no-overlap-prefill: arrivals' prompts in a step with the decode rows, the
    # default until stop 53), solo (--no-decode-rides-prefill: a prefill behind the step in
    # flight carries no decode rows, the default until stop 55), hold<MS> (arrivals wait up
    # to MS ms to share a prefill behind: --prefill-coalesce-ms), cl<N> (plain served, the
    # load sent from N client processes: `bench serve --client-processes N`), pc
    # (--enable-prefix-caching, serve's default since stop 64: plain's too), nopc
    # (--no-enable-prefix-caching, plain before it; PREFIX_LEN=N: every prompt after the same
    # N tokens)
    extra=""; clients=""; [ $arm = ngram ] && extra="--speculative ngram --num-draft-tokens 4"
    [ $arm = solo ] && extra="--no-decode-rides-prefill"
    [ $arm = thread ] && extra="--engine-process off"
    [ $arm = mixed ] && extra="--no-overlap-prefill"
    [ $arm = pc ] && extra="--enable-prefix-caching"
    [ $arm = nopc ] && extra="--no-enable-prefix-caching"
    case $arm in api*) extra="--api-server-count ${arm#api}" ;;
      pg*) extra="--prefill-graph-tokens ${arm#pg}" ;;
      hold*) extra="--prefill-coalesce-ms ${arm#hold}" ;;
      cl*) clients="--client-processes ${arm#cl}" ;; esac
    python3 -m draftgraph.cli serve random:$m --port 8123 $extra \
      > "/tmp/server_${m}_$arm.log" 2>&1 &
    pid=$!
    for _ in $(seq 180); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
    timeout ${BENCH_TIMEOUT:-240} python3 -m draftgraph.cli bench serve \
      --base-url http://127.0.0.1:8123 --dataset random --random-input-len 512 \
      --random-output-len 128 --ignore-eos --num-prompts ${NUM_PROMPTS:-512} \
      --random-prefix-len ${PREFIX_LEN:-0} \
      --max-concurrency $CONC --plot --result-dir "$OUT" $clients \
      --device-label "$GPU ($arm${TAG:+ $TAG})" \
      --result-file "serve-$m-$arm${TAG:+-$TAG}-$(date +%H%M%S).json" \
      2>&1 | tail -8
    # each level's engine steps by kind and the server's side of the latencies (its /metrics
    # before and after the level) beside the client's TTFT and E2E
    python3 -c "import json, sys; [print('c', r['max_concurrency'], 'steps', r.get('engine_steps'), 'riding', r.get('rows_riding'), 'client ttft / e2e ms', round(r['mean_ttft_ms'], 2), round(r['mean_e2e_ms'], 2), 'server', {k: round(v, 2) for k, v in r.get('server_latency', {}).items()}) for r in json.load(open(sys.argv[1]))['results']]" "$(ls -t "$OUT"/serve-$m-$arm*.json | head -1)"
    kill $pid; wait $pid 2>/dev/null
    grep -E "captured|KV cache|engine loop|API server:" "/tmp/server_${m}_$arm.log" | tail -5
  done
  [ -n "${NO_OFFLINE:-}" ] && continue
  timeout ${OFFLINE_TIMEOUT:-200} python3 benchmarks/serve_offline.py --model random:$m \
    --num-prompts ${NUM_PROMPTS:-512} --input-len 512 --output-len 128 \
    --concurrency "$(echo $CONC | tr ' ' ',')" --out "$OUT/serve_offline_${m}_${GTAG:-gpu}.json" \
    2>&1 | grep -v -i warn | grep -v "^capturing"
done
ls "$OUT"
