"""A/B in one process (issue 19): CPU decode with a request's keys read as a slice of the KV
pool (its slots run consecutively) against gathered (`run_starts` patched to -1: the code before).

    python benchmarks/ab_kv_slices_cpu.py --contexts 100 2000 --rounds 3 --out r.json

The default model, fp32 (and int4 with --quantization int4), batch 1, greedy: ms per decode
token = (time of 33 new tokens - time of 1) / 32 after a prompt of C random tokens, arms
alternating; the tokens of both arms are compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from _meta import run_header

import draftgraph.attention.backend as backend_mod
from draftgraph.config import EngineConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[100, 2000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    engine = LLMEngine(EngineConfig(model="default", device="cpu", quantization=a.quantization))
    slices = backend_mod.run_starts

    def gathered(kv_indices, kv_indptr):
        return torch.full_like(kv_indptr[:-1], -1)

    out = {"benchmark": "ab_kv_slices_cpu", **run_header(), "quantization": a.quantization,
           "command": "benchmarks/ab_kv_slices_cpu.py " + " ".join(sys.argv[1:]),
           "contexts": {}}
    g = torch.Generator().manual_seed(0)
    for c in a.contexts:
        prompt = torch.randint(100, 40000, (c,), generator=g).tolist()

        def run(n: int, prompt: list[int] = prompt) -> tuple[float, list[int]]:
            t = time.perf_counter()
            o = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0,
                                                         ignore_eos=True))
            return time.perf_counter() - t, o[0].token_ids

        run(2)
        ms = {"slice": [], "gather": []}
        tokens = {}
        for _ in range(a.rounds):
            for arm, fn in (("gather", gathered), ("slice", slices)):
                backend_mod.run_starts = fn
                t1, _ = run(1)
                t33, toks = run(33)
                ms[arm].append((t33 - t1) / 32 * 1000)
                tokens[arm] = toks
        backend_mod.run_starts = slices
        r = {arm: {"ms_per_token": v, "median": statistics.median(v)} for arm, v in ms.items()}
        r["same_tokens"] = tokens["slice"] == tokens["gather"]
        out["contexts"][str(c)] = r
        print(c, json.dumps({k: (round(v["median"], 2) if isinstance(v, dict) else v)
                             for k, v in r.items()}), flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
