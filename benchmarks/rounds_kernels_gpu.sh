#!/usr/bin/env bash
# One device call: the 8B chain and block rounds with GPU time per kernel name (bench_chain /
# bench_block --kernels), after the GPU tests of the chain and block drafters when TESTS=1.
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/benchmarks TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
if [ -n "${TESTS:-}" ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_chain_head.py \
    tests/test_gpu_block.py tests/test_gpu_exact_rows.py > "$OUT/gpu_tests_rounds.log" 2>&1
  grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_rounds.log" | tail -12
fi
timeout 250 python3 benchmarks/bench_chain.py --target random:llama-3.1-8b \
  --head random:layers=1,draft_vocab=32000 --kernels \
  --out "$OUT/chain_llama-3.1-8b_head1_kernels.json" 2>&1 | grep -v -i warn | tail -1 \
  | python3 -c "
import json, sys
r = json.loads(sys.stdin.read())
for arm in ('plain_decode', 'fused', 'fallback'):
    a = r[arm]
    print(arm, round(a['ms_per_round'], 3), 'draft', a.get('draft_ms'), 'x', a.get('round_over_decode_step'))"
timeout 320 python3 benchmarks/bench_block.py --target random:llama-3.1-8b --kernels \
  --out "$OUT/block_llama-3.1-8b_kernels.json" \
  --arms "block|random:block_size=5|in_graph;block|random:block_size=5,draft_vocab=32000|in_graph;block|random:block_size=8|in_graph;chain|random:layers=1,draft_vocab=32000|7" \
  2>&1 | grep -v -i warn | grep -E '^\{' | cut -c1-300
