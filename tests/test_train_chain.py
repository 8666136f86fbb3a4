"""Drafter training (train/): the ShareGPT reader survives a truncated file; a tiny chain head
trained for a few steps on a few of the target's own sequences lowers its loss and raises its
real accept length against the same random head untrained; a run resumes from its checkpoint;
the training-time test's level j sees what chain step j sees."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _tiny import tiny_engine, tiny_hf_model, tiny_loaded

from draftgraph.config import SpecConfig
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.heads import load_head, random_head
from draftgraph.spec.chain_head import ChainHeadDrafter
from draftgraph.train.chain import (
    TrainConfig,
    expected_accept_length,
    regenerate,
    train_head,
)
from draftgraph.train.data import (
    held_out,
    jsonl_prompts,
    sharegpt_conversations,
    sharegpt_prompts,
)


def test_the_sharegpt_reader_survives_a_truncated_file(tmp_path):
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i} " * 50},
                                               {"from": "gpt", "value": "a"}]}
             for i in range(40)]
    text = json.dumps(convs)
    cut = text[: len(text) - len(json.dumps(convs[-1])) // 2]  # torn inside the last element
    path = tmp_path / "sg.json"
    path.write_text(cut)
    got = list(sharegpt_conversations(str(path), chunk=97))  # elements span many chunks
    assert [c["id"] for c in got] == [f"c{i}" for i in range(39)]
    path.write_text(text)
    assert len(list(sharegpt_conversations(str(path), chunk=64))) == 40
    assert held_out("x") in (True, False) and held_out("x") == held_out("x")
    chat = [{"id": "m", "conversations": [{"from": "human", "value": "a"},
                                          {"from": "gpt", "value": "b"},
                                          {"from": "human", "value": "c"}]}]
    path.write_text(json.dumps(chat))
    split = "held_out" if held_out("m") else "train"
    assert sharegpt_prompts(split, path=str(path)) == [[{"role": "user", "content": "a"}]]
    assert sharegpt_prompts(split, path=str(path), turns="all")[1] == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}]
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", '
                                      '"content": "yo"}]}\n')
    assert jsonl_prompts(str(tmp_path / "p.jsonl")) == ["hi", [{"role": "user",
                                                                "content": "yo"}]]
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        jsonl_prompts(str(tmp_path / "bad.jsonl"))


def test_expected_accept_length():
    assert expected_accept_length([1.0, 1.0]) == 3.0
    assert expected_accept_length([0.5, 0.5]) == 1.75


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    hf = tiny_hf_model(seed=5)
    engine = tiny_engine(hf)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 16, (8,), generator=g)]
    seqs = regenerate(engine, prompts, 40)
    cfg = tiny_loaded(hf).config
    head = random_head(cfg, "", seed=1)
    out = str(tmp_path_factory.mktemp("run"))
    tc = TrainConfig(steps=80, lr=3e-3, batch_tokens=256, warmup=10, checkpoint_every=40)
    state = train_head(head, engine.model, seqs, tc, out, "cpu", torch.float32, "torch",
                       progress=False)
    return hf, prompts, out, state, tc, seqs, engine


def _accept_length(hf, head, prompts) -> float:
    engine = tiny_engine(hf, spec=SpecConfig(method="ngram", num_draft_tokens=4,
                                             adaptive=False),
                         drafter=ChainHeadDrafter(head, 4))
    engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    s = engine.stats
    return 1 + s["num_accepted_tokens"] / s["num_drafts"]


def test_a_trained_head_lowers_its_loss_and_raises_its_accept_length(trained):
    hf, prompts, out, state, _, _, _ = trained
    h = state.history
    first = sum(r["loss"] for r in h[:8]) / 8
    last = sum(r["loss"] for r in h[-8:]) / 8
    assert last < 0.5 * first
    assert h[-1]["accept_estimate"] > h[0]["accept_estimate"] + 0.5
    cfg = tiny_loaded(hf).config
    shipped = load_head(os.path.join(out, "head"), cfg)  # the directory --draft-head takes
    untrained = random_head(cfg, "", seed=1)
    assert _accept_length(hf, untrained, prompts[:4]) < 1.1
    assert _accept_length(hf, shipped, prompts[:4]) > 1.3  # (1.45 measured; random ~1.0)
    for name in ("history.json", "loss.png", "checkpoint.pt"):
        assert os.path.getsize(os.path.join(out, name)) > 0


def test_a_run_resumes_from_its_checkpoint(trained):
    hf, _, out, state, tc, seqs, engine = trained
    head = random_head(tiny_loaded(hf).config, "", seed=7)
    more = TrainConfig(**{**tc.__dict__, "steps": tc.steps + 5})
    resumed = train_head(head, engine.model, seqs, more, out, "cpu", torch.float32, "torch",
                         progress=False)
    assert resumed.step == tc.steps + 5
    assert len(resumed.history) == tc.steps + 5
    assert resumed.history[: tc.steps] == state.history


def test_a_head_config_that_does_not_fit_is_refused(trained):
    hf, _, out, _, tc, seqs, engine = trained
    head = random_head(tiny_loaded(hf).config, "layers=2", seed=1)
    with pytest.raises(ValueError, match="1-layer"):
        train_head(head, engine.model, seqs, tc, out, "cpu", torch.float32, "torch")


def test_train_drafter_cli_runs_and_resumes(tmp_path, capsys):
    from draftgraph.cli import main

    data = tmp_path / "ids.json"
    # the last prompt is longer than --max-len (the engine refuses it): skipped, not fatal
    data.write_text(json.dumps([[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16],
                                list(range(5, 75))]))
    out = tmp_path / "run"
    argv = ["train-drafter", "random:tiny", "--out", str(out), "--data", str(data),
            "--max-new-tokens", "12", "--max-len", "64", "--draft-vocab", "32", "--steps", "6",
            "--batch-tokens", "128"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "step 6/6" in err and "1 prompts skipped" in err
    saved = json.loads((out / "sequences.json").read_text())
    assert len(saved["sequences"]) == 3 and len(saved["sha256"]) == 64
    assert main(argv[:-4] + ["--steps", "8", "--batch-tokens", "128"]) == 0  # resumes
    assert "step 8/8" in capsys.readouterr().err
    head = json.loads((out / "head" / "config.json").read_text())
    assert head["draft_vocab_size"] == 32
