#!/usr/bin/env bash
# Issue 20's batch-1 decode A/B, bisected by kernel on the H200: bench_decode.py --kernels at
# batch 1 over several commits' trees (carry .baseline: each `git archive <sha> src/draftgraph
# benchmarks/bench_decode.py benchmarks/_meta.py` unpacked in .baseline/<sha>, heads left out)
# and this tree, in turn, REPS rounds; each run's step time and its kernels (GPU us per step)
# are printed and its JSON lands in $OUT (ROUNDS x trees files: keep the product at most 8).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
TREES=${TREES:-$(ls .baseline)}
for i in $(seq ${REPS:-2}); do
  for t in $TREES HEAD; do
    if [ $t = HEAD ]; then root=$PWD; else root=.baseline/$t; fi
    echo "=== $t round $i"
    PYTHONPATH=$root/src:$root/benchmarks timeout 150 python3 $root/benchmarks/bench_decode.py \
      --model ${MODEL:-random:smollm2-135m} --batch-sizes 1 --steps 300 --no-ab --kernels \
      --out "/tmp/bisect_${t}_$i.json" 2>&1 | grep -v -i warn | grep -v "^capturing" | tail -30
  done
done
python3 - "$OUT" <<'PY'
import glob, json, sys
rows = {}
for f in sorted(glob.glob("/tmp/bisect_*.json")):
    t = f.split("_")[1]
    a = json.load(open(f))["results"][0]["arms"][0]
    rows.setdefault(t, []).append((a["ms_per_step"], a.get("replay_gpu_ms"), a.get("kernels_us_total")))
json.dump(rows, open(sys.argv[1] + "/bisect_decode_summary.json", "w"), indent=1)
for t, r in rows.items():
    print(t, r)
PY
