"""Exact rows (`--exact-rows`) against cuBLAS rows, in one run over one target: ms per decode
step at several batch sizes and per n-gram step (k = 4 fixed: every step verifies 5 rows per
request), with the exact rows' per-program register budget swept (`gemv.ROWS_REG_BUDGET`:
how many rows share a program; a row's arithmetic is the same at every budget).

    python benchmarks/bench_exact_rows.py --target random:smollm2-135m --out r.json

Random weights, bf16, 512-token context; arms `off` and `on:<budget>`.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _meta import model_shape, run_header
from profile_verify import motif_ms_per_step

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.kernels import gemv
from draftgraph.models.loader import load_model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="random:smollm2-135m")
    ap.add_argument("--arms", default="off;on:16;on:32;on:64;on:128")
    ap.add_argument("--decode-batch-sizes", default="1,8,16")
    ap.add_argument("--spec-batch-sizes", default="1,2")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    target = load_model(a.target, device="cuda", dtype=torch.bfloat16)
    out = {"benchmark": "exact_rows", **run_header(), "target": a.target,
           "target_shape": model_shape(target.config), "context": a.context, "arms": {}}

    def engine(bs: int, spec: SpecConfig, exact: str) -> LLMEngine:
        return LLMEngine(EngineConfig(
            model=a.target, device="cuda", dtype="bfloat16", exact_rows=exact,
            cache=CacheConfig(kv_cache_tokens=bs * (a.context + 20 * a.steps + 512)),
            scheduler=SchedulerConfig(max_num_seqs=bs, max_num_batched_tokens=4096,
                                      max_model_len=a.context + 20 * a.steps + 256),
            spec=spec), loaded=target)

    ngram = SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    default_budget = gemv.ROWS_REG_BUDGET
    for arm in a.arms.split(";"):
        exact, _, budget = arm.partition(":")
        gemv.ROWS_REG_BUDGET = int(budget) if budget else default_budget
        r = {}
        for bs in map(int, a.decode_batch_sizes.split(",")):
            r[f"decode_bs{bs}_ms"] = motif_ms_per_step(engine(bs, SpecConfig(), exact),
                                                       a.context, a.steps, bs)
        for bs in map(int, a.spec_batch_sizes.split(",")):
            r[f"ngram_k4_bs{bs}_ms"] = motif_ms_per_step(engine(bs, ngram, exact),
                                                         a.context, a.steps, bs)
        out["arms"][arm] = r
        print(json.dumps({"arm": arm, **{k: round(v, 3) for k, v in r.items()}}), flush=True)
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
