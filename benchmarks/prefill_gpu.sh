#!/usr/bin/env bash
# Time to first token and start-up with the GPU defaults (issue 15), on the H200:
#   profile_prefill.py: batch-1 prefill of 512 / 4096 tokens, TTFT vs GPU time, kernel launches,
#     top kernels (random smollm2-135m and llama-3.1-8b, bf16);
#   bench_startup.py: an engine with the default flags (256 requests, 8192-token steps on a
#     GPU): capture seconds and MiB per graph set, then 64 x 512-token prompts, 32 tokens each;
#   bench_async_spec.py on smollm2 (MODELS=smollm2-135m in async_spec_gpu.sh).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-}
for m in smollm2-135m llama-3.1-8b; do
  timeout 120 python3 benchmarks/profile_prefill.py --model random:$m \
    --out "$OUT/prefill_${m}_h200.json" 2>&1 | grep -v -i warn
done
for s in none ngram; do
  flag=""; [ $s = ngram ] && flag="--speculative ngram"
  timeout 150 python3 benchmarks/bench_startup.py --model random:smollm2-135m $flag \
    --out "$OUT/startup_defaults_smollm2-135m_${s}_h200.json" 2>&1 | grep -v -i warn | grep -v "^capturing"
done
MODELS=smollm2-135m bash benchmarks/async_spec_gpu.sh bench
