#!/usr/bin/env bash
# Issue 17's soak on the H200 (after benchmarks/serve_gpu_prepare.sh here, carry [".whl"]):
# tests/test_reliability_soak.py against random:smollm2-135m on the GPU, 128 concurrent
# clients, 1024 requests (streams disconnecting at random, hostile bodies, seeded probes);
# it asserts no 5xx, nothing hung, KV back to idle, the greedy prompt's tokens unchanged.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export DRAFTGRAPH_SOAK_MODEL=${SOAK_MODEL:-random:smollm2-135m} DRAFTGRAPH_SOAK_DEVICE=cuda
export DRAFTGRAPH_SOAK_CONCURRENCY=${SOAK_CONCURRENCY:-128}
export DRAFTGRAPH_SOAK_REQUESTS=${SOAK_REQUESTS:-1024}
start=$SECONDS
timeout ${SOAK_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider \
  tests/test_reliability_soak.py > "$OUT/soak_h200.log" 2>&1
echo "soak: ${DRAFTGRAPH_SOAK_CONCURRENCY} clients, ${DRAFTGRAPH_SOAK_REQUESTS} requests, \
$DRAFTGRAPH_SOAK_MODEL, $((SECONDS - start)) s" | tee -a "$OUT/soak_h200.log"
grep -E "passed|failed|Error|assert" "$OUT/soak_h200.log" | tail -12
