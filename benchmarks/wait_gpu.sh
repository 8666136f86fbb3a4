#!/usr/bin/env bash
# One device call (carry [".whl"]): where a step's time goes at 64 streams, served against
# offline on one machine: smollm2-135m (MODELS) at concurrency 64 served (serve_gpu_check.sh)
# and offline (serve_offline.py); each step kind's ms and the part of it spent waiting for the
# device (wait_ms_each; the rest is the engine thread's host work, GIL waits included).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
for m in ${MODELS:-smollm2-135m}; do
  CONCURRENCY=64 MODELS=$m NO_OFFLINE=1 BENCH_TIMEOUT=150 OUT=$OUT \
    bash benchmarks/serve_gpu_check.sh 2>&1 | grep -E "^ +64|^c 64|engine loop" | cut -c1-900
  rm -f "$OUT"/*.png
  PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks TRITON_INTERPRET=0 timeout 150 python3 \
    benchmarks/serve_offline.py --model random:$m --num-prompts 512 --input-len 512 \
    --output-len 128 --concurrency 64 --out "$OUT/serve_offline_$m.json" 2>&1 \
    | grep -v -i warn | grep -v "^capturing" | tail -2
done
