#!/usr/bin/env bash
# One device call (nvidia-h200): kernel tests on the GPU, the decode-attention and GEMV /
# qkv+RoPE tuning sweeps (tables to paste into kernels/attention.py and kernels/gemv.py), then
# the batch-1 decode benchmarks with per-kernel times. Results land in $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
cd benchmarks
timeout 90 python3 -m pytest -q -p no:cacheprovider ../tests/test_kernels_gemv.py \
  ../tests/test_kernels_attention.py 2>&1 | tail -3
timeout 260 python3 bench_attention.py --budget-s ${ATTN_BUDGET:-35} \
  --out "$OUT/attn_tune_h200.json" 2>&1 | grep -v Warn
timeout 200 python3 bench_gemv.py --tune --models smollm2-135m,llama-3.1-8b --ms 1 \
  --tune-budget-s ${GEMV_BUDGET:-12} --out "$OUT/gemv_tune2_h200.json" 2>&1 | grep -v Warn
[ -n "${SKIP_DECODE:-}" ] && exit 0
for m in smollm2-135m llama-3.1-8b; do
  timeout 100 python3 bench_decode.py --model random:$m --batch-sizes 1 --kernels --no-ab \
    --out "$OUT/decode_$m.json" 2>&1 | grep -v Warn | head -14
done
