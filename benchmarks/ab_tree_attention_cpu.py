"""Tree rows' attention on the CPU (TorchBackend), A/B in one process: a request's tree rows in
one SDPA call over their shared keys and every row's path, each row masked to its own list,
against one call per row over its own gathered list (the A arm, as before); the default model,
the shipped chain head's 4x5:16 trees and its chain of 4, plain decoding beside them, batch 1,
arms interleaved over `--repeats` rounds. Tokens/s, accept length, outputs equal to plain.

    python benchmarks/ab_tree_attention_cpu.py --dtypes float32 bfloat16 --out r.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from _meta import ab_arm, ab_prompts, model_shape, run_header, timed_generate

from draftgraph.attention.backend import TorchBackend
from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.loader import load_model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    prompts = ab_prompts(55, 27)  # 3 code prompts, 3 chat prompts
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    grouped = TorchBackend._tree_groups
    out = {"benchmark": "tree_attention_ab", **run_header("cpu"), "model": a.model,
           "max_tokens": a.max_tokens, "prompts": len(prompts), "runs": []}
    for dtype_name in a.dtypes:
        loaded = load_model(a.model, device="cpu", dtype=getattr(torch, dtype_name))
        out["model_shape"] = model_shape(loaded.config)
        for rep in range(a.repeats):
            for mode in ("one call a request", "one call a row"):
                TorchBackend._tree_groups = (grouped if mode == "one call a request"
                                             else lambda *args: {})
                for arm in ("plain", "chain", "tree"):
                    spec, d = ab_arm(arm, loaded, getattr(torch, dtype_name), a.model)
                    e = LLMEngine(EngineConfig(
                        model=a.model, device="cpu", dtype=dtype_name,
                        cache=CacheConfig(kv_cache_tokens=8192),
                        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2048,
                                                  max_model_len=2048), spec=spec),
                        loaded=loaded, drafter=d)
                    run = {"dtype": dtype_name, "repeat": rep, "mode": mode, "arm": arm,
                           **timed_generate(e, prompts, params)}
                    out["runs"].append(run)
                    print(json.dumps(run), flush=True)
                    del e, d
    TorchBackend._tree_groups = grouped
    plain = {(r["dtype"], r["repeat"], r["mode"]): r["outputs_md5"] for r in out["runs"]
             if r["arm"] == "plain"}
    for r in out["runs"]:
        r["equal_to_plain"] = r["outputs_md5"] == plain[r["dtype"], r["repeat"], r["mode"]]
    Path(a.out).write_text(json.dumps(out, indent=1))
    for r in out["runs"]:
        print(f"{r['dtype']:9s} {r['mode']:18s} {r['arm']:5s} {r['tokens_per_s']:6.1f} tok/s "
              f"equal {r['equal_to_plain']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
