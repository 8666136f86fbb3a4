"""`draftgraph bench serve | compare` against a real server on loopback (random tiny model with
n-gram speculation), and the statistics they report; how a streamed request's tokens are
counted (from the ids the server streams, or from its text when it streams none)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from draftgraph.bench.compare import abba_order, ratio_ci  # noqa: E402
from draftgraph.bench.datasets import BenchRequest  # noqa: E402
from draftgraph.bench.serve import parse_metrics, send_request, spec_summary  # noqa: E402
from draftgraph.cli import main  # noqa: E402
from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from draftgraph.server.cli import build_server  # noqa: E402
from draftgraph.server.config import ServerConfig  # noqa: E402
from draftgraph.server.launcher import ServerThread  # noqa: E402

NUM_DRAFT_TOKENS = 3


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(model="random:tiny", device="cpu",
                          scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512),
                          cache=CacheConfig(kv_cache_tokens=4096),
                          spec=SpecConfig(method="ngram", num_draft_tokens=NUM_DRAFT_TOKENS))
    try:
        app, _ = build_server(config, ServerConfig(served_model_names=["tiny"]))
    except ImportError as e:
        pytest.skip(f"n-gram speculation not available ({e})")
    st = ServerThread(app).start()
    yield st
    st.stop()


def test_bench_serve_writes_sane_json_and_plot(server, tmp_path):
    rc = main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "8",
               "--max-concurrency", "1", "4", "--random-input-len", "24",
               "--random-output-len", "12", "--ignore-eos", "--num-warmups", "1",
               "--result-dir", str(tmp_path), "--result-file", "out.json", "--plot"])
    assert rc == 0
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["model"] == "random:tiny" and data["served_model_name"] == "tiny"
    assert data["device"].startswith("cpu") and data["date"] and "bench serve" in data["command"]
    assert data["config"]["num_prompts"] == 8 and data["server"]["speculative"] == "ngram"
    assert [r["max_concurrency"] for r in data["results"]] == [1, 4]
    for run in data["results"]:
        assert run["completed"] == 8 and run["failed"] == 0
        assert run["total_output_tokens"] == 8 * 12  # ignore_eos: every request runs to 12
        assert run["total_input_tokens"] == 8 * 24
        assert 0 < run["median_ttft_ms"] <= run["p99_ttft_ms"] <= run["median_e2e_ms"] * 10
        assert run["mean_tpot_ms"] > 0 and run["mean_itl_ms"] > 0
        assert run["median_ttft_ms"] < run["median_e2e_ms"]
        assert run["output_throughput"] == pytest.approx(96 / run["duration_s"])
        assert run["mean_tokens_per_chunk"] >= 1  # counted from the streamed ids
        spec = run["speculative"]
        assert spec["num_drafts"] > 0
        assert 1 <= spec["acceptance_length"] <= 1 + NUM_DRAFT_TOKENS
        assert 0 <= spec["acceptance_rate"] <= 1
        assert len(spec["acceptance_rate_per_pos"]) == NUM_DRAFT_TOKENS
        # a later position is accepted only after every earlier one
        per_pos = spec["acceptance_rate_per_pos"]
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
        # the server's steps in this run, by kind (/metrics before and after): the prompts'
        # prefills, the n-gram server's speculative steps
        steps = run["engine_steps"]
        assert set(steps) <= {"decode", "spec", "ahead", "extend"} and "spec" in steps
        assert 2 <= steps["extend"]["steps"] <= 8 * 24 and steps["spec"]["steps"] >= 8
        assert all(v["ms_each"] > 0 for v in steps.values())
        assert run["rows_riding"] == 0  # speculative steps: no decode row rides a prefill
        # the server's side of each request's latency (its /metrics histograms): a part of
        # what the client timed, TTFT = to the engine's queue + queued + prefill
        lat = run["server_latency"]
        assert set(lat) == {"mean_ttft_ms", "mean_queue_ms", "mean_prefill_ms", "mean_e2e_ms",
                            "mean_to_engine_ms"}
        assert 0 < lat["mean_prefill_ms"] and 0 <= lat["mean_queue_ms"]
        # timed from the HTTP request's arrival: the API server's part before the engine's
        # queue is positive, and the whole is within what the client saw
        assert 0.01 < lat["mean_to_engine_ms"] < lat["mean_ttft_ms"] < run["mean_ttft_ms"]
        assert lat["mean_e2e_ms"] < run["mean_e2e_ms"]
    # the API server's own count of that part, by stage (logged at its shutdown): every
    # request of both levels and the warm-ups counted, both stages timed
    stages = server.app.state.server.stages
    assert stages["n"] >= 16 and 0 <= stages["to_handler"] and 0 < stages["to_engine"]
    assert os.path.getsize(tmp_path / "out.png") > 1000


def test_bench_serve_splits_the_load_over_client_processes(server, tmp_path):
    """Two client processes share the requests and the streams (2 + 2 for concurrency 4):
    every request completes and is counted once, timed from the first start to the last end."""
    rc = main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "8",
               "--max-concurrency", "4", "--client-processes", "2", "--random-input-len", "24",
               "--random-output-len", "12", "--ignore-eos", "--num-warmups", "1",
               "--result-dir", str(tmp_path), "--result-file", "out.json"])
    assert rc == 0
    run = json.loads((tmp_path / "out.json").read_text())["results"][0]
    assert run["client_processes"] == 2 and run["max_concurrency"] == 4
    assert run["completed"] == 8 and run["failed"] == 0
    assert run["total_output_tokens"] == 8 * 12 and run["total_input_tokens"] == 8 * 24
    assert run["output_throughput"] == pytest.approx(96 / run["duration_s"])
    assert run["speculative"]["num_drafts"] > 0  # /metrics read before and after both
    # the processes wait for each other before sending (a barrier, not a fixed start time)
    assert 0.0 <= run["client_start_spread_s"] < 0.5


def test_the_bench_client_does_not_import_torch():
    """A client process imports the bench client alone: not torch (2-3 s of import a
    process, which had started client processes late and stretched a run's duration)."""
    code = ("import sys, draftgraph.bench.serve, draftgraph; "
            "print('torch' in sys.modules, draftgraph.__all__[:2])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0] == "False"


def test_client_processes_default_to_one_per_16_streams():
    from draftgraph.bench.serve import client_processes

    assert client_processes(64, 3) == 3 and client_processes(2, 8) == 2
    assert client_processes(1, None) == 1
    assert client_processes(64, None) == min(8, max(1, (os.cpu_count() or 1) // 2))


def test_bench_compare_against_running_servers(server, tmp_path, capsys):
    rc = main(["bench", "compare", "--a-url", server.base_url, "--b-url", server.base_url,
               "--rounds", "2", "--num-prompts", "3", "--random-input-len", "8",
               "--random-output-len", "4", "--ignore-eos", "--num-warmups", "0",
               "--metric", "output_throughput", "--result-dir", str(tmp_path),
               "--result-file", "cmp.json"])
    assert rc == 0
    data = json.loads((tmp_path / "cmp.json").read_text())
    cmp = data["comparison"]
    assert len(cmp["a"]) == len(cmp["b"]) == 2 and cmp["pairs"] == 2
    assert [r["arm"] for r in data["runs"]] == ["A", "B", "B", "A"]
    assert cmp["ratio"] > 0 and cmp["ci95"][0] <= cmp["ratio"] <= cmp["ci95"][1]
    assert "B/A" in capsys.readouterr().out


def _send(client: httpx.AsyncClient, base_url: str, req: BenchRequest):
    return send_request(client, base_url, "completions", "tiny", req, ignore_eos=True,
                        api_key=None, temperature=0.0)


def test_bench_request_counts_tokens_from_the_ids_a_random_weight_server_streams(server):
    """The random model streams no text: every chunk is timed by its ids, the last one (its
    finish_reason, no text) too, and the ids add up to max_tokens."""
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await _send(client, server.base_url, BenchRequest(list(range(100, 124)), 12))

    res = asyncio.run(run())
    assert res.ok, res.error
    assert res.output_tokens == sum(res.chunk_tokens) == 12 and min(res.chunk_tokens) >= 1
    assert len(res.itl) == len(res.chunk_tokens) - 1  # one gap between each timed chunk
    assert 0 < res.ttft < res.e2e


def _sse_transport(events: list[dict], requests: list[dict]) -> httpx.MockTransport:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(json.loads(request.content))
        return httpx.Response(200, text=body, headers={"Content-Type": "text/event-stream"})

    return httpx.MockTransport(handler)


def _chunk(text: str, finish: str | None = None, **extra) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish, **extra}]}


@pytest.mark.parametrize("events,output_tokens,chunk_tokens,num_itl", [
    # ids, no text, no usage: the ids are the count (the chunks alone would say 2)
    ([_chunk("", token_ids=[7], prompt_token_ids=[1, 2]), _chunk("", token_ids=[8, 9]),
      _chunk("", "length", token_ids=[10])], 4, [1, 2, 1], 2),
    # a server that streams no ids: chunks with text are timed, usage counts the tokens
    ([_chunk("a"), _chunk("b"), _chunk("", "stop"),
      {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}], 3, [], 1),
], ids=["ids", "text"])
def test_bench_request_counts_ids_when_streamed_and_text_otherwise(events, output_tokens,
                                                                   chunk_tokens, num_itl):
    sent: list[dict] = []

    async def run():
        async with httpx.AsyncClient(transport=_sse_transport(events, sent)) as client:
            return await _send(client, "http://bench.test", BenchRequest([1, 2], 4))

    res = asyncio.run(run())
    assert res.ok, res.error
    assert sent[0]["return_token_ids"] is True and sent[0]["stream"] is True
    assert (res.output_tokens, res.chunk_tokens, len(res.itl)) == (output_tokens, chunk_tokens,
                                                                  num_itl)


def test_abba_order_alternates():
    assert "".join(abba_order(3)) == "ABBAAB"


def test_ratio_ci_of_constant_ratio_is_exact():
    r = ratio_ci([(10.0, 20.0), (12.0, 24.0), (9.0, 18.0)])
    assert r["ratio"] == pytest.approx(2.0)
    assert r["ci95"] == pytest.approx([2.0, 2.0])


def test_ratio_ci_widens_with_noise():
    r = ratio_ci([(10.0, 11.0), (10.0, 9.0), (10.0, 12.0), (10.0, 10.0)])
    lo, hi = r["ci95"]
    assert lo < r["ratio"] < hi and lo < 1.0 < hi
    assert r["ratio"] == pytest.approx(math.exp(sum(math.log(x / 10) for x in
                                                    (11, 9, 12, 10)) / 4))


def test_spec_summary_from_prometheus_counters():
    def text(drafts, draft_tokens, accepted, per_pos):
        lines = [f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
                 f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {draft_tokens}',
                 f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}']
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",'
                  f'position="{i}"}} {n}' for i, n in enumerate(per_pos)]
        return "\n".join(lines) + "\n"

    before = parse_metrics(text(10, 40, 20, [8, 6, 4, 2]))
    after = parse_metrics(text(30, 120, 50, [26, 14, 7, 3]))
    s = spec_summary(before, after)
    assert s["num_drafts"] == 20 and s["num_accepted_tokens"] == 30
    assert s["acceptance_length"] == pytest.approx(2.5)
    assert s["acceptance_rate"] == pytest.approx(30 / 80)
    assert s["acceptance_rate_per_pos"] == pytest.approx([0.9, 0.4, 0.15, 0.05])


def test_engine_step_accounts_from_prometheus_counters():
    from draftgraph.engine.stats import step_accounts

    def text(ahead, ahead_s, extend, extend_s, ahead_wait):
        return "\n".join([
            f'draftgraph:engine_steps_total{{model_name="m",kind="ahead"}} {ahead}',
            f'draftgraph:engine_steps_total{{model_name="m",kind="extend"}} {extend}',
            'draftgraph:engine_steps_total{model_name="m",kind="spec"} 0.0',
            f'draftgraph:engine_step_seconds_total{{model_name="m",kind="ahead"}} {ahead_s}',
            f'draftgraph:engine_step_seconds_total{{model_name="m",kind="extend"}} {extend_s}',
            'draftgraph:engine_step_seconds_total{model_name="m",kind="spec"} 0.0',
            f'draftgraph:engine_step_wait_seconds_total{{model_name="m",kind="ahead"}} '
            f'{ahead_wait}',
            f'draftgraph:engine_rows_riding_total{{model_name="m"}} {ahead // 10}']) + "\n"

    before = parse_metrics(text(100, 0.1, 4, 0.02, 0.05))
    after = parse_metrics(text(300, 0.34, 6, 0.05, 0.15))
    got = step_accounts(after, before)
    assert after["rows_riding"] - before["rows_riding"] == 20
    assert set(got) == {"ahead", "extend"}  # spec ran no step in between
    assert got["ahead"]["steps"] == 200 and got["ahead"]["ms_each"] == pytest.approx(1.2)
    assert got["ahead"]["wait_ms_each"] == pytest.approx(0.5)
    assert got["extend"]["steps"] == 2 and got["extend"]["ms_each"] == pytest.approx(15.0)
    assert got["extend"]["wait_ms_each"] == 0.0


def test_server_latencies_from_prometheus_histograms():
    from draftgraph.bench.serve import server_latencies

    def text(n, ttft, queue):
        return "\n".join([
            f'vllm:time_to_first_token_seconds_bucket{{le="0.01",model_name="m"}} {n}',
            f'vllm:time_to_first_token_seconds_count{{model_name="m"}} {n}',
            f'vllm:time_to_first_token_seconds_sum{{model_name="m"}} {ttft}',
            f'vllm:request_queue_time_seconds_count{{model_name="m"}} {n}',
            f'vllm:request_queue_time_seconds_sum{{model_name="m"}} {queue}',
            'vllm:inter_token_latency_seconds_count{model_name="m"} 7',
            'vllm:inter_token_latency_seconds_sum{model_name="m"} 9.0']) + "\n"

    got = server_latencies(parse_metrics(text(14, 0.5, 0.1)), parse_metrics(text(4, 0.1, 0.02)))
    # means over the 10 requests in between; histograms not asked for, or without requests
    # in between, are left out
    assert got == pytest.approx({"mean_ttft_ms": 40.0, "mean_queue_ms": 8.0})


def test_bench_load_is_sized_by_the_servers_device_and_results_leave_the_checkout(
        monkeypatch, tmp_path):
    from draftgraph.bench.cli import CPU_DEFAULTS, GPU_DEFAULTS, apply_device_defaults
    from draftgraph.cli import parse_args

    monkeypatch.setenv("DRAFTGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    args = parse_args(["bench", "serve", "--output-len", "16"])
    assert args.num_prompts is None and args.result_dir is None
    apply_device_defaults(args, "cpu (x86_64, 2 threads)")
    assert args.num_prompts == CPU_DEFAULTS["num_prompts"] == 8
    assert args.random_output_len == CPU_DEFAULTS["random_output_len"]
    assert args.output_len == 16  # given: kept
    assert args.result_dir == str(tmp_path / "cache" / "results")
    args = parse_args(["bench", "serve", "--output-dir", str(tmp_path / "mine")])
    apply_device_defaults(args, "NVIDIA H200")
    assert (args.num_prompts, args.output_len) == (GPU_DEFAULTS["num_prompts"],
                                                   GPU_DEFAULTS["output_len"]) == (100, 256)
    assert args.result_dir == str(tmp_path / "mine")


def test_bench_serve_prints_why_the_requests_of_a_run_failed(server, tmp_path, capsys):
    """Prompts longer than the server's context (512) are refused: the run's table says
    `done 0`, and the terminal says why, the reason counted (not only in the result JSON)."""
    rc = main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "3",
               "--random-input-len", "600", "--random-output-len", "4", "--num-warmups", "0",
               "--result-dir", str(tmp_path), "--result-file", "out.json"])
    out, err = capsys.readouterr()
    assert rc == 1
    run = json.loads((tmp_path / "out.json").read_text())["results"][0]
    assert run["failed"] == 3 and run["distinct_errors"] == 1
    reason = run["errors"][0]["error"]
    assert run["errors"] == [{"error": reason, "count": 3}]
    assert reason.startswith("HTTP 400: ") and "{" not in reason  # the body's message alone
    assert err.splitlines()[:2] == ["error: 3 of 3 requests failed at max concurrency 1:",
                                    f"  3 x {reason}"]
    assert "Traceback" not in out + err


def test_bench_serve_reports_a_failed_warm_up_without_a_traceback(server, tmp_path, capsys):
    rc = main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "2",
               "--random-input-len", "600", "--random-output-len", "4", "--num-warmups", "1",
               "--result-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("error: the run at --max-concurrency 1 failed: warm-up request "
                          "failed: HTTP 400: ")
    assert not list(tmp_path.iterdir())


def test_bench_serve_refuses_a_random_vocab_above_the_servers(server, tmp_path, capsys):
    rc = main(["bench", "serve", "--base-url", server.base_url, "--random-vocab-size", "100000",
               "--result-dir", str(tmp_path)])
    assert rc == 2
    assert capsys.readouterr().err.startswith(
        "error: --random-vocab-size 100000 is above the server's vocabulary (512 tokens)")


def test_random_prompts_after_a_shared_prefix():
    """--random-prefix-len: every prompt starts with the same tokens, and after them each is
    the prompt it was without a prefix (the prefix is drawn apart)."""
    from draftgraph.bench.datasets import random_requests

    plain = random_requests(4, 20, 8, 0.0, 1000, 3)
    shared = random_requests(4, 20, 8, 0.0, 1000, 3, prefix_len=32)
    assert len({tuple(r.prompt[:32]) for r in shared}) == 1
    assert [r.prompt[32:] for r in shared] == [r.prompt for r in plain]
    assert [r.output_len for r in shared] == [r.output_len for r in plain]
