#!/usr/bin/env bash
# Async speculative steps on the H200 (issue 15): step N + 1 launched before step N is read.
#   `bash benchmarks/async_spec_gpu.sh tests`: the GPU tests that replay speculative graphs
#     (they run with async scheduling on, the engine's default with graphs) and the
#     async-vs-sync equality tests, fp32;
#   `bash benchmarks/async_spec_gpu.sh bench`: bench_async_spec.py (sync vs async in one run,
#     A B A B on one engine per drafter; n-gram k = 4 fixed and a random chain head k = 4;
#     batch 1 and 32, 512-token context, bf16) on random smollm2-135m, llama-3.2-1b,
#     llama-3.1-8b.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-}
if [ "${1:-}" = tests ]; then
  timeout 560 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_tokens.py \
    tests/test_gpu_graphs.py tests/test_gpu_chain_head.py tests/test_gpu_block.py \
    tests/test_gpu_draft_model.py tests/test_gpu_exact_rows.py tests/test_async_spec.py \
    > "$OUT/gpu_tests_async_spec_h200.log" 2>&1
  grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_async_spec_h200.log" | tail -15
  exit 0
fi
for m in ${MODELS:-smollm2-135m llama-3.2-1b llama-3.1-8b}; do
  timeout 200 python3 benchmarks/bench_async_spec.py --model random:$m --batch-sizes 1,32 \
    --out "$OUT/async_spec_${m}_h200.json" 2>&1 | grep -v -i warn | grep -v "^capturing"
done
