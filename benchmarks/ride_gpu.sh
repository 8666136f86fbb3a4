#!/usr/bin/env bash
# One device call (carry [".whl", ".old"]; .old/src from `git archive <rev> src`, heads
# removed): decode rows riding in the prefill behind the step in flight
# (`--decode-rides-prefill`, stop 55) against the prefill alone (`solo`,
# --no-decode-rides-prefill) and against the older tree in .old (`old`, TREE_OLD=0 skips it).
# The GPU test of the overlap first (outputs equal the synchronous engine's; rows rode), then
# served smollm2-135m at concurrency 64 (serve_gpu_check.sh, ARMS default
# solo / plain / solo / plain) and offline (serve_offline.py at 64, solo then plain), all in
# one call so the arms share the machine. PROFILE=1 and SWEEP=<models> add the split-KV
# extend attention's measurements after (kernels/attention.py EXTEND_MAX_SPLITS).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$PWD/src:$PWD/benchmarks timeout 200 python3 -m pytest -q -p no:cacheprovider \
  tests/test_gpu_graphs.py -k "overlapped${TESTS_K:+ and $TESTS_K}" > "$OUT/gpu_tests_ride.log" 2>&1
tail -3 "$OUT/gpu_tests_ride.log"
if [ "${TREE_OLD:-1}" = 1 ] && [ -d .old/src ]; then
  SRC=$PWD/.old/src TAG=old CONCURRENCY=64 MODELS=smollm2-135m NO_OFFLINE=1 BENCH_TIMEOUT=150 \
    OUT=$OUT bash benchmarks/serve_gpu_check.sh 2>&1 | grep -v "^serve-\|\.png$\|\.json$"
fi
CONCURRENCY=64 MODELS=smollm2-135m ARMS="${ARMS:-solo plain solo plain}" NO_OFFLINE=1 \
  BENCH_TIMEOUT=150 OUT=$OUT bash benchmarks/serve_gpu_check.sh 2>&1 \
  | grep -v "^serve-\|\.png$\|\.json$"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks
for flags in "--no-decode-rides-prefill" ""; do
  timeout 150 python3 benchmarks/serve_offline.py --model random:smollm2-135m \
    --num-prompts 512 --input-len 512 --output-len 128 --concurrency 64 $flags \
    --out "$OUT/serve_offline_smollm2-135m${flags:+_solo}.json" 2>&1 \
    | grep -v -i warn | grep -v "^capturing" | tail -2
done
rm -f "$OUT"/*.png
# then, in what is left of the call: split-KV extend attention in the engine's prefill
# (PROFILE=1: TTFT and GPU time at 512 / 4096 tokens, unsplit against up to 4 and 8 splits)
[ -n "${PROFILE:-}" ] && PYTHONPATH=$PWD/src:$PWD/benchmarks timeout ${PROFILE_TIMEOUT:-150} \
  python3 benchmarks/profile_prefill.py --model random:smollm2-135m --tokens 512,4096 \
  --arms graphs,graphs_masked,graphs_split4,graphs_split8 --repeats 5 --out "$OUT/prefill_splits.json" \
  2>&1 | grep -v -i warn | grep -v "^capturing"
# and the extend kernel's config sweep (SWEEP=model,...)
[ -n "${SWEEP:-}" ] && PYTHONPATH=$PWD/src:$PWD/benchmarks timeout ${SWEEP_TIMEOUT:-200} \
  python3 benchmarks/bench_extend_attention.py --models "$SWEEP" \
  --out "$OUT/extend_sweep_$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E "h100|h200" | tr A-Z a-z).json"
