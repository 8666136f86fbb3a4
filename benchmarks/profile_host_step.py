"""Where the host's time goes in a decode step at batch 64 (issue 15): `LLMEngine.step()` with
the default flags (async scheduling: step N + 1 is launched before step N is read), under
cProfile, against the step's GPU time.

    python benchmarks/profile_host_step.py --model random:smollm2-135m --batch 64 --out r.json

Per run: wall ms per step without the profiler, the replayed graph's GPU ms (back to back),
and the functions with the most own time per step under cProfile (its overhead inflates the
Python part; the ranking is what it is for).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from _meta import model_shape, profile_per_step, run_header

from draftgraph.config import EngineConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=3 * args.steps + 64, temperature=0, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request(torch.randint(0, vocab, (args.context,), generator=g).tolist(), sp)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting \
            or engine._inbox:
        engine.step()
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / args.steps * 1e3
    graphs = engine.decode_graphs
    graph = graphs.graphs[(graphs.bucket_for(args.batch), True)][-1]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    gpu_ms = start.elapsed_time(end) / args.steps
    def steps():
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()

    print(f"{args.model} batch {args.batch}: {wall_ms:.3f} ms/step wall, graph GPU "
          f"{gpu_ms:.3f} ms", flush=True)
    rows = profile_per_step(steps, args.steps, args.top)
    total_us = sum(r["own_us_per_step"] for r in rows)
    print(f"profiled own time {total_us / 1e3:.3f} ms/step", flush=True)
    out = {"benchmark": "host_step_profile", **run_header(), "model": args.model,
           "model_shape": model_shape(engine.model_config), "batch": args.batch,
           "context": args.context, "wall_ms_per_step": wall_ms, "graph_gpu_ms": gpu_ms,
           "profiled_own_ms_per_step": total_us / 1e3, "top": rows[:args.top]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
