#!/usr/bin/env bash
# One device call on a 2-GPU machine (nvidia-h200-x2): the TP decode benchmark first
# (llama-3.1-8b, TP 1 and 2, batch 1 and 32; its JSON is known to come back), then the
# tensor-parallel GPU tests, each test's outcome printed as it ends. Results land in $OUT.
# The first run (2026-11-29) gave the benchmark but no test output within 300 s: each test
# starts TP=1 and TP=2 engines, and rank 1 then had to be terminated at shutdown.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
# NVLink multicast stays off in every process (the engine also sets these for its workers)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
timeout 240 python3 benchmarks/bench_tp.py --model random:llama-3.1-8b --tp 1,2 \
  --batch-sizes 1,32 --steps 50 --out "$OUT/tp_llama-3.1-8b.json" 2>&1 | grep -v Warning | tail -20
[ -n "${SKIP_TESTS:-}" ] && exit 0
timeout 300 python3 -m pytest -v -x -p no:cacheprovider tests/test_tp_gpu.py 2>&1 \
  | tee "$OUT/tp_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
ls -la "$OUT"
