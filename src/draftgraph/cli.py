"""`draftgraph generate | serve | bench` — the command-line entry points.

One grammar for every subcommand: the model as the first positional or `--model`, every flag
with help and its default shown, the subcommand's usage on an error, and arguments checked
before the model loads. The engine flags live in `draftgraph.flags`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from importlib import metadata

from draftgraph.flags import (
    Formatter,
    add_engine_args,
    add_model_args,
    apply_process_flags,
    engine_config_from_args,
    looks_like_model,
    resolve_model,
    usage_error,
)

DEFAULT_PROMPT = "Write a haiku about graphs."


def version() -> str:
    try:
        return metadata.version("draftgraph")
    except metadata.PackageNotFoundError:
        return "unknown"


# ---- generate -------------------------------------------------------------------------------

def add_generate_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("prompts", nargs="*", metavar="PROMPT",
                   help="prompts (default: one, 'Write a haiku about graphs.'); the first "
                        "is the model instead when it names one ('default', random:<preset>, "
                        "a .gguf path or a directory): `generate MODEL PROMPT`")
    add_model_args(g, positional=False)
    add_engine_args(g)
    s = g.add_argument_group("sampling and output")
    s.add_argument("--max-tokens", type=int, default=128,
                   help="tokens to generate per prompt; the prompt plus these must fit in "
                        "--max-model-len (an error otherwise, as in the server)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--top-k", type=int, default=-1, help="-1 or 0 keeps every token")
    s.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this times the likeliest one (0: off)")
    s.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: drawn from --engine-seed)")
    s.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--raw", action="store_true", help="no chat template")
    s.add_argument("--prompts-file",
                   help='JSONL file, one {"prompt": "..."} per line (added after PROMPTs)')
    s.add_argument("--prompt-ids", action="append", metavar="ID,ID,...",
                   help="a prompt given as token ids, e.g. 1,2,3 (repeatable; for models "
                        "without a tokenizer such as random:<preset>)")
    s.add_argument("--json", action="store_true",
                   help="one JSON object per prompt on stdout, nothing streamed")


def split_model_positional(args: argparse.Namespace) -> None:
    """`generate MODEL PROMPT...`: move a first positional that names a model to model_pos."""
    args.model_pos = None
    if args.prompts and looks_like_model(args.prompts[0]):
        args.model_pos = args.prompts.pop(0)


def _parse_ids(text: str) -> list[int]:
    try:  # spaces around the commas are fine; ids apart by spaces alone or empty items are not
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected comma-separated integers, "
                         "e.g. 1,2,3") from None
    if not ids or min(ids) < 0:
        raise ValueError(f"--prompt-ids {text!r}: expected non-negative token ids, e.g. 1,2,3")
    return ids


def read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    """Text prompts (positional, then --prompts-file) and token-id prompts (--prompt-ids);
    ValueError for an empty prompt or an unreadable file."""
    prompts: list[str | list[int]] = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        prompts.append(json.loads(line)["prompt"])
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise ValueError(f"{args.prompts_file}:{n}: expected a JSON object "
                                         f'like {{"prompt": "..."}} ({e})') from None
        except OSError as e:
            raise ValueError(f"cannot read --prompts-file: {e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompts-file {args.prompts_file} is not UTF-8 text: {e}") \
                from None
        if len(prompts) == len(args.prompts):
            raise ValueError(f"--prompts-file {args.prompts_file}: no prompts (expected one "
                             '{"prompt": "..."} a line)')
    for i, p in enumerate(prompts, 1):
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"prompt {i} is empty" if isinstance(p, str) else
                             f"prompt {i} is not a string: {p!r}")
    prompts += [_parse_ids(t) for t in args.prompt_ids or []]
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    return prompts


def _check_before_loading(args: argparse.Namespace, prompts: list) -> None:
    """What can be checked without the weights: a model without a tokenizer given text, a
    --max-tokens that cannot fit in --max-model-len."""
    from draftgraph.models.loader import missing_tokenizer_reason

    if any(isinstance(p, str) for p in prompts):
        reason = missing_tokenizer_reason(resolve_model(args))
        if reason:
            raise ValueError(f"{reason}: pass prompts as token ids (--prompt-ids 1,2,3)")
    if args.max_model_len is not None and args.max_tokens >= args.max_model_len:
        raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in "
                         f"--max-model-len {args.max_model_len}")


def encode_prompts(engine, prompts: list, max_tokens: int, raw: bool) -> list[list[int]]:
    """Token ids of every prompt; the server's rule for max_tokens (EngineError when the
    prompt plus max_tokens overflow the context: never a silent cap)."""
    from draftgraph.engine.engine import EngineError

    out = []
    for i, p in enumerate(prompts, 1):
        ids = engine.encode_prompt(p, use_chat_template=not raw)
        room = engine.max_model_len - len(ids)
        if max_tokens > room:
            raise EngineError(f"prompt {i} has {len(ids)} tokens and --max-tokens is "
                              f"{max_tokens}; the model's context is {engine.max_model_len} "
                              f"tokens (--max-model-len): ask for at most {room}")
        out.append(ids)
    return out


def summary_line(outputs: list, seconds: float, speculating: bool = False) -> str:
    """One line for stderr: tokens, tokens/s, first-token time, accept length if speculating
    (tokens gained per verify step, drafts accepted + 1)."""
    tokens = sum(len(o.token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    ttfts = [o.metrics["ttft"] for o in outputs if o.metrics.get("ttft") is not None]
    parts = [f"{len(outputs)} prompt{'s' if len(outputs) != 1 else ''} ({prompt_tokens} "
             f"tokens): {tokens} tokens in {seconds:.2f} s, {tokens / max(seconds, 1e-9):.1f} "
             "tok/s"]
    if ttfts:
        parts.append(f"first token after {min(ttfts):.2f} s")
    steps = sum(o.metrics.get("verify_steps", 0) for o in outputs)
    if steps:
        accepted = sum(o.metrics.get("accepted_tokens", 0) for o in outputs)
        parts.append(f"accept length {(accepted + steps) / steps:.2f} over {steps} "
                     "verify steps")
    elif speculating:
        parts.append("accept length n/a (no drafts proposed)")
    return "draftgraph: " + ", ".join(parts)


def cmd_generate(args: argparse.Namespace) -> int:
    from draftgraph.engine.engine import LLMEngine
    from draftgraph.engine.sampling import SamplingParams

    try:  # everything that needs no model, before the model loads
        if args.top_k < -1:
            raise ValueError(f"--top-k must be -1 or 0 (no limit) or a positive integer, got "
                             f"{args.top_k}")
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop or [],
            ignore_eos=args.ignore_eos,
        )
        config = engine_config_from_args(args)
        prompts = read_prompts(args)
        _check_before_loading(args, prompts)
        # NOTE: a batch queues every prompt at once: --max-waiting bounds a server's queue
        sched = config.scheduler
        sched.max_waiting = max(sched.max_waiting, len(prompts) - sched.max_num_seqs)
    except (ValueError, FileNotFoundError) as e:
        usage_error(args, str(e))
    apply_process_flags(args)
    try:
        engine = LLMEngine(config)
        if engine.tokenizer is None and any(isinstance(p, str) for p in prompts):
            from draftgraph.models.loader import missing_tokenizer_reason

            raise ValueError(f"{missing_tokenizer_reason(engine.loaded.source, loaded=True)}: "
                             "pass prompts as token ids (--prompt-ids 1,2,3)")
        encoded = encode_prompts(engine, prompts, args.max_tokens, args.raw)
        t0 = time.perf_counter()
        ids = [engine.add_request(e, params) for e in encoded]
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    has_text = engine.tokenizer is not None
    stream = not args.json and len(prompts) == 1 and has_text
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if stream and out.delta_text:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
            if out.finished:
                final[out.request_id] = out
    seconds = time.perf_counter() - t0
    outputs = [final[rid] for rid in ids]
    rc = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        if args.json:
            print(json.dumps({
                "prompt": prompt,
                "text": out.text,
                "token_ids": out.token_ids,
                "prompt_token_ids": out.prompt_token_ids,
                "finish_reason": out.finish_reason,
                "metrics": out.metrics,
            }))
        elif stream:
            sys.stdout.write("\n")
        else:
            shown = out.text if has_text else " ".join(map(str, out.token_ids))
            print(f"--- {prompt!r}\n{shown}")
        if out.error:
            print(f"error: request failed: {out.error}", file=sys.stderr)
            rc = 1
    print(summary_line(outputs, seconds, config.spec.method is not None), file=sys.stderr,
          flush=True)
    return rc


# ---- the parser -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftgraph", description=__doc__.split("\n")[0],
                                     formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=f"draftgraph {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text for prompts", formatter_class=Formatter,
                       description="Generate text for prompts; a one-line summary (tokens, "
                                   "tokens/s, accept length) goes to stderr.")
    add_generate_args(g)
    g.set_defaults(func=cmd_generate, _parser=g)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=Formatter,
                       description="Serve MODEL (or --model) over an OpenAI-compatible API.")
    add_model_args(s, positional=True)
    add_engine_args(s)
    s.set_defaults(_parser=s, enable_prefix_caching=None)  # on (flags.py)
    try:
        from draftgraph.server.cli import add_serve_args, cmd_serve

        add_serve_args(s)
        s.set_defaults(func=cmd_serve)
    except ImportError as e:
        s.set_defaults(func=lambda a, e=e: _missing(e, "server"))

    t = sub.add_parser("train-drafter", help="train a chain head for a model",
                       formatter_class=Formatter,
                       description="Regenerate responses with the target, then train an "
                                   "EAGLE-3-style chain head against its forward.")
    t.set_defaults(_parser=t)
    from draftgraph.train.cli import add_train_args

    add_train_args(t)

    b = sub.add_parser("bench", help="benchmarks against an OpenAI-compatible server",
                       formatter_class=Formatter)
    b.set_defaults(_parser=b)
    try:
        from draftgraph.bench.cli import add_bench_args

        add_bench_args(b)
    except ImportError as e:
        b.set_defaults(func=lambda a, e=e: _missing(e, "bench"))
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse; an unknown flag is reported with the usage of the subcommand it was given to."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "generate" and not any(x.startswith("-") for x in extra):
        args.prompts += extra  # prompts after options: `generate MODEL --max-tokens 2 PROMPT`
        extra = []
    if extra:
        usage_error(args, f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "generate":
        split_model_positional(args)
    try:
        resolve_model(args)
    except ValueError as e:
        usage_error(args, str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


def _missing(e: ImportError, extra: str) -> int:
    print(f"error: {e}. Install with: pip install 'draftgraph[{extra}]'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
