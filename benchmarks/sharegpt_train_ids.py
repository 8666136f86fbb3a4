"""ShareGPT prompts as token ids, for `train-drafter --data IDS.json.gz` (the train split) and
`--eval-data IDS.json.gz` (the held-out split) on a machine without the dataset package (the
GPU machine): `sharegpt_prompts(split, turns=...)` encoded with the engine's `encode_prompt`
(the chat template), as `train/cli.py` does, keeping prompts of at most --max-len -
--max-new-tokens tokens (those the context cannot hold at all are refused by the engine and
counted) and none of the prompts of `--exclude` (a JSON {set: [ids, ...]} file: the acceptance
benchmark's prompts stay out of the held-out set a run selects its head by). With
--fit-history a prompt over the limit loses its oldest exchanges until it fits
(`train.data.fit_history`: the later turns of long conversations, which the limit alone
drops); --only-fitted keeps just those, the complement of the same command without the flag.
--code takes the raw-text completion prompts of `train.data.sharegpt_code_prompts` instead
(the opening lines of the assistant turns' code blocks, no chat template), for a head that
must draft code continued from a bare prompt as HumanEval's are. Prints the count and the
sha256 of the ids' JSON (the value the head READMEs quote).

    python benchmarks/sharegpt_train_ids.py --model default --turns all \
        --out .traindata_all/sharegpt_train_all_ids.json.gz
    python benchmarks/sharegpt_train_ids.py --split held_out --limit 256 \
        --exclude benchmarks/data/accept_sets_smollm2_ids.json --out .traindata_all/eval.json.gz
    python benchmarks/sharegpt_train_ids.py --turns all --max-len 1024 --fit-history \
        --only-fitted --out .traindata_fit/sharegpt_train_fitted_ids.json.gz
    python benchmarks/sharegpt_train_ids.py --code --max-len 1024 \
        --out .traindata_code/sharegpt_train_code_ids.json.gz
    python benchmarks/sharegpt_train_ids.py --code --max-len 1024 --skip 10000 \
        --out .traindata_code/sharegpt_train_code_rest_ids.json.gz  # past --limit 10000
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys

from draftgraph.config import EngineConfig, SchedulerConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.errors import EngineError
from draftgraph.train.data import fit_history, sharegpt_code_prompts, sharegpt_prompts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--turns", choices=["first", "all"], default="all")
    ap.add_argument("--max-len", type=int, default=640)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="keep at most this many prompts")
    ap.add_argument("--skip", type=int, default=0, help="drop the first N prompts kept (an "
                    "earlier run's --limit N) before --limit")
    ap.add_argument("--split", choices=["train", "held_out"], default="train")
    ap.add_argument("--exclude", default=None, help="JSON {set: [prompt ids, ...]}: prompts "
                    "to leave out")
    ap.add_argument("--fit-history", action="store_true", help="drop a long prompt's oldest "
                    "exchanges until it fits, instead of dropping the prompt")
    ap.add_argument("--only-fitted", action="store_true", help="with --fit-history: keep only "
                    "the prompts that lost history")
    ap.add_argument("--code", action="store_true", help="raw-text completions cut from the "
                    "assistant turns' code blocks instead of chat turns")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.only_fitted and not a.fit_history:
        ap.error("--only-fitted needs --fit-history")
    if a.code and a.fit_history:
        ap.error("--fit-history drops chat history: --code prompts have none")
    engine = LLMEngine(EngineConfig(model=a.model, device="cpu",
                                    scheduler=SchedulerConfig(max_model_len=a.max_len)))
    limit = a.max_len - a.max_new_tokens
    messages = (sharegpt_code_prompts(a.split) if a.code
                else sharegpt_prompts(a.split, turns=a.turns))
    excluded = set()
    if a.exclude:
        with open(a.exclude) as f:
            excluded = {tuple(p) for ps in json.load(f).values() for p in ps}
    ids, refused, too_long, dropped, fitted = [], 0, 0, 0, 0
    for m in messages:
        try:
            p = engine.encode_prompt(m, use_chat_template=not a.code)
        except EngineError:  # longer than the context (or not valid text)
            p = None
        cut = 0
        if (p is None or len(p) > limit) and a.fit_history:
            fitted_p, cut = fit_history(m, engine.encode_prompt, limit)
            p = p if fitted_p is None else fitted_p  # unfittable: counted as before
        if p is None:
            refused += 1
            continue
        if len(p) > limit:
            too_long += 1
            continue
        fitted += cut > 0
        if a.only_fitted and not cut:
            continue
        if tuple(p) in excluded:
            dropped += 1
            continue
        ids.append(p)
    ids = ids[a.skip:][: a.limit]
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    blob = json.dumps(ids)
    with gzip.open(a.out, "wt") as f:
        f.write(blob)
    print(json.dumps({"split": a.split, "turns": "code" if a.code else a.turns,
                      "conversation_prompts": len(messages),
                      "refused_by_engine": refused, "over_limit": too_long,
                      "excluded": dropped, "fitted": fitted, "skipped": a.skip,
                      "kept": len(ids), "tokens": sum(map(len, ids)), "max_prompt_len": limit,
                      "sha256": hashlib.sha256(blob.encode()).hexdigest(),
                      "file_bytes": os.path.getsize(a.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
