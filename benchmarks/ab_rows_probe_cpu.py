"""Exact rows on the CPU with and without the batch-invariance probe, A/B in one process: the
default model with `exact_rows="on"` (every verify row computed as the decode row at its
position), its products of up to N rows batched where `gemv.probe_rows` measured them bitwise
equal to their lone rows on this machine, or (the A arm) one row at a time as before; plain
decoding, the shipped chain head (k = 4) and its 4x5:16 trees, arms interleaved over
`--repeats` rounds, and the same arms with exact rows off for reference. Tokens/s, accept
length, and whether each arm's outputs equal plain decoding's with exact rows.

    python benchmarks/ab_rows_probe_cpu.py --dtype bfloat16 --out r.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _meta import ab_arm, ab_prompts, model_shape, run_header, timed_generate

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.kernels import gemv
from draftgraph.models.loader import load_model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    prompts = ab_prompts(40, 20)  # 4 code prompts, 4 chat prompts
    dtype = getattr(torch, a.dtype)
    loaded = load_model(a.model, device="cpu", dtype=dtype)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    out = {"benchmark": "rows_probe_ab", **run_header("cpu"), "model": a.model,
           "model_shape": model_shape(loaded.config), "dtype": a.dtype,
           "max_tokens": a.max_tokens, "prompts": len(prompts), "runs": []}
    arms = (("plain", 1), ("chain", 1), ("tree", 1), ("plain", 4), ("chain", 4))
    modes = (("exact, probed", "on", True), ("exact, row by row", "on", False),
             ("not exact", "off", False))
    for rep in range(a.repeats):
        for label, exact, probed in modes:
            for arm, bs in arms:
                spec, d = ab_arm(arm, loaded, dtype, a.model)
                t0 = time.perf_counter()
                e = LLMEngine(EngineConfig(
                    model=a.model, device="cpu", dtype=a.dtype, exact_rows=exact,
                    cache=CacheConfig(kv_cache_tokens=16384),
                    scheduler=SchedulerConfig(max_num_seqs=bs, max_num_batched_tokens=2048,
                                              max_model_len=2048), spec=spec),
                    loaded=loaded, drafter=d)
                start_s = time.perf_counter() - t0
                bounds = {p.shape: getattr(p, gemv.ROWS_INVARIANT_ATTR, 0)
                          for p in loaded.model.parameters() if p.dim() == 2}
                if not probed:  # the A arm: the rows one at a time, as before the probe
                    for p in loaded.model.parameters():
                        setattr(p, gemv.ROWS_INVARIANT_ATTR, 0)
                ps = prompts if bs > 1 else prompts[::2]  # batch 1: 4 of them
                run = {"repeat": rep, "mode": label, "arm": arm, "batch": bs,
                       **timed_generate(e, ps, params), "engine_start_s": start_s,
                       "probed_rows": sorted(set(bounds.values()))}
                out["runs"].append(run)
                print(json.dumps(run), flush=True)
                del e, d
    plain = {r["batch"]: r["outputs_md5"] for r in out["runs"]
             if r["arm"] == "plain" and r["mode"] == "exact, probed"}
    for r in out["runs"]:
        r["equal_to_exact_plain"] = r["outputs_md5"] == plain[r["batch"]]
    Path(a.out).write_text(json.dumps(out, indent=1))
    for r in out["runs"]:
        if r["repeat"] == a.repeats - 1:
            print(f"{r['mode']:18s} {r['arm']:5s} bs{r['batch']} {r['tokens_per_s']:6.1f} tok/s"
                  f" equal {r['equal_to_exact_plain']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
