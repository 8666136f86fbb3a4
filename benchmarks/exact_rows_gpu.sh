#!/usr/bin/env bash
# Verify rows computed exactly as decode rows (issue 16), on the H200. The real default model
# travels in quarters (`split -n 4 -d FILE`, in the ignored folders .modelq1/ .. .modelq4/,
# the last with the file's sha256): the package's own files take half of a call's 64 MiB.
# Back-to-back calls to the same warm machine:
#   `bash benchmarks/exact_rows_gpu.sh tests` (carry [".modelq1"]): the kernel and GPU tests,
#     the verify-step profile (n-gram k = 4 vs decode, batch 1, 512-token context, random
#     smollm2-135m / llama-3.2-1b / llama-3.1-8b);
#   `bash benchmarks/exact_rows_gpu.sh stage 2`, then `stage 3` (carry [".modelq2"], [".modelq3"]);
#   `bash benchmarks/exact_rows_gpu.sh real` (carry [".modelq4", ".whl"]): the real default
#     model in bf16 with `--exact-rows on`, n-gram greedy against plain greedy on the 164
#     HumanEval prompts (128 tokens) at batch 1 and at batch 32.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-}
D=/tmp/dg_model
mkdir -p $D
if [ "${1:-}" = stage ]; then
  cp .modelq$2/part* $D/ && ls $D; exit 0
fi
if [ "${1:-}" = tests ]; then
  cp .modelq1/part00 $D/
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
for i in 00 01 02; do
  [ -f $D/part$i ] || { echo "part $i missing: the machine was not the warm one"; exit 3; }
done
cat $D/part00 $D/part01 $D/part02 .modelq4/part03 > $D/smollm2.gguf
echo "$(cat .modelq4/sha256)  $D/smollm2.gguf" | sha256sum -c - || exit 4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH
for b in 1 32; do
  timeout 250 python3 benchmarks/eval_lossless.py --model $D/smollm2.gguf --device cuda \
    --dtype bfloat16 --batch $b --exact-rows on --prompt-ids benchmarks/data/humaneval_smollm2_ids.json \
    --out "$OUT/lossless_humaneval_real_bf16_exact_bs${b}_h200.json" 2>&1 | grep -v Warning | tail -6
done
