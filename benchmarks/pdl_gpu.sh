#!/usr/bin/env bash
# Programmatic dependent launch A/B (issues 12 / 13 / 16 and the decode step): the decode step
# with PDL off (DRAFTGRAPH_PDL=0) and on, arms alternating (ARMS; "prefetch" and "wait" were
# the two variants of stop 39's first call: the L2 prefetch is gone, both now run the same
# code). `tests` first runs the GPU tests that cover the PDL kernels; `rounds` times the
# default model's chain and block rounds (shipped heads, random smollm2 weights) instead;
# `exact` the n-gram step with exact rows (all-Triton verify rows, PDL throughout) against
# cuBLAS rows (whose launches PDL cannot overlap), each with PDL off and on.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:$PWD/benchmarks
MODELS=${MODELS:-smollm2-135m llama-3.1-8b}
REPS=${REPS:-2}
if [ "${1:-}" = tests ]; then
  python3 -c "import triton; print('triton', triton.__version__)"
  { timeout 120 python3 -m pytest -q -x -p no:cacheprovider -k pdl tests/test_kernels_gemv.py
    timeout 420 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_graphs.py \
      tests/test_gpu_chain_head.py tests/test_gpu_block.py; } 2>&1 | tail -15 \
    | tee "$OUT/pdl_tests.log"
  exit 0
fi
if [ "${1:-}" = exact ]; then  # exact rows (every verify row through the PDL GEMVs) vs cuBLAS
  for i in $(seq 1 "$REPS"); do
    for pdl in 0 1; do
      DRAFTGRAPH_PDL=$pdl timeout 280 python3 benchmarks/bench_exact_rows.py \
        --target random:smollm2-135m --arms "off;on:16" \
        --out "$OUT/pdl_exact_rows_smollm2_pdl${pdl}_$i.json" 2>&1 | grep -v -i warn | tail -4
    done
  done
  exit 0
fi
if [ "${1:-}" = rounds ]; then
  H=src/draftgraph/heads
  for i in $(seq 1 "$REPS"); do
    for pdl in 0 1; do
      DRAFTGRAPH_PDL=$pdl timeout 240 python3 benchmarks/bench_block.py \
        --target random:smollm2-135m --steps 200 --out "$OUT/pdl_rounds_smollm2_pdl${pdl}_$i.json" \
        --arms "block|$H/smollm2-135m-block|in_graph;chain|$H/smollm2-135m-chain|4" 2>&1 \
        | grep -E "ms|rror" | grep -v -i warn | tail -6
    done
  done
  exit 0
fi
arm() {  # name, env...
  local name=$1; shift
  for m in $MODELS; do
    bs=1; [ "$m" = smollm2-135m ] && bs=${BS_SMALL:-1,8,64}
    env "$@" timeout 200 python3 benchmarks/bench_decode.py --model random:$m --batch-sizes $bs \
      --steps 300 --no-ab --out "$OUT/pdl_decode_${m}_${name}_$i.json" 2>&1 \
      | grep -E "ms|Error|error" | grep -v -i warn | tail -4
  done
}
ARMS=${ARMS:-off on}
for i in $(seq 1 "$REPS"); do
  for a in $ARMS; do
    case $a in
      off) arm off DRAFTGRAPH_PDL=0 ;;
      on) arm on DRAFTGRAPH_PDL=1 ;;
    esac
  done
done
