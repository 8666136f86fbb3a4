"""Draft-model chain rounds on the GPU: ms per speculative step (k draft steps + verify +
accept, one graph replay) and accept length, next to the plain decode step in the same run.

    python benchmarks/bench_chain.py --target random:llama-3.1-8b --draft random:llama-3.2-1b \
        --out r.json
    python benchmarks/bench_chain.py --target random:smollm2-135m --draft self --out r.json

`--draft self` drafts with the target itself (every draft accepted at temperature 0: the
round's cost at accept length k + 1). Batch 1, 512-token context, bf16 by default.
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
from draftgraph.models.loader import load_model
from draftgraph.spec.draft_model import DraftModelDrafter


def measure(engine: LLMEngine, ctx: int, steps: int, bs: int) -> dict:
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=8 * steps + 64, temperature=0, ignore_eos=True)
    for _ in range(bs):
        engine.add_request(torch.randint(0, vocab, (ctx,), generator=g).tolist(), sp)
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    gen0 = engine.stats["generation_tokens"]
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    tokens = engine.stats["generation_tokens"] - gen0
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()
    return {"ms_per_step": ms, "tokens_per_step_per_request": tokens / steps / bs,
            "tokens_per_s": tokens / (ms * steps) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True, help="a model, or `self`")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    target = load_model(a.target, device="cuda", dtype=dtype)
    draft = target if a.draft == "self" else load_model(a.draft, device="cuda", dtype=dtype)

    def engine(drafter=None):  # drafter None: plain decoding
        spec = SpecConfig(method="ngram", num_draft_tokens=a.k, adaptive=False) \
            if drafter is not None else SpecConfig()
        return LLMEngine(EngineConfig(
            model=a.target, device="cuda", dtype=a.dtype,
            cache=CacheConfig(kv_cache_tokens=a.batch_size * (a.context + 16 * a.steps + 512)),
            scheduler=SchedulerConfig(max_num_seqs=a.batch_size, max_num_batched_tokens=4096,
                                      max_model_len=a.context + 16 * a.steps + 256),
            spec=spec), loaded=target, drafter=drafter)

    plain = measure(engine(), a.context, a.steps, a.batch_size)
    chain = measure(engine(DraftModelDrafter(draft.model, a.k)), a.context, a.steps,
                    a.batch_size)
    out = {"benchmark": "draft_model_chain", **run_header(), "target": a.target,
           "draft": a.draft, "k": a.k, "batch_size": a.batch_size, "context": a.context,
           "dtype": a.dtype, "target_shape": model_shape(target.config),
           "draft_shape": model_shape(draft.config), "plain_decode": plain, "chain": chain,
           "round_over_decode_step": chain["ms_per_step"] / plain["ms_per_step"]}
    print(json.dumps({k: v for k, v in out.items() if k not in ("target_shape", "draft_shape")}))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
