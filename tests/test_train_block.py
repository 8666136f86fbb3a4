"""Block-head training (train/block.py): the training forward computes what the block drafter
computes at inference (the head's own executor over the slot space: injected context KV, a
DRAFT_BLOCK forward on the torch backend, and on the Triton one in its interpreter), windows
shorter than the context included; the loss is its definition, recomputed row by row; a tiny
block head trained for a few dozen steps on a few of the target's own sequences lowers its
DSpark loss and raises its agreement, its accept length estimate and its real accept length in
the engine against the same random head untrained; a run resumes exactly where it stopped;
`train-drafter --kind block` writes a head directory that loads as a BlockHead."""

from __future__ import annotations

import json
import math
import os
import types

import pytest
import torch
from _tiny import tiny_engine, tiny_hf_model, tiny_loaded

from draftgraph.attention.backend import ForwardBatch, Phase
from draftgraph.config import SpecConfig
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.block_head import BlockHead
from draftgraph.models.heads import load_head, random_head
from draftgraph.runtime.executor import ModelExecutor
from draftgraph.runtime.slot_space import SlotSpace
from draftgraph.spec.block import BlockHeadDrafter
from draftgraph.train.block import (
    BlockTrainConfig,
    block_forward,
    confidence_logit,
    default_mask_token_id,
    draft_logits,
    dspark_loss,
    position_weights,
    sample_anchors,
    train_block_head,
)
from draftgraph.train.loop import OracleBatch, Sequence, TargetOracle, regenerate

SPEC = "block_size=5,window=8,markov_rank=8,confidence=1,mask_token_id=127"


@pytest.fixture(scope="module")
def hf():
    """The tiny random target with its LM head scaled up: peaked next-token distributions (the
    TV term then matters as it does for a trained model) and the same greedy tokens."""
    model = tiny_hf_model(seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


@pytest.fixture(scope="module")
def data(hf):
    engine = tiny_engine(hf)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 16, (8,), generator=g)]
    return engine, prompts, regenerate(engine, prompts, 40)


def _oracle_batch(engine, head, seqs: list[Sequence]) -> OracleBatch:
    total = sum(len(s.ids) for s in seqs)
    oracle = TargetOracle(engine.model, head.head_config.hidden_layer_ids, total, len(seqs),
                          max(len(s.ids) for s in seqs), "cpu", torch.float32, "torch")
    streams, logits = oracle([s.ids for s in seqs])
    offsets = [0]
    for s in seqs[:-1]:
        offsets.append(offsets[-1] + len(s.ids))
    return OracleBatch(seqs, streams, logits, offsets)


def _inference_block(engine, head: BlockHead, batch: OracleBatch, anchors: list[int],
                     backend_name: str = "torch"):
    """What the block drafter computes for the blocks anchored at `anchors` (one per sequence
    of `batch`, all in one DRAFT_BLOCK forward): the head's executor over its own slot space,
    the context K/V of positions 0 .. a - 1 injected from the target's streams, then the block
    [t_a, m, ...] at positions a .. a + g - 1, on the attention backend named. Returns
    (hidden [bs, g, H], base logits [bs, g - 1, V] through the target's LM head)."""
    g, bs = head.block_size, len(anchors)
    slots = SlotSpace(256, 1, bs, 128, torch.device("cpu"))
    ex = ModelExecutor(head, slots, bs, 128, torch.device("cpu"), torch.float32, backend_name)
    ex.meta.add_block_lists(head.head_config.window, g)
    backend = ex.backend

    def t(x):
        return torch.tensor(x, dtype=torch.int64)

    ctx_loc = [list(range(1 + 64 * r, 1 + 64 * r + a)) for r, a in enumerate(anchors)]
    fb = ForwardBatch(Phase.EXTEND, t([0] * sum(anchors)), t(list(range(1, bs + 1))),
                      t(anchors), t(anchors), t([s for loc in ctx_loc for s in loc]), ex.meta)
    backend.build_metadata(fb)
    streams = torch.cat([batch.streams[off : off + a]
                         for off, a in zip(batch.offsets, anchors, strict=True)])
    head.inject_kv(streams, fb, backend)
    ids = [[s.ids[a]] + [head.head_config.mask_token_id] * (g - 1)
           for s, a in zip(batch.seqs, anchors, strict=True)]
    blk_loc = [200 + g * r + j for r in range(bs) for j in range(g)]  # fresh slots
    fb_block = ForwardBatch(Phase.DRAFT_BLOCK, t(ids).flatten(), t(list(range(1, bs + 1))),
                            t([a + g for a in anchors]), t([g] * bs), t(blk_loc), ex.meta)
    backend.build_metadata(fb_block)
    hidden = head(engine.model.embed_tokens(fb_block.input_ids), fb_block, backend)
    logits = head.logits(hidden.view(bs, g, -1)[:, 1:].reshape(bs * (g - 1), -1),
                         engine.model.lm_head_weight)
    return hidden.view(bs, g, -1), logits.view(bs, g - 1, -1)


@pytest.mark.parametrize("spec,backend", [
    ("layers=2,block_size=5,window=3,markov_rank=8,confidence=1,mask_token_id=127", "torch"),
    ("block_size=4,window=64", "torch"),  # a window longer than every context
    # the Triton kernels and in-graph metadata builders (in Triton's interpreter on a CPU)
    ("layers=2,block_size=5,window=3,markov_rank=8,confidence=1,mask_token_id=127", "triton"),
])
def test_the_training_forward_equals_the_drafters_forward(hf, data, spec, backend):
    engine, _, seqs = data
    head = random_head(tiny_loaded(hf).config, spec, seed=4, kind="block")
    # large weights, so that a wrong key set or position shows in the logits
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name and p.dim() == 2:
                p.mul_(20.0)
    g = head.block_size
    batch = _oracle_batch(engine, head, seqs[:3])
    lens = [len(s.ids) for s in batch.seqs]
    # short contexts (shorter than the window) and long ones; a block running past the end
    anchors = [[2, lens[1] - 2, 9], [lens[0] - 3, 5, 1]]
    tokens = batch.padded("tokens")
    for row in anchors:
        with torch.no_grad():
            want_h, want = _inference_block(engine, head, batch, row, backend)
            a = torch.tensor(row)[:, None]  # one block per sequence
            got_h = block_forward(head, engine.model.embed_tokens.weight, batch.padded("streams"),
                                  tokens, a, torch.ones_like(a, dtype=torch.bool))
            prev = torch.stack([torch.tensor(s.ids + [0] * g)[r : r + g - 1]
                                for s, r in zip(batch.seqs, row, strict=True)])[:, None]
            got = draft_logits(head, got_h, engine.model.lm_head_weight, prev)[:, 0]
        torch.testing.assert_close(got_h[:, 0], want_h, rtol=1e-4, atol=1e-4)
        markov = (torch.stack([head.markov(p) for p in prev[:, 0]])
                  if head.markov_in is not None else 0)
        torch.testing.assert_close(got, want + markov, rtol=1e-4, atol=1e-3)
        assert (want.argmax(-1) != want[:, :1].argmax(-1)).any()  # rows differ: a real check
        if head.confidence is not None:
            conf = confidence_logit(head, got_h, prev).sigmoid()[:, 0]
            ref = torch.stack([head.accept_prob(want_h[i, 1:], prev[i, 0])
                               for i in range(len(row))])
            torch.testing.assert_close(conf, ref, rtol=1e-5, atol=1e-5)
    # many anchors at once (the training batch) give what each gives alone
    many = torch.tensor([[1, 4, 7], [2, 3, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        joint = block_forward(head, engine.model.embed_tokens.weight, batch.padded("streams")[:2],
                              tokens[:2], many, valid)
        for i in range(2):
            for j in range(2):
                alone = block_forward(head, engine.model.embed_tokens.weight,
                                      batch.padded("streams")[i : i + 1], tokens[i : i + 1],
                                      many[i : i + 1, j : j + 1], valid[i : i + 1, j : j + 1])
                torch.testing.assert_close(joint[i, j], alone[0, 0], rtol=1e-5, atol=1e-5)


def test_the_dspark_loss_is_its_definition(hf, data, trained):
    """Per draft j of the block at a: 0.1 CE against t_{a+j} + 0.9 TV against the target's
    distribution at a + j - 1 + BCE of the confidence head against "drafts 1 .. j all match",
    the Markov head reading t_{a+j-1}, weighted exp(-(j - 1) / g), averaged over the rows with
    a token to predict; recomputed row by row here from the head's hidden states."""
    w = position_weights(8)
    assert w[0] == 1.0 and torch.allclose(w[3], torch.tensor(2.718281828 ** (-3 / 8)))
    seqs = [Sequence(list(range(10)), 4), Sequence(list(range(6)), 5), Sequence([1, 2, 3], 2)]
    anchors, valid = sample_anchors(seqs, 3, torch.Generator().manual_seed(0), "cpu")
    assert valid.tolist() == [[True, True, True], [False, False, False],
                              [False, False, False]]
    assert all(4 <= a <= 8 for a in anchors[0].tolist())  # response positions, a + 1 < len
    assert len(set(anchors[0].tolist())) == 3
    few, ok = sample_anchors(seqs, 3, torch.Generator().manual_seed(0), "cpu", max_blocks=4)
    assert ok.tolist() == [[True], [False], [False]]  # 4 // 3 sequences: one block each
    engine, _, seqs = data
    # the trained head: it gets some drafts right, so the acceptance labels are not all 0
    head = load_head(os.path.join(trained[0], "head"), tiny_loaded(hf).config)
    batch = _oracle_batch(engine, head, seqs[:2])
    lens = [len(x.ids) for x in batch.seqs]
    anchors = torch.tensor([[batch.seqs[0].prompt_len, lens[0] - 3], [lens[1] - 2, 0]])
    valid = torch.tensor([[True, True], [True, False]])
    tc = BlockTrainConfig()
    emb, lm = engine.model.embed_tokens.weight, engine.model.lm_head_weight
    with torch.no_grad():
        loss, m = dspark_loss(head, emb, lm, batch, anchors, valid, tc)
        hidden = block_forward(head, emb, batch.padded("streams"), batch.padded("tokens"),
                               anchors, valid)
    g = head.block_size
    total = weight = 0.0
    accepted_drafts, hits, rows = 0, [0] * (g - 1), [0] * (g - 1)
    for i, x in enumerate(batch.seqs):
        for k in range(2):
            a = int(anchors[i, k])
            if not valid[i, k]:
                continue
            chain = True
            for j in range(1, g):
                if a + j >= len(x.ids):
                    break
                prev = torch.tensor(x.ids[a + j - 1])
                logits = (hidden[i, k, j] @ lm.T + head.markov(prev[None])[0]).double()
                p_t = batch.logits[batch.offsets[i] + a + j - 1].double().softmax(-1)
                ce = -logits.log_softmax(-1)[x.ids[a + j]]
                tv = 0.5 * (logits.softmax(-1) - p_t).abs().sum()
                chain = chain and int(logits.argmax()) == x.ids[a + j]
                conf = head.accept_prob(hidden[i, k, j][None], prev[None])[0].double()
                bce = -(conf.log() if chain else (1 - conf).log())
                wj = math.exp(-(j - 1) / g)
                total += wj * (0.1 * ce + 0.9 * tv + bce).item()
                weight += wj
                accepted_drafts += chain
                hits[j - 1] += int(logits.argmax()) == x.ids[a + j]
                rows[j - 1] += 1
    assert 0 < accepted_drafts < 3 * (g - 1)
    assert loss.item() == pytest.approx(total / weight, rel=1e-4)
    assert m["accept_estimate"] == pytest.approx(1 + accepted_drafts / 3)
    assert m["agree"] == pytest.approx([h / r for h, r in zip(hits, rows, strict=True)])
    assert m["blocks"] == 3


@pytest.fixture(scope="module")
def trained(hf, data, tmp_path_factory):
    engine, prompts, seqs = data
    cfg = tiny_loaded(hf).config
    head = random_head(cfg, SPEC, seed=1, kind="block")
    out = str(tmp_path_factory.mktemp("run"))
    tc = BlockTrainConfig(steps=60, lr=3e-3, batch_tokens=256, warmup=6, checkpoint_every=30,
                          anchors=8)
    state = train_block_head(head, engine.model, seqs, tc, out, "cpu", torch.float32, "torch",
                             progress=False, eval_seqs=seqs[:2])
    return out, state, tc


def _metrics(engine, head, seqs, tc):
    """The DSpark loss and metrics of `head` on all of `seqs`, with fixed anchors."""
    batch = _oracle_batch(engine, head, seqs)
    anchors, valid = sample_anchors(seqs, 16, torch.Generator().manual_seed(9), "cpu")
    with torch.no_grad():
        loss, m = dspark_loss(head, engine.model.embed_tokens.weight,
                              engine.model.lm_head_weight, batch, anchors, valid, tc)
    return loss.item(), m


def _accept_length(hf, head, prompts) -> float:
    engine = tiny_engine(hf, spec=SpecConfig(method="ngram", adaptive=False),
                         drafter=BlockHeadDrafter(head, confidence_threshold=0.0))
    engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    s = engine.stats
    return 1 + s["num_accepted_tokens"] / s["num_drafts"]


def test_a_trained_block_head_lowers_its_loss_and_raises_its_accept_length(hf, data, trained):
    engine, prompts, seqs = data
    out, state, tc = trained
    h = state.history
    assert len(h) == tc.steps and len(h[0]["agree"]) == 4
    assert {"ce", "tv", "bce", "accept_cut", "drafts_cut"} <= set(h[0])
    first = sum(r["loss"] for r in h[:6]) / 6
    last = sum(r["loss"] for r in h[-6:]) / 6
    assert last < 0.75 * first  # (1.93 -> 1.14 measured)
    cfg = tiny_loaded(hf).config
    shipped = load_head(os.path.join(out, "head"), cfg)  # the directory --draft-head takes
    assert isinstance(shipped, BlockHead) and shipped.head_config.block_size == 5
    untrained = random_head(cfg, SPEC, seed=1, kind="block")
    loss0, m0 = _metrics(engine, untrained, seqs, tc)
    loss1, m1 = _metrics(engine, shipped, seqs, tc)
    assert loss1 < 0.75 * loss0
    assert all(b > a + 0.2 for a, b in zip(m0["agree"], m1["agree"], strict=True))
    assert m1["accept_estimate"] > m0["accept_estimate"] + 1.0
    assert m1["bce"] < m0["bce"]
    real0 = _accept_length(hf, untrained, prompts[:3])
    real1 = _accept_length(hf, shipped, prompts[:3])
    assert real0 < 1.2
    assert real1 > 1.6  # (1.86 measured: the engine's own blocks land after rejections)
    # the held-out evaluation (at the last step) walks the engine's blocks along its outputs
    ev = h[-1]["eval"]
    assert 1.0 < ev["accept_replayed"] <= 5  # block 5: at most 4 drafts and one more
    for name in ("history.json", "loss.png", "checkpoint.pt"):
        assert os.path.getsize(os.path.join(out, name)) > 0


@pytest.mark.parametrize("threshold", [0.0, None])  # no cut, and the head's own cut
def test_acceptance_replayed_from_the_training_forward_is_the_engines(hf, data, trained,
                                                                      threshold):
    """The trained block head in the engine (every prompt prefilled in the first step, then
    one block per step) accepts exactly what `replay_blocks` walks from the training forward
    along the same outputs; with the confidence cut, the rounds that drafted at all match too
    (the count of drafts past the first mismatch may differ: the heads then read the drafts,
    not the true tokens)."""
    from draftgraph.train.block import replay_blocks

    _, prompts, _ = data
    out, _, tc = trained
    head = load_head(os.path.join(out, "head"), tiny_loaded(hf).config)
    if threshold is not None:
        head.head_config.confidence_threshold = threshold
    engine = tiny_engine(hf, budget=256, spec=SpecConfig(method="ngram", adaptive=False),
                         drafter=BlockHeadDrafter(head))
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0,
                                                   ignore_eos=True))
    seqs = [Sequence(p + o.token_ids, len(p)) for p, o in zip(prompts, outs, strict=True)]
    walks = replay_blocks(head, engine.model.embed_tokens.weight, engine.model.lm_head_weight,
                          _oracle_batch(engine, head, seqs), tc.max_blocks)
    s = engine.stats
    assert s["num_accepted_tokens"] > 0.3 * s["num_drafts"]  # drafts get accepted
    for key in ("num_drafts", "num_accepted_tokens"):
        assert sum(w[key] for w in walks) == s[key], key
    per_pos = [sum(c) for c in zip(*(w["accepted_per_pos"] for w in walks), strict=True)]
    assert per_pos == s["accepted_per_pos"]
    if threshold == 0.0:
        assert sum(w["num_draft_tokens"] for w in walks) == s["num_draft_tokens"]


def test_a_block_run_resumes_where_it_stopped(hf, data, tmp_path):
    """A run cut by its time limit after every step, then resumed, is the uninterrupted run:
    same losses, same agreement, same weights."""
    engine, _, seqs = data
    cfg = tiny_loaded(hf).config
    tc = BlockTrainConfig(steps=6, lr=3e-3, batch_tokens=256, warmup=2, checkpoint_every=100,
                          anchors=4)
    whole = train_block_head(random_head(cfg, SPEC, seed=1, kind="block"), engine.model, seqs,
                             tc, str(tmp_path / "a"), "cpu", torch.float32, "torch",
                             progress=False)
    cut = BlockTrainConfig(**{**tc.__dict__, "time_limit_s": 1e-9})  # stops after one step
    for i in range(3):
        head = random_head(cfg, SPEC, seed=1 if i == 0 else 7, kind="block")  # resumed: replaced
        part = train_block_head(head, engine.model, seqs, cut, str(tmp_path / "b"), "cpu",
                                torch.float32, "torch", progress=False)
        assert part.step == i + 1
    resumed = train_block_head(random_head(cfg, SPEC, seed=7, kind="block"), engine.model, seqs,
                               tc, str(tmp_path / "b"), "cpu", torch.float32, "torch",
                               progress=False)
    assert resumed.step == 6 and len(resumed.history) == 6
    for a, b in zip(whole.history, resumed.history, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["agree"] == pytest.approx(b["agree"], abs=1e-6)
    a_head = load_head(str(tmp_path / "a" / "head"), cfg)
    b_head = load_head(str(tmp_path / "b" / "head"), cfg)
    for (name, x), y in zip(a_head.state_dict().items(), b_head.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(x, y, msg=name)


def test_the_default_mask_token_is_a_reserved_special_token():
    def tok(content, special=True):
        return types.SimpleNamespace(content=content, special=special)

    added = {0: tok("<|endoftext|>"), 1: tok("<|im_start|>"), 2: tok("<|im_end|>"),
             3: tok("<repo_name>"), 15: tok("<jupyter_script>"), 16: tok("<empty_output>"),
             17: tok("hello", special=False)}
    fake = types.SimpleNamespace(
        chat_template="{{'<|im_start|>' + m + '<|im_end|>'}}", eos_token_ids={0, 2},
        bos_token_id=1, backend=types.SimpleNamespace(get_added_tokens_decoder=lambda: added))
    embed = torch.ones(32, 4)
    assert default_mask_token_id(fake, embed, 32) == 16  # SmolLM2's choice
    embed[16] = 0  # an untrained (zero) row is never chosen
    assert default_mask_token_id(fake, embed, 32) == 15
    added[20] = tok("<|reserved_special_token_3|>")
    assert default_mask_token_id(fake, embed, 32) == 20
    assert default_mask_token_id(fake, embed, 18) == 15  # ids past the vocabulary skipped
    assert default_mask_token_id(None, None, 32) == 31


def test_train_drafter_cli_trains_a_block_head(tmp_path, capsys):
    from draftgraph.cli import main

    data = tmp_path / "ids.json"
    data.write_text(json.dumps([[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]))
    out = tmp_path / "run"
    argv = ["train-drafter", "random:tiny", "--out", str(out), "--data", str(data),
            "--kind", "block", "--block-size", "4", "--window", "16", "--markov-rank", "4",
            "--max-new-tokens", "12", "--max-len", "64", "--batch-tokens", "128",
            "--anchors", "4", "--steps", "5"]
    assert main(argv + ["--mask-token-id", "100000"]) == 2
    assert "--mask-token-id 100000 is outside the target's vocabulary" in capsys.readouterr().err
    assert main(argv) == 0
    assert "step 5/5" in capsys.readouterr().err
    saved = json.loads((out / "sequences.json").read_text())
    assert len(saved["sequences"]) == 3 and len(saved["sha256"]) == 64
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert (cfg["kind"], cfg["block_size"], cfg["window"], cfg["markov_rank"],
            cfg["confidence"], cfg["num_layers"]) == ("block", 4, 16, 4, True, 2)
    from draftgraph.models.loader import load_model

    target = load_model("random:tiny")
    assert cfg["mask_token_id"] == target.config.vocab_size - 1  # no tokenizer: the last id
    head = load_head(str(out / "head"), target.config)
    assert isinstance(head, BlockHead) and head.confidence is not None
    history = json.loads((out / "history.json").read_text())["history"]
    assert len(history) == 5 and len(history[0]["agree"]) == 3
    assert main(argv[:-2] + ["--steps", "7"]) == 0  # resumes the run
    assert "step 7/7" in capsys.readouterr().err
    # --draft-vocab: trained over the whole vocabulary, drafting over the most frequent
    # response tokens of its sequences (d2t, saved with the head)
    out2 = tmp_path / "reduced"
    assert main([str(out2) if a == str(out) else a for a in argv] + ["--draft-vocab", "32"]) == 0
    capsys.readouterr()
    reduced = load_head(str(out2 / "head"), target.config)
    responses = [t for q in json.loads((out2 / "sequences.json").read_text())["sequences"]
                 for t in q["ids"][q["prompt_len"]:]]
    top = max(set(responses), key=responses.count)
    d2t = reduced.d2t.tolist()
    assert reduced.head_config.draft_vocab_size == 32 and d2t == sorted(set(d2t))
    assert top in d2t and d2t != list(range(32))
    assert reduced.markov_out.weight.shape[0] == 32  # the Markov head's rows d2t alone
