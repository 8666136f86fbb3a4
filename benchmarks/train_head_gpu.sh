#!/usr/bin/env bash
# Train the default model's chain head (KIND=chain, the default) or block head (KIND=block) on
# the H200, whose calls carry at most 64 MiB (the package's tracked files are about half of it),
# over back-to-back calls to the same warm machine. The GGUF travels in quarters (`split -n 4
# -d FILE`, the ignored folders .modelq1/ .. .modelq4/, the last with the file's sha256):
#   calls 1-3: `bash benchmarks/train_head_gpu.sh stage N`, N = 1, 2, 3, with carry
#           [".modelqN"]: the quarters go to /tmp/dg_model;
#   call 4: `[KIND=block] bash benchmarks/train_head_gpu.sh train` with carry [".modelq4",
#           ".whl", DATA's folder]: joins the GGUF, regenerates the prompts' responses with the
#           engine (bf16, greedy, 256 new tokens, SEQS requests at a time, default 1024; 256 if
#           that fails at once), returns them packed (`pack_sequences.py`: seqs.npz, store them
#           under .trainseqs_all/) and trains until END seconds (default 550) after the call
#           began; returns head/, history.json, loss.png and train_log.txt (the data's sha256s).
#           A block run on a machine that already ran the chain one takes its sequences.json
#           (same model, prompts and lengths); with .trainseqs_all/ carried, a run unpacks the
#           sequences there instead of regenerating;
#   call 5: `[KIND=block] bash benchmarks/train_head_gpu.sh bench` (no carry but SRC's folder):
#           MINUTES (default 1.5) more training when the steps are not done, then the chain head
#           against the shipped one (OLD, default src/draftgraph/heads/smollm2-135m-chain) on
#           the real model, plain and chain arms of bench_accept.py each, batch 1, bf16, NUM
#           (default 32) prompts per set; a block head against plain and n-gram.
# DATA: the prompts' token ids (`sharegpt_train_ids.py`), default the shipped heads' data,
# .traindata/sharegpt_train_ids.json.gz (the first human turn of each ShareGPT train
# conversation); DATA=.traindata_all/sharegpt_train_all_ids.json.gz is every human turn with
# its history (the 2026-12-02 run, benchmarks/NOTES.md: not better, not shipped).
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
DATA=${DATA:-.traindata/sharegpt_train_ids.json.gz}
# SRC: where the package is imported from (default src; a snapshot of a commit, e.g.
# `git archive HEAD src/draftgraph`, keeps others' uncommitted edits out of a run)
export PYTHONPATH=/tmp/site:${SRC:-$PWD/src}:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
M=$D/smollm2.gguf
LOG="$OUT/train_log.txt"
mkdir -p $D
if [ "${1:-}" = stage ]; then
  cp .modelq$2/part* $D/ && ls $D; exit 0
fi
if [ "$KIND" = block ]; then
  FLAGS="--kind block --block-size 8 --head-layers 1 --window 512 --markov-rank 64
    --confidence --anchors ${ANCHORS:-64} --max-blocks ${MAX_BLOCKS:-2048}
    --steps ${STEPS:-3000} --lr ${LR:-5e-4}"
else
  FLAGS="--steps ${STEPS:-2500}"
fi
COMMON="--out $RUN --data $DATA --num-prompts 100000 --max-new-tokens 256 --max-len 640
  --batch-tokens 16384 --dtype bfloat16 $FLAGS"

quiet() { tr '\r' '\n' | grep -v -i warn | grep -v "it/s]$" | grep -v "s/it]$"; }

train() {  # train-drafter with a small engine (nothing to regenerate) for $1 minutes
  echo "== train $1 min from $(date +%T)" | tee -a "$LOG"
  timeout $(( ${1%.*} * 60 + 120 )) python3 -m draftgraph.cli train-drafter $M $COMMON \
    --max-num-seqs 8 --time-limit $1 2>&1 | quiet | tail -4 | tee -a "$LOG"
}

report() {
  rm -rf "$OUT/head"; cp -r $RUN/head "$OUT/head"; cp $RUN/history.json $RUN/loss.png "$OUT/"
  python3 -c "import json; h=json.load(open('$RUN/history.json'))['history']; r=h[-1]; \
print('steps', r['step'], {k: (float(f'{v:.4g}') if isinstance(v, float) else v) for k, v in r.items() \
if k not in ('step', 'agree')}, 'agree', [round(a, 3) for a in r['agree']])" | tee -a "$LOG"
}

if [ "${1:-}" = train ]; then
  END=${END:-550}
  for i in 00 01 02; do
    [ -f $D/part$i ] || { echo "part $i missing: the machine was not the warm one"; exit 3; }
  done
  [ -f $M ] || cat $D/part00 $D/part01 $D/part02 .modelq4/part03 > $M
  echo "$(cat .modelq4/sha256)  $M" | sha256sum -c - || exit 4
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/gguf-*.whl || exit 1
  sha256sum $DATA | tee -a "$LOG"
  mkdir -p $RUN
  if [ ! -f $RUN/sequences.json ] && ls .trainseqs_all/seqs.npz* > /dev/null 2>&1; then
    python3 benchmarks/pack_sequences.py unpack .trainseqs_all $RUN/sequences.json | tee -a "$LOG"
  fi
  if [ ! -f $RUN/sequences.json ] && [ -f /tmp/dg_train/sequences.json ]; then
    cp /tmp/dg_train/sequences.json $RUN/
  fi
  if [ ! -f $RUN/sequences.json ]; then  # regenerate (a big engine), one step, a checkpoint
    for seqs in ${SEQS:-1024} 256; do
      echo "== regenerate, --max-num-seqs $seqs, from $(date +%T) (${SECONDS}s)" | tee -a "$LOG"
      timeout $(( END - SECONDS - 60 )) python3 -m draftgraph.cli train-drafter $M $COMMON \
        --max-num-seqs $seqs --time-limit 0.01 2>&1 | quiet | tail -8 | tee -a "$LOG"
      [ -f $RUN/sequences.json ] && break
      [ $SECONDS -gt 150 ] && break  # it failed late: no time for a second try
    done
    [ -f $RUN/sequences.json ] || { echo "no sequences"; exit 5; }
    echo "== regenerated by ${SECONDS}s" | tee -a "$LOG"
    python3 benchmarks/pack_sequences.py pack $RUN/sequences.json "$OUT" | tee -a "$LOG"
  fi
  MIN=$(python3 -c "print(round(max(0.5, ($END - $SECONDS - 50) / 60), 2))")
  train $MIN
  report
  ls -la "$OUT" "$OUT/head"
  exit 0
fi
[ -f $M ] || { echo "the model is missing: run the train call first on this machine"; exit 3; }
DONE=$(python3 -c "import json; h=json.load(open('$RUN/history.json')); \
print(int(h['history'][-1]['step'] >= h['config']['steps']))")
if [ "$DONE" = 0 ] && [ "${MINUTES:-1.5}" != 0 ]; then
  train ${MINUTES:-1.5}
fi
report
H=${HEAD:-$RUN/head}
NUM=${NUM:-32}
if [ "$KIND" = block ]; then
  timeout 250 python3 benchmarks/bench_accept.py --model $M --device cuda --dtype bfloat16 \
    --arms plain,block,ngram --block-head $H --sets benchmarks/data/accept_sets_smollm2_ids.json \
    --num-prompts $NUM --batch 1 --out "$OUT/accept_block_real_bs1_h200.json" 2>&1 | quiet | tail -9
  exit 0
fi
for arm in old new; do
  HD=$H; [ $arm = old ] && HD=${OLD:-src/draftgraph/heads/smollm2-135m-chain}
  echo "== $arm head $HD" | tee -a "$LOG"
  timeout 200 python3 benchmarks/bench_accept.py --model $M --device cuda --dtype bfloat16 \
    --arms plain,chain --head $HD --sets benchmarks/data/accept_sets_smollm2_ids.json \
    --num-prompts $NUM --batch 1 --out "$OUT/accept_ab_chain_${arm}_real_bs1_h200.json" 2>&1 \
    | quiet | tail -6 | tee -a "$LOG"
done
