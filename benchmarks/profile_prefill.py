"""Where time to first token goes (issue 15): a batch-1 prefill of N tokens, wall time against
GPU time, by kernel and by host-side CUDA call (torch.profiler).

    python benchmarks/profile_prefill.py --model random:smollm2-135m --tokens 512,4096 \\
        --arms graphs,eager --out r.json

Per prompt length and arm: TTFT of `LLMEngine.generate(max_tokens=1)` (median of --repeats,
after warm-up), the engine step alone (the extend forward and its sampling tail), GPU busy
time inside that step, kernel launches from the host, and the top kernels by GPU time. Arms
(`--arms`, one engine each over one loaded model, measured in turn per prompt length):
`graphs` replays the captured prefill (`--prefill-graph-tokens`, the default), `eager` launches
every kernel from the host (`--prefill-graph-tokens 0`).

`--mixed P,N`: instead, the step that mixes P arriving prompts of each length with N decoding
requests (512-token contexts), as a server runs it under `--no-overlap-prefill`: its wall time
with the GPU synchronised (median of --repeats; the P requests end after their first token,
the N keep decoding), then one such step profiled, beside the decode step of the N alone.
With `--behind`, the step the defaults run instead: the P prompts prefilled behind the
launched decode step, the N's next decode rows riding in that forward. Its wall time is
taken as every step's here, with the GPU synchronised before and after, so it holds the
device work the step waits on (the decode step it launches ahead included), not the host's
work alone; the profiles split it (kernels by GPU time, the host's by op and by function).
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
from draftgraph.kernels import attention
from draftgraph.models.loader import load_model


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


MIXED_DECODE_TOKENS = 1024  # a --mixed decoding request's budget: the run's steps stay below it
LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    sync()
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    sync()
    return (time.perf_counter() - t0) * 1e3


def profile(engine: LLMEngine, prompt: list[int], top: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx

    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    engine._drain_inbox([])
    sync()
    with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.step()  # the prefill step (its sampled token ends the request)
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    while engine.has_unfinished():
        engine.step()
    return {"step_wall_ms_profiled": wall, **kernel_table(prof, top)}


def mixed(engine: LLMEngine, n: int, prompts: int, decoding: int, repeats: int, top: int,
          g: torch.Generator) -> dict:
    """The extend step of `prompts` new prompts of n tokens beside `decoding` decoding requests
    (with --overlap-prefill: the step that prefills them behind the decode step in flight),
    and the decode step of those alone, both timed with the GPU synchronised."""
    kind = "behind" if engine.config.overlap_prefill else "extend"
    vocab = engine.model_config.vocab_size
    if not engine.has_unfinished():
        for _ in range(decoding):
            engine.add_request(torch.randint(0, vocab, (512,), generator=g).tolist(),
                               SamplingParams(max_tokens=MIXED_DECODE_TOKENS, temperature=0,
                                              ignore_eos=True))
        engine._drain_inbox([])
        while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
            engine.step()
        for _ in range(4):
            engine.step()

    def add_prompts() -> None:
        for _ in range(prompts):
            engine.add_request(torch.randint(0, vocab, (n,), generator=g).tolist(),
                               SamplingParams(max_tokens=1, temperature=0))

    def timed_step() -> float:
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        return (time.perf_counter() - t0) * 1e3

    def timed_extend() -> float:
        add_prompts()
        for _ in range(4):  # a launched-ahead decode step is read first (mixed step)
            ms = timed_step()
            if engine.step_kind == kind:
                return ms
        raise RuntimeError(f"no {kind} step after the prompts arrived")

    for _ in range(2):
        timed_extend()  # warm-up: Triton compiles for this length
    ext = [timed_extend() for _ in range(repeats)]
    dec = [timed_step() for _ in range(repeats)]
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx
    add_prompts()
    for _ in range(4 if kind == "extend" else 0):  # up to the extend step, not profiled
        engine._drain_inbox([])
        if engine._inflight is None:
            break
        engine.step()
    sync()
    with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        sync()
    assert engine.step_kind == kind, engine.step_kind
    host = sorted(({"op": e.key[:100], "count": e.count, "self_cpu_us": e.self_cpu_time_total}
                   for e in prof.key_averages()), key=lambda r: -r["self_cpu_us"])[:top]
    return {"step": kind, "prompts": prompts, "decoding": decoding, "prompt_tokens": n,
            "rows_riding": engine.stats["rows_riding"],
            "extend_ms_median": statistics.median(ext), "extend_ms": ext,
            "decode_ms_median": statistics.median(dec), "decode_ms": dec,
            **kernel_table(prof, top), "host_top": host, "python_top": python_profile(
                engine, add_prompts, top)}


def python_profile(engine: LLMEngine, add_prompts, top: int) -> list[dict]:
    """The Python functions of one more such extend step, by their own time (cProfile)."""
    import cProfile
    import pstats
    add_prompts()
    for _ in range(0 if engine.config.overlap_prefill else 4):
        engine._drain_inbox([])
        if engine._inflight is None:
            break
        engine.step()
    sync()
    pr = cProfile.Profile()
    pr.enable()
    engine.step()
    sync()
    pr.disable()
    st = pstats.Stats(pr).stats
    rows = sorted(({"function": f"{k[0].rsplit('/', 2)[-1]}:{k[1]}:{k[2]}", "calls": v[1],
                    "own_us": v[2] * 1e6, "cumulative_us": v[3] * 1e6}
                   for k, v in st.items()), key=lambda r: -r["own_us"])
    return rows[:top]


def kernel_table(prof, top: int) -> dict:
    launches = sum(e.count for e in prof.key_averages() if e.key in LAUNCH)
    kernels, gpu_us = {}, 0.0
    for e in prof.events():
        if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset")):
            r = kernels.setdefault(e.name[:120], {"us": 0.0, "count": 0})
            r["us"] += e.time_range.elapsed_us()
            r["count"] += 1
            gpu_us += e.time_range.elapsed_us()
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:top]
    return {"gpu_ms": gpu_us / 1e3, "kernel_launches": launches,
            "top_kernels": [{"kernel": k, **v} for k, v in ranked]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--arms", default="graphs,eager",
                    help="graphs, eager; a _det suffix runs the arm with --deterministic, "
                         "_split<N> with split-KV extend attention of up to N splits, "
                         "_masked with every key tile masked (EXTEND_UNMASKED_FIRST off)")
    ap.add_argument("--prefill-graph-tokens", type=int,
                    default=EngineConfig.prefill_graph_tokens,
                    help="the graphs arms' captured prefill (default: the engine's)")
    ap.add_argument("--mixed", default="", metavar="P,N",
                    help="P prompts of each length arriving while N requests decode")
    ap.add_argument("--behind", action="store_true",
                    help="--mixed: the prompts prefilled behind the decode step in flight, "
                         "decode rows riding (the default engine), not the mixed step")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lens = [int(x) for x in args.tokens.split(",")]
    arms = args.arms.split(",")
    prompts, decoding = (int(x) for x in args.mixed.split(",")) if args.mixed else (1, 0)
    # a step's budget: the arriving prompts and the decode rows (at least one --mixed
    # decoder's 512-token prompt, so they prefill before the timing)
    step_tokens = max(max(lens) * prompts + decoding, 512 + 8)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run of the script
    loaded = load_model(args.model, device=dev, dtype=getattr(torch, args.dtype))

    def engine_for(arm: str) -> LLMEngine:
        # the backend takes its split-KV extend plan when built (its graphs keep it)
        splits = arm.split("_split")[1].split("_")[0] if "_split" in arm else "1"
        attention.EXTEND_MAX_SPLITS = int(splits)
        attention.EXTEND_UNMASKED_FIRST = defaults[1] and "_masked" not in arm
        return LLMEngine(EngineConfig(
            model=args.model, device=dev, dtype=args.dtype,
            prefill_graph_tokens=(min(step_tokens, args.prefill_graph_tokens)
                                  if arm.startswith("graphs") else 0),
            deterministic=arm.endswith("_det"),
            overlap_prefill=args.behind,  # --mixed: the mixed step, else the step behind
            cache=CacheConfig(kv_cache_tokens=max(lens) * (prompts + 1)
                              + decoding * (512 + MIXED_DECODE_TOKENS + 64) + 1024),
            scheduler=SchedulerConfig(max_num_seqs=max(8, prompts + decoding),
                                      max_num_batched_tokens=step_tokens,
                                      # --mixed: the model's (as a server's), so the captured
                                      # prefill's padding row is as wide
                                      max_model_len=None if args.mixed else max(lens) + 64)),
            loaded=loaded)

    defaults = attention.EXTEND_MAX_SPLITS, attention.EXTEND_UNMASKED_FIRST
    engines = {arm: engine_for(arm) for arm in arms}
    for e in engines.values():  # (async scheduling is off on a CPU, where --behind dry-runs)
        e.async_scheduling = e.async_scheduling or args.behind
    attention.EXTEND_MAX_SPLITS, attention.EXTEND_UNMASKED_FIRST = defaults
    engine = engines[arms[0]]
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    results = []
    for n in lens:
        prompt = torch.randint(0, vocab, (n,), generator=g).tolist()
        for arm, engine in engines.items():
            if args.mixed:
                r = {"arm": arm, **mixed(engine, n, prompts, decoding, args.repeats, args.top, g)}
                results.append(r)
                print(f"{args.model} {arm} {prompts} x {n} tokens beside {decoding} decoding: "
                      f"{r['step']} step {r['extend_ms_median']:.2f} ms (decode step "
                      f"{r['decode_ms_median']:.2f}), GPU {r['gpu_ms']:.2f} ms, "
                      f"{r['kernel_launches']} launches", flush=True)
                for k in r["top_kernels"][:8]:
                    print(f"    {k['us'] / 1e3:8.3f} ms x{k['count']:4d} {k['kernel'][:90]}",
                          flush=True)
                for k in r["python_top"][:12]:
                    print(f"    {k['own_us'] / 1e3:8.3f} ms own, {k['cumulative_us'] / 1e3:8.3f} "
                          f"cum x{k['calls']:5d} {k['function'][:80]}", flush=True)
                continue
            for _ in range(2):
                ttft(engine, prompt)  # warm-up: Triton compiles for this length
            times = [ttft(engine, prompt) for _ in range(args.repeats)]
            r = {"arm": arm, "prompt_tokens": n, "ttft_ms_median": statistics.median(times),
                 "ttft_ms": times, **profile(engine, prompt, args.top)}
            results.append(r)
            print(f"{args.model} {arm} {n} tokens: TTFT {r['ttft_ms_median']:.2f} ms, profiled "
                  f"step {r['step_wall_ms_profiled']:.2f} ms, GPU {r['gpu_ms']:.2f} ms, "
                  f"{r['kernel_launches']} launches", flush=True)
            for k in r["top_kernels"][:6]:
                print(f"    {k['us'] / 1e3:8.3f} ms x{k['count']:4d} {k['kernel'][:90]}",
                      flush=True)
    out = {"benchmark": "prefill_profile", **run_header(), "model": args.model,
           "model_shape": model_shape(engine.model_config), "dtype": args.dtype,
           "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
