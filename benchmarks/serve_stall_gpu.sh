#!/usr/bin/env bash
# Issue 15: on a fresh machine the first served run at high concurrency showed one request
# with a ~0.7 s time to first token (p99 TTFT 702 ms at concurrency 64 for smollm2-135m, 750 ms
# at 16 for llama-3.2-1b), and a second server on the same machine did not. Hypothesis: Triton
# compiles new specialisations (integer arguments divisible by 16 or not, equal to 1 or not) of
# the eager extend path's kernels the first time a step exceeds the captured prefill sizes,
# and the on-disk cache hides it afterwards. This counts the Triton cache's entries before and
# after each concurrency level of the first served run on an empty cache. Carry [".whl"].
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:$PWD/src
export TRITON_CACHE_DIR=/tmp/triton_cache_fresh; rm -rf $TRITON_CACHE_DIR
M=${MODEL:-random:smollm2-135m}
python3 -m draftgraph.cli serve $M --port 8123 > /tmp/server.log 2>&1 &
pid=$!
for _ in $(seq 180); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
count() { find $TRITON_CACHE_DIR -name "*.json" -newer /tmp/mark 2>/dev/null | grep -v __grp | wc -l; }
for c in 1 16 64 128; do
  touch /tmp/mark; sleep 1
  timeout 200 python3 -m draftgraph.cli bench serve --base-url http://127.0.0.1:8123 \
    --dataset random --random-input-len 512 --random-output-len 128 --ignore-eos \
    --num-prompts 128 --max-concurrency $c --result-dir "$OUT" \
    --result-file "stall_$c.json" --device-label "NVIDIA H200" 2>&1 | tail -2 | head -1
  echo "   kernels compiled during concurrency $c: $(count)"
  find $TRITON_CACHE_DIR -name "*.json" -newer /tmp/mark | grep -v __grp | xargs -r -n1 basename | sort | uniq -c | head
done
kill $pid; wait $pid 2>/dev/null
