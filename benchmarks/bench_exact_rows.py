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

import time

import torch
from _meta import model_shape, run_header

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.kernels import gemv
from draftgraph.models.loader import load_model


def ms_per_step(engine: LLMEngine, ctx: int, steps: int, bs: int) -> float:
    """Warmed ms per engine step over prompts that repeat a motif (n-gram drafts every step)."""
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(0, engine.model_config.vocab_size, (16,), generator=g)
    sp = SamplingParams(max_tokens=8 * steps + 64, temperature=0, ignore_eos=True)
    for _ in range(bs):
        engine.add_request(motif.repeat(ctx // 16 + 1)[:ctx].tolist(), sp)
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


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
    for arm in a.arms.split(";"):
        exact, _, budget = arm.partition(":")
        gemv.ROWS_REG_BUDGET = int(budget) if budget else 128
        r = {}
        for bs in map(int, a.decode_batch_sizes.split(",")):
            r[f"decode_bs{bs}_ms"] = ms_per_step(engine(bs, SpecConfig(), exact), a.context,
                                                 a.steps, bs)
        for bs in map(int, a.spec_batch_sizes.split(",")):
            r[f"ngram_k4_bs{bs}_ms"] = ms_per_step(engine(bs, ngram, exact), a.context,
                                                   a.steps, bs)
        out["arms"][arm] = r
        print(json.dumps({"arm": arm, **{k: round(v, 3) for k, v in r.items()}}), flush=True)
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
