"""`draftgraph generate | serve | bench` — the command-line entry points."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        p.add_argument("model", nargs="?", default="default",
                       help="'default', a .gguf file, a HF directory or random:<preset>")
    else:
        p.add_argument("--model", default="default",
                       help="'default' (SmolLM2-135M-Instruct), a .gguf file, a Hugging Face "
                            "directory, or random:<preset> (smollm2-135m, llama-3.2-1b, "
                            "llama-3.1-8b)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda if available")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--no-graphs", action="store_true", help="run every step eagerly")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="read each decode step's tokens before launching the next")
    p.add_argument("--attention-backend", choices=["torch", "triton"], default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-waiting", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--speculative", choices=["ngram"], default=None)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--no-adaptive-draft", action="store_true",
                   help="keep the draft length fixed even when acceptance is low")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="split the model over N processes (one GPU each; gloo on --device cpu)")
    p.add_argument("--engine-seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        use_graphs=not args.no_graphs,
        async_scheduling=not args.no_async_scheduling,
        attention_backend=args.attention_backend,
        seed=args.engine_seed,
        tensor_parallel_size=args.tensor_parallel_size,
        cache=CacheConfig(page_size=args.page_size, kv_cache_tokens=args.kv_cache_tokens),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_waiting=args.max_waiting,
                                  max_model_len=args.max_model_len),
        spec=SpecConfig(method=args.speculative, num_draft_tokens=args.num_draft_tokens,
                        ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                        adaptive=not args.no_adaptive_draft),
    )


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                        prompts.append(obj["prompt"])
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise SystemExit(f"{args.prompts_file}:{n}: expected a JSON object "
                                         f'like {{"prompt": "..."}} ({e})') from None
        except OSError as e:
            raise SystemExit(f"cannot read --prompts-file: {e}") from None
    if not prompts:
        prompts = ["Write a haiku about graphs."]
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from draftgraph.engine.engine import LLMEngine
    from draftgraph.engine.sampling import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos,
        )
        config = engine_config_from_args(args)
        prompts = _read_prompts(args)
        engine = LLMEngine(config)
        ids = [engine.add_request(p, params, use_chat_template=not args.raw) for p in prompts]
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stream = not args.json and len(prompts) == 1
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if stream and out.delta_text:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
            if out.finished:
                final[out.request_id] = out
    for rid, prompt in zip(ids, prompts, strict=True):
        out = final[rid]
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
            print(f"--- {prompt!r}\n{out.text}")
        if out.error:
            print(f"error: request failed: {out.error}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftgraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts")
    g.add_argument("prompts", nargs="*", metavar="PROMPT")
    add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--prompts-file", help='JSONL file, one {"prompt": ...} per line')
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s, model_positional=True)
    try:
        from draftgraph.server.cli import add_serve_args, cmd_serve

        add_serve_args(s)
        s.set_defaults(func=cmd_serve)
    except ImportError as e:
        s.set_defaults(func=lambda a, e=e: _missing(e, "server"))

    b = sub.add_parser("bench", help="benchmarks against an OpenAI-compatible server")
    try:
        from draftgraph.bench.cli import add_bench_args

        add_bench_args(b)
    except ImportError as e:
        b.set_defaults(func=lambda a, e=e: _missing(e, "bench"))

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


def _missing(e: ImportError, extra: str) -> int:
    print(f"error: {e}. Install with: pip install 'draftgraph[{extra}]'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
