#!/usr/bin/env bash
# Time to first token on the H200 (issue 15):
#   profile_prefill.py: batch-1 prefill of 512 / 4096 tokens, captured prefill graphs against
#     eager extend forwards in one run (TTFT, GPU time, kernel launches, top kernels), random
#     smollm2-135m and llama-3.1-8b, bf16;
#   bench_startup.py: an engine with the default flags (256 requests, 8192-token steps, prefill
#     graphs up to 4096 tokens): capture seconds and MiB per graph set, then 64 x 512-token
#     prompts, 32 tokens each.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-}
for m in ${MODELS:-smollm2-135m llama-3.1-8b}; do
  timeout 200 python3 benchmarks/profile_prefill.py --model random:$m \
    --out "$OUT/prefill_graphs_${m}_h200.json" 2>&1 | grep -v -i warn | grep -v "^capturing"
done
timeout 150 python3 benchmarks/bench_startup.py --model random:smollm2-135m \
  --out "$OUT/startup_defaults_smollm2-135m_none_h200.json" 2>&1 | grep -v -i warn \
  | grep -v "^capturing"
