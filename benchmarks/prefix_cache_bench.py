"""Automatic prefix caching A/B (`--enable-prefix-caching`): prompts that share a system
prompt, through `LLMEngine` as `serve_offline.py` drives it, arms off / on alternating in
one process (a fresh engine per arm, the server's default flags otherwise).

    python benchmarks/prefix_cache_bench.py --model random:smollm2-135m --prefix-len 2048 \\
        --input-len 128 --output-len 64 --num-prompts 64 --concurrency 1,16 --out r.json

Each prompt is `--prefix-len` shared tokens then `--input-len` of its own, new prompts for
each level (`bench serve --dataset random --random-prefix-len`'s prompts); greedy,
ignore_eos. Per arm and level:
TTFT, TPOT, output tokens/s, and the prompt tokens found cached. A warm-up request per arm
(the prefix alone, as a server's first user would send) runs before the timing, so the
cache arm starts with the prefix cached; with --cold there is none, and the cache is emptied
before each level: the level's first wave arrives together to a cold cache (a server's first
burst), where the requests after the first wait for its blocks instead of computing copies.
Writes JSON with device, model shape, date and command.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch
from _meta import model_shape, run_header
from serve_offline import drive

from draftgraph.bench.datasets import random_requests
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.flags import add_engine_args, add_model_args, engine_config_from_args


def main() -> int:
    ap = argparse.ArgumentParser()
    add_model_args(ap, positional=False)
    add_engine_args(ap)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--arms", default="off,on,off,on")
    ap.add_argument("--cold", action="store_true", help="no warm-up request; the cache "
                    "emptied before each level")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs, header = [], None
    for arm in args.arms.split(","):
        args.enable_prefix_caching = arm == "on"
        engine = LLMEngine(engine_config_from_args(args))
        header = header or {**run_header(str(engine.device)), "model": engine.config.model,
                            "model_shape": model_shape(engine.model_config)}
        levels = [int(x) for x in args.concurrency.split(",")]
        n = args.num_prompts
        # each level its own prompts (a level must not find the last one's in the cache)
        every = random_requests(n * len(levels), args.input_len, args.output_len, 0.0,
                                engine.model_config.vocab_size, 0, args.prefix_len)
        if not args.cold:
            engine.generate([every[0].prompt[:args.prefix_len + 1]],
                            SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        for i, c in enumerate(levels):
            requests = every[i * n:(i + 1) * n]
            if args.cold and engine.prefix_cache is not None:
                engine.prefix_cache.clear()
            before = engine.stats.get("prefix_cache_hits", 0)
            r = drive(engine, requests, c)
            r.update(arm=arm, prefix_cache_hits=engine.stats.get("prefix_cache_hits", 0)
                     - before)
            runs.append(r)
            print(f"{arm} c={c}: {r['output_throughput']:.0f} tok/s, TTFT mean / median "
                  f"{r['mean_ttft_ms']:.2f} / {r['median_ttft_ms']:.2f} ms, TPOT "
                  f"{r['median_tpot_ms']:.3f} ms, cached {r['prefix_cache_hits']} of "
                  f"{len(requests) * (args.prefix_len + args.input_len)} prompt tokens",
                  flush=True)
        engine.shutdown()
        # the next arm's engine sizes its KV pool from free memory: give this one's back
        # (a Llama-3.2-1B's second arm ran out of memory without it)
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out = {"benchmark": "prefix_cache", **header, "prefix_len": args.prefix_len,
           "input_len": args.input_len, "output_len": args.output_len,
           "num_prompts": args.num_prompts, "cold": args.cold, "results": runs}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
