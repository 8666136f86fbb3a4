#!/usr/bin/env bash
# One device call (carry [".whl", ".old"], .old/src from `git archive <rev> src`, heads
# removed): the serving path of this tree against an older one (stop 54: the first tokens of
# a prefill behind left on the device, engine/first_tokens.py, against its parent 8c63426,
# which read them before the next launch; next, the prefill-before-launch order against
# 394fa48). The GPU tests of async scheduling and the overlap first, then served smollm2-135m at
# concurrency 64 (old / new / old / new, serve_gpu_check.sh) and offline (serve_offline.py at
# 64, old then new), all in one call so the arms share the machine.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$PWD/src:$PWD/benchmarks timeout 300 python3 -m pytest -q -p no:cacheprovider \
  tests/test_gpu_graphs.py -k "overlapped or async" > "$OUT/gpu_tests_first_tokens.log" 2>&1
tail -3 "$OUT/gpu_tests_first_tokens.log"
for tree in ${TREES:-old new old new}; do
  src=$PWD/src; [ $tree = old ] && src=$PWD/.old/src
  SRC=$src TAG=$tree CONCURRENCY=64 MODELS=smollm2-135m NO_OFFLINE=1 BENCH_TIMEOUT=150 \
    OUT=$OUT bash benchmarks/serve_gpu_check.sh 2>&1 | grep -v "^serve-\|\.png$\|\.json$"
done
for tree in old new; do
  src=$PWD/src; [ $tree = old ] && src=$PWD/.old/src
  PYTHONPATH=/tmp/site:$src:$PWD/benchmarks timeout 150 python3 benchmarks/serve_offline.py \
    --model random:smollm2-135m --num-prompts 512 --input-len 512 --output-len 128 \
    --concurrency 64 --out "$OUT/serve_offline_smollm2-135m_$tree.json" 2>&1 \
    | grep -v -i warn | grep -v "^capturing" | tail -2
done
