"""Prometheus metrics of the server, named as vLLM names them so dashboards and bench tools
that read a vLLM server read this one too (`vllm:time_to_first_token_seconds`,
`vllm:spec_decode_num_accepted_tokens_total`, ...).

Per-request latencies are histograms observed on the event loop as outputs arrive; engine state
(KV usage, running/waiting requests, cumulative token and speculative counters from
`engine.stats`) is read at scrape time by a collector, so the engine thread does no bookkeeping
for metrics.
"""

from __future__ import annotations

import bisect
import logging
import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from draftgraph.engine.request import RequestOutput
from draftgraph.engine.stats import STEP_KINDS

logger = logging.getLogger(__name__)

PREFIX = "vllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]


class LoopHistogram:
    """A histogram observed on the event loop alone: one bisect and two adds per observation,
    exposed at scrape time as prometheus_client's Histogram would expose it. (Its Histogram
    takes a lock per bucket tried and a second for the sum: ~8 us an observation, which the
    loop paid for every streamed output, the inter-token latency, ~45k times a second at
    concurrency 64 on a small model.)"""

    def __init__(self, name: str, doc: str, buckets: list[float]) -> None:
        self.name, self.doc = name, doc
        self.bounds = [float(b) for b in buckets] + [math.inf]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1  # le: count(x <= bound)
        self.sum += amount

    def family(self, model_name: str, peers: list[tuple] = ()) -> HistogramMetricFamily:
        """The histogram as exposed; `peers`: other API servers' (counts, sum) added in."""
        counts, total = list(self.counts), self.sum
        for peer_counts, peer_sum in peers:
            counts = [a + b for a, b in zip(counts, peer_counts, strict=True)]
            total += peer_sum
        h = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, n in zip(self.bounds, counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        h.add_metric([model_name], buckets, total)
        return h


class LoopCounter:
    """A counter by one label, counted on the event loop (like LoopHistogram: no locks) and
    exposed as prometheus_client's labelled Counter would be."""

    def __init__(self, name: str, doc: str, label: str) -> None:
        self.name, self.doc, self.label = name, doc, label
        self.values: dict[str, float] = {}

    def inc(self, value: str, amount: float = 1.0) -> None:
        self.values[value] = self.values.get(value, 0.0) + amount

    def family(self, model_name: str, peers: list[dict] = ()) -> CounterMetricFamily:
        values = dict(self.values)
        for peer in peers:
            for k, v in peer.items():
                values[k] = values.get(k, 0.0) + v
        c = CounterMetricFamily(self.name, self.doc, labels=["model_name", self.label])
        for k in sorted(values):
            c.add_metric([model_name, k], values[k])
        return c


class _RequestCollector:
    """The request histograms and counters of this API server, plus those the other API
    servers of the same engine last reported (`peers()`: their `ServerMetrics.state()`s)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        peers = m.peers()
        for name, h in m.histograms.items():
            yield h.family(m.model_name, [p["histograms"][name] for p in peers])
        for name, c in m.counters.items():
            yield c.family(m.model_name, [p["counters"][name] for p in peers])


class _EngineCollector:
    """Engine state read at scrape time."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def collect(self):
        e = self.engine
        stats = dict(e.stats)
        yield self._gauge("num_requests_running", "Requests being decoded.",
                          e.num_running())
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                          e.num_waiting())
        usage = e.kv_usage()
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV slots in use (1 = full).", usage)
        yield self._gauge("gpu_cache_usage_perc", "Alias of kv_cache_usage_perc.", usage)
        yield self._gauge("kv_cache_free_slots", "Free KV slots.", e.num_free_kv_slots())
        yield self._counter("prompt_tokens", "Prompt tokens admitted.",
                            stats.get("prompt_tokens", 0))
        yield self._counter("generation_tokens", "Tokens generated.",
                            stats.get("generation_tokens", 0))
        if "prefix_cache_queries" in stats:  # --enable-prefix-caching
            yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the "
                                "prefix cache.", stats["prefix_cache_queries"])
            yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                stats["prefix_cache_hits"])
        yield self._counter("spec_decode_num_drafts", "Speculative verify steps with a draft.",
                            stats.get("num_drafts", 0))
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                            stats.get("num_draft_tokens", 0))
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            stats.get("num_accepted_tokens", 0))
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position.",
                                      labels=["model_name", "position"])
        for pos, n in enumerate(stats.get("accepted_per_pos", [])):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos
        steps = CounterMetricFamily(PREFIX + "engine_steps", "Engine steps by what they ran "
                                    "(decode / spec replays, ahead: launched before the last "
                                    "was read, extend: prefill chunks).",
                                    labels=["model_name", "kind"])
        seconds = CounterMetricFamily(PREFIX + "engine_step_seconds",
                                      "Seconds in engine steps, by kind.",
                                      labels=["model_name", "kind"])
        waits = CounterMetricFamily(PREFIX + "engine_step_wait_seconds",
                                    "Seconds of engine steps spent waiting for the device's "
                                    "results, by kind (the rest: host work).",
                                    labels=["model_name", "kind"])
        for kind in STEP_KINDS:
            steps.add_metric([self.model_name, kind], stats.get(f"steps_{kind}", 0))
            seconds.add_metric([self.model_name, kind], stats.get(f"step_seconds_{kind}", 0.0))
            waits.add_metric([self.model_name, kind], stats.get(f"wait_seconds_{kind}", 0.0))
        yield steps
        yield seconds
        yield waits
        yield self._counter("engine_rows_riding", "Decode rows that rode in a prefill behind "
                            "the step in flight (--decode-rides-prefill).",
                            stats.get("rows_riding", 0))


class ServerMetrics:
    """Request histograms and counters plus the engine collector, in one registry per server
    (several servers in one process do not share metrics). With several API-server processes
    on one engine (`serve --api-server-count`) each sends its `state()` to the others every
    second through the engine process, and each exposes its own counts plus the others' latest
    (`engine.peer_metrics`): a scrape of any of them sees every request, the others' at most a
    second or two late."""

    def __init__(self, engine, model_name: str) -> None:
        self.model_name = model_name
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.ttft = LoopHistogram(PREFIX + "time_to_first_token_seconds",
                                  "Time from request arrival to its first token.", TTFT_BUCKETS)
        self.queue = LoopHistogram(PREFIX + "request_queue_time_seconds",
                                   "Time in the engine's queue before a request's first "
                                   "step.", TTFT_BUCKETS)
        self.prefill = LoopHistogram(PREFIX + "request_prefill_time_seconds",
                                     "Time from a request's first step to its first token.",
                                     TTFT_BUCKETS)
        self.itl = LoopHistogram(PREFIX + "inter_token_latency_seconds",
                                 "Time between consecutive outputs of a request (one output may "
                                 "carry several tokens under speculation).", ITL_BUCKETS)
        self.tpot = LoopHistogram(PREFIX + "time_per_output_token_seconds",
                                  "Decode time per output token of a request, after the first.",
                                  ITL_BUCKETS)
        self.e2e = LoopHistogram(PREFIX + "e2e_request_latency_seconds",
                                 "Time from request arrival to its last token.", E2E_BUCKETS)
        self.prompt_len = LoopHistogram(PREFIX + "request_prompt_tokens",
                                        "Prompt tokens per request.", TOKEN_BUCKETS)
        self.gen_len = LoopHistogram(PREFIX + "request_generation_tokens",
                                     "Generated tokens per request.", TOKEN_BUCKETS)
        self.histograms = {h.name: h for h in (self.ttft, self.queue, self.prefill, self.itl,
                                                self.tpot, self.e2e, self.prompt_len,
                                                self.gen_len)}
        self.success = LoopCounter(PREFIX + "request_success", "Finished requests by reason.",
                                   "finished_reason")
        self.http_errors = LoopCounter(PREFIX + "http_request_errors",
                                       "Requests refused or failed, by HTTP status.", "status")
        self.counters = {c.name: c for c in (self.success, self.http_errors)}
        reg.register(_RequestCollector(self))
        reg.register(_EngineCollector(engine, model_name))
        self._last_output_time: dict[str, float] = {}

    def observe_output(self, out: RequestOutput, now: float) -> None:
        """Called on the event loop for every output the engine thread dispatches."""
        rid = out.request_id
        if out.new_token_ids:
            last = self._last_output_time.get(rid)
            if last is None:
                m = out.metrics
                for h, key in ((self.ttft, "ttft"), (self.queue, "queue"),
                               (self.prefill, "prefill")):
                    if m.get(key) is not None:
                        h.observe(m[key])
            else:
                self.itl.observe(now - last)
            self._last_output_time[rid] = now
        if out.finished:
            self._last_output_time.pop(rid, None)
            reason = out.finish_reason or "unknown"
            self.success.inc(reason)
            m = out.metrics
            if reason in ("stop", "length"):
                seconds, ttft = m.get("seconds"), m.get("ttft")
                if seconds is not None:
                    self.e2e.observe(seconds)
                n = m.get("completion_tokens", len(out.token_ids))
                if ttft is not None and seconds is not None and n > 1:
                    self.tpot.observe((seconds - ttft) / (n - 1))
                self.prompt_len.observe(m.get("prompt_tokens", len(out.prompt_token_ids)))
                self.gen_len.observe(n)

    def count_error(self, status: int) -> None:
        self.http_errors.inc(str(status))

    def state(self) -> dict:
        """This server's request counts, for the other API servers of its engine."""
        return {"histograms": {n: (list(h.counts), h.sum) for n, h in self.histograms.items()},
                "counters": {n: dict(c.values) for n, c in self.counters.items()}}

    def peers(self) -> list[dict]:
        """The other API servers' latest `state()`s (none with one server)."""
        return list(getattr(self.engine, "peer_metrics", {}).values())

    def render(self) -> bytes:
        return generate_latest(self.registry)
