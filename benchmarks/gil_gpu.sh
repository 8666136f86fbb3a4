#!/usr/bin/env bash
# One device call (carry [".whl"]): where a served step's time goes at 64 streams, and whether
# the engine process's helper threads (the sender pickling each step's outputs, the receiver
# adding requests) hold the GIL its step loop waits for. Served smollm2-135m at concurrency 64
# with CPython's GIL switch interval at its default 5 ms and at SI (default 0.2 ms) in every
# server process (benchmarks/switch_interval_sitecustomize.py), then offline at 64; each
# step kind's ms and the part waiting for the device (wait_ms_each) in the JSON and the log.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT" /tmp/site
cp benchmarks/switch_interval_sitecustomize.py /tmp/site/sitecustomize.py
for si in ${SIS:-"" 0.0002}; do
  DG_SWITCH_INTERVAL=$si TAG=si${si:-default} CONCURRENCY=64 MODELS=smollm2-135m NO_OFFLINE=1 \
    BENCH_TIMEOUT=150 OUT=$OUT bash benchmarks/serve_gpu_check.sh 2>&1 \
    | grep -E "^ +64|^c 64|engine loop" | cut -c1-700
done
rm -f "$OUT"/*.png
PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks TRITON_INTERPRET=0 timeout 150 python3 \
  benchmarks/serve_offline.py --model random:smollm2-135m --num-prompts 512 --input-len 512 \
  --output-len 128 --concurrency 64 --out "$OUT/serve_offline_smollm2-135m.json" 2>&1 \
  | grep -v -i warn | grep -v "^capturing" | tail -2
