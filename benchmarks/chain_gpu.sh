#!/usr/bin/env bash
# One device call: the draft-model chain's GPU tests, then its round benchmarks.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 300 python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/test_gpu_draft_model.py \
  tests/test_gpu_graphs.py} > "$OUT/gpu_tests_chain.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_chain.log" | tail -12
B=benchmarks/bench_chain.py
timeout 120 python3 $B --target random:smollm2-135m --draft self \
  --out "$OUT/chain_smollm2-135m_self.json" 2>&1 | grep -v -i warn | tail -2 | cut -c1-600
timeout 180 python3 $B --target random:llama-3.1-8b --draft random:llama-3.2-1b \
  --out "$OUT/chain_llama-3.1-8b_1b.json" 2>&1 | grep -v -i warn | tail -2 | cut -c1-600
ls "$OUT"
