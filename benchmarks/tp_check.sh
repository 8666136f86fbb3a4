#!/usr/bin/env bash
# One device call on a 2-GPU machine (nvidia-h200-x2): the tensor-parallel GPU tests (each
# outcome printed as it ends; about 70 s), then the TP decode benchmark (llama-3.1-8b, TP 1
# and 2, batch 1 and 32). Results land in $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
# NVLink multicast stays off in every process (the engine also sets these for its workers)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
timeout 220 python3 -m pytest -v -p no:cacheprovider tests/test_tp_gpu.py > "$OUT/tp_tests.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tp_tests.log"
[ -n "${SKIP_BENCH:-}" ] && exit 0
timeout 150 python3 benchmarks/bench_tp.py --model random:llama-3.1-8b --tp 1,2 \
  --batch-sizes 1,32 --steps 30 --out "$OUT/tp_llama-3.1-8b.json" 2>&1 | grep -v Warning | tail -8
ls -la "$OUT"
