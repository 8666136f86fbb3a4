"""`draftgraph bench serve`: load an OpenAI-compatible server and measure it.

Each request streams; the client times its first token (TTFT), the gaps between chunks (ITL;
under speculation one chunk may carry several tokens), the time per output token after the
first (TPOT) and end to end (E2E). Requests ask for vLLM's `return_token_ids`: a chunk counts
when it carries ids, and the output tokens are the ids streamed, so a model with no text
(random weights, no tokenizer) is timed like any other. A server that returns no ids is timed
by the chunks with text (or not yet finished), its output tokens taken from its usage.
Acceptance statistics come from the difference of the server's `/metrics` speculative counters
before and after the run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from draftgraph.bench.datasets import BenchRequest
from draftgraph.engine.stats import step_accounts

logger = logging.getLogger(__name__)

SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens")

# the server's request histograms (`vllm:<name>_seconds`), timed from the HTTP request's
# arrival at the API server (ttft, e2e) and in the engine's queue (queue, then prefill to the
# first token): the client's TTFT less the server's is the HTTP connection's and the client's
# own share
SERVER_LATENCIES = {"ttft": "time_to_first_token", "queue": "request_queue_time",
                    "prefill": "request_prefill_time", "e2e": "e2e_request_latency"}


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    # tokens of each timed chunk, from its ids ([] when the server streams no ids)
    chunk_tokens: list[int] = field(default_factory=list)
    error: str = ""


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def send_request(client: httpx.AsyncClient, base_url: str, endpoint: str, model: str,
                       req: BenchRequest, ignore_eos: bool, api_key: str | None,
                       temperature: float) -> RequestResult:
    body: dict = {"model": model, "max_tokens": req.output_len, "temperature": temperature,
                  "stream": True, "stream_options": {"include_usage": True},
                  "ignore_eos": ignore_eos, "return_token_ids": True}
    if endpoint == "chat":
        if not isinstance(req.prompt, str):
            return RequestResult(False, error="token-id prompts need --endpoint completions")
        url = f"{base_url}/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        url = f"{base_url}/v1/completions"
        body["prompt"] = req.prompt
    start = time.perf_counter()
    # per choice of each chunk: (arrival, its token ids or None, text or not yet finished)
    events: list[tuple[float, list[int] | None, bool]] = []
    usage: dict = {}
    try:
        async with client.stream("POST", url, json=body, headers=_headers(api_key)) as r:
            if r.status_code != 200:
                return RequestResult(False, error=f"HTTP {r.status_code}: "
                                     f"{_error_message((await r.aread()).decode())}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=chunk["error"].get("message", "error"))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                now = time.perf_counter()
                for choice in chunk.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    events.append((now, choice.get("token_ids"),
                                   bool(text) or choice.get("finish_reason") is None))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if any(ids is not None for _, ids, _ in events):  # the server streams ids: count them
        timed = [(t, ids) for t, ids, _ in events if ids]
        token_times = [t for t, _ in timed]
        chunk_tokens = [len(ids) for _, ids in timed]
        output_tokens = sum(chunk_tokens)
    else:
        token_times = [t for t, _, counts in events if counts]
        chunk_tokens = []
        output_tokens = usage.get("completion_tokens", len(token_times))
    if not token_times:
        return RequestResult(False, error="no tokens streamed")
    return RequestResult(
        True, prompt_tokens=usage.get("prompt_tokens", 0), output_tokens=output_tokens,
        ttft=token_times[0] - start, e2e=end - start,
        itl=[b - a for a, b in zip(token_times, token_times[1:], strict=False)],
        chunk_tokens=chunk_tokens)


def _error_message(body: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body;
    at most 200 characters."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body
    return str(message)[:200]


_STEP_STATS = {"steps": "steps", "step_seconds": "step_seconds",
               "step_wait_seconds": "wait_seconds"}  # metric -> engine stats' name


def parse_metrics(text: str) -> dict:
    """Speculative counters (any metric-name prefix, e.g. `vllm:`) from Prometheus text,
    draftgraph's engine step counters by kind (as engine stats: steps_<kind>, ...) and the
    sums and counts of the SERVER_LATENCIES histograms (<name>_sum, <name>_count) and the
    decode rows that rode in prefills (rows_riding)."""
    out: dict = {name: 0.0 for name in SPEC_COUNTERS}
    out["rows_riding"] = sum(float(m.group(1)) for m in re.finditer(
        r"^(?:[\w]+:)?engine_rows_riding(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.M))
    for m in re.finditer(r"^(?:[\w]+:)?engine_(steps|step_seconds|step_wait_seconds)(?:_total)?"
                         r'\{[^}]*kind="(\w+)"[^}]*\} (\S+)$', text, re.M):
        key = f"{_STEP_STATS[m.group(1)]}_{m.group(2)}"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    for m in re.finditer(r"^(?:[\w]+:)?(\w+?)_seconds_(sum|count)(?:\{[^}]*\})? (\S+)$", text,
                         re.M):
        if m.group(1) in SERVER_LATENCIES.values():
            key = f"{m.group(1)}_{m.group(2)}"
            out[key] = out.get(key, 0.0) + float(m.group(3))
    per_pos: dict[int, float] = {}
    for m in re.finditer(r"^(?:[\w]+:)?(spec_decode_\w+?)(?:_total)?(\{[^}]*\})? (\S+)$", text,
                         re.M):
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "spec_decode_num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        elif name in out:
            out[name] += value
    out["per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


async def fetch_metrics(client: httpx.AsyncClient, base_url: str) -> dict | None:
    try:
        r = await client.get(f"{base_url}/metrics")
        return parse_metrics(r.text) if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def spec_summary(before: dict | None, after: dict | None) -> dict:
    if before is None or after is None:
        return {}
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    drafts = d["spec_decode_num_drafts"]
    if drafts <= 0:
        return {"num_drafts": 0}
    per_pos = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0)
               for i, a in enumerate(after["per_pos"])]
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(d["spec_decode_num_draft_tokens"]),
        "num_accepted_tokens": int(d["spec_decode_num_accepted_tokens"]),
        # tokens per verify step: the accepted drafts plus the one the target always adds
        "acceptance_length": 1 + d["spec_decode_num_accepted_tokens"] / drafts,
        "acceptance_rate": (d["spec_decode_num_accepted_tokens"]
                            / max(d["spec_decode_num_draft_tokens"], 1)),
        "acceptance_rate_per_pos": [n / drafts for n in per_pos],
    }


def server_latencies(after: dict, before: dict) -> dict:
    """Mean ms of each server-side latency over the requests between two /metrics reads."""
    out = {}
    for key, name in SERVER_LATENCIES.items():
        n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if n > 0:
            s = after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)
            out[f"mean_{key}_ms"] = 1e3 * s / n
    if {"mean_ttft_ms", "mean_queue_ms", "mean_prefill_ms"} <= out.keys():
        # the API server's part of TTFT: tokenizing, admission, the trip to the engine's queue
        out["mean_to_engine_ms"] = (out["mean_ttft_ms"] - out["mean_queue_ms"]
                                    - out["mean_prefill_ms"])
    return out


def _stats_ms(values: list[float], name: str) -> dict:
    if not values:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    s = sorted(values)
    p99 = s[min(len(s) - 1, max(0, int(round(0.99 * len(s))) - 1))]
    return {f"mean_{name}_ms": 1000 * statistics.fmean(s),
            f"median_{name}_ms": 1000 * statistics.median(s), f"p99_{name}_ms": 1000 * p99}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if not r.ok)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        # the most frequent reasons of the failed requests, with their counts
        "errors": [{"error": e, "count": n} for e, n in errors.most_common(5)],
        "distinct_errors": len(errors),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    summary.update(_stats_ms([r.ttft for r in ok], "ttft"))
    summary.update(_stats_ms([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
                              if r.output_tokens > 1], "tpot"))
    summary.update(_stats_ms([x for r in ok for x in r.itl], "itl"))
    summary.update(_stats_ms([r.e2e for r in ok], "e2e"))
    chunk_tokens = [n for r in ok for n in r.chunk_tokens]
    # tokens per timed chunk (from the ids): above 1 under speculation, where ITL > TPOT
    summary["mean_tokens_per_chunk"] = (statistics.fmean(chunk_tokens) if chunk_tokens
                                        else None)
    return summary


# concurrent streams one client process times without becoming the bottleneck: httpx parses
# about 10k chunks/s per process, and a 135M model on an H200 streams 35k tokens/s at 64
# (a served run at 64 drew 12.9k tok/s from 4 processes, 15.6k from 8;
# serve_client_sweep_gpu.sh)
CLIENT_STREAMS_PER_PROCESS = 8


def client_processes(max_concurrency: int, asked: int | None) -> int:
    """Client processes for a run: `asked`, else one per CLIENT_STREAMS_PER_PROCESS streams
    (at most half the machine's cores, at least 1)."""
    if asked is not None:
        return max(1, min(asked, max_concurrency))
    cores = os.cpu_count() or 1
    return max(1, min(-(-max_concurrency // CLIENT_STREAMS_PER_PROCESS), cores // 2))


async def _send_all(base_url: str, model: str, requests: list[BenchRequest],
                    max_concurrency: int, request_rate: float, ignore_eos: bool, endpoint: str,
                    api_key: str | None, temperature: float,
                    seed: int) -> tuple[list[RequestResult], float, float]:
    """The requests at most `max_concurrency` at a time (Poisson arrivals at `request_rate`),
    beginning now; (results, start, end) in time.time()."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max_concurrency + 4,
                          max_keepalive_connections=max_concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        sem = asyncio.Semaphore(max_concurrency)

        async def limited(req: BenchRequest) -> RequestResult:
            async with sem:
                return await send_request(client, base_url, endpoint, model, req, ignore_eos,
                                          api_key, temperature)

        start = time.time()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), start, time.time()


def _client_process(index: int, kwargs: dict, ready, results) -> None:
    """One client process: once imported, it waits at `ready` (a barrier of
    every client process) so that all start together, then sends its share and puts (its
    index, its results, start, end) on `results`."""
    try:
        ready.wait(timeout=300)
        out = asyncio.run(_send_all(**kwargs))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        results.put((index, None, repr(e), 0.0))
        return
    results.put((index, *out))


def _run_client_processes(shards: list[dict]) -> list[tuple[list[RequestResult], float, float]]:
    """Run each shard in a spawned process of its own; all begin sending at one instant (a
    barrier they reach after their imports: a start at a fixed time let a slow import, e.g.
    of torch, start one process late and stretch the run's duration)."""
    import multiprocessing
    import queue as queue_mod

    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Barrier(len(shards)), ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(i, shard, ready, results),
                         daemon=True) for i, shard in enumerate(shards)]
    for proc in procs:
        proc.start()
    parts: dict[int, tuple] = {}
    try:
        while len(parts) < len(procs):
            try:
                i, res, start, end = results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a bench client process exited with code "
                                       f"{dead[0].exitcode}") from None
                continue
            if res is None:
                raise RuntimeError(f"a bench client process failed: {start}")
            parts[i] = (res, start, end)
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return [parts[i] for i in range(len(procs))]


async def run_benchmark(base_url: str, model: str, requests: list[BenchRequest],
                        max_concurrency: int, request_rate: float = float("inf"),
                        ignore_eos: bool = False, endpoint: str = "completions",
                        num_warmups: int = 1, api_key: str | None = None,
                        temperature: float = 0.0, seed: int = 0,
                        processes: int | None = None) -> dict:
    """One load run; returns the summary dict (latencies in ms, throughputs per second).
    With several client processes (`client_processes`), process i sends requests i, i + P,
    ... at max_concurrency / P streams (and request_rate / P), all starting at one instant,
    and the duration runs from the first start to the last end."""
    num = client_processes(max_concurrency, processes)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for req in requests[:num_warmups]:
            warm = BenchRequest(req.prompt, min(req.output_len, 16))
            res = await send_request(client, base_url, endpoint, model, warm, ignore_eos,
                                     api_key, temperature)
            if not res.ok:
                raise RuntimeError(f"warm-up request failed: {res.error}")
        before = await fetch_metrics(client, base_url)
    common = dict(base_url=base_url, model=model, ignore_eos=ignore_eos, endpoint=endpoint,
                  api_key=api_key, temperature=temperature)
    if num == 1:
        results, start, end = await _send_all(requests=requests,
                                              max_concurrency=max_concurrency,
                                              request_rate=request_rate, seed=seed, **common)
    else:
        shards = [dict(requests=requests[i::num],
                       max_concurrency=max_concurrency // num + (i < max_concurrency % num),
                       request_rate=request_rate / num, seed=seed + i, **common)
                  for i in range(num)]
        parts = await asyncio.get_running_loop().run_in_executor(
            None, _run_client_processes, shards)
        results = [r for part, _, _ in parts for r in part]
        start, end = min(p[1] for p in parts), max(p[2] for p in parts)
        spread = max(p[1] for p in parts) - start
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        after = await fetch_metrics(client, base_url)
    summary = {"max_concurrency": max_concurrency, "request_rate": request_rate,
               "num_prompts": len(requests), "client_processes": num,
               # seconds between the first and the last client process's start
               "client_start_spread_s": spread if num > 1 else 0.0}
    summary.update(summarize(results, end - start))
    summary["speculative"] = spec_summary(before, after)
    if before is not None and after is not None:  # the server's steps by kind in this run
        summary["engine_steps"] = step_accounts(after, before)
        summary["rows_riding"] = after["rows_riding"] - before["rows_riding"]
        summary["server_latency"] = server_latencies(after, before)
    return summary


def server_info(base_url: str, api_key: str | None) -> tuple[dict, str | None, int | None]:
    """(/info, the first served model name, vocab size) — whatever the server exposes."""
    info: dict = {}
    model = vocab = None
    with httpx.Client(timeout=30) as client:
        try:
            r = client.get(f"{base_url}/info")
            if r.status_code == 200:
                info = r.json()
        except httpx.HTTPError:
            pass
        r = client.get(f"{base_url}/v1/models", headers=_headers(api_key))
        r.raise_for_status()
        data = r.json().get("data") or []
        if data:
            model, vocab = data[0]["id"], data[0].get("vocab_size")
    return info, model, vocab


def format_failures(run: dict, shown: int = 3) -> str:
    """Why the failed requests of a run failed: the most frequent reasons with their counts
    ("" when none failed)."""
    if not run["failed"]:
        return ""
    total = run["failed"] + run["completed"]
    lines = [f"error: {run['failed']} of {total} requests failed at max concurrency "
             f"{run['max_concurrency']}:"]
    lines += [f"  {e['count']} x {e['error']}" for e in run["errors"][:shown]]
    if run["distinct_errors"] > shown:
        lines.append(f"  ... and {run['distinct_errors'] - shown} more distinct errors "
                     "(the first 5 in the result JSON)")
    return "\n".join(lines)


def format_table(runs: list[dict]) -> str:
    cols = [("conc", "max_concurrency", "{:>5}"), ("done", "completed", "{:>5}"),
            ("req/s", "request_throughput", "{:>7.2f}"),
            ("out tok/s", "output_throughput", "{:>9.1f}"),
            ("TTFT med", "median_ttft_ms", "{:>9.1f}"), ("TTFT p99", "p99_ttft_ms", "{:>9.1f}"),
            ("TPOT med", "median_tpot_ms", "{:>9.2f}"), ("ITL med", "median_itl_ms", "{:>8.2f}"),
            ("E2E med", "median_e2e_ms", "{:>9.1f}"), ("acc len", None, "{:>7}")]
    lines = [" ".join(f"{h:>{len(fmt.format(0) if k else '       ')}}" for h, k, fmt in cols)]
    for run in runs:
        cells = []
        for _, key, fmt in cols:
            if key is None:
                acc = run.get("speculative", {}).get("acceptance_length")
                cells.append(f"{acc:>7.2f}" if acc else f"{'-':>7}")
            else:
                v = run.get(key)
                cells.append(fmt.format(v) if v is not None else f"{'-':>{len(fmt.format(0))}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def plot_runs(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r["max_concurrency"] for r in runs]
    fig, (ax_lat, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("median_ttft_ms", "TTFT median"), ("p99_ttft_ms", "TTFT p99"),
                       ("median_tpot_ms", "TPOT median"), ("median_itl_ms", "ITL median"),
                       ("median_e2e_ms", "E2E median")):
        ax_lat.plot(conc, [r[key] or float("nan") for r in runs], marker="o", label=label)
    ax_lat.set(xscale="log", yscale="log", xlabel="max concurrency", ylabel="ms",
               title="latency")
    ax_lat.legend(fontsize=8)
    ax_tput.plot(conc, [r["output_throughput"] for r in runs], marker="o", label="output tok/s")
    ax_tput.plot(conc, [r["total_token_throughput"] for r in runs], marker="s",
                 label="total tok/s")
    ax_tput.set(xscale="log", xlabel="max concurrency", ylabel="tokens / s", title="throughput")
    ax_tput.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
