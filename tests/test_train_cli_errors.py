"""`draftgraph train-drafter` refuses bad input with one `error: ...` line naming its own flag
(exit status 2), never a traceback: flag values and missing or malformed files before the
target loads, what needs the target's config (--draft-vocab, --max-len past its context)
before any response is regenerated."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def ids(tmp_path):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps([[5, 6, 7, 8], [9, 10, 11]]))
    return path


@pytest.fixture
def no_model(monkeypatch):
    """The engine (the target's loading) and regeneration fail the test if reached."""
    import draftgraph.engine.engine
    import draftgraph.train.loop

    def loaded(*a, **k):
        raise AssertionError("the target was loaded before the check")

    monkeypatch.setattr(draftgraph.engine.engine, "LLMEngine", loaded)
    monkeypatch.setattr(draftgraph.train.loop, "regenerate", loaded)


@pytest.fixture
def no_regeneration(monkeypatch):
    import draftgraph.train.loop

    def regenerated(*a, **k):
        raise AssertionError("responses were regenerated before the check")

    monkeypatch.setattr(draftgraph.train.loop, "regenerate", regenerated)


def _run(tmp_path, data, extra: list[str], capsys) -> tuple[int, str]:
    from draftgraph.cli import main

    argv = ["train-drafter", "random:tiny", "--out", str(tmp_path / "run"), "--data", str(data),
            "--max-new-tokens", "4", "--max-len", "64", "--batch-tokens", "128",
            "--eval-prompts", "0", "--steps", "1"]
    rc = main(argv + extra)
    return rc, capsys.readouterr().err


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("extra, says", [
    (["--head-layers", "0"], "--head-layers must be >= 1, got 0"),
    (["--head-layers", "-1"], "--head-layers must be >= 1, got -1"),
    (["--kind", "block", "--head-layers", "0"], "--head-layers must be >= 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--steps", "-1"], "--steps must be >= 0, got -1"),
    (["--kind", "block", "--anchors", "0"], "--anchors must be >= 1, got 0"),
    (["--time-limit", "-5"], "--time-limit must be > 0"),
    (["--batch-tokens", "0"], "--batch-tokens must be >= 1, got 0"),
    (["--ttt-steps", "0"], "--ttt-steps must be >= 1, got 0"),
    (["--temperature", "-0.5"], "--temperature must be in 0..1000.0, got -0.5"),
    (["--temperature", "nan"], "--temperature must be in 0..1000.0, got nan"),
    (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["--lr", "nan"], "--lr must be > 0"),
    (["--intermediate-size", "-3"], "--intermediate-size must be >= 0, got -3"),
    (["--kind", "block", "--markov-rank", "-1"], "--markov-rank must be >= 0, got -1"),
    (["--eval-every", "0"], "--eval-every must be >= 1, got 0"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--max-len", "1"], "--max-len 1 leaves no room for a prompt"),
    (["--max-len", "4"], "--max-len 4 leaves no room for a prompt before --max-new-tokens 4"),
    (["--kind", "block", "--block-size", "1"], "--block-size must be in 2..17"),
    (["--kind", "block", "--window", "0"], "--window must be >= 1"),
    (["--draft-vocab", "-2"], "--draft-vocab must be >= 0"),
])
def test_a_bad_flag_value_is_refused_before_the_target_loads(tmp_path, ids, capsys, no_model,
                                                              extra, says):
    rc, err = _run(tmp_path, ids, extra, capsys)
    assert rc == 2
    assert says in _one_error_line(err)
    assert not (tmp_path / "run").exists()  # nothing written either


def test_missing_files_are_refused_before_the_target_loads(tmp_path, ids, capsys, no_model):
    rc, err = _run(tmp_path, tmp_path / "nope.jsonl", [], capsys)
    assert rc == 2 and f"--data {tmp_path / 'nope.jsonl'}: no such file" in _one_error_line(err)
    # each of several sources is checked
    rc, err = _run(tmp_path, f"{ids},{tmp_path / 'nope.jsonl'}", [], capsys)
    assert rc == 2 and f"--data {tmp_path / 'nope.jsonl'}: no such file" in _one_error_line(err)
    # held-out data is read after the training data: its path is checked at start-up too
    rc, err = _run(tmp_path, ids, ["--eval-data", str(tmp_path / "nope.json"),
                                   "--eval-prompts", "3"], capsys)
    assert rc == 2
    assert f"--eval-data {tmp_path / 'nope.json'}: no such file" in _one_error_line(err)
    (tmp_path / "afile").write_text("x")
    rc, err = _run(tmp_path, ids, ["--out", str(tmp_path / "afile")], capsys)
    assert rc == 2 and f"--out {tmp_path / 'afile'} is a file" in _one_error_line(err)
    # a head to start from: a directory with its config, of the kind and depth asked for
    rc, err = _run(tmp_path, ids, ["--init-head", str(tmp_path / "nohead")], capsys)
    assert rc == 2 and f"--init-head '{tmp_path / 'nohead'}': no config.json there" in \
        _one_error_line(err)
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"kind": "chain", "num_layers": 2}))
    rc, err = _run(tmp_path, ids, ["--init-head", str(head)], capsys)
    assert rc == 2 and (f"--init-head {head} is a chain head of 2 layer(s); the flags describe "
                        "a chain head of 1") in _one_error_line(err)
    rc, err = _run(tmp_path, ids, ["--init-head", str(head), "--kind", "block"], capsys)
    assert rc == 2 and "the flags describe a block head of 2" in _one_error_line(err)


def test_malformed_data_files_name_the_flag_the_file_and_the_line(tmp_path, ids, capsys,
                                                                  no_model):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n\n{bad\n')
    rc, err = _run(tmp_path, bad, [], capsys)
    assert rc == 2 and f"--data {bad}:3: not JSON" in _one_error_line(err)
    bad.write_text('{"prompt": "hi"}\n[1, 2]\n')
    rc, err = _run(tmp_path, bad, [], capsys)
    assert rc == 2 and f"--data {bad}:2: expected a JSON object" in _one_error_line(err)
    flat = tmp_path / "flat.json"
    flat.write_text("[1, 2]")
    rc, err = _run(tmp_path, flat, [], capsys)
    assert rc == 2
    assert _one_error_line(err) == (f"error: --data {flat}: expected a JSON list of token-id "
                                    "lists")
    torn = tmp_path / "torn.json"
    torn.write_text("[[1, 2], [3")
    rc, err = _run(tmp_path, ids, ["--eval-data", str(torn), "--eval-prompts", "3"], capsys)
    assert rc == 2 and f"--eval-data {torn}: not JSON" in _one_error_line(err)


def test_no_prompts_is_said_as_such(tmp_path, capsys, no_model):
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    rc, err = _run(tmp_path, empty, [], capsys)
    assert rc == 2 and _one_error_line(err) == f"error: --data {empty} holds no prompts"


def test_what_needs_the_targets_config_is_refused_before_regenerating(tmp_path, ids, capsys,
                                                                      no_regeneration):
    rc, err = _run(tmp_path, ids, ["--draft-vocab", "100000"], capsys)
    assert rc == 2
    assert "--draft-vocab 100000 exceeds the target's vocabulary of 512" in _one_error_line(err)
    rc, err = _run(tmp_path, ids, ["--kind", "block", "--draft-vocab", "100000"], capsys)
    assert rc == 2 and "--draft-vocab 100000 exceeds" in _one_error_line(err)
    # the engine's own message, in train-drafter's flag
    rc, err = _run(tmp_path, ids, ["--max-len", "100000"], capsys)
    line = _one_error_line(err)
    assert rc == 2 and "--max-len 100000 exceeds the model's context" in line
    assert "--max-model-len" not in line
