"""`draftgraph bench serve | compare`.

Results (JSON, and PNG with --plot) go to --result-dir, by default `results/` in draftgraph's
cache directory (`~/.cache/draftgraph/results`, or under $XDG_CACHE_HOME / $DRAFTGRAPH_CACHE_DIR),
never into the package or a checkout unless asked. The load's size defaults to the server's
device: 100 prompts and 256-token outputs on a GPU, 8 prompts and 64-token outputs on a CPU
(about a minute for three concurrency levels on two cores).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import sys

from draftgraph.flags import Formatter

logger = logging.getLogger(__name__)


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name to send (default: the server's "
                   "first from /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("DRAFTGRAPH_API_KEY"),
                   help="bearer key of the server (default: $DRAFTGRAPH_API_KEY)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="OpenAI endpoint the requests go to")
    p.add_argument("--dataset", choices=["random", "humaneval", "jsonl"], default="random",
                   help="random token ids, HumanEval prompts, or a JSONL file")
    p.add_argument("--dataset-path", help="JSONL file for --dataset jsonl")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests per run (default: {GPU_DEFAULTS['num_prompts']} on a GPU "
                        f"server, {CPU_DEFAULTS['num_prompts']} on a CPU one)")
    p.add_argument("--random-input-len", type=int, default=128,
                   help="prompt tokens of --dataset random")
    p.add_argument("--random-output-len", type=int, default=None,
                   help="max_tokens of --dataset random (default: "
                        f"{GPU_DEFAULTS['random_output_len']} on a GPU server, "
                        f"{CPU_DEFAULTS['random_output_len']} on a CPU one)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly within ± this fraction")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of --dataset random every prompt starts with, the same for "
                        "all (a shared system prompt: what --enable-prefix-caching reuses)")
    p.add_argument("--random-vocab-size", type=int, default=None,
                   help="token ids drawn below this (default: the server's vocabulary)")
    p.add_argument("--output-len", type=int, default=None,
                   help="max_tokens for humaneval/jsonl prompts (default: "
                        f"{GPU_DEFAULTS['output_len']} on a GPU server, "
                        f"{CPU_DEFAULTS['output_len']} on a CPU one)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--ignore-eos", action="store_true", help="every request runs to max_tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--num-warmups", type=int, default=2, help="requests sent before timing")
    p.add_argument("--client-processes", type=int, default=None,
                   help="processes that send the load, each its share of the requests and "
                        "streams (default: one per 8 streams, at most half the cores: one "
                        "Python client process parses about 10k chunks/s and would be the "
                        "bottleneck of a fast server)")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset's sampling")
    p.add_argument("--result-dir", "--output-dir", dest="result_dir", default=None,
                   help="where the JSON goes (default: results/ in draftgraph's cache "
                        "directory, e.g. ~/.cache/draftgraph/results)")
    p.add_argument("--result-file", default=None, help="default: a name from the run")
    p.add_argument("--device-label", default=None,
                   help="device to record when the server does not report one (/info)")


# the load's size by the server's device (the flags left unset)
GPU_DEFAULTS = {"num_prompts": 100, "output_len": 256, "random_output_len": 128}
CPU_DEFAULTS = {"num_prompts": 8, "output_len": 64, "random_output_len": 32}


def default_result_dir() -> str:
    from draftgraph.models.weight_cache import cache_root

    return str(cache_root() / "results")


def apply_device_defaults(args: argparse.Namespace, device: str | None) -> None:
    """Fill the size flags left unset from the server's device (a GPU's sizes unless it
    reports a CPU or nothing)."""
    table = CPU_DEFAULTS if not device or device.lower().startswith("cpu") else GPU_DEFAULTS
    for key, value in table.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if getattr(args, "result_dir", None) is None:
        args.result_dir = default_result_dir()


def add_bench_args(b: argparse.ArgumentParser) -> None:
    sub = b.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    s = sub.add_parser("serve", help="load an OpenAI-compatible server and measure latency, "
                       "throughput and speculative acceptance", formatter_class=Formatter)
    s.set_defaults(_parser=s)
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    s.add_argument("--max-concurrency", type=int, nargs="+", default=[1],
                   help="one run per value (e.g. 1 4 16)")
    s.add_argument("--plot", action="store_true",
                   help="also write a PNG of latency and throughput vs concurrency")
    _add_load_args(s)
    s.set_defaults(func=cmd_bench_serve)

    c = sub.add_parser("compare", help="A/B two server configurations, run alternately "
                       "(A B B A ...), and report the ratio of a metric with a 95%% CI",
                       formatter_class=Formatter)
    c.set_defaults(_parser=c)
    c.add_argument("--server-model", default="default",
                   help="MODEL argument of `draftgraph serve` for launched servers")
    c.add_argument("--a-args", default="", help="extra `draftgraph serve` flags of A")
    c.add_argument("--b-args", default="", help="extra `draftgraph serve` flags of B")
    c.add_argument("--a-url", default=None, help="use a running server as A (no launch)")
    c.add_argument("--b-url", default=None, help="use a running server as B (no launch)")
    c.add_argument("--rounds", type=int, default=2, help="ABBA rounds: 2·rounds runs")
    c.add_argument("--max-concurrency", type=int, default=1,
                   help="requests in flight in every run")
    c.add_argument("--metric", default="output_throughput",
                   help="summary key to compare (output_throughput, median_tpot_ms, ...)")
    _add_load_args(c)
    c.set_defaults(func=cmd_bench_compare)


def _at_least(flag: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise ValueError(f"{flag} must be >= {low}, got {value}")


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag values no run can use (a ValueError naming the flag); called before any
    request, so a bad value never reaches the load loop (where --max-concurrency 0 would wait
    forever on its semaphore)."""
    from draftgraph.bench.serve import summarize

    concurrencies = args.max_concurrency if isinstance(args.max_concurrency, list) \
        else [args.max_concurrency]
    for conc in concurrencies:
        _at_least("--max-concurrency", conc, 1)
    if args.bench_command == "compare":
        _at_least("--rounds", args.rounds, 1)
        metrics = [k for k, v in summarize([], 1.0).items() if v is None or isinstance(v, float)]
        if args.metric not in metrics:
            raise ValueError(f"--metric {args.metric!r} is not a summary metric; choose one of "
                             f"{', '.join(metrics)}")
    for flag in ("--num-prompts", "--random-input-len", "--random-output-len",
                 "--random-vocab-size", "--output-len", "--client-processes"):
        _at_least(flag, getattr(args, flag[2:].replace("-", "_")), 1)
    _at_least("--num-warmups", args.num_warmups, 0)
    if not args.request_rate > 0:  # NaN too
        raise ValueError(f"--request-rate must be > 0 requests per second (inf, the default, "
                         f"sends every request at once), got {args.request_rate}")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    _at_least("--random-prefix-len", args.random_prefix_len, 0)
    if not 0 <= args.temperature < float("inf"):
        raise ValueError(f"--temperature must be >= 0 and finite, got {args.temperature}")
    if args.dataset == "jsonl" and not args.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path FILE")
    if args.dataset == "random" and args.endpoint == "chat":
        raise ValueError("--dataset random sends token-id prompts, which --endpoint chat cannot "
                         "carry: use --endpoint completions or a text --dataset")


def _requests(args, base_url: str):
    from draftgraph.bench.datasets import load_requests
    from draftgraph.bench.serve import server_info

    info, served, vocab = server_info(base_url, args.api_key)
    apply_device_defaults(args, info.get("device") or args.device_label)
    model = args.model or served
    if model is None:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    if args.dataset == "random" and vocab and (args.random_vocab_size or 0) > vocab:
        raise ValueError(f"--random-vocab-size {args.random_vocab_size} is above the server's "
                         f"vocabulary ({vocab} tokens), which refuses such token ids")
    return info, model, load_requests(args, vocab)


def _config(args) -> dict:
    return {k: (v if isinstance(v, (str, int, float, bool, list, type(None))) else str(v))
            for k, v in vars(args).items()
            if k not in ("func", "api_key") and not k.startswith("_")}


def _command(args) -> str:
    """A command line that repeats this run (every option spelled out; the API key left out)."""
    import shlex

    words = ["draftgraph", "bench", args.bench_command]
    for key, value in vars(args).items():
        if key in ("func", "bench_command", "command", "api_key") or key.startswith("_") \
                or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def _write(args, name: str, payload: dict) -> str:
    result_dir = args.result_dir or default_result_dir()
    os.makedirs(result_dir, exist_ok=True)
    path = os.path.join(result_dir, args.result_file or name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    return path


def _stamp() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from draftgraph.bench.serve import format_failures, format_table, plot_runs, run_benchmark

    base_url = args.base_url.rstrip("/")
    try:
        check_args(args)
        info, model, requests = _requests(args, base_url)
    except Exception as e:  # a bad flag, connection refused, bad dataset, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = []
    for conc in args.max_concurrency:
        try:
            run = asyncio.run(run_benchmark(
                base_url, model, requests, conc, args.request_rate, args.ignore_eos,
                args.endpoint, args.num_warmups, args.api_key, args.temperature, args.seed,
                processes=args.client_processes))
        except Exception as e:  # a failed warm-up request, a client process that died
            print(f"error: the run at --max-concurrency {conc} failed: {e}", file=sys.stderr)
            if not runs:
                return 1
            break
        runs.append(run)
        print(format_table([run]).splitlines()[-1] if len(runs) > 1 else format_table([run]),
              flush=True)
        if run["failed"]:
            print(format_failures(run), file=sys.stderr, flush=True)
    spec = info.get("speculative")
    payload = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": _command(args),
        "device": info.get("device") or args.device_label or "unknown",
        "model": info.get("model") or model,
        "served_model_name": model,
        "server": info,
        "config": _config(args),
        "results": runs,
    }
    name = (f"serve-{args.dataset}-{os.path.basename(str(payload['model'])).replace(':', '-')}"
            f"-{spec or 'plain'}-{_stamp()}.json")
    path = _write(args, name, payload)
    print(f"wrote {path}")
    if args.plot:
        png = os.path.splitext(path)[0] + ".png"
        plot_runs(runs, png, f"{payload['model']} on {payload['device']} "
                  f"({args.dataset}, speculative={spec})")
        print(f"wrote {png}")
    complete = len(runs) == len(args.max_concurrency)
    return 0 if complete and all(r["failed"] == 0 for r in runs) else 1


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from draftgraph.bench.compare import ServerProcess, abba_order, ratio_ci
    from draftgraph.bench.serve import format_failures, run_benchmark

    try:
        check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    values: dict[str, list[float]] = {"A": [], "B": []}
    runs = []
    for label in abba_order(args.rounds):
        url = args.a_url if label == "A" else args.b_url
        extra = args.a_args if label == "A" else args.b_args
        ctx = nullcontext(None) if url else ServerProcess(args.server_model, extra)
        try:
            with ctx as proc:
                base_url = (url or proc.base_url).rstrip("/")
                info, model, requests = _requests(args, base_url)
                summary = asyncio.run(run_benchmark(
                    base_url, model, requests, args.max_concurrency, args.request_rate,
                    args.ignore_eos, args.endpoint, args.num_warmups, args.api_key,
                    args.temperature, args.seed, processes=args.client_processes))
        except Exception as e:
            print(f"error: run {label} failed: {e}", file=sys.stderr)
            return 2
        if args.metric not in summary or summary[args.metric] is None:
            print(f"error: --metric {args.metric!r} is not in the summary; choose one of "
                  f"{', '.join(k for k, v in summary.items() if isinstance(v, float))}",
                  file=sys.stderr)
            return 2
        values[label].append(summary[args.metric])
        runs.append({"arm": label, "server": info, "summary": summary})
        print(f"{label}: {args.metric} = {summary[args.metric]:.4g}", flush=True)
        if summary["failed"]:
            print(format_failures(summary), file=sys.stderr, flush=True)
    pairs = list(zip(values["A"], values["B"], strict=True))
    result = ratio_ci(pairs)
    lo, hi = result["ci95"]
    ci = f"[{lo:.3f}, {hi:.3f}]" if lo is not None else "[n/a]"
    print(f"{args.metric}: B/A = {result['ratio']:.3f}, 95% CI {ci} over {result['pairs']} "
          f"pairs (A: {args.a_url or args.a_args!r}, B: {args.b_url or args.b_args!r})")
    payload = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": _command(args),
        "device": (runs[0]["server"].get("device") if runs else None) or args.device_label
        or "unknown",
        "model": (runs[0]["server"].get("model") if runs else None) or args.server_model,
        "config": _config(args),
        "metric": args.metric,
        "comparison": {"a": values["A"], "b": values["B"], **result},
        "runs": runs,
    }
    print(f"wrote {_write(args, f'compare-{args.metric}-{_stamp()}.json', payload)}")
    return 0 if all(r["summary"]["failed"] == 0 for r in runs) else 1
