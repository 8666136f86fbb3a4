"""The server's loop histograms expose what prometheus_client's Histogram exposes for the same
observations (bucket edges included), so vLLM-reading dashboards and `bench serve` see no
difference."""

from __future__ import annotations

import random

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from draftgraph.server.metrics import ITL_BUCKETS, LoopHistogram  # noqa: E402


def _exposition(collect) -> list[str]:
    registry = prometheus_client.CollectorRegistry()
    collect(registry)
    return [ln for ln in prometheus_client.generate_latest(registry).decode().splitlines()
            if not ln.startswith("# ") and "_created" not in ln]


def test_loop_histogram_exposes_what_prometheus_client_does():
    rng = random.Random(0)
    values = [rng.expovariate(100.0) for _ in range(500)] + ITL_BUCKETS + [0.0, 7.0]
    ours = LoopHistogram("vllm:inter_token_latency_seconds", "doc", ITL_BUCKETS)

    def theirs(registry):
        h = prometheus_client.Histogram("vllm:inter_token_latency_seconds", "doc",
                                        ["model_name"], buckets=ITL_BUCKETS,
                                        registry=registry).labels("m")
        for v in values:
            h.observe(v)

    for v in values:
        ours.observe(v)

    class Collector:
        def collect(self):
            yield ours.family("m")

    expected = _exposition(theirs)
    got = _exposition(lambda registry: registry.register(Collector()))
    assert got == expected
    inf = next(ln for ln in got if 'le="+Inf"' in ln)
    assert inf.endswith(f" {float(len(values))}") and any('le="0.001"' in ln for ln in got)
