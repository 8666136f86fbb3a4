#!/usr/bin/env bash
# Programmatic dependent launch A/B on the H200 (issues 12 / 13 / 16 and the decode step): the
# decode step with PDL off (DRAFTGRAPH_PDL=0), on with the weights prefetched into L2 before
# each GEMV's wait (the default), and on without the prefetch, arms alternating; then the
# speculative rounds. `tests` first runs the GPU tests that cover the PDL kernels.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:$PWD/benchmarks
MODELS=${MODELS:-smollm2-135m llama-3.1-8b}
REPS=${REPS:-2}
if [ "${1:-}" = tests ]; then
  python3 -c "import triton; print('triton', triton.__version__)"
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider -k "pdl or graph" \
    tests/test_kernels_gemv.py tests/test_gpu_graphs.py 2>&1 | tail -15 | tee "$OUT/pdl_tests.log"
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
ARMS=${ARMS:-off prefetch wait}
for i in $(seq 1 "$REPS"); do
  for a in $ARMS; do
    case $a in
      off) arm off DRAFTGRAPH_PDL=0 ;;
      prefetch) arm prefetch DRAFTGRAPH_PDL=1 ;;
      wait) arm wait DRAFTGRAPH_PDL=1 DRAFTGRAPH_PDL_PREFETCH=0 ;;
    esac
  done
done
