"""A/B of the decode step's sampling tail: plain requests (the plain graph set) against
requests asking for top-N logprobs or sampling controls (the extras graph set: top 20 per row,
logit bias / min_tokens / penalties, spec/extras.py), arms interleaved A B C A B C.

    python benchmarks/bench_tail_ab.py --model random:smollm2-135m --batch-sizes 1,8,64 \\
        --out benchmarks/results/tail_ab_h200.json

Per arm: ms per engine step (async scheduling on, as served) and the GPU time of the step's
graph replayed back to back. The plain arm is the cost a request that asks for nothing pays;
compare it with `bench_decode.py` at the commit before the extras (8a226c4) for the before /
after A/B of the same step. Writes JSON with the device, model shape, date and command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from _meta import model_shape, run_header

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams

ARMS = {
    "plain": {},
    "top_logprobs_20": dict(logprobs=True, top_logprobs=20),
    "penalties": dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1,
                      logit_bias={3: 1.0}),
}


def run_arm(engine: LLMEngine, arm: str, bs: int, ctx: int, steps: int,
            temperature: float) -> dict:
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=2 * steps + 64, temperature=temperature, ignore_eos=True,
                        seed=0, **ARMS[arm])
    for _ in range(bs):
        engine.add_request(torch.randint(0, vocab, (ctx,), generator=g).tolist(), sp)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting \
            or engine._inbox:
        engine.step()
    for _ in range(5):
        engine.step()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    ms_step = (time.perf_counter() - t0) / steps * 1e3
    graphs = engine.decode_graphs if arm == "plain" else \
        engine.extras_graphs[engine.decode_graphs]
    replay_ms = None
    if graphs.use_graphs:  # the step's (last) graph, replayed back to back
        graph = graphs.graphs[(graphs.bucket_for(bs), temperature == 0)][-1]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        sync()
        replay_ms = start.elapsed_time(end) / steps
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return {"arm": arm, "ms_per_step": ms_step, "replay_gpu_ms": replay_ms,
            "graph_set": graphs.body.name}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of A B C")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (no graphs)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    max_bs = max(sizes)
    max_len = args.context + 2 * args.steps + 256
    engine = LLMEngine(EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, use_graphs=True,
        cache=CacheConfig(kv_cache_tokens=max_bs * max_len + 1024),
        scheduler=SchedulerConfig(max_num_seqs=max_bs, max_num_batched_tokens=8192,
                                  max_model_len=max_len)))
    results = []
    for bs in sizes:
        rounds = [[run_arm(engine, arm, bs, args.context, args.steps, args.temperature)
                   for arm in ARMS] for _ in range(args.repeats)]
        summary = {}
        for arm in ARMS:
            ms = [r["ms_per_step"] for rnd in rounds for r in rnd if r["arm"] == arm]
            gpu = [r["replay_gpu_ms"] for rnd in rounds for r in rnd if r["arm"] == arm]
            summary[arm] = {"ms_per_step_median": statistics.median(ms),
                            "replay_gpu_ms_median": statistics.median(gpu)
                            if None not in gpu else None}
        base = summary["plain"]
        for arm, s in summary.items():
            s["step_vs_plain"] = s["ms_per_step_median"] / base["ms_per_step_median"]
            s["replay_vs_plain"] = (s["replay_gpu_ms_median"] / base["replay_gpu_ms_median"]
                                    if base["replay_gpu_ms_median"] else None)
            print(f"bs={bs:3d} {arm:16s} {s['ms_per_step_median']:.3f} ms/step "
                  f"(x{s['step_vs_plain']:.3f})  replay {s['replay_gpu_ms_median']} ms "
                  f"(x{s['replay_vs_plain']})", flush=True)
        results.append({"batch_size": bs, "summary": summary, "rounds": rounds})
    out = {"benchmark": "tail_ab", **run_header(), "model": args.model, "dtype": args.dtype,
           "context": args.context, "temperature": args.temperature,
           "model_shape": model_shape(engine.model_config), "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
