#!/usr/bin/env bash
# The shipped chain and block heads on the real default model at batch 1 (issue 14's speed
# goal: 1.8x plain, greedy and at T = 0.7), with the CLI's auto trees, 20 MT-Bench and 20
# HumanEval prompts x 256 tokens, bf16. After `train_head_gpu.sh stage 1..9`; carry
# [".modelj10", ".whl_gguf"]. TEMPS picks the temperatures (default "0.7 0").
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
. benchmarks/gguf_parts.sh
gguf_join || exit $?
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
GTAG=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o -i -E "h100|h200" | tr A-Z a-z | head -1)
H=src/draftgraph/heads
for t in ${TEMPS:-0.7 0}; do
  python3 benchmarks/bench_accept.py --model $M --device cuda --dtype bfloat16 \
    --sets benchmarks/data/accept_sets_smollm2_ids.json --only mtbench,humaneval \
    --num-prompts 20 --batch 1 --max-tokens 256 --temperature $t --k 3 \
    --arms plain,chain+8x5:27+g16@$H/smollm2-135m-chain,block+4x7:27+g16@$H/smollm2-135m-block,plain \
    --out "$OUT/heads_real_bs1_t${t}_${GTAG:-gpu}.json" 2>&1 | grep -v -i warn | cut -c1-330
done
