"""Decode-step benchmark: ms per step through the engine, graph replay GPU time, host-launched
kernels per step, and the in-graph vs eager-metadata A/B, on random-weight shape presets.

    python benchmarks/bench_decode.py --model random:smollm2-135m --batch-sizes 1 --out r.json

Writes JSON with the device, model shape, date and command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from _meta import model_shape, run_header

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams


def weight_bytes(model) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed_tokens.weight
    if model.lm_head is not None:  # untied: the embedding table is read one row at a time
        n -= emb.numel() * emb.element_size()
    return n


def profile_step(engine: LLMEngine, steps: int) -> dict:
    """Host-side CUDA API calls per decode step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    counts = {"kernel_launches": 0, "graph_launches": 0, "memcpy": 0}
    api_us = {}  # host time inside each CUDA API call, per step: launches against waits
    for e in prof.key_averages():
        name = e.key
        if name.startswith("cu"):
            api_us[name] = round(e.cpu_time_total / steps, 1)
        if name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                    "cudaLaunchKernelExC"):
            counts["kernel_launches"] += e.count
        elif name in ("cudaGraphLaunch", "cuGraphLaunch"):
            counts["graph_launches"] += e.count
        elif name.startswith("cudaMemcpy"):
            counts["memcpy"] += e.count
    return {**{k: v / steps for k, v in counts.items()}, "cuda_api_us_per_step": api_us}


def kernel_table(engine: LLMEngine, graph, steps: int) -> tuple[str, list[dict]]:
    """GPU time per step by kernel name, largest first: from a profile of `steps` replays of
    the step's graph (the kernels inside it), or, where the profiler sees none inside graphs,
    from `steps` eager steps (the same forward, each kernel timed alone; the graph body's
    sampling tail may differ). Returns (source, table)."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(prof) -> list:
        return [e for e in prof.events() if e.device_type.name == "CUDA"
                and not e.name.startswith(("Memcpy", "Memset"))]

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    source, events = "graph_replay", kernels(prof)
    if not events:
        from draftgraph.runtime.graph_set import GraphSet
        from draftgraph.spec.step import StepBody

        graphs = engine.decode_graphs
        engine.decode_graphs = GraphSet(engine.target, StepBody(engine.target), 0,
                                        use_graphs=False)
        try:
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    engine.step()
                torch.cuda.synchronize()
        finally:
            engine.decode_graphs = graphs
        source, events = "eager_steps", kernels(prof)
    rows: dict[str, list] = {}
    for e in events:
        r = rows.setdefault(e.name[:120], [0, 0.0])
        r[0] += 1
        r[1] += e.time_range.elapsed_us()
    table = [{"kernel": name, "per_step": n / steps, "us_per_step": us / steps}
             for name, (n, us) in rows.items()]
    return source, sorted(table, key=lambda r: -r["us_per_step"])


def step_kernels(engine: LLMEngine, steps: int) -> list[dict]:
    """GPU time per engine step by kernel name, largest first, from a profile of `steps`
    steps (graph replays included: the profiler sees the kernels inside them on the H200)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    rows: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset")):
            r = rows.setdefault(e.name[:120], [0, 0.0])
            r[0] += 1
            r[1] += e.time_range.elapsed_us()
    table = [{"kernel": name, "per_step": n / steps, "us_per_step": us / steps}
             for name, (n, us) in rows.items()]
    return sorted(table, key=lambda r: -r["us_per_step"])


def run_arm(engine: LLMEngine, bs: int, ctx: int, steps: int, metadata_in_graph: bool,
            kernels: bool = False, async_scheduling: bool = True) -> dict:
    from draftgraph.runtime.graph_set import GraphSet
    from draftgraph.spec.step import StepBody

    engine.async_scheduling = async_scheduling
    body = StepBody(engine.target, None, metadata_in_graph=metadata_in_graph)
    graphs = GraphSet(engine.target, body, 0, use_graphs=True)
    graphs.capture()
    engine.decode_graphs = graphs
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=4 * steps + 64, temperature=0, ignore_eos=True)
    for _ in range(bs):
        engine.add_request(torch.randint(0, vocab, (ctx,), generator=g).tolist(), sp)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting \
            or engine._inbox:
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms_step = (time.perf_counter() - t0) / steps * 1e3
    # GPU time of the replay alone, back to back
    bucket = graphs.bucket_for(bs)
    graph = graphs.graphs[(bucket, True)][-1]  # the (last) captured part
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if metadata_in_graph:
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        gpu_ms = start.elapsed_time(end) / steps
    else:
        gpu_ms = None
    prof = profile_step(engine, 10)
    source, table = kernel_table(engine, graph, 5) if metadata_in_graph and kernels \
        else (None, None)
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()
    return {
        "metadata_in_graph": metadata_in_graph,
        "async_scheduling": async_scheduling,
        "ms_per_step": ms_step,
        "tokens_per_s": bs / ms_step * 1e3,
        "replay_gpu_ms": gpu_ms,
        "gpu_busy": (gpu_ms / ms_step) if gpu_ms else None,
        "per_step": prof,
        **({"kernels": table, "kernels_source": source,
            "kernels_us_total": sum(k["us_per_step"] for k in table)} if table else {}),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-ab", action="store_true", help="skip the eager-metadata arm")
    ap.add_argument("--kernels", action="store_true",
                    help="add GPU time per kernel name (profile of the step's graph replays)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    max_bs = max(sizes)
    kv = max_bs * (args.context + 4 * args.steps + 200)
    engine = LLMEngine(EngineConfig(
        model=args.model, device="cuda", dtype=args.dtype, use_graphs=False,
        cache=CacheConfig(kv_cache_tokens=kv),
        scheduler=SchedulerConfig(max_num_seqs=max_bs, max_num_batched_tokens=8192,
                                  max_model_len=args.context + 4 * args.steps + 256)))
    cfg = engine.model_config
    wb = weight_bytes(engine.model)
    results = []
    for bs in sizes:
        row = {"batch_size": bs, "arms": []}
        # (metadata in graph, async scheduling): the main arm, the same step read back before
        # the next launch, and the eager-metadata A arm
        arms = [(True, True), (True, False)] + ([] if args.no_ab else [(False, True)])
        for arm, async_on in arms:
            r = run_arm(engine, bs, args.context, args.steps, arm,
                        args.kernels and arm and async_on, async_on)
            row["arms"].append(r)
            print(f"bs={bs:3d} metadata_in_graph={arm!s:5} async={async_on!s:5} "
                  f"{r['ms_per_step']:.3f} ms/step  "
                  f"replay {r['replay_gpu_ms'] or float('nan'):.3f} ms  "
                  f"{r['tokens_per_s']:.0f} tok/s  per step {r['per_step']}", flush=True)
            for k in (r.get("kernels") or [])[:25]:
                print(f"    {k['us_per_step']:8.1f} us  x{k['per_step']:5.1f}  {k['kernel']}")
        results.append(row)
    out = {
        "benchmark": "decode_step",
        **run_header(),
        "model": args.model,
        "dtype": args.dtype,
        "context": args.context,
        "model_shape": model_shape(cfg),
        "weight_bytes_per_step": wb,
        "floor_ms_at_4.1TBps": wb / 4.1e12 * 1e3,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
