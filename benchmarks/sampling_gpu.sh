#!/usr/bin/env bash
# Sampling on the H200 (issue 14's temperature-0.7 speed), one call, random weights, no
# staging: the sampling kernels' GPU tests, then bench_sampling.py: the micro part (this
# tree), and the rounds under an older tree and this one, in one call:
#   rm -rf .old && mkdir .old && git archive <commit> src | tar -x -C .old \
#     && rm -rf .old/src/draftgraph/heads          (an ignored folder; carry [".old"])
#   bash benchmarks/sampling_gpu.sh              (MODELS, default smollm2-135m,llama-3.1-8b)
# Without .old the rounds run on this tree alone.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
MODELS=${MODELS:-smollm2-135m,llama-3.1-8b}
PYTHONPATH=$PWD/src:$PWD/benchmarks python3 -m pytest -q -p no:cacheprovider \
  tests/test_kernels_sampling.py ${TESTS:-} 2>&1 | tail -5 | tee "$OUT/gpu_tests_sampling.log"
if [ -d .old/src ]; then
  PYTHONPATH=$PWD/.old/src:$PWD/benchmarks python3 benchmarks/bench_sampling.py \
    --models "$MODELS" --skip-micro --tag old --steps ${STEPS:-60} \
    --out "$OUT/sampling_old_h200.json" 2>&1 | grep '^{' | tail -40
fi
PYTHONPATH=$PWD/src:$PWD/benchmarks python3 benchmarks/bench_sampling.py --models "$MODELS" \
  --steps ${STEPS:-60} --out "$OUT/sampling_h200.json" 2>&1 | grep '^{' | tail -60
