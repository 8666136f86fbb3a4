#!/usr/bin/env bash
# The block drafter on the H200, over two device calls:
#   `bash benchmarks/block_gpu.sh tests`: the block GPU tests and the attention / metadata
#     kernel tests on the GPU, then the smollm2-135m rounds;
#   `bash benchmarks/block_gpu.sh big`: the llama-3.1-8b rounds and llama-3.2-1b at batch
#     8 / 32 / 64.
# Every run: the plain decode step, block rounds at block size 5 and 8 (1- and 3-layer heads,
# in-graph metadata) with the eager-metadata fallback as the A arm, a block-5 head over the
# chain's reduced draft vocabulary, and chain rounds with the same number of drafts (k = 4
# and 7), all in one process per target.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench() {  # name, target, dv (chain draft vocabulary), extra args...
  local name=$1 target=$2 dv=$3; shift 3
  local b5="random:block_size=5" b8="random:block_size=8"
  local l3="random:layers=3,block_size=5" l38="random:layers=3,block_size=8"
  local ch="random:layers=1$dv"
  timeout 280 python3 benchmarks/bench_block.py --target $target --out "$OUT/block_$name.json" \
    --arms "block|$b5|in_graph;block|$b5|eager${dv:+;block|$b5$dv|in_graph};block|$b8|in_graph;block|$l3|in_graph;block|$l38|in_graph;chain|$ch|4;chain|$ch|7" \
    "$@" 2>&1 | grep -v -i warn | grep -E '^\{' | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(f\"{r['arm']:48s} round {r['ms_per_round']:.3f} ms  draft {r.get('draft_ms', 0):.3f} ms  \"
          f\"x{r['round_over_decode_step']:.2f} decode  host kernels {r.get('kernel_launches')} graphs {r.get('graph_launches')}\")"
}
bench1() {  # 1B at a batch size: the block at 5 (both arms) next to the chain at k = 4
  local bs=$1
  timeout 200 python3 benchmarks/bench_block.py --target random:llama-3.2-1b --batch-size $bs \
    --out "$OUT/block_llama-3.2-1b_bs$bs.json" --steps 60 \
    --arms "block|random:block_size=5|in_graph;block|random:block_size=5|eager;chain|random:layers=1,draft_vocab=32000|4" \
    2>&1 | grep -v -i warn | grep -E '^\{' | cut -c1-300
}
if [ "${1:-}" = tests ]; then
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_block.py \
    tests/test_kernels_attention.py tests/test_kernels_metadata.py tests/test_gpu_chain_head.py \
    > "$OUT/gpu_tests_block.log" 2>&1
  grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_block.log" | tail -12
  bench smollm2-135m random:smollm2-135m ""
else
  bench llama-3.1-8b random:llama-3.1-8b ",draft_vocab=32000"
  for bs in 8 32 64; do bench1 $bs; done
fi
ls "$OUT"
