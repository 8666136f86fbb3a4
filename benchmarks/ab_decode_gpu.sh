#!/usr/bin/env bash
# Issue 20's A/B on the H200: the plain decode step before the sampling extras (git c4dca0e,
# carried as .baseline/c4dca0e: `git archive c4dca0e src/draftgraph benchmarks/bench_decode.py
# benchmarks/_meta.py`, heads left out) against this tree, bench_decode.py (unchanged between
# the two) at batch 1 / 8 / 64, arms alternating B A B A B A. JSON per run in $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
BASE=.baseline/c4dca0e
[ -d $BASE/src/draftgraph ] || { echo "carry $BASE"; exit 2; }
for i in 1 2 3; do
  for arm in before after; do
    if [ $arm = before ]; then root=$BASE; else root=$PWD; fi
    PYTHONPATH=$root/src:$root/benchmarks timeout 150 python3 $root/benchmarks/bench_decode.py \
      --model ${MODEL:-random:smollm2-135m} --batch-sizes 1,8,64 --steps 300 --no-ab \
      --out "$OUT/ab_decode_${arm}_$i.json" 2>&1 | grep -v -i warn | grep -v "^capturing" | tail -3
  done
done
