#!/usr/bin/env bash
# One device call (nvidia-h200): GPU tests, then the decode and speculative benchmarks.
# Results land in $OUT (at most 8 files come back: logs stay small, one JSON per run).
#   GPU_TESTS="tests/..."  which tests (default: graphs + kernels); SKIP_BENCH=1: tests only;
#   SKIP_SPEC=1: decode benchmarks only.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider \
  ${GPU_TESTS:-tests/test_gpu_graphs.py tests/test_kernels_*.py} > "$OUT/gpu_tests.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -8
[ -n "${SKIP_BENCH:-}" ] && exit 0
B=benchmarks/bench_decode.py
timeout 120 python3 $B --model random:smollm2-135m --batch-sizes 1 --kernels \
  --out "$OUT/decode_smollm2-135m.json" 2>&1 | grep -v Warn
timeout 150 python3 $B --model random:llama-3.1-8b --batch-sizes 1 --kernels \
  --out "$OUT/decode_llama-3.1-8b.json" 2>&1 | grep -v Warn
timeout 120 python3 $B --model random:llama-3.2-1b --batch-sizes 8,32,64 --no-ab \
  --out "$OUT/decode_llama-3.2-1b.json" 2>&1 | grep -v Warn
[ -n "${SKIP_SPEC:-}" ] && exit 0
S=benchmarks/bench_spec.py
timeout 150 python3 $S --model random:smollm2-135m --device cuda --batch-sizes 1,32 \
  --out "$OUT/spec_smollm2-135m.json" 2>&1 | grep -v Warn
timeout 200 python3 $S --model random:llama-3.1-8b --device cuda --batch-sizes 1,32 \
  --out "$OUT/spec_llama-3.1-8b.json" 2>&1 | grep -v Warn
ls "$OUT"
