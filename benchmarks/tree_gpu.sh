#!/usr/bin/env bash
# Draft trees on the GPU (spec/tree.py, `--speculative-tree`; issue 14).
#   tests:  the tree, argmax, token and norm kernels against their twins (compiled; the
#           step's pack / accept / catch-up staging among them), the GPU tree tests
#           (oracle trees, greedy and sampled, accepted to full depth in fused graphs, the
#           per-step fallback and eager; random-head trees agree across the three), the
#           metadata builders (tree rows' lists) and the chain-head GPU tests (its catch-up
#           now reads a path); fp32.
#   tests2: the graph, block, draft-model and exact-rows GPU tests (the chain pack and the
#           greedy tail under every drafter).
#   sites:  launches per round by the draftgraph function that issued them (eager rounds,
#           profile_round_sites.py): tree 4x5:16, chain k = 4, plain decode; GLUE=twins: the
#           step's glue as the torch ops it was.
#   rounds: ms per round of the default model's shape (random weights, bf16, batches
#           BATCHES, 512 tokens of context) with the shipped chain head: chain k = 4 against
#           trees, each also with the step's glue as the torch ops it was (`/twins`: the A
#           arm), the plain decode step in the same run (`bench_block.py`); TEMP=0.7: sampled.
#   dot:    the rounds of `rounds` with `--tensor-core-rows` off (`/cublas`) and on (`/dot`),
#           then the kernel tests of that matmul's PDL chain and the deterministic GPU tests.
#   fma:    the rounds of `rounds` against `/fma` arms (o and SwiGLU + down of 2 .. 8 rows on
#           the fused single-row kernels: the chain's verify of 5 rows).
#   epi:    the rounds of `rounds` (and plain decode: batches of 2+ rows take the matmul) with
#           the tensor-core matmul's epilogues off, on and with RoPE (`--dot-epilogues`: SwiGLU
#           in gate_up's, the next norm in down's combine; rope: also RoPE + the KV store in
#           qkv's), one process each (EPI overrides the list), then the GPU tests of that
#           matmul (the epilogues bitwise their unfused kernels) and of the trees.
#   dotab:  the same arms in runs with `--tensor-core-rows off` and `on` (plain decode too),
#           alternating, at batch sizes BATCHES (1 4 32; trees where they are drafted, at up
#           to 4 requests).
#   batch:  chain k = 4 against the trees TREES in one process at each batch size of BATCHES
#           (8 16 32): above `config.TREE_MAX_BS` requests a tree drafter drafts its head's
#           chain of D (verifying 1 + D rows a request), at or below it its tree.
#   blockr: ms per round of the shipped block head (random-weight target of the default
#           model's shape, bf16) alone and with the trees BTREES (its n-gram branch, wider
#           trees of its rows) at BATCHES (1 4), plain decode in the same run; BARMS: other
#           arms (e.g. "block|$B|in_graph/chain3": chain steps verifying 3 of the block).
#   kernels: GPU time per kernel name over graph-replayed rounds (`bench_block.py --kernels`),
#           chain k = 4 and the trees TREES, plain decode in the same run.
#   real:   the real default model (GGUF staged in tenths as accept_real_gpu.sh does:
#           calls 1-9 `bash benchmarks/tree_gpu.sh stage N` with carry [".modeljN"], then
#           `bash benchmarks/tree_gpu.sh real` with carry [".modelj10", ".whl_gguf"]): greedy
#           MT-Bench and HumanEval at batch BS (1), plain / chain / trees, accept length,
#           tokens/s and equality with plain (`bench_accept.py`); TEMP=0.7 for sampled steps;
#           SETS=mtbench (or humaneval): one set a process, N prompts (20); K: --k (a block
#           tree's chain steps verify K of the block).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD/src:$PWD/benchmarks
H=src/draftgraph/heads/smollm2-135m-chain
TREES=${TREES:-4x5:16 2x4:8}
B=src/draftgraph/heads/smollm2-135m-block

batch_rounds() {  # $1: the JSON's stem, $2: the arms, $3: the default BATCHES; one process each
  for bs in ${BATCHES:-$3}; do
    o="$OUT/${1}_smollm2_bs${bs}_t${TEMP:-0}.json"
    timeout 250 python3 benchmarks/bench_block.py --target random:smollm2-135m \
      --batch-size "$bs" --steps 200 --arms "$2" --temperature ${TEMP:-0} --out "$o" 2>&1 \
      | grep -E "rror" | grep -v -i warn | cut -c1-300
    # per arm: ms a round, tokens a round a request, host-launched kernels a round
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('bs', sys.argv[2], 'decode', d['plain_decode']['ms_per_round'], {k.split('|', 1)[1]: (round(v['ms_per_round'], 4), round(v['tokens_per_round_per_request'], 3), v.get('kernel_launches')) for k, v in d['arms'].items()})" "$o" "$bs"
  done
}
case "${1:-}" in
  tests)
    timeout 500 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_tree.py \
      tests/test_kernels_argmax.py tests/test_kernels_tokens.py tests/test_kernels_elementwise.py \
      tests/test_gpu_tree.py tests/test_kernels_metadata.py tests/test_gpu_chain_head.py 2>&1 \
      | tail -25 | tee "$OUT/tree_tests.log" ;;
  tests2)  # the chain pack and greedy tail under every other drafter
    timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graphs.py \
      tests/test_gpu_block.py tests/test_gpu_draft_model.py tests/test_gpu_exact_rows.py 2>&1 \
      | tail -25 | tee "$OUT/other_gpu_tests.log" ;;
  sites)
    for m in 4x5:16 4 plain; do
      arm="chain|$H|$m"; [ "$m" = plain ] && arm=plain
      timeout 200 python3 benchmarks/profile_round_sites.py --arm "$arm" \
        --temperature ${TEMP:-0} --batch-size ${BS:-1} --glue ${GLUE:-default} \
        --out "$OUT/round_sites_${m//[:+]/_}_bs${BS:-1}_t${TEMP:-0}_${GLUE:-default}.json" 2>&1 \
        | grep -v -i warn | head -45
    done ;;
  rounds|dot|fma)
    # rounds: each arm against its glue twins; dot: cuBLAS rows (`/cublas`) against tensor-core
    # rows (`/dot`), then the tests of that path; fma: against o and down on the fused kernels.
    # One process per arm (a habit from stop 45's "instance effect", which stop 46 traced to
    # bench_block's draft timing, now off unless --draft-alone: arms may share a process).
    a=""; b="/twins"; p=tree; [ "$1" = dot ] && { a="/cublas"; b="/dot"; p=dot; }
    [ "$1" = fma ] && { a=""; b="/fma"; p=fma; }
    for bs in ${BATCHES:-1 4}; do
      for m in 4 $TREES; do
        for v in "$a" "$b"; do
          o="$OUT/${p}_rounds_smollm2_bs${bs}_t${TEMP:-0}_${m//[:+]/_}${v:+_${v#/}}.json"
          timeout 120 python3 benchmarks/bench_block.py --target random:smollm2-135m \
            --batch-size "$bs" --steps 200 --arms "chain|$H|$m$v" --temperature ${TEMP:-0} \
            --out "$o" 2>&1 | grep -E "arm|rror" | grep -v -i warn | cut -c1-400
        done
      done
    done
    [ "$1" = dot ] && timeout 200 python3 -m pytest -q -p no:cacheprovider \
      tests/test_kernels_gemv.py tests/test_gpu_deterministic.py \
      tests/test_gpu_tensor_core_rows.py 2>&1 | tail -5 | tee "$OUT/dot_tests.log" ;;
  epi)
    for bs in ${BATCHES:-1 4}; do
      for m in 4 $TREES; do
        for e in ${EPI:-off on rope}; do
          o="$OUT/epi_rounds_smollm2_bs${bs}_t${TEMP:-0}_${m//[:+]/_}_${e}.json"
          timeout 120 python3 benchmarks/bench_block.py --target random:smollm2-135m \
            --batch-size "$bs" --steps 200 --arms "chain|$H|$m" --temperature ${TEMP:-0} \
            --dot-epilogues $e --out "$o" 2>&1 | grep -E "arm|rror" | grep -v -i warn \
            | cut -c1-300
          python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('decode', d['plain_decode']['ms_per_round'])" "$o"
        done
      done
    done
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_matmul.py \
      tests/test_gpu_tensor_core_rows.py tests/test_gpu_tree.py 2>&1 | tail -5 \
      | tee "$OUT/epi_tests.log" ;;
  dotab)
    for bs in ${BATCHES:-1 4 32}; do
      arms="chain|$H|4"
      [ "$bs" -le 4 ] && for t in $TREES; do arms="$arms;chain|$H|$t"; done
      for rows in off on; do
        timeout 200 python3 benchmarks/bench_block.py --target random:smollm2-135m \
          --tensor-core-rows $rows --batch-size "$bs" --steps 100 --arms "$arms" \
          --out "$OUT/dotab_smollm2_bs${bs}_${rows}.json" 2>&1 | grep -E "arm|rror" \
          | grep -v -i warn | cut -c1-160
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('decode', d['plain_decode']['ms_per_round'], {k: round(v['ms_per_round'], 4) for k, v in d['arms'].items()})" "$OUT/dotab_smollm2_bs${bs}_${rows}.json"
      done
    done ;;
  batch)
    arms="chain|$H|4"
    for t in $TREES; do arms="$arms;chain|$H|$t"; done
    batch_rounds batch_rounds "$arms" "8 16 32" ;;
  blockr)
    arms="block|$B|in_graph"
    for t in ${BTREES:-1x7:7+g16 4x7:27+g16 8x7:27+g16}; do arms="$arms;block|$B|$t"; done
    batch_rounds block_rounds "${BARMS:-$arms}" "1 4" ;;
  kernels)
    arms="chain|$H|4"
    for t in $TREES; do arms="$arms;chain|$H|$t"; done
    timeout 280 python3 benchmarks/bench_block.py --target random:smollm2-135m --kernels \
      --batch-size ${BS:-1} --steps 100 --arms "$arms" \
      --out "$OUT/tree_kernel_times_smollm2_bs${BS:-1}.json" 2>&1 | grep -E "arm|rror" \
      | grep -v -i warn | cut -c1-400 ;;
  stage|real)
    . benchmarks/gguf_parts.sh
    gguf_stage_or_join "$@"
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    arms="plain,chain@$H"
    for t in $TREES; do arms="$arms,chain+$t@$H"; done
    arms=${ARMS:-$arms}  # e.g. with "dot:" arms (bench_accept.py)
    timeout ${LIMIT:-520} python3 benchmarks/bench_accept.py --model "$M" --device cuda \
      --dtype bfloat16 --sets benchmarks/data/accept_sets_smollm2_ids.json \
      --only ${SETS:-mtbench,humaneval} --num-prompts ${N:-20} --batch ${BS:-1} \
      --max-tokens ${MAXTOK:-256} --temperature ${TEMP:-0} --k ${K:-4} --arms "$arms" \
      --out "$OUT/tree_accept_real_bs${BS:-1}_t${TEMP:-0}${SETS:+_${SETS/,/_}}.json" 2>&1 | grep -v Warning | tail -12
    ;;
  *) echo "usage: $0 tests | tests2 | sites | rounds | dot | fma | epi | dotab | batch | blockr | kernels | stage N | real"; exit 2 ;;
esac
