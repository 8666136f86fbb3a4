#!/usr/bin/env bash
# The real default model (SmolLM2-135M-Instruct, GGUF Q4_1, 98 MB) on the H200, staged in
# tenths over back-to-back calls to one warm machine (benchmarks/gguf_parts.sh), joined under
# /tmp, checked, then measured in bf16:
#   - eval_lossless.py: share of the 164 HumanEval prompts (+ chat prompts) whose n-gram
#     speculative output equals plain greedy decoding, 128 new tokens;
#   - the same in fp32 (how much of a bf16 mismatch is rounding, not logic);
#   - bench_spec.py (unless SKIP_SPEC=1): ms per step and acceptance length, code-edit and free-form, batch 1 and 32.
# Calls 1-9: `bash benchmarks/real_model_gpu.sh stage N` with carry [".modeljN"];
# call 10: `bash benchmarks/real_model_gpu.sh run` with carry [".modelj10", ".whl_gguf"].
# On nvidia-h200-x2, `... tp` instead of `run`: TP = 2 against TP = 1 (tp_compare.py, bf16),
# then the bf16 HumanEval share alone.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
. benchmarks/gguf_parts.sh  # D, M, gguf_stage_or_join
gguf_stage_or_join "$@"
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
if [ "${1:-}" = tp ]; then
  timeout 240 python3 benchmarks/tp_compare.py --model $M --dtype bfloat16 \
    --prompt-ids benchmarks/data/humaneval_smollm2_ids.json --num-prompts 16 \
    --out "$OUT/tp_real_bf16_h200x2.json" 2>&1 | grep -v Warning | tail -5
  SKIP_FP32=1 SKIP_SPEC=1
fi
timeout 300 python3 benchmarks/eval_lossless.py --model $M --device cuda --dtype bfloat16 \
  --batch 32 --prompt-ids benchmarks/data/humaneval_smollm2_ids.json \
  --out "$OUT/lossless_humaneval_real_bf16_h200.json" 2>&1 | grep -v Warning | tail -12
# fp32 on the same GPU: how much of the bf16 mismatch is rounding (kernel summation order)
[ -n "${SKIP_FP32:-}" ] || timeout 200 python3 benchmarks/eval_lossless.py --model $M --device cuda --dtype float32 \
  --batch 32 --prompt-ids benchmarks/data/humaneval_smollm2_ids.json \
  --out "$OUT/lossless_humaneval_real_fp32_h200.json" 2>&1 | grep -v Warning | tail -12
[ -n "${SKIP_SPEC:-}" ] || timeout 240 python3 benchmarks/bench_spec.py --model $M --device cuda --dtype bfloat16 \
  --batch-sizes 1,32 --out "$OUT/spec_default_h200.json" 2>&1 | grep -v Warning | tail -12
ls -la "$OUT"
