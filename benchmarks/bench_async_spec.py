"""Async speculative steps against synchronous ones, in one run (issue 15).

For each drafter, ONE engine (same graphs, same buffers) is measured with async scheduling
off and on, in the order A B A B: synchronous steps read step N before launching N + 1; async
steps launch N + 1 first, staged as if step N emitted one token per request and shifted on
the device by what it did emit. Plain decode (async) is measured in the same run for scale.
Per arm: ms per step, tokens/s, accept length, tokens per request and step; host-side CUDA
calls per step (kernel launches must stay 0, one graph launch) from torch.profiler.

    python benchmarks/bench_async_spec.py --model random:llama-3.1-8b --batch-sizes 1,32 \\
        --drafters ngram,chain --out r.json

Random-weight models: the prompts are a 64-token motif repeated to --context tokens, so the
n-gram drafter finds matches where the model repeats itself; the chain drafter is a random
1-layer head (accept length about 1: its numbers are round costs). Outputs of the async and
sync arms are compared token for token (greedy): `same_tokens`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from _meta import model_shape, run_header
from bench_decode import profile_step

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams


def measure(engine: LLMEngine, prompts: list, max_tokens: int) -> dict:
    """Prefill first (not timed), then the decode/speculative steps until every request ends."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts]
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting \
            or engine._inbox:
        engine.step()
    before = dict(engine.stats)
    tokens = steps = 0
    final = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        tokens += sum(len(o.new_token_ids) for o in outs)
        steps += 1
        final.update({o.request_id: o.token_ids for o in outs if o.finished})
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    drafts = engine.stats["num_drafts"] - before["num_drafts"]
    accepted = engine.stats["num_accepted_tokens"] - before["num_accepted_tokens"]
    return {"steps": steps, "ms_per_step": dt / max(steps, 1) * 1e3, "tokens_per_s": tokens / dt,
            "tokens_per_request_step": tokens / max(steps, 1) / len(prompts),
            "accept_len_mean": (accepted + drafts) / drafts if drafts else None,
            "outputs": [final[i] for i in ids]}


def calls_per_step(engine: LLMEngine, prompts: list, steps: int = 20) -> dict:
    """Host-side CUDA calls per engine step while every request decodes."""
    sp = SamplingParams(max_tokens=steps * 8 + 64, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts]
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting \
            or engine._inbox:
        engine.step()
    for _ in range(3):
        engine.step()
    out = profile_step(engine, steps)
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished():
        engine.step()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--drafters", default="ngram,chain")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    max_bs = max(sizes)
    results, shape = [], None
    for drafter in ["plain"] + args.drafters.split(","):
        spec = {"plain": SpecConfig(),
                "ngram": SpecConfig(method="ngram", num_draft_tokens=args.k, adaptive=False),
                "chain": SpecConfig(method="chain", draft_head="random",
                                    num_draft_tokens=args.k, adaptive=False)}[drafter]
        engine = LLMEngine(EngineConfig(
            model=args.model, device="cuda", dtype=args.dtype,
            cache=CacheConfig(kv_cache_tokens=max_bs * (args.context + args.max_tokens + 600)),
            scheduler=SchedulerConfig(max_num_seqs=max_bs, max_num_batched_tokens=8192,
                                      max_model_len=args.context + args.max_tokens + 512),
            spec=spec))
        shape = model_shape(engine.model_config)
        vocab = engine.model_config.vocab_size
        g = torch.Generator().manual_seed(0)
        for bs in sizes:
            prompts = []
            for _ in range(bs):
                motif = torch.randint(0, vocab, (64,), generator=g)
                prompts.append(motif.repeat(args.context // 64 + 1)[: args.context].tolist())
            arms = ["async"] if drafter == "plain" else ["sync", "async", "sync", "async"]
            measure(engine, prompts[:1], 16)  # warm-up
            seen = {}
            for arm in arms:
                engine.async_scheduling = arm == "async"
                r = measure(engine, prompts, args.max_tokens)
                outputs = r.pop("outputs")
                same = None
                if arm in seen:
                    same = seen[arm] == outputs
                seen.setdefault(arm, outputs)
                r.update(drafter=drafter, arm=arm, batch_size=bs)
                if same is not None:
                    r["same_tokens_as_first_" + arm] = same
                results.append(r)
                print(f"{drafter:6s} {arm:5s} bs={bs:3d} {r['ms_per_step']:8.3f} ms/step "
                      f"{r['tokens_per_s']:9.1f} tok/s accept={r['accept_len_mean']}",
                      flush=True)
            if "sync" in seen:
                results.append({"drafter": drafter, "batch_size": bs,
                                "async_equals_sync_tokens": seen["sync"] == seen["async"]})
                print(f"{drafter} bs={bs}: async tokens == sync tokens: "
                      f"{seen['sync'] == seen['async']}", flush=True)
            for arm in sorted(set(arms)):
                engine.async_scheduling = arm == "async"
                c = calls_per_step(engine, prompts)
                results.append({"drafter": drafter, "arm": arm, "batch_size": bs,
                                "cuda_calls_per_step": c})
                print(f"{drafter:6s} {arm:5s} bs={bs:3d} calls/step {c}", flush=True)
        del engine
        torch.cuda.empty_cache()
    out = {"benchmark": "async_speculative_steps", **run_header(), "model": args.model,
           "model_shape": shape, "dtype": args.dtype, "k": args.k, "context": args.context,
           "max_tokens": args.max_tokens, "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
