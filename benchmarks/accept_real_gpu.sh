#!/usr/bin/env bash
# The shipped heads against plain decoding on the real default model (SmolLM2-135M-Instruct,
# GGUF Q4_1) on the H200, bf16, with `bench_accept.py`: MT-Bench and HumanEval, arms plain,
# chain head (k = 4), block head (its block of 8), plain again; for each temperature in TEMPS
# (default 0.7) and batch in BATCHES (default "1 32"; 12 prompts at batch 1, 64 above).
# One process builds 4 engines a set, 8 a run: it also checks that graph capture survives
# the earlier engines' garbage (`graph_set.gc_paused`).
# The GGUF travels in tenths (benchmarks/gguf_parts.sh) over back-to-back calls:
#   calls 1-9: `bash benchmarks/accept_real_gpu.sh stage N` with carry [".modeljN"];
#   call 10:   `bash benchmarks/accept_real_gpu.sh run` with carry [".modelj10", ".whl_gguf"].
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
. benchmarks/gguf_parts.sh  # D, M, gguf_stage_or_join
gguf_stage_or_join "$@"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
H=src/draftgraph/heads
for T in ${TEMPS:-0.7}; do
  for B in ${BATCHES:-1 32}; do
    N=$([ "$B" = 1 ] && echo 12 || echo 64)
    timeout ${LIMIT:-250} python3 benchmarks/bench_accept.py --model $M --device cuda \
      --dtype bfloat16 --sets benchmarks/data/accept_sets_smollm2_ids.json \
      --only mtbench,humaneval --num-prompts $N --batch $B --temperature $T \
      --arms plain,chain@$H/smollm2-135m-chain,block@$H/smollm2-135m-block,plain \
      --out "$OUT/accept_t${T}_bs${B}_real_h200.json" 2>&1 | grep -v Warning | tail -12
  done
done
ls -la "$OUT"
