"""Engine start-up with the default flags on a GPU (issue 15): load, KV sizing, graph capture
per graph set (seconds and MiB, from the engine's own log lines), and one short generate.

    python benchmarks/bench_startup.py --model random:smollm2-135m --speculative ngram --out r.json
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time

import torch
from _meta import model_shape, run_header

from draftgraph.config import EngineConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--speculative", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    handler = Captured()
    logging.getLogger("draftgraph").addHandler(handler)
    logging.getLogger("draftgraph").setLevel(logging.INFO)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, spec=SpecConfig(method=args.speculative)))
    torch.cuda.synchronize()
    start_s = time.perf_counter() - t0
    sched = engine.config.scheduler
    captures = []
    for line in handler.lines:
        m = re.match(r"captured (.+) graphs for batch sizes \[(.*)\], .* in ([\d.]+) s "
                     r"\((-?\d+) MiB\)", line)
        if m:
            captures.append({"body": m.group(1), "buckets": len(m.group(2).split(",")),
                             "seconds": float(m.group(3)), "mib": int(m.group(4))})
        m = re.match(r"captured prefill graphs for (\d+) token counts .* in ([\d.]+) s "
                     r"\((-?\d+) MiB\)", line)
        if m:
            captures.append({"body": "prefill", "buckets": int(m.group(1)),
                             "seconds": float(m.group(2)), "mib": int(m.group(3))})
    vocab = engine.model_config.vocab_size
    prompt = torch.randint(0, vocab, (512,)).tolist()
    t1 = time.perf_counter()
    engine.generate([prompt] * 64, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    gen_s = time.perf_counter() - t1
    out = {"benchmark": "startup_gpu_defaults", **run_header(), "model": args.model,
           "model_shape": model_shape(engine.model_config), "speculative": args.speculative,
           "max_num_seqs": sched.max_num_seqs,
           "max_num_batched_tokens": sched.max_num_batched_tokens,
           "kv_slots": engine.slots.allocator.usable_slots, "startup_s": start_s,
           "captures": captures, "capture_s_total": sum(c["seconds"] for c in captures),
           "graph_mib_total": sum(c["mib"] for c in captures),
           "gpu_memory_allocated_gib": torch.cuda.memory_allocated() / 2**30,
           "generate_64x512in_32out_s": gen_s}
    print(json.dumps({k: v for k, v in out.items() if k != "captures"}), flush=True)
    for c in captures:
        print(c, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
