"""Chain-drafter rounds on the GPU (a chain head or a draft model), A/B in one run: the plain
decode step; the speculative round (k draft steps + verify + accept) with the chain fused in
one graph; the same round with the per-step fallback (the backend declared without
`draft_step_update`: one graph per draft step, metadata rebuilt eagerly between them). Per arm:
ms per round, tokens per round per request (the accept length), host-launched kernels and
graph launches per round (torch.profiler), and for the fused arm the k-step draft alone (its
`propose`, captured as one graph).

    python benchmarks/bench_chain.py --target random:llama-3.1-8b \
        --head random:layers=1,draft_vocab=32000 --out r.json
    python benchmarks/bench_chain.py --target random:llama-3.1-8b --draft random:llama-3.2-1b \
        --out r.json
    python benchmarks/bench_chain.py --target random:smollm2-135m --draft self --out r.json

`--draft self` drafts with the target itself (every draft accepted at temperature 0: the
round's cost at accept length k + 1); random heads accept almost nothing, so their rounds are
priced at accept length ~1. Batch 1, 512-token context, bf16 by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from _meta import model_shape, run_header
from bench_decode import profile_step, step_kernels

from draftgraph.attention.triton_backend import TritonBackend
from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.loader import load_model


def run(engine: LLMEngine, ctx: int, steps: int, bs: int, draft_alone: bool,
        kernels: bool = False, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Rounds of `bs` requests with `ctx`-token random prompts; sampled when temperature > 0
    (seed 0 per request)."""
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=8 * steps + 64, temperature=temperature, top_p=top_p,
                        seed=0 if temperature > 0 else None, ignore_eos=True)
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
    out = {"ms_per_round": ms, "tokens_per_round_per_request": tokens / steps / bs,
           "tokens_per_s": tokens / (ms * steps) * 1e3, **profile_step(engine, 10)}
    if kernels:
        table = step_kernels(engine, 10)
        out["kernels"] = table[:40]
        out["kernels_us_total"] = sum(k["us_per_step"] for k in table)
    if draft_alone:
        out["draft_ms"] = time_propose(engine, bs, steps, temperature <= 0)
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()
    return out


def time_propose(engine: LLMEngine, bs: int, steps: int, greedy: bool = True) -> float:
    """The k-step draft alone: the drafter's `propose` over the last round's raw inputs,
    captured as one graph and replayed (it rewrites the same draft KV each time); sampled
    drafts when not greedy."""
    body = engine.spec_graphs.body
    ctx = body._ctx(bs, greedy)
    drafter = engine.drafter
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):
            drafter.propose(ctx)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            drafter.propose(ctx)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", help="a draft model, or `self`")
    ap.add_argument("--head", help="a chain head: a directory or random[:layers=N,...]")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--arms", default="fused,fallback")
    ap.add_argument("--kernels", action="store_true",
                    help="add GPU time per kernel name over 10 rounds (torch.profiler)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if (a.draft is None) == (a.head is None):
        ap.error("give one of --draft or --head")
    dtype = getattr(torch, a.dtype)
    target = load_model(a.target, device="cuda", dtype=dtype)

    def drafter():
        if a.head is not None:
            from draftgraph.spec import make_drafter

            return make_drafter(SpecConfig(method="chain", draft_head=a.head,
                                           num_draft_tokens=a.k), "cuda", dtype,
                                target.config)
        from draftgraph.spec.draft_model import DraftModelDrafter

        draft = target if a.draft == "self" else load_model(a.draft, device="cuda",
                                                             dtype=dtype)
        return DraftModelDrafter(draft.model, a.k)

    def engine(d=None):  # d None: plain decoding
        spec = SpecConfig(method="ngram", num_draft_tokens=a.k, adaptive=False) \
            if d is not None else SpecConfig()
        return LLMEngine(EngineConfig(
            model=a.target, device="cuda", dtype=a.dtype,
            cache=CacheConfig(kv_cache_tokens=a.batch_size * (a.context + 16 * a.steps + 512)),
            scheduler=SchedulerConfig(max_num_seqs=a.batch_size, max_num_batched_tokens=4096,
                                      max_model_len=a.context + 16 * a.steps + 256),
            spec=spec), loaded=target, drafter=d)

    out = {"benchmark": "chain_round", **run_header(), "target": a.target,
           "drafter": f"head {a.head}" if a.head else f"draft model {a.draft}", "k": a.k,
           "batch_size": a.batch_size, "context": a.context, "dtype": a.dtype,
           "target_shape": model_shape(target.config)}
    e = engine()
    out["plain_decode"] = run(e, a.context, a.steps, a.batch_size, False, a.kernels)
    del e
    for arm in a.arms.split(","):
        d = drafter()
        if arm == "fallback":
            TritonBackend.draft_step_update = False  # what a backend without it gets
        try:
            e = engine(d)
            assert e.spec_graphs.body.fused_draft == (arm == "fused")
            out[arm] = run(e, a.context, a.steps, a.batch_size, arm == "fused", a.kernels)
        finally:
            TritonBackend.draft_step_update = True
        if a.head is not None:
            out["head_shape"] = model_shape(d.head.config)
            out["head_config"] = dict(vars(d.head.head_config))
        elif a.draft != "self":
            out["draft_shape"] = model_shape(d.model.config)
        del e, d
        torch.cuda.empty_cache()
        out[arm]["round_over_decode_step"] = (out[arm]["ms_per_round"]
                                              / out["plain_decode"]["ms_per_round"])
    print(json.dumps({k: v for k, v in out.items() if not k.endswith(("shape", "config"))}))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
