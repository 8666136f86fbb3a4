#!/usr/bin/env bash
# Train the default model's chain head on the H200, whose calls carry at most 64 MiB, over
# back-to-back calls to the same warm machine:
#   call 1: `bash benchmarks/real_model_gpu.sh stage` with carry [".model1"] (the GGUF's half);
#   call 2: `bash benchmarks/train_head_gpu.sh train` with carry [".model2", ".whl", ".traindata"]:
#           joins the GGUF, regenerates the ShareGPT train prompts' responses with the engine
#           (bf16, greedy, 256 new tokens), trains for MINUTES (default 4: regeneration and graph capture take ~3 of the call's 10), returns head/,
#           history.json, loss.png and the data's sha256 (the run resumes from /tmp/dg_train
#           if called again while the machine is warm);
#   call 3: `bash benchmarks/train_head_gpu.sh bench` (no carry): the trained head's
#           acceptance and speed against plain and n-gram on the real model (bench_accept.py,
#           batch 1 and 32, bf16).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
D=/tmp/dg_model RUN=/tmp/dg_train
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
M=$D/smollm2.gguf
if [ "${1:-}" = train ]; then
  [ -f $D/part00 ] || { echo "first half missing: the machine was not the warm one"; exit 3; }
  cat $D/part00 .model2/part01 > $M
  echo "$(cat .model2/sha256)  $M" | sha256sum -c - || exit 4
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/gguf-*.whl || exit 1
  timeout 540 python3 -m draftgraph.cli train-drafter $M --out $RUN \
    --data .traindata/sharegpt_train_ids.json.gz --num-prompts 100000 --max-new-tokens 256 \
    --max-len 640 --steps ${STEPS:-2500} --batch-tokens 16384 --time-limit ${MINUTES:-4} \
    --dtype bfloat16 2>&1 | tr '\r' '\n' | grep -v -i warn | grep -v "it/s]$" | tail -6
  cp -r $RUN/head "$OUT/head"; cp $RUN/history.json $RUN/loss.png "$OUT/"
  python3 -c "import json; d=json.load(open('$RUN/sequences.json')); print('sequences', \
len(d['sequences']), 'tokens', sum(len(s['ids']) for s in d['sequences']), 'sha256', d['sha256'])" \
    | tee "$OUT/data.txt"
  ls -la "$OUT" "$OUT/head"
  exit 0
fi
[ -f $M ] || { echo "the model is missing: run the train call first on this machine"; exit 3; }
H=${HEAD:-$RUN/head}
for bs in 1 32; do
  timeout 250 python3 benchmarks/bench_accept.py --model $M --device cuda --dtype bfloat16 \
    --head $H --sets benchmarks/data/accept_sets_smollm2_ids.json --num-prompts 64 \
    --batch $bs --out "$OUT/accept_real_bs${bs}_h200.json" 2>&1 | grep -v -i warn | tail -9
done
