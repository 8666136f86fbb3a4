#!/usr/bin/env bash
# One device call: verify attention planned by rows (the default) against by requests
# (`batchplan`), block and chain rounds in one process per target: llama-3.1-8b at batch 1,
# llama-3.2-1b at batch 8 and 32.
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/benchmarks TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
b5="random:block_size=5" ch="random:layers=1,draft_vocab=32000"
arms="block|$b5|in_graph;block|$b5|batchplan;chain|$ch|4;chain|$ch|batchplan"
run() {  # target, batch size
  timeout 200 python3 benchmarks/bench_block.py --target random:$1 --batch-size $2 --steps 60 \
    --arms "$arms" --out "$OUT/verify_plan_$1_bs$2.json" 2>&1 | grep -E '^\{' | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(f\"$1 bs $2 {r['arm']:48s} round {r['ms_per_round']:.3f} ms  x{r['round_over_decode_step']:.3f} decode\")"
}
run llama-3.2-1b 8
run llama-3.2-1b 32
run llama-3.1-8b 1
