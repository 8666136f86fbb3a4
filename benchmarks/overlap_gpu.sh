#!/usr/bin/env bash
# One device call with the `.whl` carry (benchmarks/serve_gpu_prepare.sh): `--overlap-prefill`
# (the default since stop 53) against `--no-overlap-prefill` on the GPU. Its GPU test first
# (outputs equal the synchronous engine's with arrivals mid-run, decode and a chain head), then
# served smollm2-135m at concurrency 64 (ARMS, default mixed / plain / mixed / plain,
# serve_gpu_check.sh) and offline without and with it (serve_offline.py at 64), all in one
# call so the arms share the machine.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/benchmarks TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graphs.py -k overlapped \
  > "$OUT/gpu_tests_overlap.log" 2>&1
tail -3 "$OUT/gpu_tests_overlap.log"
CONCURRENCY=64 MODELS=smollm2-135m ARMS="${ARMS:-mixed plain mixed plain}" NO_OFFLINE=1 \
  BENCH_TIMEOUT=150 OUT=$OUT bash benchmarks/serve_gpu_check.sh 2>&1 | grep -v "png$"
export PYTHONPATH=/tmp/site:$PYTHONPATH
for flags in "--no-overlap-prefill" ""; do
  timeout 150 python3 benchmarks/serve_offline.py --model random:smollm2-135m \
    --num-prompts 512 --input-len 512 --output-len 128 --concurrency 64 $flags \
    --out "$OUT/serve_offline_smollm2-135m${flags:+_mixed}.json" 2>&1 \
    | grep -v -i warn | grep -v "^capturing" | tail -2
done
