#!/usr/bin/env bash
# The chain head's draft vocabulary on the GPU (issue 14): the shipped head (16,384 tokens)
# against the same weights reduced to 32,768 (built here from the shipped head and its
# training responses), real default model, bf16, batch 1 and 32. After `train_head_gpu.sh
# stage 1..9`; carry [".modelj10", ".whl_gguf"].
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
. benchmarks/gguf_parts.sh
gguf_join || exit $?
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
H=src/draftgraph/heads/smollm2-135m-chain
python3 benchmarks/pack_sequences.py unpack benchmarks/data/smollm2_allturns1024_seqs /tmp/s1.json
python3 benchmarks/pack_sequences.py unpack benchmarks/data/smollm2_code10k_seqs /tmp/s2.json
python3 benchmarks/pack_sequences.py merge /tmp/s1.json /tmp/s2.json /tmp/merged.json
sha256sum /tmp/merged.json
python3 benchmarks/reduce_head_vocab.py $H --model $M --vocab 32768 \
  --sequences /tmp/merged.json --out /tmp/chain32k 2>&1 | tail -3
cd benchmarks
for b in 1 32; do
  python3 bench_accept.py --model $M --device cuda --dtype bfloat16 --batch $b --k 4 \
    --sets data/accept_sets_smollm2_ids.json --num-prompts 24 --max-tokens 128 \
    --arms plain,chain@../$H,chain@/tmp/chain32k,plain,chain@/tmp/chain32k,chain@../$H \
    --out "$OUT/vocab_ab_bs${b}_h100.json" 2>&1 | grep -v -i warn | tail -12
done
