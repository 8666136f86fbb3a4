"""`draftgraph bench serve | compare` refuse unusable flag values with one `error:` line naming
the flag, before any request: the base URL is unreachable, so a check that moved after the
first request would report the connection instead."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")

from draftgraph.cli import main  # noqa: E402

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens


@pytest.mark.parametrize("flags,message", [
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
    (["--max-concurrency", "4", "-3"], "--max-concurrency must be >= 1, got -3"),
    (["--request-rate", "0"], "--request-rate must be > 0 requests per second (inf, the "
                              "default, sends every request at once), got 0.0"),
    (["--request-rate", "-2"], "--request-rate must be > 0"),
    (["--request-rate", "nan"], "--request-rate must be > 0"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--random-input-len", "0"], "--random-input-len must be >= 1, got 0"),
    (["--random-output-len", "-1"], "--random-output-len must be >= 1, got -1"),
    (["--random-vocab-size", "0"], "--random-vocab-size must be >= 1, got 0"),
    (["--output-len", "0"], "--output-len must be >= 1, got 0"),
    (["--client-processes", "0"], "--client-processes must be >= 1, got 0"),
    (["--num-warmups", "-1"], "--num-warmups must be >= 0, got -1"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio must be in [0, 1), got 1.5"),
    (["--temperature", "-0.5"], "--temperature must be >= 0 and finite, got -0.5"),
    (["--dataset", "jsonl"], "--dataset jsonl needs --dataset-path FILE"),
    (["--endpoint", "chat"], "--dataset random sends token-id prompts"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bench_serve_refuses_bad_flag_before_any_request(flags, message, capsys, tmp_path):
    rc = main(["bench", "serve", "--base-url", UNREACHABLE, "--result-dir", str(tmp_path),
               *flags])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())  # no result written


@pytest.mark.parametrize("flags,message", [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--metric", "tpot"], "--metric 'tpot' is not a summary metric; choose one of "
                           "duration_s, request_throughput, output_throughput"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bench_compare_refuses_bad_flag_before_any_run(flags, message, capsys, tmp_path):
    rc = main(["bench", "compare", "--a-url", UNREACHABLE, "--b-url", UNREACHABLE,
               "--result-dir", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())
