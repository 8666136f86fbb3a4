#!/usr/bin/env bash
# Prefix caching on a GPU (stop 62; carry [".whl"] for the serving part, no GGUF): the GPU
# tests (prefix caching behind steps in flight, and stop 61's extras graphs with the min_p /
# allowed-ids / bad-words lanes), then prefix_cache_bench.py (TTFT with a cached 2,048-token
# system prompt, arms off / on alternating; then --cold: 16 streams' first wave meets an empty
# cache) per model, then (SERVE=1) what the cache costs
# random-prompt serving at 64 streams (arms nopc / pc alternating, no hits to be had).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks TRITON_INTERPRET=0
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 280 python3 -m pytest -q -m gpu tests/test_sampling_controls.py \
  tests/test_prefix_cache.py -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
for m in ${MODELS:-smollm2-135m llama-3.2-1b}; do
  (cd benchmarks && timeout 150 python3 prefix_cache_bench.py --model random:$m \
    --prefix-len 2048 --input-len 128 --output-len 64 --num-prompts 32 --concurrency 1,16 \
    --arms off,on,off,on --out "$OUT/prefix_cache_${m}_gpu.json" 2>&1 \
    | grep -E "c=|Error" | tail -10)
  # a cold first burst (stop 64: the burst after the first waits for its blocks)
  (cd benchmarks && timeout 120 python3 prefix_cache_bench.py --model random:$m --cold \
    --prefix-len 2048 --input-len 128 --output-len 64 --num-prompts 32 --concurrency 16 \
    --arms off,on,off,on --out "$OUT/prefix_cache_cold_${m}_gpu.json" 2>&1 \
    | grep -E "c=|Error" | tail -10)
done
if [ -n "${SERVE:-}" ]; then
  CONCURRENCY=64 MODELS=smollm2-135m ARMS="nopc pc nopc pc" NO_OFFLINE=1 \
    timeout 300 bash benchmarks/serve_gpu_check.sh 2>&1 | grep -v -i warn | tail -30
fi
