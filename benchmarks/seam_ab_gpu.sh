#!/usr/bin/env bash
# The drafter-seam A/B in one device call: the same public-API benchmark
# (benchmarks/bench_seam_ab.py) against the package before the change (.baseline/, carried:
# `git archive f1ad3b1 draftgraph | tar -x -C .baseline`) and after it (src/), arms
# alternating A B A B per model. MODELS="smollm2-135m llama-3.1-8b" by default;
# GPU_TESTS="..." runs those tests first.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
if [ -n "${GPU_TESTS:-}" ]; then
  PYTHONPATH=$PWD/src timeout 240 python3 -m pytest -q -p no:cacheprovider $GPU_TESTS \
    > "$OUT/gpu_tests.log" 2>&1
  grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -12
fi
for m in ${MODELS:-smollm2-135m llama-3.1-8b}; do
  for rep in 1 2; do
    for a in old:$PWD/.baseline new:$PWD/src; do
      arm=${a%%:*}; root=${a#*:}
      PYTHONPATH=$root timeout 150 python3 benchmarks/bench_seam_ab.py --arm "$arm" \
        --model "random:$m" --out "$OUT/seam_${m}_${arm}_$rep.json" 2>&1 \
        | grep -v -i warn | tail -1 | cut -c1-400
    done
  done
done
ls "$OUT"
