"""Bad command-line input gets a one-line error naming the flag or file and what to do (exit
status 2, the usage when it is caught before the model loads), never a traceback; a batch of
prompts larger than the server's queue bound runs whole."""

from __future__ import annotations

import json

import pytest

from draftgraph.cli import main, parse_args
from draftgraph.flags import resolve_model
from draftgraph.models import loader


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything loads a model."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loader, "load_model", refuse)


def fails_before_loading(argv: list[str], capsys) -> str:
    """stderr of `draftgraph generate ...argv`, which must exit 2 with the usage."""
    with pytest.raises(SystemExit) as e:
        main(["generate", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: draftgraph generate" in err and "Traceback" not in err
    return err


def fails_after_loading(argv: list[str], capsys) -> str:
    """stderr of `draftgraph generate ...argv`, which must return 2 with one error line."""
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("ids", ["1 2 3", "1,,2", "1,2,", ""])
def test_prompt_ids_apart_by_spaces_or_with_empty_items_are_an_error(ids, capsys, no_loading):
    err = fails_before_loading(["random:tiny", "--prompt-ids", ids], capsys)
    assert f"--prompt-ids {ids!r}: expected comma-separated integers" in err


def test_prompt_ids_may_have_spaces_around_the_commas(capsys):
    assert main(["generate", "random:tiny", "--prompt-ids", "1, 2 ,3", "--max-tokens", "1",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_token_ids"] == [1, 2, 3]


@pytest.mark.parametrize("text", ["", "\n \n\n"])
def test_a_prompts_file_without_prompts_is_an_error_not_the_default_prompt(text, tmp_path,
                                                                           capsys, no_loading):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    err = fails_before_loading(["--prompts-file", str(f)], capsys)
    assert f"--prompts-file {f}: no prompts" in err


def test_a_prompts_file_that_is_not_utf8_names_the_file(tmp_path, capsys, no_loading):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'\xff\xfe{"prompt": "x"}\n')
    err = fails_before_loading(["--prompts-file", str(f)], capsys)
    assert f"--prompts-file {f} is not UTF-8 text" in err


@pytest.mark.parametrize("flags, named", [
    (["--num-draft-tokens", "3"], "--num-draft-tokens is"),
    (["--ngram-min", "2"], "--ngram-min is"),
    (["--ngram-max", "2"], "--ngram-max is"),
    (["--no-adaptive-draft"], "--no-adaptive-draft is"),
    (["--ngram-min", "1", "--no-adaptive-draft"], "--ngram-min, --no-adaptive-draft are"),
])
def test_drafter_flags_without_speculative_are_refused(flags, named, capsys, no_loading):
    err = fails_before_loading(["random:tiny", "--prompt-ids", "1", *flags], capsys)
    assert f"{named} for --speculative (ngram, chain, draft, block)" in err


def test_drafter_flags_with_speculative_are_taken():
    from draftgraph.flags import spec_config_from_args

    spec = spec_config_from_args(parse_args(
        ["generate", "random:tiny", "hi", "--speculative", "ngram", "--ngram-min", "2",
         "--ngram-max", "3", "--no-adaptive-draft", "--num-draft-tokens", "5"]))
    assert (spec.ngram_min, spec.ngram_max, spec.adaptive, spec.num_draft_tokens) == \
        (2, 3, False, 5)
    spec = spec_config_from_args(parse_args(["generate", "random:tiny", "hi",
                                             "--speculative", "ngram"]))
    assert (spec.ngram_min, spec.ngram_max, spec.adaptive) == (1, 4, True)


def test_more_prompts_than_rows_and_queue_all_run_in_prompt_order(capsys):
    prompts = [[3 + i, 4 + i] for i in range(4)]  # 4 prompts, 1 row + 0 waiting
    argv = ["generate", "random:tiny", "--max-tokens", "1", "--json", "--max-num-seqs", "1",
            "--max-waiting", "0"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt_token_ids"] for r in rows] == prompts
    assert all(len(r["token_ids"]) == 1 for r in rows)


@pytest.mark.parametrize("flags, message", [
    (["--max-waiting", "-1"], "--max-waiting must be >= 0, got -1"),
    (["--engine-seed", "-1"], "--engine-seed must be an integer in [0, 9223372036854775807]"),
    (["--engine-seed", "99999999999999999999999"], "--engine-seed must be an integer in [0, "),
    (["--top-k", "-5"], "--top-k must be -1 or 0 (no limit) or a positive integer, got -5"),
    (["--kv-cache-tokens", "16", "--page-size", "64"],
     "--kv-cache-tokens 16 is less than one page of --page-size 64: set --kv-cache-tokens "
     ">= 64 or a smaller --page-size"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--prefill-coalesce-ms", "-1"], "--prefill-coalesce-ms must be in [0, 1000.0], got -1"),
    (["--prefill-coalesce-ms", "nan"], "--prefill-coalesce-ms must be in [0, 1000.0], got nan"),
])
def test_out_of_range_flags_are_refused_naming_the_flag(flags, message, capsys, no_loading):
    err = fails_before_loading(["random:tiny", "--prompt-ids", "1", *flags], capsys)
    assert message in err


def test_top_k_zero_means_no_limit_as_the_help_says():
    from draftgraph.cli import build_parser
    from draftgraph.engine.sampling import SamplingParams

    assert SamplingParams(top_k=0).top_k == -1
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["generate"]
                    .format_help().split())
    assert "-1 or 0 keeps every token" in text


def test_a_prompt_after_options_is_a_prompt():
    args = parse_args(["generate", "default", "--max-tokens", "2", "hello there"])
    assert resolve_model(args) == "default" and args.prompts == ["hello there"]
    assert args.max_tokens == 2


def test_an_unknown_flag_after_a_prompt_is_still_refused(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["generate", "default", "hi", "--max-tokens", "2", "there", "--nope"])
    assert e.value.code == 2
    assert "unrecognized arguments: there --nope" in capsys.readouterr().err


# ---- model sources ----------------------------------------------------------------------------

HF_CONFIG = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64,
             "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2}


def test_hf_config_without_the_shape_names_the_missing_fields(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    err = fails_after_loading([str(tmp_path), "--prompt-ids", "1"], capsys)
    assert (f"error: {tmp_path / 'config.json'} lacks vocab_size, hidden_size, "
            "intermediate_size, num_hidden_layers, num_attention_heads") in err


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_broken_json_in_a_model_dir_names_the_file(name, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / name).write_text("{not json")
    err = fails_after_loading([str(tmp_path), "--prompt-ids", "1"], capsys)
    assert f"error: {tmp_path / name} is not valid JSON (Expecting" in err


def test_broken_json_in_a_draft_heads_config_names_the_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text("")
    err = fails_after_loading(["random:tiny", "--prompt-ids", "1", "--max-tokens", "1",
                               "--speculative", "chain", "--draft-head", str(tmp_path)],
                              capsys)
    assert f"{tmp_path / 'config.json'} is not valid JSON (Expecting value" in err


def test_a_dir_with_only_config_json_says_it_has_no_weights(tmp_path, capsys, no_loading):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    err = fails_before_loading([str(tmp_path), "hello"], capsys)
    assert f"{tmp_path}: no *.safetensors files" in err
    assert "has weights" not in err and "tokenizer" not in err


def test_a_mistyped_preset_is_reported_before_the_tokenizer(capsys, no_loading):
    err = fails_before_loading(["random:tinyy", "hello"], capsys)
    assert "unknown model preset 'tinyy'" in err and "tokenizer" not in err


def test_a_kv_pool_too_large_for_memory_names_the_flag(monkeypatch, capsys):
    import builtins

    from draftgraph.runtime import kv_cache

    def small_lists_only(items=()):  # --kv-cache-tokens 10**11 fails so without a patch
        if isinstance(items, range) and len(items) > 10**6:
            raise MemoryError
        return builtins.list(items)

    monkeypatch.setattr(kv_cache, "list", small_lists_only, raising=False)
    err = fails_after_loading(["random:tiny", "--prompt-ids", "1", "--kv-cache-tokens",
                               str(10**11)], capsys)
    assert "lower --kv-cache-tokens" in err
