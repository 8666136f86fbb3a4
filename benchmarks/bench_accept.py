"""Acceptance of a drafter on real prompts, against plain decoding and n-gram in the same run:
per prompt set, accept length (accepted drafts per verify step + 1) overall and the acceptance
rate per draft position, tokens/s, and how many greedy outputs equal plain decoding.

    python benchmarks/bench_accept.py --model default --head src/draftgraph/heads/smollm2-chain \
        --sets benchmarks/data/accept_sets_smollm2_ids.json --num-prompts 20 --out r.json
    python benchmarks/bench_accept.py --model default --arms plain,block,ngram \
        --block-head DIR --sets benchmarks/data/accept_sets_smollm2_ids.json --out r.json

accept_length counts the verify steps that drafted (accepted drafts per step + 1);
tokens_per_step counts every speculative step, those where a block head's confidence cut left
no draft included (DSpark's accepted length).

An arm `chain@DIR` (or `block@DIR`) drafts with the head directory DIR instead of --head
(--block-head), so several heads run in one process on the same prompts; drafters run k drafts
every step, `chain+adaptive` (`ngram+adaptive`, ...) with the engine's default adaptive draft
length instead, `chain+4x5:16` with draft trees (width 4, depth 5, 16 verified nodes:
`--speculative-tree`); a prefix `dot:` or `cublas:` runs the arm with `--tensor-core-rows`
on or off (GPU: products of 2 .. 128 rows on the tensor-core matmul or on cuBLAS; else the
engine's default, "auto"):

    python benchmarks/bench_accept.py --arms plain,chain@runs/a/head,chain@runs/b/head ...

`--sets` is JSON {set name: [[prompt token ids], ...]} (chat-templated MT-Bench first turns,
HumanEval, held-out ShareGPT for the default model). Greedy unless --temperature. A run of
fewer prompts than a set holds takes them evenly spaced over it (`--pick spread`; MT-Bench's
first 20, which the runs before 2026-12-03 took, are its writing and role-play questions).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from _meta import model_shape, run_header

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig, TreeShape
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.loader import load_model


def pick(prompts: list, n: int, how: str) -> list:
    """n of the prompts: the first n, or n evenly spaced over the whole list."""
    if how == "first" or n >= len(prompts):
        return prompts[:n]
    return [prompts[i * len(prompts) // n] for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--head", default=None, help="the chain arm's head directory (or random)")
    ap.add_argument("--block-head", default=None, help="the block arm's head directory")
    ap.add_argument("--block-size", type=int, default=None, help="block arm (default: the "
                    "head's)")
    ap.add_argument("--sets", required=True)
    ap.add_argument("--only", default=None, help="comma-separated set names")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--pick", choices=["spread", "first"], default="spread",
                    help="spread: num-prompts evenly spaced over the set (MT-Bench's questions "
                    "come in category order: its first 20 are writing and role play); first: "
                    "the set's first num-prompts (the runs before 2026-12-03)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=4,
                    help="chain / n-gram drafts a step; an arm with a tree: the drafts its "
                    "steps without one verify (flags.AUTO_TREE_CHAIN is the CLI's)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--arms", default="plain,chain,ngram")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quantization", default="none", choices=["none", "int4"],
                    help="every arm's target (CPU; the model is packed once, shared)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    arms = a.arms.split(",")
    if "chain" in arms and a.head is None:
        ap.error("the chain arm needs --head (or name the head: chain@DIR)")
    if "block" in arms and a.block_head is None:
        ap.error("the block arm needs --block-head (or name the head: block@DIR)")
    loaded = load_model(a.model, device=a.device or "cpu", **({"dtype": __import__(
        "torch").__dict__[a.dtype]} if a.dtype else {}))
    with open(a.sets) as f:
        sets = json.load(f)
    names = a.only.split(",") if a.only else list(sets)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=0)
    out = {"benchmark": "accept", **run_header(a.device or "cpu"), "model": a.model,
           "head": a.head, "block_head": a.block_head, "block_size": a.block_size, "k": a.k,
           "max_tokens": a.max_tokens, "batch": a.batch, "quantization": a.quantization,
           "pick": a.pick,
           "temperature": a.temperature, "model_shape": model_shape(loaded.config), "sets": {}}
    for name in names:
        prompts = pick(sets[name], a.num_prompts, a.pick)
        res, plain_tokens, plain_key = {}, None, None
        out["sets"][name] = {"num_prompts": len(prompts)}
        for arm in arms:
            # an arm named twice (plain before and after, say) is kept twice: arm, arm#2, ...
            seen = sum(k.split("#")[0] == arm for k in res)
            arm_key = arm if seen == 0 else f"{arm}#{seen + 1}"
            # "dot:<arm>" / "cublas:<arm>": --tensor-core-rows on / off (else the default)
            rows, _, bare = arm.partition(":") if arm.split(":")[0] in ("dot", "cublas") \
                else ("", "", arm)
            kind, _, head = bare.partition("@")
            kind, _, mode = kind.partition("+")  # "+adaptive": the engine's default policy
            adaptive = mode == "adaptive"
            tree = TreeShape.parse(mode) if ":" in mode else None  # "+WxD:N": draft trees
            # only this arm's kind is built: a tree is checked against its drafter's bound
            spec = SpecConfig(**{
                "plain": {},
                "chain": dict(method="chain", draft_head=head or a.head, num_draft_tokens=a.k,
                              adaptive=adaptive, tree=tree),
                "block": dict(method="block", draft_head=head or a.block_head,
                              block_size=a.block_size, adaptive=adaptive, tree=tree,
                              num_draft_tokens=a.k),  # with a tree: its chain steps' drafts
                "ngram": dict(method="ngram", num_draft_tokens=a.k, adaptive=adaptive)}[kind])
            engine = LLMEngine(EngineConfig(
                model=a.model, device=a.device, dtype=a.dtype, quantization=a.quantization,
                cache=CacheConfig(kv_cache_tokens=a.batch * (max(map(len, prompts))
                                                             + a.max_tokens + 64)),
                scheduler=SchedulerConfig(max_num_seqs=a.batch, max_num_batched_tokens=4096),
                tensor_core_rows={"dot": "on", "cublas": "off"}.get(rows, "auto"),
                spec=spec), loaded=loaded)
            # warm up (first-call kernel compiles, cuBLAS picks) outside the timed run
            engine.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=a.temperature,
                                                        seed=1))
            for key, v in engine.stats.items():  # in place: the policy holds this dict
                engine.stats[key] = [0] * len(v) if isinstance(v, list) else 0
            t0 = time.perf_counter()
            outs = engine.generate(prompts, sp)
            sec = time.perf_counter() - t0
            tokens = [o.token_ids for o in outs]
            s = engine.stats
            r = {"seconds": sec, "tokens": sum(map(len, tokens)),
                 "tokens_per_s": sum(map(len, tokens)) / sec}
            if kind == "plain":
                if plain_tokens is None:  # the first plain arm is what the others match
                    plain_tokens, plain_key = tokens, arm_key
                else:
                    r["equal_to_plain"] = sum(x == y for x, y in zip(tokens, plain_tokens,
                                                                     strict=True))
            else:
                steps = s["num_drafts"]
                # every step after a request's prefill emits 1 + its accepted drafts
                all_steps = r["tokens"] - len(prompts) - s["num_accepted_tokens"]
                r.update(accept_length=1 + s["num_accepted_tokens"] / max(steps, 1),
                         tokens_per_step=1 + s["num_accepted_tokens"] / max(all_steps, 1),
                         verify_steps=steps,
                         acceptance_per_position=[x / max(steps, 1)
                                                  for x in s["accepted_per_pos"]])
                if plain_tokens is not None:
                    r["equal_to_plain"] = sum(x == y for x, y in zip(tokens, plain_tokens,
                                                                     strict=True))
                    r["speedup"] = r["tokens_per_s"] / res[plain_key]["tokens_per_s"]
            res[arm_key] = r
            del engine
            out["sets"][name][arm_key] = r
            with open(a.out, "w") as f:  # after every arm: a run cut short keeps what it has
                json.dump(out, f, indent=1)
            print(name, arm_key, json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                         for k, v in r.items() if k != "tokens"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
