"""What `--deterministic` costs, and the batch-invariant matmul's configs (issue 16), on a GPU.

    OUT=out python benchmarks/bench_deterministic.py kernels   # matmul sweep -> dot_sweep.json
    OUT=out python benchmarks/bench_deterministic.py engine    # steps, on vs off -> det_*.json

kernels: per weight shape of random smollm2-135m / llama-3.2-1b / llama-3.1-8b, us per call of
the batch-invariant matmul under each candidate config at M = 1 and 5 (32 and 512 for
the heuristic's and the best), next to cuBLAS
(F.linear) and the fused single-row kernel at M = 1; each timed as 20 calls replayed in one
CUDA graph (no launch gaps of the host), and whether its rows are bitwise the same at
M = 1 / 5 / 64 (every config should be). The best config per shape is what DOT_TUNED takes.

engine: wall ms per engine step at batch 1, 512-token context, deterministic off and on in one
run: plain decode, n-gram k = 4 (every step drafts: the prompts repeat a motif), and plain
decode at batch 32 / 64 (smollm2-135m, llama-3.2-1b); `profile_verify.motif_ms_per_step`.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from _meta import model_shape, run_header

from draftgraph.kernels import gemv as G
from draftgraph.kernels import matmul as MM

OUT = os.environ.get("OUT", ".")
MODELS = {
    "smollm2-135m": dict(h=576, q=576, kv=192, i=1536, v=49152),
    "llama-3.2-1b": dict(h=2048, q=2048, kv=512, i=8192, v=128256),
    "llama-3.1-8b": dict(h=4096, q=4096, kv=1024, i=14336, v=128256),
}


def shapes(c: dict) -> dict[str, tuple[int, int]]:
    return {"qkv": (c["q"] + 2 * c["kv"], c["h"]), "o": (c["h"], c["q"]),
            "gate_up": (2 * c["i"], c["h"]), "down": (c["h"], c["i"]), "lm_head": (c["v"], c["h"])}


def graph_us(fn, calls: int = 20, reps: int = 5) -> float:
    """us per call of fn, `calls` calls captured in one CUDA graph, best of reps replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / calls)
    return best


def call_us(fn, *args, **kwargs) -> float:
    return graph_us(lambda: fn(*args, **kwargs))


def candidates(n: int, k: int) -> list[MM.DotConfig]:
    out = [MM.dot_config(n, k)]
    for bm in (16, 64):
        for bn in (32, 64):
            for bk in (64, 128):
                for split in sorted({1, 2, 4, 8} | {out[0].split_k}):
                    if k // split < bk or (bm == 16 and bn == 64):
                        continue
                    c = MM.DotConfig(bm, bn, bk, split, 4, 4 if bk == 64 else 3)
                    if c not in out:
                        out.append(c)
    return out


def kernels() -> None:
    torch.manual_seed(0)
    rows = []
    seen = set()
    for model, c in MODELS.items():
        for name, (n, k) in shapes(c).items():
            if (n, k) in seen:
                continue
            seen.add((n, k))
            w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
            x = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)
            row = {"model": model, "proj": name, "n": n, "k": k,
                   "cublas": {m: call_us(F.linear, x[:m], w) for m in (1, 5, 32, 512)},
                   "fused_m1": call_us(G.gemv_triton, x[:1], w), "dot": []}
            for cfg in candidates(n, k):
                ref = MM.dot_linear(x[:64], w, config=cfg)
                exact = all(torch.equal(MM.dot_linear(x[:m], w, config=cfg), ref[:m])
                            for m in (1, 5)) and torch.equal(
                                MM.dot_linear(x[9:10], w, config=cfg)[0], ref[9])
                row["dot"].append({"cfg": list(cfg), "exact": exact, "us": {
                    m: call_us(MM.dot_linear, x[:m], w, config=cfg) for m in (1, 5)}})
            best = min(row["dot"], key=lambda d: d["us"][1] + d["us"][5])
            for d in (row["dot"][0], best):  # the heuristic's and the best one's larger M
                cfg = MM.DotConfig(*d["cfg"])
                for m in (32, 512):
                    d["us"][m] = call_us(MM.dot_linear, x[:m], w, config=cfg)
            row["best"] = best["cfg"]
            print(f"{model:13s} {name:8s} {n:6d}x{k:5d} cublas m1 {row['cublas'][1]:7.1f} "
                  f"m5 {row['cublas'][5]:7.1f} m512 {row['cublas'][512]:7.1f} | fused m1 "
                  f"{row['fused_m1']:7.1f} | heur {row['dot'][0]['us'][1]:7.1f} "
                  f"{row['dot'][0]['us'][5]:7.1f} {row['dot'][0]['us'][512]:7.1f} | best "
                  f"{best['cfg']} {best['us'][1]:7.1f} {best['us'][5]:7.1f} "
                  f"{best['us'][512]:7.1f} | exact {all(d['exact'] for d in row['dot'])}",
                  flush=True)
            rows.append(row)
    with open(os.path.join(OUT, "dot_sweep_h200.json"), "w") as f:
        json.dump({"benchmark": "dot_sweep", **run_header(), "shapes": rows}, f, indent=1)


def engine() -> None:
    from profile_verify import motif_ms_per_step

    from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from draftgraph.engine.engine import LLMEngine
    from draftgraph.models.loader import load_model

    ctx, steps = 512, 40
    for model in sys.argv[2:] or list(MODELS):
        target = load_model(f"random:{model}", device="cuda", dtype=torch.bfloat16)
        out = {"benchmark": "deterministic_cost", **run_header(), "model": f"random:{model}",
               "shape": model_shape(target.config), "context": ctx, "arms": []}
        sizes = [int(b) for b in os.environ.get("BATCHES", "").split(",") if b] or (
            [1, 32, 64] if model != "llama-3.1-8b" else [1, 32])
        for det in (False, True):
            for bs in sizes:
                for name, spec in (("plain", SpecConfig()),
                                   ("ngram_k4", SpecConfig(method="ngram", num_draft_tokens=4,
                                                           adaptive=False))):
                    if name == "ngram_k4" and bs > 1:
                        continue
                    e = LLMEngine(EngineConfig(
                        model=f"random:{model}", device="cuda", dtype="bfloat16",
                        deterministic=det,
                        cache=CacheConfig(kv_cache_tokens=bs * (ctx + 20 * steps + 512)),
                        scheduler=SchedulerConfig(max_num_seqs=bs, max_num_batched_tokens=8192,
                                                  max_model_len=ctx + 20 * steps + 256),
                        spec=spec), loaded=target)
                    ms = motif_ms_per_step(e, ctx, steps, bs)
                    for rid in list(e.requests):
                        e.abort(rid)
                    e.step()
                    arm = {"deterministic": det, "batch": bs, "arm": name, "ms_per_step": ms}
                    out["arms"].append(arm)
                    print(f"{model} det={det} bs={bs} {name}: {ms:.3f} ms/step", flush=True)
                    with open(os.path.join(OUT, f"det_cost_{model}_h200.json"), "w") as f:
                        json.dump(out, f, indent=1)  # after every arm: a cut run keeps them
                    del e
                    torch.cuda.empty_cache()
        del target
        torch.cuda.empty_cache()


if __name__ == "__main__":
    {"kernels": kernels, "engine": engine}[sys.argv[1]]()
