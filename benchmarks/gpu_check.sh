#!/usr/bin/env bash
# One device call: GPU tests, then the decode and speculative benchmarks. Results land in $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/nvidia-smi.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/test_gpu_graphs.py tests/test_kernels_*.py} \
  2>&1 | tail -60 | tee "$OUT/gpu_tests.log"
[ -n "${SKIP_BENCH:-}" ] && exit 0
B=benchmarks/bench_decode.py
timeout 120 python3 $B --model random:smollm2-135m --batch-sizes 1 --out "$OUT/decode_smollm2-135m.json"
timeout 150 python3 $B --model random:llama-3.1-8b --batch-sizes 1 --out "$OUT/decode_llama-3.1-8b.json"
timeout 150 python3 $B --model random:llama-3.2-1b --batch-sizes 8,32,64 --no-ab \
  --out "$OUT/decode_llama-3.2-1b.json"
S=benchmarks/bench_spec.py
timeout 200 python3 $S --model random:smollm2-135m --device cuda --batch-sizes 1,32 \
  --out "$OUT/spec_smollm2-135m.json" 2>&1 | grep -v Warning
timeout 300 python3 $S --model random:llama-3.1-8b --device cuda --batch-sizes 1,32 \
  --out "$OUT/spec_llama-3.1-8b.json" 2>&1 | grep -v Warning
# bf16 on the GPU: share of HumanEval prompts whose speculative output equals plain decoding
timeout 240 python3 benchmarks/eval_lossless.py --model random:smollm2-135m --device cuda \
  --dtype bfloat16 --prompt-ids benchmarks/data/humaneval_smollm2_ids.json --batch 32 \
  --out "$OUT/lossless_humaneval_bf16_h200.json"
ls -la "$OUT"
