#!/usr/bin/env bash
# One device call: the chain drafters' GPU tests, then their round benchmarks (fused and
# fallback arms in each run, next to the plain decode step).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 300 python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/test_gpu_chain_head.py \
  tests/test_gpu_draft_model.py tests/test_gpu_graphs.py} > "$OUT/gpu_tests_chain.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_chain.log" | tail -12
B=benchmarks/bench_chain.py
bench() {  # name, args...
  local name=$1; shift
  timeout 200 python3 $B "$@" --out "$OUT/chain_$name.json" 2>&1 | grep -v -i warn | tail -2 \
    | cut -c1-900
}
[ -n "${SKIP_BENCH:-}" ] && exit 0
bench llama-3.1-8b_head1 --target random:llama-3.1-8b --head random:layers=1,draft_vocab=32000
bench smollm2-135m_head1 --target random:smollm2-135m --head random:layers=1
bench llama-3.2-1b_head1_bs8 --target random:llama-3.2-1b --head random:layers=1,draft_vocab=32000 \
  --batch-size 8
bench llama-3.2-1b_head1_bs32 --target random:llama-3.2-1b \
  --head random:layers=1,draft_vocab=32000 --batch-size 32
bench smollm2-135m_self --target random:smollm2-135m --draft self
ls "$OUT"
