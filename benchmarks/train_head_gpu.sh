#!/usr/bin/env bash
# Train the default model's chain head (KIND=chain, the default) or block head (KIND=block) on
# the H200, whose calls carry at most 64 MiB, over back-to-back calls to the same warm machine:
#   call 1: `bash benchmarks/real_model_gpu.sh stage` with carry [".model1"] (the GGUF's half);
#   call 2: `[KIND=block] bash benchmarks/train_head_gpu.sh train` with carry [".model2", ".whl",
#           ".traindata"]: joins the GGUF, regenerates the ShareGPT train prompts' responses with
#           the engine (bf16, greedy, 256 new tokens; a block run on a machine that already ran
#           the chain one takes its sequences.json: same model, prompts and lengths), trains for
#           MINUTES (default 4, or 6 once the responses exist: regeneration and graph capture
#           take ~3 of the call's 10), returns head/, history.json, loss.png and the data's
#           sha256; called again while the machine is warm, the run resumes from its run
#           directory (/tmp/dg_train, /tmp/dg_train_block) for MINUTES more;
#   call 3: `[KIND=block] bash benchmarks/train_head_gpu.sh bench` (no carry): the trained head's
#           acceptance and speed against plain and n-gram on the real model (bench_accept.py,
#           batch 1 and 32, bf16).
# The block head: block size 8 (7 drafts), 1 layer, window 512 (the whole of nearly every
# 640-token training sequence, and at inference a block's attention stays at 512 + 8 keys),
# Markov head of rank 64, confidence head on, mask token = the tokenizer's <empty_output> (16),
# ANCHORS (default 64) blocks per sequence and at most MAX_BLOCKS (default 2048) per step
# (7 vocabulary rows each: ~25 bytes per row and token, ~18 GB at 2048, measured on the CPU).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
KIND=${KIND:-chain}
D=/tmp/dg_model RUN=/tmp/dg_train
[ "$KIND" = block ] && RUN=/tmp/dg_train_block
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
M=$D/smollm2.gguf
if [ "${1:-}" = train ]; then
  [ -f $D/part00 ] || { echo "first half missing: the machine was not the warm one"; exit 3; }
  [ -f $M ] || cat $D/part00 .model2/part01 > $M
  echo "$(cat .model2/sha256)  $M" | sha256sum -c - || exit 4
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/gguf-*.whl || exit 1
  mkdir -p $RUN
  if [ ! -f $RUN/sequences.json ] && [ -f /tmp/dg_train/sequences.json ]; then
    cp /tmp/dg_train/sequences.json $RUN/
  fi
  MIN=${MINUTES:-4} SEQS=
  if [ -f $RUN/sequences.json ]; then  # nothing to regenerate: a small engine, more training
    [ -z "${MINUTES:-}" ] && MIN=6
    SEQS="--max-num-seqs 8"
  fi
  if [ "$KIND" = block ]; then
    FLAGS="--kind block --block-size 8 --head-layers 1 --window 512 --markov-rank 64
      --confidence --anchors ${ANCHORS:-64} --max-blocks ${MAX_BLOCKS:-2048}
      --steps ${STEPS:-3000} --lr ${LR:-5e-4}"
  else
    FLAGS="--steps ${STEPS:-2500}"
  fi
  timeout 540 python3 -m draftgraph.cli train-drafter $M --out $RUN \
    --data .traindata/sharegpt_train_ids.json.gz --num-prompts 100000 --max-new-tokens 256 \
    --max-len 640 --batch-tokens 16384 --time-limit $MIN $FLAGS $SEQS \
    --dtype bfloat16 2>&1 | tr '\r' '\n' | grep -v -i warn | grep -v "it/s]$" | tail -6
  rm -rf "$OUT/head"; cp -r $RUN/head "$OUT/head"; cp $RUN/history.json $RUN/loss.png "$OUT/"
  python3 -c "import json; d=json.load(open('$RUN/sequences.json')); print('sequences', \
len(d['sequences']), 'tokens', sum(len(s['ids']) for s in d['sequences']), 'sha256', d['sha256'])" \
    | tee "$OUT/data.txt"
  python3 -c "import json; h=json.load(open('$RUN/history.json'))['history']; r=h[-1]; \
print('steps', r['step'], {k: (float(f'{v:.4g}') if isinstance(v, float) else v) for k, v in r.items() \
if k not in ('step', 'agree')}, 'agree', [round(a, 3) for a in r['agree']])" | tee -a "$OUT/data.txt"
  ls -la "$OUT" "$OUT/head"
  exit 0
fi
[ -f $M ] || { echo "the model is missing: run the train call first on this machine"; exit 3; }
H=${HEAD:-$RUN/head}
for bs in 1 32; do
  if [ "$KIND" = block ]; then
    ARMS="--arms plain,block,ngram --block-head $H" NAME=block_
  else
    ARMS="--head $H" NAME=
  fi
  timeout 250 python3 benchmarks/bench_accept.py --model $M --device cuda --dtype bfloat16 \
    $ARMS --sets benchmarks/data/accept_sets_smollm2_ids.json --num-prompts 64 \
    --batch $bs --out "$OUT/accept_${NAME}real_bs${bs}_h200.json" 2>&1 | grep -v -i warn | tail -9
done
