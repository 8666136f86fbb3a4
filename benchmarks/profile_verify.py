"""Where a speculative step's GPU time goes, next to the decode step's, in one run: GPU time per
step by kernel, from torch.profiler over engine steps (graph replays included), for plain
decoding and for n-gram speculation at a fixed k (every step drafts k tokens: the prompts
repeat a motif), batch 1, 512-token context, random weights.

    python benchmarks/profile_verify.py --target random:llama-3.1-8b --out r.json

Per arm: wall ms per step, the GPU kernel time per step and the kernels that take it, largest
first, with each kernel's count per step; and the host ops by self CPU time per step.
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


def motif_ms_per_step(engine: LLMEngine, ctx: int, steps: int, bs: int) -> float:
    """bs requests of `ctx` prompt tokens that repeat a 16-token motif (n-gram drafts on every
    step), 10 warm-up steps, then ms per engine step over `steps`; the requests stay."""
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


def profile_arm(engine: LLMEngine, ctx: int, steps: int, bs: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    ms = motif_ms_per_step(engine, ctx, steps, bs)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    host = sorted(({"op": e.key[:100], "per_step": e.count / steps,
                    "self_cpu_us_per_step": e.self_cpu_time_total / steps}
                   for e in prof.key_averages()), key=lambda r: -r["self_cpu_us_per_step"])
    rows: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.name.startswith(("Memcpy", "Memset")):
            continue
        r = rows.setdefault(e.name[:100], [0, 0.0])
        r[0] += 1
        r[1] += e.time_range.elapsed_us()
    table = sorted(({"kernel": k, "per_step": n / steps, "us_per_step": us / steps}
                    for k, (n, us) in rows.items()), key=lambda r: -r["us_per_step"])
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()
    return {"ms_per_step": ms, "gpu_us_per_step": sum(r["us_per_step"] for r in table),
            "kernels_per_step": sum(r["per_step"] for r in table), "top": table[:top],
            "host_top": host[:top]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tensor-core-rows", choices=("auto", "on", "off"), default="auto",
                    help="the whole run's setting (plain decode too)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    target = load_model(a.target, device="cuda", dtype=getattr(torch, a.dtype))
    out = {"benchmark": "profile_verify", **run_header(), "target": a.target,
           "target_shape": model_shape(target.config), "batch_size": a.batch_size,
           "context": a.context, "k": a.k, "dtype": a.dtype,
           "tensor_core_rows": a.tensor_core_rows, "arms": {}}
    for name, spec in (("plain", SpecConfig()),
                       (f"ngram_k{a.k}", SpecConfig(method="ngram", num_draft_tokens=a.k,
                                                    adaptive=False))):
        e = LLMEngine(EngineConfig(
            model=a.target, device="cuda", dtype=a.dtype, tensor_core_rows=a.tensor_core_rows,
            cache=CacheConfig(kv_cache_tokens=a.batch_size * (a.context + 20 * a.steps + 512)),
            scheduler=SchedulerConfig(max_num_seqs=a.batch_size, max_num_batched_tokens=4096,
                                      max_model_len=a.context + 20 * a.steps + 256),
            spec=spec), loaded=target)
        r = profile_arm(e, a.context, a.steps, a.batch_size, a.top)
        out["arms"][name] = r
        print(f"== {a.target} {name}: {r['ms_per_step']:.3f} ms/step, GPU "
              f"{r['gpu_us_per_step']:.0f} us in {r['kernels_per_step']:.0f} kernels")
        for row in r["top"]:
            print(f"  {row['us_per_step']:8.1f} us  x{row['per_step']:5.1f}  {row['kernel']}")
        print("  host, self CPU time per step:")
        for row in r["host_top"]:
            print(f"  {row['self_cpu_us_per_step']:8.1f} us  x{row['per_step']:5.1f}  {row['op']}")
        del e
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
