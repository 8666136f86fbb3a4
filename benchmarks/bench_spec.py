"""Speculative-decoding benchmark: ms per step, acceptance length and tokens/s of n-gram
speculation against plain decoding, on code-editing prompts (the prompt holds most of the
answer) and free-form prompts.

    python benchmarks/bench_spec.py --model default --device cpu --batch-sizes 1 --out r.json
    python benchmarks/bench_spec.py --model random:llama-3.1-8b --batch-sizes 1,32 --out r.json

On random-weight presets acceptance says little (the model does not copy its prompt), so the
GPU numbers are step costs; acceptance on real weights is measured with the default model.
Writes JSON with the device, model shape, date and command.
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

CODE_EDIT = (
    "Rename the variable `total` to `running_sum` in this function and return the code:\n\n"
    "def summarize(values):\n    total = 0\n    count = 0\n    for v in values:\n"
    "        if v is None:\n            continue\n        total += v\n        count += 1\n"
    "    mean = total / count if count else 0.0\n    return {'total': total, 'count': count,"
    " 'mean': mean}\n"
)
FREE_FORM = [
    "Tell me a short story about a lighthouse keeper.",
    "What are three good habits for learning a new language?",
    "Describe the water cycle to a ten-year-old.",
    "Write a friendly email inviting a colleague to lunch.",
]


def prompt_sets(engine: LLMEngine, bs: int, ctx: int) -> dict[str, list]:
    if engine.tokenizer is not None:
        code = [CODE_EDIT] * bs
        free = [FREE_FORM[i % len(FREE_FORM)] for i in range(bs)]
        return {"code_edit": code, "free_form": free}
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(0, vocab, (64,), generator=g)
    code = [motif.repeat(ctx // 64 + 1)[:ctx].tolist() for _ in range(bs)]
    free = [torch.randint(0, vocab, (ctx,), generator=g).tolist() for _ in range(bs)]
    return {"code_edit": code, "free_form": free}


def measure(engine: LLMEngine, prompts: list, max_tokens: int) -> dict:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, sp)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting \
            or engine._inbox:
        engine.step()
    before = dict(engine.stats, accepted_per_pos=list(engine.stats["accepted_per_pos"]))
    tokens = steps = 0
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        tokens += sum(len(o.new_token_ids) for o in outs)
        steps += 1
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    drafts = engine.stats["num_drafts"] - before["num_drafts"]
    accepted = engine.stats["num_accepted_tokens"] - before["num_accepted_tokens"]
    proposed = engine.stats["num_draft_tokens"] - before["num_draft_tokens"]
    per_pos = [a - b for a, b in zip(engine.stats["accepted_per_pos"],
                                     before["accepted_per_pos"], strict=True)]
    bs = len(prompts)
    return {
        "steps": steps,
        "ms_per_step": dt / max(steps, 1) * 1e3,
        "tokens_per_s": tokens / dt,
        "tokens_per_request_step": tokens / max(steps, 1) / bs,
        "verify_steps_with_drafts": drafts,
        "draft_tokens": proposed,
        "accepted_tokens": accepted,
        "accept_len_mean": (accepted + drafts) / drafts if drafts else None,
        "acceptance_rate_per_pos": [a / drafts for a in per_pos] if drafts else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens (random presets)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    max_bs = max(sizes)
    results = []
    shape = None
    for arm in ("plain", "ngram", "ngram_fixed_k"):
        spec = SpecConfig(method=None if arm == "plain" else "ngram", num_draft_tokens=args.k,
                          adaptive=arm == "ngram")
        engine = LLMEngine(EngineConfig(
            model=args.model, device=args.device, dtype=args.dtype,
            cache=CacheConfig(kv_cache_tokens=max_bs * (args.context + args.max_tokens + 600)),
            scheduler=SchedulerConfig(max_num_seqs=max_bs, max_num_batched_tokens=4096,
                                      max_model_len=args.context + args.max_tokens + 512),
            spec=spec))
        shape = model_shape(engine.model_config)
        for bs in sizes:
            for name, prompts in prompt_sets(engine, bs, args.context).items():
                measure(engine, prompts[:1], 8)  # warm-up
                r = measure(engine, prompts, args.max_tokens)
                r.update(arm=arm, batch_size=bs, prompts=name)
                results.append(r)
                print(f"{arm:14s} bs={bs:3d} {name:10s} {r['ms_per_step']:8.3f} ms/step "
                      f"{r['tokens_per_s']:9.1f} tok/s  accept_len={r['accept_len_mean']}",
                      flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    device = (torch.cuda.get_device_name() if (args.device or "cuda") == "cuda"
              and torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)")
    out = {
        "benchmark": "speculative_step",
        **run_header(device),
        "model": args.model,
        "model_shape": shape,
        "k": args.k,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
