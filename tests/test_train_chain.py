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
    fit_history,
    held_out,
    jsonl_prompts,
    sharegpt_code_prompts,
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


def _code_conversations(n: int) -> list[dict]:
    """Conversations whose assistant turns hold fenced code: a block of 6 + i lines, the same
    block quoted again in a later turn, a 3-line block (too short) and code in a human turn."""
    convs = []
    for i in range(n):
        block = "\n".join(f"line{i}_{k} = {k}" for k in range(6 + i))
        convs.append({"id": f"k{i}", "conversations": [
            {"from": "human", "value": "```py\nhuman_code = 1\nx = 2\ny = 3\nz = 4\n```"},
            {"from": "gpt", "value": f"Here:\n```python\n{block}\n```\nand short:\n"
                                     "```\na\nb\nc\n```"},
            {"from": "human", "value": "again"},
            {"from": "gpt", "value": f"Same:\n```python\n{block}\n```"}]})
    return convs


def test_code_prompts_are_the_opening_lines_of_the_assistants_code_blocks(tmp_path):
    convs = _code_conversations(12)
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    train = sharegpt_code_prompts("train", path=str(path))
    held = sharegpt_code_prompts("held_out", path=str(path))
    # the short block and the human's code give none; the block quoted again gives a prompt
    # only where its cut differs: none twice; each conversation in its id's split
    got = train + held
    assert len(set(got)) == len(got)
    by_conv = {i: sum(p.startswith(f"line{i}_") for p in got) for i in range(12)}
    assert set(by_conv.values()) <= {1, 2} and 2 in by_conv.values()
    assert {int(p.split("_")[0][len("line"):]) for p in held} == {
        i for i, c in enumerate(convs) if held_out(c["id"])}
    for p in train + held:
        i = int(p.split("_")[0][len("line"):])
        lines = p.split("\n")
        assert p.endswith("\n") and lines[-1] == ""
        assert 1 <= len(lines) - 1 <= (6 + i) // 2  # the first 1 .. n // 2 lines
        assert lines[:-1] == [f"line{i}_{k} = {k}" for k in range(len(lines) - 1)]
    assert sharegpt_code_prompts("train", path=str(path)) == train  # the same every run
    assert len({len(p.split("\n")) for p in train + held}) > 1  # cuts vary by block
    assert sharegpt_code_prompts("train", path=str(path), limit=2) == train[:2]
    with pytest.raises(ValueError, match="split"):
        sharegpt_code_prompts("test", path=str(path))


def test_train_drafter_regenerates_code_prompts_as_raw_text(tmp_path, monkeypatch,
                                                             default_gguf_path):
    """--data sharegpt-code: the prompts reach the target as bare text, not as a user's chat
    turn (the chat template would wrap them in <|im_start|>user ...); with other sources
    after a comma, theirs follow in turn, as they are, up to --num-prompts in all."""
    from draftgraph.cli import main
    from draftgraph.models.loader import load_model
    from draftgraph.train import data

    path = tmp_path / "sg.json"
    path.write_text(json.dumps(_code_conversations(6)))
    monkeypatch.setattr(data, "sharegpt_path", lambda: str(path))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([[5, 6, 7, 8], [9, 10, 11], [12, 13]]))
    code = sharegpt_code_prompts("train", path=str(path))
    out = tmp_path / "run"
    assert main(["train-drafter", default_gguf_path, "--out", str(out), "--data",
                 f"sharegpt-code,{ids}", "--num-prompts", str(len(code) + 2),
                 "--max-new-tokens", "3", "--max-len", "96", "--steps", "0",
                 "--eval-prompts", "0"]) == 0
    saved = json.loads((out / "sequences.json").read_text())["sequences"]
    tok = load_model(default_gguf_path).tokenizer
    want = [tok.encode(p, add_special_tokens=False) for p in code] + [[5, 6, 7, 8], [9, 10, 11]]
    assert [s["ids"][:s["prompt_len"]] for s in saved] == want
    assert all(s["prompt_len"] < len(s["ids"]) for s in saved)  # responses regenerated


def test_fit_history_drops_the_oldest_exchanges_until_the_prompt_fits():
    msgs = [{"role": "user", "content": "a " * 30}, {"role": "assistant", "content": "b " * 30},
            {"role": "user", "content": "c " * 10}, {"role": "assistant", "content": "d"},
            {"role": "user", "content": "e " * 5}]

    def encode(m):  # a word a token, and a context of 60 the way the engine refuses
        ids = [0] * sum(len(x["content"].split()) for x in m)
        if len(ids) > 60:
            raise ValueError("longer than the context")
        return ids

    # whole, 76 tokens: past the context (the encoder refuses), so not fitting either
    assert fit_history(msgs, encode, 100) == ([0] * 16, 2)  # a whole exchange dropped
    assert fit_history(msgs, encode, 40) == ([0] * 16, 2)
    assert fit_history(msgs, encode, 10) == ([0] * 5, 4)  # the last turn alone
    assert fit_history(msgs, encode, 4) == (None, 5)  # not even that
    # the kept history opens with a user turn, wherever the user turns fall
    odd = [{"role": "user", "content": "x " * 50}, {"role": "user", "content": "y " * 20},
           {"role": "assistant", "content": "z"}, {"role": "user", "content": "w"}]
    assert fit_history(odd, encode, 30) == ([0] * 22, 1)


def test_init_draft_vocab_starts_an_own_lm_head_at_the_targets_rows():
    from draftgraph.models.config import ModelConfig
    from draftgraph.train.loop import Sequence, init_draft_vocab

    cfg = ModelConfig.from_hf_dict(tiny_hf_model().config.to_dict())
    target_lm = torch.randn(cfg.vocab_size, cfg.hidden_size)
    seqs = [Sequence([1, 2, 3, 7, 7, 7, 9, 9], 3), Sequence([4, 5, 9, 7, 3], 2)]
    head = random_head(cfg, "draft_vocab=3")
    init_draft_vocab(head, seqs, 3, 128, target_lm)
    assert head.d2t.tolist() == [3, 7, 9]  # the most frequent response tokens, ascending
    assert torch.equal(head.lm_head.weight, target_lm[[3, 7, 9]])
    shared = random_head(cfg, "draft_vocab=3,share_lm_head=1")
    init_draft_vocab(shared, seqs, 3, 128, target_lm)  # no LM head of its own: d2t alone
    assert shared.lm_head is None and shared.d2t.tolist() == [3, 7, 9]


def test_sampled_regeneration_is_the_engines_sampled_output_and_repeats():
    """--temperature: each prompt's response is what the engine samples for it at that
    temperature with seed `seed + i` (so a run regenerates the same data), not greedy, and the
    prompts are not all drawn from one seed."""
    engine = tiny_engine(tiny_hf_model(seed=5))
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11]]
    greedy = regenerate(engine, prompts, 24)
    hot = regenerate(engine, prompts, 24, temperature=1.5, seed=3)
    again = regenerate(engine, prompts, 24, temperature=1.5, seed=3)
    assert [s.ids for s in hot] == [s.ids for s in again]
    assert [s.prompt_len for s in hot] == [4, 4, 3]
    assert [s.ids for s in hot] != [s.ids for s in greedy]
    assert hot[0].ids != hot[1].ids  # one prompt twice: seeds 3 and 4
    for i, p in enumerate(prompts):
        want = engine.generate([p], SamplingParams(max_tokens=24, temperature=1.5,
                                                   seed=3 + i))[0].token_ids
        assert hot[i].ids == p + want
    # any --seed: the seeds wrap into the engine's range (2**63 + 3 is seed 3)
    assert [s.ids for s in regenerate(engine, prompts, 24, 1.5, seed=2**63 + 3)] == \
        [s.ids for s in hot]


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
    tc = TrainConfig(steps=80, lr=3e-3, batch_tokens=256, warmup=10, checkpoint_every=40,
                     eval_every=20)
    state = train_head(head, engine.model, seqs, tc, out, "cpu", torch.float32, "torch",
                       progress=False, eval_seqs=seqs[:3])
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


def test_acceptance_replayed_from_the_training_forward_is_the_engines(trained):
    """The trained head's greedy speculation in the engine (k = 4, catch-up after every round,
    the prefill observed) accepts exactly the drafts that the training loss's levels predict
    along the same output sequences, walked as the engine walks (`replay_acceptance`): the
    trainer's held-out `accept_replayed` scores what the engine will run."""
    from draftgraph.train.chain import replay_acceptance, ttt_loss
    from draftgraph.train.loop import TargetOracle

    hf, prompts, out, _, _, _, _ = trained
    head = load_head(os.path.join(out, "head"), tiny_loaded(hf).config)
    # every prompt prefilled in the first step: no later step mixes a prefill chunk with
    # decode rows (those rows draft nothing, which a replay along the sequence cannot know)
    engine = tiny_engine(hf, budget=256, spec=SpecConfig(method="ngram", num_draft_tokens=4,
                                                         adaptive=False),
                         drafter=ChainHeadDrafter(head, 4))
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0,
                                                   ignore_eos=True))
    model = engine.model
    oracle = TargetOracle(model, head.head_config.hidden_layer_ids, 64, 1, 64, "cpu",
                          torch.float32, "torch")
    replayed = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                "accepted_per_pos": [0] * 4}
    for prompt, o in zip(prompts, outs, strict=True):
        ids = prompt + o.token_ids
        streams, logits = oracle([ids])
        mask = torch.zeros(1, len(ids), dtype=torch.bool)
        mask[0, len(prompt) - 1 : len(ids) - 1] = True  # the response positions, as trained
        with torch.no_grad():
            _, _, preds = ttt_loss(head, model.embed_tokens.weight, model.lm_head_weight,
                                   streams[None], logits[None], torch.tensor([ids]), mask, 4,
                                   0.8)
        walk = replay_acceptance(preds[:, 0], ids, len(prompt), 4)
        for key, total in replayed.items():
            v = walk[key]
            replayed[key] = ([a + b for a, b in zip(total, v, strict=True)]
                             if isinstance(v, list) else total + v)
    s = engine.stats
    assert s["num_accepted_tokens"] > 0.3 * s["num_drafts"]  # a head that gets drafts accepted
    assert replayed == {key: s[key] for key in replayed}


def test_a_one_wide_draft_tree_is_the_chain(trained):
    """benchmarks/tree_accept.py's tree of width 1 is the chain: its node at depth d has the
    stream of training-time-test level d at t + d (it attends to the sequence's level-0
    entries up to t and to its ancestors, at the chain's positions: a node that missed its
    ancestors, or sat at a wrong position, has another stream), and walks exactly the chain
    replay's rounds along the trained head's sequences; a wider tree with every node
    verified accepts no fewer tokens here."""
    import sys
    from pathlib import Path

    from draftgraph.train.chain import replay_acceptance, ttt_loss, ttt_streams
    from draftgraph.train.loop import TargetOracle

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import tree_accept

    hf, _, out, _, _, seqs, engine = trained
    head = load_head(os.path.join(out, "head"), tiny_loaded(hf).config).float()
    model = engine.model
    drafter = tree_accept.TreeDrafter(head, model.embed_tokens.weight, model.lm_head_weight)
    oracle = TargetOracle(model, head.head_config.hidden_layer_ids, 64, 1, 64, "cpu",
                          torch.float32, "torch")
    chain = tree = wide = compared = 0
    with torch.no_grad():
        for s in seqs[:4]:
            streams, logits = oracle([s.ids])
            mask = torch.zeros(1, len(s.ids), dtype=torch.bool)
            mask[0, s.prompt_len - 1 : len(s.ids) - 1] = True
            _, _, preds = ttt_loss(head, model.embed_tokens.weight, model.lm_head_weight,
                                   streams[None], logits[None], torch.tensor([s.ids]), mask,
                                   4, 0.8)
            chain += replay_acceptance(preds[:, 0], s.ids, s.prompt_len, 4)[
                "num_accepted_tokens"]
            context = drafter.context(streams, s.ids)
            levels = ttt_streams(head, model.embed_tokens.weight, streams[None],
                                 torch.tensor([s.ids]), 4)
            for t in range(s.prompt_len, len(s.ids) - 4):
                parent, token, _, node_streams = drafter.grow(*context, t, 1, 4)
                assert parent == [-1, 0, 1, 2]  # one node a depth, each the last one's child
                for d in (1, 2, 3):  # node d - 1 (depth d), as level d reads the sequence's
                    if token[d - 1] != s.ids[t + d]:  # tokens: equal while the drafts are
                        break
                    torch.testing.assert_close(node_streams[d - 1], levels[d][0, t + d],
                                               rtol=1e-5, atol=1e-5)
                    compared += 1
            tree += tree_accept.walk(drafter, context, s.ids, s.prompt_len, 1, 4, 4)["accepted"]
            wide += tree_accept.walk(drafter, context, s.ids, s.prompt_len, 3, 4, 30)["accepted"]
    assert compared > 20 and chain > 10 and tree == chain
    assert wide >= chain


def test_the_held_out_evaluation_scores_the_head_as_the_loss_does(trained):
    """The history's held-out entries are the training loss and agreement of the head at that
    step on the held-out sequences (here the first three training ones), computed directly."""
    from draftgraph.train.chain import replay_acceptance, ttt_loss
    from draftgraph.train.loop import TargetOracle

    hf, _, out, state, tc, seqs, engine = trained
    evals = [h for h in state.history if "eval" in h]
    assert [h["step"] for h in evals] == [20, 40, 60, 80]
    assert evals[-1]["eval"]["accept_estimate"] > evals[0]["eval"]["accept_estimate"]
    cfg = tiny_loaded(hf).config
    head = load_head(os.path.join(out, "head"), cfg)  # the final head, saved in bf16
    model = engine.model
    held = seqs[:3]
    oracle = TargetOracle(model, head.head_config.hidden_layer_ids, sum(len(s.ids) for s in held),
                          3, 64, "cpu", torch.float32, "torch")
    streams, logits = oracle([s.ids for s in held])
    s_max = max(len(s.ids) for s in held)
    tok = torch.zeros(3, s_max, dtype=torch.int64)
    st = streams.new_zeros(3, s_max, streams.shape[-1])
    lg = logits.new_zeros(3, s_max, logits.shape[-1])
    mask = torch.zeros(3, s_max, dtype=torch.bool)
    off = 0
    for i, s in enumerate(held):
        n = len(s.ids)
        tok[i, :n], st[i, :n], lg[i, :n] = torch.tensor(s.ids), streams[off:off + n], \
            logits[off:off + n]
        mask[i, s.prompt_len - 1 : n - 1] = True
        off += n
    with torch.no_grad():
        loss, agree, preds = ttt_loss(head, model.embed_tokens.weight, model.lm_head_weight, st,
                                      lg, tok, mask, tc.ttt_steps, tc.decay)
    # the trained fp32 head against its bf16 copy: close, not bitwise
    assert abs(loss.item() - evals[-1]["eval"]["loss"]) < 0.05 * evals[-1]["eval"]["loss"] + 0.02
    assert max(abs(a - b) for a, b in zip(agree, evals[-1]["eval"]["agree"],
                                          strict=True)) < 0.1
    # and the engine's walk along the held-out outputs, from the same predictions
    walks = [replay_acceptance(preds[:, i], s.ids, s.prompt_len, tc.ttt_steps)
             for i, s in enumerate(held)]
    replayed = 1 + sum(w["num_accepted_tokens"] for w in walks) / sum(w["num_drafts"]
                                                                     for w in walks)
    assert abs(replayed - evals[-1]["eval"]["accept_replayed"]) < 0.15
    assert all("accept_replayed" in h for h in state.history)


def test_a_run_resumes_from_its_checkpoint(trained):
    hf, _, out, state, tc, seqs, engine = trained
    head = random_head(tiny_loaded(hf).config, "", seed=7)
    more = TrainConfig(**{**tc.__dict__, "steps": tc.steps + 5})
    resumed = train_head(head, engine.model, seqs, more, out, "cpu", torch.float32, "torch",
                         progress=False)
    assert resumed.step == tc.steps + 5
    assert len(resumed.history) == tc.steps + 5
    assert resumed.history[: tc.steps] == state.history


def test_a_run_starts_from_a_heads_weights(trained, tmp_path):
    """--init-head: a fresh run (new optimizer and schedule) starts from a trained head's
    weights, so its first steps' loss is the trained head's, far below a random head's; a
    reduced chain head sharing the target's LM head trains on over the whole vocabulary; a
    head of another shape is refused by name."""
    from draftgraph.models.heads import reduce_vocab, save_head
    from draftgraph.train.loop import init_from_head

    hf, _, out, state, tc, seqs, engine = trained
    cfg = tiny_loaded(hf).config
    saved = load_head(os.path.join(out, "head"), cfg)
    head = random_head(cfg, "", seed=7)
    init_from_head(head, os.path.join(out, "head"), cfg)
    for k, t in saved.state_dict().items():
        assert torch.equal(head.state_dict()[k], t), k
    fresh = TrainConfig(**{**tc.__dict__, "steps": 3, "lr": 1e-4, "warmup": 1})
    tuned = train_head(head, engine.model, seqs, fresh, str(tmp_path / "tuned"), "cpu",
                       torch.float32, "torch", progress=False)
    first_random = sum(r["loss"] for r in state.history[:3]) / 3
    first_tuned = sum(r["loss"] for r in tuned.history) / 3
    assert first_tuned < 0.5 * first_random, (first_tuned, first_random)
    # a reduced head sharing the target's LM head: its weights over the whole vocabulary
    reduced = tmp_path / "reduced"
    save_head(reduce_vocab(saved, torch.arange(0, 64, 2), cfg), str(reduced))
    whole = random_head(cfg, "", seed=7)
    init_from_head(whole, str(reduced), cfg)
    assert whole.d2t.numel() == 0 and torch.equal(whole.fc.weight, saved.fc.weight)
    same = random_head(cfg, "draft_vocab=32,share_lm_head=1", seed=7)  # keeps its vocabulary
    init_from_head(same, str(reduced), cfg)
    assert torch.equal(same.d2t, torch.arange(0, 64, 2))
    with pytest.raises(ValueError, match=r"another shape: num_layers 1 \(the flags: 2\)"):
        init_from_head(random_head(cfg, "layers=2"), os.path.join(out, "head"), cfg)
    with pytest.raises(ValueError, match=r"kind chain \(the flags: block\)"):
        init_from_head(random_head(cfg, "", kind="block"), os.path.join(out, "head"), cfg)
    with pytest.raises(ValueError, match="lm_head.weight"):  # the flags ask for an own LM head
        init_from_head(random_head(cfg, "draft_vocab=16", seed=7), str(reduced), cfg)
    # a reduced block head's Markov rows (its draft vocabulary's alone) back over the whole
    # vocabulary: its tokens' rows, zero elsewhere; every other weight as saved
    block = random_head(cfg, "markov_rank=4", kind="block", seed=5)
    vocab = torch.arange(1, 64, 2)
    save_head(reduce_vocab(block, vocab, cfg), str(tmp_path / "block"))
    conf = tmp_path / "block" / "config.json"  # a drafting-time setting, not a shape (the
    conf.write_text(conf.read_text().replace(  # shipped block head's is 0.0)
        '"confidence_threshold": 0.5', '"confidence_threshold": 0.0'))
    assert '"confidence_threshold": 0.0' in conf.read_text()
    whole = random_head(cfg, "markov_rank=4", kind="block", seed=6)
    init_from_head(whole, str(tmp_path / "block"), cfg)
    rows = whole.markov_out.weight
    assert torch.equal(rows[vocab], block.markov_out.weight[vocab])
    assert not rows[::2].any() and rows.shape == block.markov_out.weight.shape
    for name, t in block.state_dict().items():
        if name != "markov_out.weight":
            assert torch.equal(whole.state_dict()[name], t), name
    with pytest.raises(ValueError, match="markov_rank 4 \\(the flags: 2\\)"):
        init_from_head(random_head(cfg, "markov_rank=2", kind="block"),
                       str(tmp_path / "block"), cfg)


def test_a_head_config_that_does_not_fit_is_refused(trained):
    import dataclasses

    hf, _, out, _, tc, seqs, engine = trained
    cfg = tiny_loaded(hf).config
    other = dataclasses.replace(cfg, hidden_size=2 * cfg.hidden_size)
    head = random_head(other, "", seed=1)  # built for a wider target
    with pytest.raises(ValueError, match="hidden size"):
        train_head(head, engine.model, seqs, tc, out, "cpu", torch.float32, "torch")
    with pytest.raises(ValueError, match="chain heads"):
        train_head(random_head(cfg, "", seed=1, kind="block"), engine.model, seqs, tc, out,
                   "cpu", torch.float32, "torch")


def test_train_drafter_cli_runs_and_resumes(tmp_path, capsys):
    from draftgraph.cli import main

    data = tmp_path / "ids.json"
    # the last prompt is longer than --max-len (the engine refuses it): skipped, not fatal
    data.write_text(json.dumps([[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16],
                                list(range(5, 75))]))
    out = tmp_path / "run"
    argv = ["train-drafter", "random:tiny", "--out", str(out), "--data", str(data),
            "--max-new-tokens", "12", "--max-len", "64", "--draft-vocab", "32",
            "--eval-data", str(data), "--eval-every", "3", "--steps", "6",
            "--batch-tokens", "128"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "step 6/6" in err and "1 training prompts skipped" in err
    saved = json.loads((out / "sequences.json").read_text())
    assert len(saved["sequences"]) == 3 and len(saved["sha256"]) == 64
    # the held-out prompts: regenerated once, scored at steps 3 and 6, the best head kept
    assert "held out (3 sequences)" in err
    assert len(json.loads((out / "eval_sequences.json").read_text())["sequences"]) == 3
    history = json.loads((out / "history.json").read_text())["history"]
    assert [h["step"] for h in history if "eval" in h] == [3, 6]
    assert all(len(h["eval"]["agree"]) == 4 and h["eval"]["loss"] > 0
               for h in history if "eval" in h)
    # the summary names the step best/ was kept from: the best replayed walk
    kept = max((h for h in history if "eval" in h), key=lambda h: h["eval"]["accept_replayed"])
    assert (f"best {kept['eval']['accept_replayed']:.3f} at step {kept['step']} (its head"
            in err and "replayed accept length" in err)
    assert json.loads((out / "best" / "config.json").read_text())["draft_vocab_size"] == 32
    assert main(argv[:-4] + ["--steps", "8", "--batch-tokens", "128"]) == 0  # resumes
    assert "step 8/8" in capsys.readouterr().err
    # a run that resumes reads its saved sequences: its prompt files may be gone (a later
    # call on the GPU machine carries none)
    gone = [str(tmp_path / "gone.json") if a == str(data) else a for a in argv[:-4]]
    assert main(gone + ["--steps", "9", "--batch-tokens", "128"]) == 0
    assert "step 9/9" in capsys.readouterr().err
    head = json.loads((out / "head" / "config.json").read_text())
    assert head["draft_vocab_size"] == 32
    # fine-tuning: a new run from the kept head's weights (and its vocabulary)
    tuned = tmp_path / "tuned"
    assert main([str(tuned) if a == str(out) else a for a in argv[:-4]]
                + ["--steps", "2", "--batch-tokens", "128", "--init-head", str(out / "best")]) == 0
    assert f"starting from the weights of {out / 'best'}" in capsys.readouterr().err
    first = json.loads((tuned / "history.json").read_text())["history"][0]["loss"]
    assert first < history[0]["loss"]
    # a reduced vocabulary over the target's own LM-head rows: no LM head to train or ship
    shared = tmp_path / "shared"
    assert main(["train-drafter", "random:tiny", "--out", str(shared), "--data", str(data),
                 "--max-new-tokens", "12", "--max-len", "64", "--draft-vocab", "32",
                 "--share-lm-head", "--eval-prompts", "0", "--steps", "2",
                 "--batch-tokens", "128"]) == 0
    cfg = json.loads((shared / "head" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 32 and cfg["share_lm_head"] is True
    from safetensors import safe_open

    names = [n for f in os.listdir(shared / "head") if f.endswith(".safetensors")
             for n in safe_open(str(shared / "head" / f), "pt").keys()]
    assert "d2t" in names and not any(n.startswith("lm_head") for n in names)
    assert main(["train-drafter", "random:tiny", "--out", str(tmp_path / "x"), "--data",
                 str(data), "--share-lm-head"]) == 2
    assert "--share-lm-head needs --draft-vocab" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["", "layers=2"])
def test_training_time_test_level_j_is_chain_step_j(spec):
    """Level j of the training-time test at position p computes what the engine's chain step j
    computes there: run one speculative step of a random head in the engine, then the
    training-time test over the prompt, the step's last token and its drafts."""
    from draftgraph.train.chain import ttt_streams
    from draftgraph.train.loop import TargetOracle, rms

    hf = tiny_hf_model(seed=5)
    cfg = tiny_loaded(hf).config
    head = random_head(cfg, spec, seed=3)
    drafter = ChainHeadDrafter(head, 4)
    seen: list[torch.Tensor] = []
    take = drafter.take

    def recording_take(ctx, i, logits):
        seen.append(drafter.target_vocab(logits)[0].clone())
        return take(ctx, i, logits)

    drafter.take = recording_take
    engine = tiny_engine(hf, spec=SpecConfig(method="ngram", num_draft_tokens=4,
                                             adaptive=False), drafter=drafter)
    prompt = [5, 9, 17, 33, 2, 61, 7, 40, 11, 23]
    out = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0,
                                                   ignore_eos=True))[0]
    assert len(seen) >= 4
    steps = torch.stack(seen[:4])  # [4, V]: chain steps 0..3 of the first speculative step
    drafts = steps.argmax(-1).tolist()
    seq = prompt + [out.token_ids[0]] + drafts[:3]  # step j feeds the token at len(prompt) + j
    model = engine.model
    oracle = TargetOracle(model, head.head_config.hidden_layer_ids, len(seq), 1, 64, "cpu",
                          torch.float32, "torch")
    streams, _ = oracle([seq])
    with torch.no_grad():
        levels = ttt_streams(head, model.embed_tokens.weight, streams[None],
                             torch.tensor([seq]), 4)
        for j in range(4):
            h = levels[j][0, len(prompt) + j]
            logits = rms(h, head.norm.weight, head.config.rms_norm_eps) @ model.lm_head_weight.T
            torch.testing.assert_close(logits, steps[j], atol=2e-4, rtol=1e-4)
