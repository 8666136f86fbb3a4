"""Tensor-parallel decode benchmark: ms per decode step (CUDA graphs, greedy) through the
engine at each TP size and batch size, on a random-weight shape preset.

    python benchmarks/bench_tp.py --model random:llama-3.1-8b --tp 1,2 --batch-sizes 1,32 \
        --out benchmarks/results/tp_llama-3.1-8b.json

Each TP size runs in its own process (rank 0 of its group; ranks > 0 are started by the
engine). Writes JSON with the device, model shape, date and command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from _meta import run_header

TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
          "NVSHMEM_DISABLE_NVLS": "1"}


def run_one(args) -> dict:
    """Child mode: one engine at one TP size, every batch size."""
    from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
    from draftgraph.engine.engine import LLMEngine
    from draftgraph.engine.sampling import SamplingParams

    sizes = [int(x) for x in args.batch_sizes.split(",")]
    max_bs = max(sizes)
    max_len = args.context + args.steps + 64
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=args.model, device="cuda", dtype=args.dtype, tensor_parallel_size=args.tp_one,
        cache=CacheConfig(kv_cache_tokens=max_bs * max_len),
        scheduler=SchedulerConfig(max_num_seqs=max_bs, max_num_batched_tokens=8192,
                                  max_model_len=max_len)))
    init_s = time.perf_counter() - t0
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for bs in sizes:
        sp = SamplingParams(max_tokens=args.steps + 32, temperature=0, ignore_eos=True)
        for _ in range(bs):
            engine.add_request(torch.randint(0, vocab, (args.context,), generator=g).tolist(),
                               sp)
        while any(r.is_prefilling for r in engine.scheduler.running) or \
                engine.scheduler.waiting or engine._inbox:
            engine.step()
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        rows.append({"batch_size": bs, "ms_per_step": ms, "tokens_per_s": bs / ms * 1e3})
        print(f"tp={args.tp_one} bs={bs:3d}  {ms:.3f} ms/step  {bs / ms * 1e3:.0f} tok/s",
              file=sys.stderr, flush=True)
        for rid in list(engine.requests):
            engine.abort(rid)
        engine.step()
    local_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    engine.shutdown()
    return {"tensor_parallel_size": args.tp_one, "init_s": init_s,
            "rank0_weight_bytes": local_bytes, "results": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--tp", default="1,2", help="TP sizes, each run in its own process")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out")
    ap.add_argument("--tp-one", type=int, help=argparse.SUPPRESS)  # child mode
    args = ap.parse_args()
    if args.tp_one:
        print(json.dumps(run_one(args)))
        return 0
    runs = []
    for tp in (int(x) for x in args.tp.split(",")):
        cmd = [sys.executable, __file__, "--tp-one", str(tp), "--model", args.model,
               "--batch-sizes", args.batch_sizes, "--context", str(args.context),
               "--steps", str(args.steps), "--dtype", args.dtype]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **TP_ENV})
        if proc.returncode != 0:
            print(f"tp={tp}: failed with code {proc.returncode}", file=sys.stderr)
            runs.append({"tensor_parallel_size": tp, "error": proc.returncode})
            continue
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    from draftgraph.models.presets import PRESETS

    preset = PRESETS.get(args.model.removeprefix("random:"))
    out = {
        "benchmark": "tp_decode_step",
        **run_header(),
        "num_gpus": torch.cuda.device_count(),
        "model": args.model,
        "shape": preset.__dict__ if preset is not None else None,
        "dtype": args.dtype,
        "context": args.context,
        "steps": args.steps,
        "note": "ms per decode step through LLMEngine.step (CUDA-graph replay on every rank, "
                "control message over gloo), greedy, random weights",
        "runs": runs,
    }
    text = json.dumps(out, indent=2, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
