"""CPU benchmark of the default model (SmolLM2-135M-Instruct GGUF): start-up, decode, prefill.

    python benchmarks/bench_cpu.py --threads 2 --out benchmarks/results/cpu_smollm2.json
    python benchmarks/bench_cpu.py --threads 2 --quantizations none int4 --out r.json

- start-up: `load_model` in a fresh process with an empty weight cache (the first start:
  dequantisation + cache write) and again (the second start: the cache), plus the process's
  wall time to the loaded model (imports included);
- decode: tokens/s of one greedy request (batch 1) after its first token;
- prefill: tokens/s of one prompt of N tokens (one chunk: --max-num-batched-tokens N), next to
  one transformers forward of the same GGUF (transformers dequantises it itself), in this run;
- stall: with the CPU's default step budget (chunked prefill), per --step-seconds arm (the
  CLI's CPU default, and 0: the token budget alone), the largest gap between two tokens of a
  running stream while a --stall-tokens prompt is admitted, and that prompt's TTFT.

Writes JSON with the device, model shape, date and command. Say whether the machine was quiet
(`load_average` is recorded before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from _meta import model_shape, run_header

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.loader import resolve_model_path

_STARTUP = """
import time, json, sys
t0 = time.perf_counter()
import torch
torch.set_num_threads({threads})
from draftgraph.models.loader import load_model
t1 = time.perf_counter()
load_model({model!r})
t2 = time.perf_counter()
print(json.dumps({{"load_s": t2 - t1, "process_s": t2 - t0}}))
"""


def startup(model: str, threads: int) -> dict:
    """Two fresh processes on one empty weight cache: the first and the second start."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "DRAFTGRAPH_CACHE_DIR": cache}
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", _STARTUP.format(model=model,
                                                                      threads=threads)],
                               env=env, capture_output=True, text=True, check=True)
            run = json.loads(r.stdout.strip().splitlines()[-1])
            run["wall_s"] = time.perf_counter() - t0  # interpreter start-up included
            runs.append(run)
    return {"first": runs[0], "second": runs[1]}


def engine_for(model: str, max_batched: int, max_len: int,
               quantization: str = "none") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model, device="cpu", quantization=quantization,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_batched,
                                  max_model_len=max_len),
        cache=CacheConfig(kv_cache_tokens=max_len + 64)))


def decode(engine: LLMEngine, tokens: int, repeats: int) -> dict:
    prompt = "Write a story about a graph that learns to fly."
    rates = []
    for _ in range(repeats):
        out = engine.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0,
                                                       ignore_eos=True))[0]
        m = out.metrics
        rates.append((m["completion_tokens"] - 1) / (m["seconds"] - m["ttft"]))
    return {"tokens": tokens, "tok_s": max(rates), "tok_s_all": rates}


def prefill(engine: LLMEngine, n: int, repeats: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(n)
    times = []
    for _ in range(repeats):
        ids = torch.randint(100, vocab - 100, (n,), generator=g).tolist()
        out = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0]
        times.append(out.metrics["ttft"])
    best = min(times)
    return {"tokens": n, "seconds": best, "tok_s": n / best, "seconds_all": times}


def stall(model: str, n: int, vocab: int, quantization: str = "none",
          step_seconds: float = 0.0) -> dict:
    """A stream decodes; a prompt of n tokens arrives; its prefill is cut into chunks of the
    default budget (and, with step_seconds, of what fits in that time), each step also carrying
    the stream's next token."""
    engine = LLMEngine(EngineConfig(model=model, device="cpu", quantization=quantization,
                                    scheduler=SchedulerConfig(max_model_len=n + 256,
                                                              max_step_seconds=step_seconds),
                                    cache=CacheConfig(kv_cache_tokens=2 * n + 512)))
    budget = engine.config.scheduler.max_num_batched_tokens
    g = torch.Generator().manual_seed(1)
    stream = engine.add_request("Write a story about a graph that learns to fly.",
                                SamplingParams(max_tokens=10_000, temperature=0.0,
                                               ignore_eos=True))
    times: list[float] = []
    long_id, t_arrive, ttft = None, None, None
    while ttft is None or len(times) < 3:
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id == stream and out.new_token_ids:
                times.append(now)
            if out.request_id == long_id and out.new_token_ids and ttft is None:
                ttft = now - t_arrive
        if long_id is None and len(times) >= 5:
            t_arrive = time.perf_counter()
            long_id = engine.add_request(torch.randint(100, vocab - 100, (n,),
                                                       generator=g).tolist(),
                                         SamplingParams(max_tokens=1, temperature=0.0))
            first_gap = len(times)
    gaps = [b - a for a, b in zip(times[first_gap - 1 :], times[first_gap:], strict=False)]
    steady = [b - a for a, b in zip(times[: first_gap - 1], times[1:first_gap], strict=False)]
    engine.abort(stream)
    return {"prompt_tokens": n, "step_budget": budget, "max_step_seconds": step_seconds,
            "max_gap_s": max(gaps),
            "gaps_s": gaps, "steady_gap_s": min(steady), "long_prompt_ttft_s": ttft}


def transformers_model(path: str):
    """transformers' own GGUF loading, fp32 (without accelerate: its conversion, by hand)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    d, name = os.path.split(path)
    if is_accelerate_available():
        return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d, gguf_file=name),
                                             dtype=torch.float32)
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model.eval()


def transformers_forward(path: str, lens: list[int], repeats: int) -> dict:
    t0 = time.perf_counter()
    hf = transformers_model(path)
    out = {"load_s": time.perf_counter() - t0}
    vocab = hf.config.vocab_size
    for n in lens:
        g = torch.Generator().manual_seed(n)
        times = []
        for _ in range(repeats):
            ids = torch.randint(100, vocab - 100, (1, n), generator=g)
            t = time.perf_counter()
            with torch.no_grad():
                hf(ids, use_cache=False, logits_to_keep=1)
            times.append(time.perf_counter() - t)
        best = min(times)
        out[str(n)] = {"tokens": n, "seconds": best, "tok_s": n / best, "seconds_all": times}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="a GGUF (default: the default model)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--prefill-lens", type=int, nargs="+", default=[512])
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--stall-tokens", type=int, default=4096,
                   help="the prompt admitted while a stream runs (0: skip)")
    p.add_argument("--step-seconds", type=float, nargs="+",
                   default=[SchedulerConfig.CPU_STEP_SECONDS, 0.0],
                   help="stall arms: --max-step-seconds values (0: the token budget alone)")
    p.add_argument("--quantizations", nargs="+", default=["none"], choices=["none", "int4"],
                   help="arms, each with its own engine in this run (keys of the others: "
                        "decode_batch1_int4, prefill_int4, stall_int4)")
    p.add_argument("--out", default="benchmarks/results/cpu_smollm2.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    result = run_header(f"CPU ({os.cpu_count()} logical cores, {args.threads} threads)")
    result["load_average_before"] = os.getloadavg()
    result["model"] = path
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save() -> None:  # after every stage: a long run killed midway keeps what it measured
        result["load_average_after"] = os.getloadavg()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    print("start-up ...", file=sys.stderr, flush=True)
    result["startup"] = startup(args.model, args.threads)
    save()
    max_len = max(args.prefill_lens) + args.decode_tokens + 64
    for q in args.quantizations:
        arm = "" if q == "none" else f"_{q}"
        engine = engine_for(args.model, max(args.prefill_lens), max_len, q)
        result["shape"] = model_shape(engine.model_config)
        print(f"decode{arm} ...", file=sys.stderr, flush=True)
        result[f"decode_batch1{arm}"] = decode(engine, args.decode_tokens, args.repeats)
        save()
        print(f"prefill{arm} ...", file=sys.stderr, flush=True)
        vocab = engine.model_config.vocab_size
        result[f"prefill{arm}"] = {str(n): prefill(engine, n, args.repeats, vocab)
                                   for n in args.prefill_lens}
        save()
        del engine
        if args.stall_tokens:
            print(f"stall{arm} ...", file=sys.stderr, flush=True)
            result[f"stall{arm}"] = {str(s): stall(args.model, args.stall_tokens, vocab, q, s)
                                     for s in args.step_seconds}
            save()
    if not args.no_transformers:
        print("transformers ...", file=sys.stderr, flush=True)
        result["transformers_forward"] = transformers_forward(path, args.prefill_lens,
                                                              args.repeats)
        for q in args.quantizations:
            arm = "" if q == "none" else f"_{q}"
            for n in args.prefill_lens:
                ours = result[f"prefill{arm}"][str(n)]["tok_s"]
                result[f"prefill{arm}"][str(n)]["vs_transformers"] = \
                    ours / result["transformers_forward"][str(n)]["tok_s"]
    save()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
