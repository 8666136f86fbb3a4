"""One arm of the drafter-seam A/B: plain decode and fixed-k n-gram steps through the public
API only, so the same script runs against the code before the change and after it.

    PYTHONPATH=<package root> python benchmarks/bench_seam_ab.py --arm new \
        --model random:smollm2-135m --out r.json

Per model: ms per decode step at batch 1 with a 512-token context (engine.step() after the
prefill, async scheduling as the engine defaults), ms per n-gram step with k = 4 fixed (no
adaptive shrinking) on a repeating prompt so drafts are proposed every step, and the
host-launched kernels per step outside graph replays (torch.profiler). `benchmarks/
seam_ab_gpu.sh` runs both arms alternately (A B A B) in one device call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
from bench_decode import profile_step

from draftgraph import (
    CacheConfig,
    EngineConfig,
    LLMEngine,
    SamplingParams,
    SchedulerConfig,
    SpecConfig,
)


def arm(model: str, spec: SpecConfig | None, ctx: int, steps: int) -> dict:
    engine = LLMEngine(EngineConfig(
        model=model, device="cuda", dtype="bfloat16",
        cache=CacheConfig(kv_cache_tokens=ctx + 8 * steps + 512),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2048,
                                  max_model_len=ctx + 8 * steps + 256),
        spec=spec or SpecConfig()))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(0, vocab, (32,), generator=g)
    prompt = motif.repeat(ctx // 32 + 1)[:ctx].tolist()  # repeats: n-gram always proposes
    engine.add_request(prompt, SamplingParams(max_tokens=8 * steps + 64, temperature=0,
                                              ignore_eos=True))
    for _ in range(10):  # prefill, then warm steps
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    counts = profile_step(engine, 10)  # host-launched kernels, graph launches, copies
    stats = dict(engine.stats)
    del engine
    torch.cuda.empty_cache()
    return {"ms_per_step": ms, **counts,
            "accepted_per_verify": (stats["num_accepted_tokens"] / stats["num_drafts"])
            if stats.get("num_drafts") else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res = {"arm": a.arm, "model": a.model, "context": a.context, "batch_size": 1,
           "dtype": "bfloat16", "device": torch.cuda.get_device_name(),
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv),
           "decode": arm(a.model, None, a.context, a.steps),
           "ngram_k4_fixed": arm(a.model, SpecConfig(method="ngram", num_draft_tokens=4,
                                                     adaptive=False), a.context, a.steps)}
    print(json.dumps(res), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
