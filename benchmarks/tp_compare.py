"""TP = 2 against TP = 1 on a real model (2 GPUs): greedy tokens per prompt, their common
prefix, and the prefill logits' largest difference, in bf16 with CUDA graphs.

    python3 benchmarks/tp_compare.py --model path/to/model.gguf \
        --prompt-ids benchmarks/data/humaneval_smollm2_ids.json --out tp_real.json

Random-weight presets have near-tie logits everywhere, so in bf16 any change of summation
order flips their greedy tokens; a trained model's margins say whether TP changes outputs
beyond rounding. Writes JSON with the device, model, date and command.
"""

from __future__ import annotations

import argparse
import json
import sys

from _meta import run_header

from draftgraph.attention.backend import Phase
from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.runtime import tp_worker
from draftgraph.runtime.schema import StepBatch


def run(model: str, tp: int, dtype: str, prompts: list[list[int]], max_tokens: int,
        device: str):
    engine = LLMEngine(EngineConfig(
        model=model, device=device, dtype=dtype, tensor_parallel_size=tp, seed=0,
        cache=CacheConfig(kv_cache_tokens=32768),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048,
                                  max_model_len=1024)))
    procs = list(tp_worker._STATE["procs"])
    try:
        ids = prompts[0]
        n = len(ids)
        logits = engine.target.forward(StepBatch(Phase.EXTEND, ids, [1], [n], [n],
                                                 list(range(1, n + 1)), list(range(n))))
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                       ignore_eos=True))
    finally:
        engine.shutdown()
    return logits.float().cpu(), [o.token_ids for o in outs], [p.exitcode for p in procs]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True, help="JSON {'humaneval': [[ids]], ...}")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.prompt_ids) as f:
        data = json.load(f)
    prompts = (data["chat"] + data["humaneval"])[: args.num_prompts]
    ref_logits, ref_tokens, _ = run(args.model, 1, args.dtype, prompts, args.max_tokens,
                                    args.device)
    logits, tokens, exitcodes = run(args.model, 2, args.dtype, prompts, args.max_tokens,
                                    args.device)
    prefixes = [common_prefix(a, b) for a, b in zip(ref_tokens, tokens, strict=True)]
    out = {
        "benchmark": "tp2_vs_tp1",
        **run_header(),
        "model": args.model,
        "dtype": args.dtype,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "identical": sum(p == args.max_tokens for p in prefixes),
        "common_prefix": prefixes,
        "max_abs_logit_diff": (logits - ref_logits).abs().max().item(),
        "logit_scale": ref_logits.abs().max().item(),
        "worker_exitcodes": exitcodes,
    }
    print(json.dumps({k: out[k] for k in ("identical", "prompts", "common_prefix",
                                          "max_abs_logit_diff", "logit_scale",
                                          "worker_exitcodes")}))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
