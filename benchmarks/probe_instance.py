"""Why a process's later speculative engines ran the chain round slower than its first (NOTES,
stop 45, "the instance effect"): engines of the same arm, each timed before and after others
exist or are freed. If A stays fast while B is slow, the cause belongs to B (its allocations,
its graphs); if A slows too, it is process state. Found (stop 46): no engine is slow unless
`--draft-alone` times A's draft alone first (bench_block.py's old default: a graph of the
drafter's propose captured on a side stream); after that every round is 0.15 ms slower.

    python benchmarks/probe_instance.py --arm 'chain|src/draftgraph/heads/smollm2-135m-chain|4' \
        --out r.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch
from _meta import run_header
from bench_chain import run

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig, TreeShape
from draftgraph.engine.engine import LLMEngine
from draftgraph.models.loader import load_model
from draftgraph.spec import make_drafter


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="random:smollm2-135m")
    ap.add_argument("--arm", required=True, help="method|head|mode, as bench_block.py's")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--draft-alone", action="store_true",
                    help="A's first run also times its draft alone (bench_block.py does: a "
                         "graph of the drafter's propose captured on a side stream)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dtype = torch.bfloat16
    target = load_model(a.target, device="cuda", dtype=dtype)
    method, head, mode = a.arm.split("|")

    def engine() -> LLMEngine:
        tree = TreeShape.parse(mode) if ":" in mode else None
        spec = SpecConfig(method=method, draft_head=head, tree=tree,
                          num_draft_tokens=int(mode) if mode.isdigit() else 4)
        d = make_drafter(spec, "cuda", dtype, target.config)
        return LLMEngine(EngineConfig(
            model=a.target, device="cuda", dtype="bfloat16",
            cache=CacheConfig(kv_cache_tokens=a.context + 20 * a.steps + 512),
            scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=4096,
                                      max_model_len=a.context + 20 * a.steps + 256),
            spec=SpecConfig(method="ngram", adaptive=False)), loaded=target, drafter=d)

    def ms(e, draft_alone: bool = False) -> float:
        r = run(e, a.context, a.steps, 1, draft_alone)
        return round(r["ms_per_round"], 4)

    seq = []
    e_a = engine()
    seq.append(("A alone", ms(e_a, a.draft_alone)))
    e_b = engine()
    seq.append(("B, A alive", ms(e_b)))
    seq.append(("A, B alive", ms(e_a)))
    seq.append(("B again", ms(e_b)))
    del e_b
    gc.collect()
    torch.cuda.empty_cache()
    seq.append(("A, B freed", ms(e_a)))
    e_c = engine()
    seq.append(("C, A alive", ms(e_c)))
    seq.append(("A, C alive", ms(e_a)))
    del e_a, e_c  # no speculative engine left, as between bench_block.py's arms
    gc.collect()
    torch.cuda.empty_cache()
    e_d = engine()
    seq.append(("D, all freed", ms(e_d)))
    e_e = engine()
    seq.append(("E, D alive", ms(e_e)))
    for name, v in seq:
        print(f"{name:12s} {v} ms", flush=True)
    with open(a.out, "w") as f:
        json.dump({"benchmark": "instance_probe", **run_header(), "target": a.target,
                   "arm": a.arm, "draft_alone": a.draft_alone, "ms_per_round": dict(seq)},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
