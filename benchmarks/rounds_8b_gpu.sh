#!/usr/bin/env bash
# One device call (an H200): issues 12 / 13 / 16's batch-1 rounds on random weights with the
# tensor-core rows off and on, one process each: the n-gram k = 4 step (every draft accepted)
# against the decode step (profile_verify), then the chain (k = 4, 1-layer head, 32k draft
# vocabulary) and block (5, 32k) rounds at accept length 1 (bench_block). MODELS picks the
# targets (default: the 8B, then the 1B).
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/benchmarks TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
ARMS="block|random:block_size=5,draft_vocab=32000|in_graph;chain|random:layers=1,draft_vocab=32000|4"
for m in ${MODELS:-llama-3.1-8b llama-3.2-1b}; do
  for rows in off on; do
    timeout 200 python3 benchmarks/profile_verify.py --target random:$m --top 8 \
      --tensor-core-rows $rows --out "$OUT/verify_${m}_rows_${rows}.json" 2>&1 | grep "^=="
    timeout 200 python3 benchmarks/bench_block.py --target random:$m --tensor-core-rows $rows \
      --batch-size 1 --steps 50 --arms "$ARMS" --out "$OUT/rounds_${m}_rows_${rows}.json" \
      2>&1 | grep -v -i warn | tail -4 | cut -c1-400
  done
done
