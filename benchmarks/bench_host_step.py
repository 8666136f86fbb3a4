"""The engine's host work per decode step, alone (issue 15: little host work per token).

    python benchmarks/bench_host_step.py --batch 64 --out r.json

A decode step at batch 64 on the GPU is ~1.4 ms of graph; the host's share of a step
(scheduling, staging, reading the results, appending tokens, stops, detokenising, building
the outputs) was measured at ~1.36 ms there (`profile_host_step.py`), so the host is what a
server's threads compete with. This measures that share on any machine: the engine runs
with async scheduling on, and once every prompt is prefilled, each graph set's step body is
replaced by a stub that writes tokens into the step's results as the device would (a fixed
pseudo-random text, the same for every run), so a step's wall time is its host work. With
`--model default` the detokenizer runs too (a server streams text).

Writes JSON with the device, date, command, us per step (median of `--repeats` runs of
`--steps` steps), and the cProfile own time of the top functions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from _meta import model_shape, profile_per_step, run_header

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams


def stub_steps(engine: LLMEngine, text_ids: list[int]) -> None:
    """Every graph set's step now only writes results: per request 1 token (the next of
    `text_ids`, cycled by position), accept length 1, no drafts."""
    sets = [engine.decode_graphs, *getattr(engine, "extras_graphs", {}).values()]
    if engine.spec_graphs is not None:
        sets.append(engine.spec_graphs)
    ids = torch.tensor(text_ids, dtype=torch.int64)
    for gs in sets:
        out, raw = gs.body.out, gs.body.raw

        def run(bs, greedy, out=out, raw=raw):
            pos = raw["seq_lens"][:bs] % len(ids)
            out["tokens"][:bs, 0] = ids[pos]
            out["accept_lens"][:bs] = 1
            out["num_drafts"][:bs] = 0
            out["logprobs"][:bs] = -1.0

        gs.run_eager = run


def fill(engine: LLMEngine, batch: int, prompt_len: int, max_tokens: int, vocab: int,
         stop: list[str] | None) -> None:
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, stop=stop or [])
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), sp)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting \
            or engine._inbox:
        engine.step()


def time_steps(engine: LLMEngine, steps: int) -> float:
    for _ in range(5):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stop", action="append", default=None,
                    help="a stop string every request carries (its text is then held back)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    # every request's tokens fit: no preemption, so each step is the async decode step
    max_tokens = args.steps * (args.repeats + 2) + 64
    kv = args.batch * (args.prompt_len + max_tokens + 64)
    engine = LLMEngine(EngineConfig(
        model=args.model, cache=CacheConfig(kv_cache_tokens=kv),
        scheduler=SchedulerConfig(max_num_seqs=args.batch,
                                  max_model_len=args.prompt_len + max_tokens + 16,
                                  max_num_batched_tokens=max(256, args.batch * args.prompt_len))))
    engine.async_scheduling = True  # as on a GPU (off on the CPU: eagerly nothing overlaps)
    vocab = engine.model_config.vocab_size
    tok = engine.tokenizer
    text = ("The quick brown fox jumps over the lazy dog. def fib(n): return n if n < 2 "
            "else fib(n - 1) + fib(n - 2)\n") * 4
    text_ids = tok.encode(text) if tok is not None else list(range(100, 400))
    fill(engine, args.batch, args.prompt_len, max_tokens, vocab, args.stop)
    stub_steps(engine, text_ids)
    us = [time_steps(engine, args.steps) for _ in range(args.repeats)]
    print(f"{statistics.median(us):.1f} us/step at batch {args.batch} "
          f"({', '.join(f'{x:.0f}' for x in us)})", flush=True)
    rows = profile_per_step(lambda: time_steps(engine, args.steps), args.steps, args.top)
    out = {"benchmark": "host_step", **run_header(), "model": args.model,
           "model_shape": model_shape(engine.model_config), "batch": args.batch,
           "detokenizer": tok is not None, "stop": args.stop, "steps": args.steps,
           "us_per_step": statistics.median(us), "us_per_step_runs": us,
           "profile_top": rows[:args.top]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
