#!/usr/bin/env bash
# Verify rows computed exactly as decode rows (issue 16), on the H200. The real default model
# is staged in tenths (benchmarks/gguf_parts.sh). Back-to-back calls to the same warm machine:
#   `bash benchmarks/exact_rows_gpu.sh tests` (carry [".modelj1"]): the kernel and GPU tests,
#     the verify-step profile (n-gram k = 4 vs decode, batch 1, 512-token context, random
#     smollm2-135m / llama-3.2-1b / llama-3.1-8b);
#   `bash benchmarks/exact_rows_gpu.sh stage N` for N = 2 .. 9 (carry [".modeljN"]);
#   `bash benchmarks/exact_rows_gpu.sh real` (carry [".modelj10", ".whl_gguf"]): the real default
#     model in bf16 with `--exact-rows on`, n-gram greedy against plain greedy on the 164
#     HumanEval prompts (128 tokens) at batch 1 and at batch 32.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-}
. benchmarks/gguf_parts.sh  # D, M, gguf_stage, gguf_join
if [ "${1:-}" = stage ]; then
  shift; gguf_stage "$@"; exit $?
fi
if [ "${1:-}" = tests ]; then
  gguf_stage 1
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_exact_rows.py \
    tests/test_kernels_gemv.py tests/test_kernels_attention.py tests/test_kernels_backend.py \
    tests/test_kernels_ngram.py tests/test_spec_ngram.py \
    tests/test_gpu_graphs.py tests/test_gpu_block.py tests/test_gpu_chain_head.py \
    > "$OUT/gpu_tests_exact_rows.log" 2>&1
  grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_exact_rows.log" | tail -12
  for t in smollm2-135m llama-3.2-1b llama-3.1-8b; do
    timeout 150 python3 benchmarks/profile_verify.py --target random:$t --top 12 \
      --out "$OUT/profile_verify_exact_$t.json" 2>&1 | grep -v -i warn | head -16
  done
  exit 0
fi
gguf_join || exit $?
export PYTHONPATH=/tmp/site:$PYTHONPATH
for b in 1 32; do
  timeout 250 python3 benchmarks/eval_lossless.py --model $M --device cuda \
    --dtype bfloat16 --batch $b --exact-rows on --prompt-ids benchmarks/data/humaneval_smollm2_ids.json \
    --out "$OUT/lossless_humaneval_real_bf16_exact_bs${b}_h200.json" 2>&1 | grep -v Warning | tail -6
done
