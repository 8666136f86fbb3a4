"""`draftgraph generate | serve | bench`: one grammar (model positional or --model), help and
defaults on every flag, errors before the model loads, the server's max_tokens rule, token-id
prompts, the summary line, --threads."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from draftgraph import cli, flags
from draftgraph.cli import build_parser, main, parse_args
from draftgraph.models import loader


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything loads a model."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loader, "load_model", refuse)


def subparsers(parser: argparse.ArgumentParser, prefix: str = ""):
    """Every ("bench serve", parser) below `parser`, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + name, sub
                yield from subparsers(sub, f"{prefix}{name} ")


# ---- one grammar --------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["serve", "random:tiny"], ["serve", "--model", "random:tiny"],
                                  ["generate", "random:tiny", "hi"],
                                  ["generate", "--model", "random:tiny", "hi"]])
def test_model_is_taken_positionally_or_with_dash_dash_model(argv):
    args = parse_args(argv)
    assert flags.resolve_model(args) == "random:tiny"
    if argv[0] == "generate":
        assert args.prompts == ["hi"]


def test_generate_first_positional_is_a_prompt_unless_it_names_a_model():
    args = parse_args(["generate", "Explain CUDA graphs", "second"])
    assert args.prompts == ["Explain CUDA graphs", "second"]
    assert flags.resolve_model(args) == "default"
    args = parse_args(["generate", "x.gguf", "hello"])
    assert flags.resolve_model(args) == "x.gguf" and args.prompts == ["hello"]


def test_two_different_models_is_an_error_with_the_subcommand_usage(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["serve", "random:tiny", "--model", "default"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: draftgraph serve" in err and "pass the model once" in err


@pytest.mark.parametrize("sub", ["generate", "serve"])
def test_unknown_flag_prints_the_subcommands_usage(sub, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args([sub, "--no-such-flag"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: draftgraph {sub}" in err and "unrecognized arguments: --no-such-flag" in err


def test_every_flag_of_every_subcommand_has_help_and_shows_its_default():
    parser = build_parser()
    subs = dict(subparsers(parser))
    assert {"generate", "serve", "bench", "bench serve", "bench compare"} <= set(subs)
    for name, sub in subs.items():
        assert issubclass(sub.formatter_class, argparse.ArgumentDefaultsHelpFormatter), name
        text = sub.format_help()
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help and action.help.strip(), (name, action.dest)
            shown = (action.default is None or isinstance(action.default, bool)
                     or "default:" in action.help)
            assert shown or f"(default: {action.default})" in " ".join(text.split()), \
                (name, action.dest)
    gen = " ".join(subs["generate"].format_help().split())
    assert "(default: 128)" in gen  # --max-tokens
    assert "(default: 256 on a GPU, 32 on the CPU)" in gen  # --max-num-seqs


def test_generate_and_serve_share_the_engine_flags():
    subs = dict(subparsers(build_parser()))

    def options(p):
        return {s for a in p._actions for s in a.option_strings}

    probe = argparse.ArgumentParser()
    flags.add_engine_args(probe)
    engine_flags = options(probe) - {"-h", "--help"}
    assert {"--threads", "--speculative", "--max-model-len", "--no-weight-cache"} <= engine_flags
    assert engine_flags <= options(subs["generate"]) and engine_flags <= options(subs["serve"])


def test_version_flag(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"draftgraph {version('draftgraph')}"


def test_front_ends_import_down_and_not_each_other():
    sys.path.insert(0, str(Path(__file__).parent))
    import test_layers

    bad = test_layers.violations(test_layers.all_modules(), test_layers.layer_order())
    front = ("draftgraph.cli", "draftgraph.server.cli", "draftgraph.flags",
             "draftgraph.bench.cli", "draftgraph.models.weight_cache",
             "draftgraph.models.loader")

    def involved(line: str) -> bool:
        words = line.replace(":", " ").split()
        if line.endswith("import each other"):
            return words[0] in front or words[2] in front
        return words[0] in front  # the importer

    assert [b for b in bad if involved(b)] == []
    graph = test_layers.all_modules()
    assert "draftgraph.cli" not in {t for t, _ in graph["draftgraph.server.cli"]}


# ---- checked before the model loads -------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["generate", ""], "prompt 1 is empty"),
    (["generate", "ok", "   "], "prompt 2 is empty"),
    (["generate", "random:tiny", "hello"], "random:tiny has random weights and no tokenizer: "
                                           "pass prompts as token ids (--prompt-ids 1,2,3)"),
    (["generate", "--prompt-ids", "1,x"], "expected comma-separated integers"),
    (["generate", "random:tiny", "--prompt-ids", "1", "--max-model-len", "32",
      "--max-tokens", "32"], "--max-tokens 32 leaves no room for a prompt"),
    (["generate", "hi", "--threads", "0"], "--threads must be >= 1"),
    (["generate", "hi", "--page-size", "0"], "--page-size must be >= 1"),
])
def test_bad_arguments_fail_before_the_model_loads(argv, message, capsys, no_loading):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and f"usage: draftgraph {argv[0]}" in err


def test_prompts_file_with_an_empty_prompt_fails_before_loading(tmp_path, capsys, no_loading):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n{"prompt": ""}\n')
    with pytest.raises(SystemExit):
        main(["generate", "--prompts-file", str(f)])
    assert "prompt 2 is empty" in capsys.readouterr().err


def test_hf_dir_without_tokenizer_says_so_not_random_weights(tmp_path, capsys, no_loading):
    from conftest import save_tiny_hf_checkpoint, tiny_llama_config

    save_tiny_hf_checkpoint(str(tmp_path), tiny_llama_config(), tokenizer=False)
    with pytest.raises(SystemExit):
        main(["generate", str(tmp_path), "hello"])
    err = capsys.readouterr().err
    assert f"{tmp_path} has weights but no tokenizer files (tokenizer.json" in err
    assert "random weights" not in err


def test_busy_port_fails_at_once_before_the_model_loads(capsys, no_loading):
    pytest.importorskip("uvicorn")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve", "random:tiny", "--port", str(port)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is already in use" in err and "--port" in err


# ---- generate -----------------------------------------------------------------------------

def test_random_preset_generates_from_prompt_ids(capsys):
    rc = main(["generate", "random:tiny", "--prompt-ids", "5,6,7", "--prompt-ids", "9",
               "--max-tokens", "4", "--ignore-eos", "--json", "--threads", "1"])
    assert rc == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt_token_ids"] for r in rows] == [[5, 6, 7], [9]]
    assert [len(r["token_ids"]) for r in rows] == [4, 4]
    assert all(r["finish_reason"] == "length" for r in rows)
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("draftgraph: 2 prompts (4 tokens): 8 tokens in ")
    assert "tok/s" in summary and "accept length" not in summary


def test_summary_line_reports_accept_length_when_speculating(capsys):
    ids = ",".join(["3", "4", "5", "6"] * 6)  # repeats: the n-gram drafter finds matches
    rc = main(["generate", "random:tiny", "--prompt-ids", ids, "--max-tokens", "12",
               "--ignore-eos", "--speculative", "ngram", "--num-draft-tokens", "3"])
    assert rc == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert "12 tokens in" in summary
    accept = float(summary.split("accept length ")[1].split()[0])
    assert 1.0 <= accept <= 4.0


def test_summary_line_formats_the_outputs_metrics():
    from types import SimpleNamespace as NS

    outs = [NS(token_ids=[1] * 10, prompt_token_ids=[1] * 3,
               metrics={"ttft": 0.5, "verify_steps": 4, "accepted_tokens": 6}),
            NS(token_ids=[1] * 6, prompt_token_ids=[1] * 2,
               metrics={"ttft": 0.25, "verify_steps": 4, "accepted_tokens": 2})]
    line = cli.summary_line(outs, 2.0, speculating=True)
    assert line == ("draftgraph: 2 prompts (5 tokens): 16 tokens in 2.00 s, 8.0 tok/s, "
                    "first token after 0.25 s, accept length 2.00 over 8 verify steps")


def test_max_tokens_past_the_context_is_an_error_as_in_the_server(capsys):
    rc = main(["generate", "random:tiny", "--prompt-ids", "1,2,3", "--max-model-len", "32",
               "--max-tokens", "30"])
    assert rc == 2
    err = capsys.readouterr().err
    assert ("prompt 1 has 3 tokens and --max-tokens is 30; the model's context is 32 tokens "
            "(--max-model-len): ask for at most 29") in err
    assert main(["generate", "random:tiny", "--prompt-ids", "1,2,3", "--max-model-len", "32",
                 "--max-tokens", "29", "--ignore-eos", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert len(row["token_ids"]) == 29  # all of it: not capped


# ---- process flags ------------------------------------------------------------------------

def test_threads_flag_sets_torch_threads_and_defaults_to_physical_cores(monkeypatch):
    before = torch.get_num_threads()
    try:
        args = parse_args(["generate", "hi", "--threads", "1"])
        flags.apply_process_flags(args)
        assert torch.get_num_threads() == 1
        assert parse_args(["generate", "hi"]).threads == flags.physical_cores() >= 1
    finally:
        torch.set_num_threads(before)


def test_oversubscribed_machine_logs_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(flags, "physical_cores", lambda: 4)
    monkeypatch.setattr(flags.os, "getloadavg", lambda: (3.0, 1.0, 1.0))
    with caplog.at_level("WARNING", logger="draftgraph.flags"):
        assert flags.warn_if_oversubscribed(4)
    assert "load average 3.0 on 4 cores with --threads 4" in caplog.text
    assert "try --threads 1" in caplog.text
    monkeypatch.setattr(flags.os, "getloadavg", lambda: (0.2, 1.0, 1.0))
    assert not flags.warn_if_oversubscribed(4)


def test_no_weight_cache_flag_turns_the_cache_off(monkeypatch):
    from draftgraph.models import weight_cache

    monkeypatch.setenv(flags.WEIGHT_CACHE_ENV, "1")  # restored after the test
    assert weight_cache.enabled()
    flags.apply_process_flags(parse_args(["generate", "hi", "--no-weight-cache",
                                          "--threads", str(torch.get_num_threads())]))
    assert not weight_cache.enabled()


def test_server_flags_are_checked_before_the_model_loads(tmp_path, capsys, no_loading):
    pytest.importorskip("uvicorn")
    empty = tmp_path / "key"
    empty.write_text("\n")
    for argv, message in [
        (["--api-key-file", str(empty)], f"--api-key-file {empty} is empty"),
        (["--max-body-bytes", "10"], "--max-body-bytes must be >= 1024"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["serve", "random:tiny", "--port", "0", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "usage: draftgraph serve" in err


@pytest.mark.parametrize("argv, overlap", [([], True), (["--overlap-prefill"], True),
                                           (["--no-overlap-prefill"], False)])
def test_overlap_prefill_is_on_unless_turned_off(argv, overlap):
    args = parse_args(["serve", "random:smollm2-135m", *argv])
    assert flags.engine_config_from_args(args).overlap_prefill is overlap


@pytest.mark.parametrize("argv, on", [
    (["serve", "random:tiny", "--device", "cpu"], True),  # serve on the CPU: on
    (["serve", "random:tiny", "--device", "cpu", "--no-enable-prefix-caching"], False),
    (["serve", "random:tiny"], True),  # a GPU (visible, below): on too
    (["serve", "random:tiny", "--enable-prefix-caching"], True),
    (["serve", "random:tiny", "--device", "cpu", "-tp", "2"], False),  # refused under TP
    (["serve", "random:tiny", "--device", "cpu", "--deterministic"], False),
    (["generate", "random:tiny", "hi", "--device", "cpu"], False),
])
def test_prefix_caching_is_on_for_serve(argv, on, monkeypatch):
    if "--device" not in argv:
        monkeypatch.setattr(flags.torch.cuda, "is_available", lambda: True)
    args = parse_args(argv)
    assert flags.engine_config_from_args(args).cache.enable_prefix_caching is on
