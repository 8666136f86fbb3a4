#!/usr/bin/env bash
# `--deterministic` on the H200 (issue 16). Back-to-back calls to one warm machine:
#   `bash benchmarks/deterministic_gpu.sh kernels`: the GPU tests of the mode and of the
#     kernels it changes, then the batch-invariant matmul's config sweep;
#   `bash benchmarks/deterministic_gpu.sh engine [models]`: ms per step, on against off;
#   `bash benchmarks/deterministic_gpu.sh stage N` for N = 1 .. 9 (carry [".modeljN"]): the
#     real default model in tenths (benchmarks/gguf_parts.sh);
#   `bash benchmarks/deterministic_gpu.sh real` (carry [".modelj10", ".whl_gguf"]): the real
#     model in bf16 with --deterministic, n-gram greedy vs plain greedy on the 164 HumanEval
#     prompts at batch 32, and the first prompt alone vs among 31 others, 20 trials.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-}
. benchmarks/gguf_parts.sh  # D, M, gguf_stage, gguf_join
case "${1:-}" in
stage) shift; gguf_stage "$@"; exit $? ;;
kernels)
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_deterministic.py \
    tests/test_kernels_matmul.py tests/test_kernels_attention.py tests/test_kernels_backend.py \
    tests/test_gpu_exact_rows.py tests/test_gpu_graphs.py > "$OUT/gpu_tests_deterministic.log" 2>&1
  grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_deterministic.log" | tail -14
  timeout 230 python3 benchmarks/bench_deterministic.py kernels 2>&1 | grep -v -i warn
  exit 0 ;;
engine) shift; timeout 450 python3 benchmarks/bench_deterministic.py engine "$@" 2>&1 \
  | grep -v -i warn; exit 0 ;;
real) ;;
*) echo "usage: $0 kernels|engine|stage N|real"; exit 2 ;;
esac
gguf_join || exit $?
export PYTHONPATH=/tmp/site:$PYTHONPATH
timeout 400 python3 benchmarks/eval_lossless.py --model $M --device cuda \
  --dtype bfloat16 --batch 32 --deterministic --invariance-trials 20 \
  --prompt-ids benchmarks/data/humaneval_smollm2_ids.json \
  --out "$OUT/lossless_humaneval_real_bf16_deterministic_bs32_h200.json" 2>&1 \
  | grep -v Warning | tail -8
