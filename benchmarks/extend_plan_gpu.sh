#!/usr/bin/env bash
# One device call (carry [".old"]; .old/src from `git archive c075727 src`, heads removed:
# the extend attention plan before stop 56): the tuned extend plan (kernels/attention.py:
# 128-key tiles for heads of <= 64 dims, 3 stages, unmasked key tiles first; chosen from the
# kernel sweep, results/extend_stop56/) in the engine. Its GPU tests first (the kernels
# against their twins, the captured prefill against the eager one, the block drafter, the
# batch-invariant mode), then the prefill's TTFT and GPU time at 512 / 4096 tokens for
# SmolLM2-135M and Llama-3.1-8B, old tree then new, on the same machine (~5 min).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$PWD/src:$PWD/benchmarks timeout 240 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kernels_attention.py tests/test_kernels_backend.py tests/test_gpu_block.py \
  tests/test_gpu_deterministic.py \
  tests/test_gpu_graphs.py::test_prefill_graphs_equal_the_eager_prefill_and_keep_their_buffers \
  > "$OUT/gpu_tests_extend_plan.log" 2>&1
tail -3 "$OUT/gpu_tests_extend_plan.log"
for model in ${MODELS:-smollm2-135m llama-3.1-8b}; do
  for tree in old new; do
    src=$PWD/src; [ $tree = old ] && src=$PWD/.old/src
    PYTHONPATH=$src:$PWD/benchmarks timeout 120 python3 benchmarks/profile_prefill.py \
      --model random:$model --tokens 512,4096 --arms graphs --repeats 5 \
      --out "$OUT/prefill_plan_${tree}_$model.json" 2>&1 | grep "tokens:" | sed "s/^/$tree /"
  done
done
