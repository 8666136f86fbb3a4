"""The offline arm of the serving benchmark (issue 15): `bench serve`'s prompts run through
`LLMEngine` in process, at the same concurrency levels, with the server's default flags.

    python benchmarks/serve_offline.py --model random:smollm2-135m --num-prompts 128 \\
        --input-len 512 --output-len 128 --concurrency 1,16,64,128 --out r.json

A client of concurrency c keeps c requests in the engine: a new one is added as soon as one
finishes, as `bench serve --max-concurrency c` does against the server. Per level: output
tokens/s, TTFT, TPOT ((last token - first token) / (tokens - 1), per request) and E2E, in
`bench serve`'s names, so the two JSONs compare field by field; the prompts are
`bench serve --dataset random --seed 0`'s (token ids drawn the same way), greedy, ignore_eos.
Writes JSON with the device, model shape, date and command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from _meta import model_shape, run_header

from draftgraph.bench.datasets import random_requests
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.engine.stats import step_accounts
from draftgraph.flags import add_engine_args, add_model_args, engine_config_from_args


def drive(engine: LLMEngine, requests, concurrency: int) -> dict:
    """Keep `concurrency` requests in the engine until all have run; bench serve's summary."""
    pending = list(requests)
    added, first, last, count = {}, {}, {}, {}
    before = dict(engine.stats)  # steps by kind, as the server's /metrics count them
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(added) - len(last) < concurrency:
            r = pending.pop(0)
            rid = engine.add_request(r.prompt, SamplingParams(
                max_tokens=r.output_len, temperature=0, ignore_eos=True))
            added[rid] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                last[out.request_id] = now
    duration = time.perf_counter() - t0
    ttft = [first[r] - added[r] for r in added]
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in added if count[r] > 1]
    e2e = [last[r] - added[r] for r in added]

    def ms(values: list[float], name: str) -> dict:
        return {f"mean_{name}_ms": 1e3 * statistics.fmean(values),
                f"median_{name}_ms": 1e3 * statistics.median(values)}

    return {"max_concurrency": concurrency, "completed": len(last), "duration_s": duration,
            "total_output_tokens": sum(count.values()),
            "output_throughput": sum(count.values()) / duration,
            "steps_by_kind": step_accounts(engine.stats, before),
            "rows_riding": engine.stats["rows_riding"] - before.get("rows_riding", 0),
            **ms(ttft, "ttft"), **ms(tpot, "tpot"), **ms(e2e, "e2e")}


def main() -> int:
    ap = argparse.ArgumentParser()
    add_model_args(ap, positional=False)
    add_engine_args(ap)  # `draftgraph serve`'s engine flags and defaults
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,16,64,128")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    engine = LLMEngine(engine_config_from_args(args))
    vocab = engine.model_config.vocab_size
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, 0.0, vocab, 0)
    drive(engine, requests[:4], 4)  # warm-up (bench serve sends 2 requests before timing)
    runs = []
    for c in (int(x) for x in args.concurrency.split(",")):
        runs.append(drive(engine, requests, c))
        r = runs[-1]
        print(f"offline c={c}: {r['output_throughput']:.0f} tok/s, TTFT "
              f"{r['median_ttft_ms']:.2f} ms, TPOT {r['median_tpot_ms']:.3f} ms; steps "
              f"{r['steps_by_kind']}", flush=True)
    out = {"benchmark": "serve_offline", **run_header(str(engine.device)),
           "model": engine.config.model, "model_shape": model_shape(engine.model_config),
           "num_prompts": args.num_prompts, "input_len": args.input_len,
           "output_len": args.output_len, "results": runs}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
