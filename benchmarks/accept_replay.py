"""Why a head's training-time estimate overshoots the engine's accept length (issue 14).

    python benchmarks/accept_replay.py --head src/draftgraph/heads/smollm2-135m-chain \\
        --sets benchmarks/data/accept_sets_smollm2_ids.json --num-prompts 10 --out r.json

Per prompt set (greedy, k = 4, the default model, one batch, every prompt prefilled in the
first step): the engine's accept length with the head; the same walked offline along the
engine's outputs from the training loss's own predictions (`train.chain.replay_acceptance`,
as `train-drafter` now scores its held-out set); the estimate from per-level agreement with
independent levels (`expected_accept_length`, what it scored before); and the level-0
agreement over every response position against at the positions where rounds begin. A block
head (`--head` of kind block: block_size - 1 drafts, its own confidence cut) is walked by
`train.block.replay_blocks` from every position's block instead; its estimate is the mean
leading matches of blocks anchored anywhere, as `train-drafter --kind block` scored it.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _meta import model_shape, run_header
from bench_accept import pick

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.chain_head import ChainHead
from draftgraph.models.heads import head_kind, load_head
from draftgraph.models.loader import load_model
from draftgraph.train.block import replay_blocks
from draftgraph.train.chain import expected_accept_length, replay_acceptance, ttt_loss
from draftgraph.train.loop import OracleBatch, Sequence, TargetOracle

K = 4


def walk_blocks(head, model, oracle, seqs: list[Sequence]) -> dict:
    """`replay_blocks` along each sequence, its statistics summed: num_drafts,
    num_accepted_tokens, steps."""
    walked = {"num_drafts": 0, "num_accepted_tokens": 0, "steps": 0}
    for s in seqs:
        streams, logits = oracle([s.ids])
        w = replay_blocks(head, model.embed_tokens.weight, model.lm_head_weight,
                          OracleBatch([s], streams, logits, [0]), 1024)[0]
        for key in walked:
            walked[key] += w[key]
    return walked


def replay_block_set(engine, head, oracle, prompts, outs, s) -> dict:
    """The engine's block statistics against `replay_blocks` along its outputs."""
    walked = walk_blocks(head, engine.model, oracle,
                         [Sequence(list(p) + o.token_ids, len(p))
                          for p, o in zip(prompts, outs, strict=True)])
    return {"num_prompts": len(prompts),
            "engine_accept_length": 1 + s["num_accepted_tokens"] / max(s["num_drafts"], 1),
            "engine_drafting_rounds": s["num_drafts"],
            "replayed_accept_length": 1 + walked["num_accepted_tokens"]
            / max(walked["num_drafts"], 1),
            "replayed_drafting_rounds": walked["num_drafts"],
            "replayed_tokens_per_step": 1 + walked["num_accepted_tokens"] / walked["steps"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--head", required=True)
    ap.add_argument("--sets", required=True)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--pick", choices=["spread", "first"], default="spread",
                    help="as bench_accept.py's (first: the runs before 2026-12-03)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    loaded = load_model(a.model, device="cpu")
    model = loaded.model
    head = load_head(a.head, model.config)
    lm_w = model.lm_head_weight.detach()  # [V, H]; a chain head's [V', H] rows below
    if isinstance(head, ChainHead):
        lm_w = head.lm_head_weight(lm_w)
    with open(a.sets) as f:
        sets = json.load(f)
    out = {"benchmark": "accept_replay", **run_header(), "model": a.model, "head": a.head,
           "k": K, "max_tokens": a.max_tokens, "model_shape": model_shape(loaded.config),
           "sets": {}}
    block = head_kind(a.head) == "block"
    for name, prompts in sets.items():
        prompts = pick(prompts, a.num_prompts, a.pick)
        engine = LLMEngine(EngineConfig(
            model=a.model, device="cpu",
            cache=CacheConfig(kv_cache_tokens=len(prompts) * 1200),
            scheduler=SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=16384),
            spec=SpecConfig(method="block", draft_head=a.head, adaptive=False) if block else
            SpecConfig(method="chain", draft_head=a.head, num_draft_tokens=K,
                       adaptive=False)), loaded=loaded)
        outs = engine.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0,
                                                       ignore_eos=True))
        s = engine.stats
        oracle = TargetOracle(model, head.head_config.hidden_layer_ids, 2048, 1, 2048, "cpu",
                              torch.float32, "torch")
        if block:
            out["sets"][name] = r = replay_block_set(engine, head, oracle, prompts, outs, s)
            print(name, json.dumps(r), flush=True)
            del engine
            continue
        walked = {"num_drafts": 0, "num_accepted_tokens": 0, "accepted_per_pos": [0] * K}
        agree_sum, positions, start_hits = [0.0] * K, 0, 0
        for prompt, o in zip(prompts, outs, strict=True):
            ids = list(prompt) + o.token_ids
            streams, logits = oracle([ids])
            mask = torch.zeros(1, len(ids), dtype=torch.bool)
            mask[0, len(prompt) - 1 : len(ids) - 1] = True
            with torch.no_grad():
                _, agree, preds = ttt_loss(head, model.embed_tokens.weight, lm_w, streams[None],
                                           logits[None], torch.tensor([ids]), mask, K, 0.8)
            n = int(mask.sum())
            agree_sum = [x + y * n for x, y in zip(agree_sum, agree, strict=True)]
            positions += n
            w = replay_acceptance(preds[:, 0], ids, len(prompt), K)
            for key in ("num_drafts", "num_accepted_tokens"):
                walked[key] += w[key]
            walked["accepted_per_pos"] = [x + y for x, y in zip(
                walked["accepted_per_pos"], w["accepted_per_pos"], strict=True)]
            start_hits += w["accepted_per_pos"][0]
        agree = [x / positions for x in agree_sum]
        r = {"num_prompts": len(prompts),
             "engine_accept_length": 1 + s["num_accepted_tokens"] / s["num_drafts"],
             "engine_per_position": [x / s["num_drafts"] for x in s["accepted_per_pos"]],
             "replayed_accept_length": 1 + walked["num_accepted_tokens"] / walked["num_drafts"],
             "replayed_per_position": [x / walked["num_drafts"]
                                       for x in walked["accepted_per_pos"]],
             "agreement_per_level": agree,
             "estimate_independent_levels": expected_accept_length(agree),
             "level0_agreement_at_round_starts": start_hits / walked["num_drafts"]}
        out["sets"][name] = r
        print(name, json.dumps({k: (round(v, 3) if isinstance(v, float) else
                                    [round(x, 3) for x in v] if isinstance(v, list) else v)
                                for k, v in r.items()}), flush=True)
        del engine
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
