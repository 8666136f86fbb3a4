"""The EAGLE-3-style chain head (`--speculative chain --draft-head`): the target's hidden states
are captured before any norm; the head's KV after every step equals a from-scratch computation
(a head that skips the catch-up, and so keeps entries of rejected drafts, fails it); the fused
chain and the per-step fallback give the same drafts; a no-op metadata advance is caught; random
heads are lossless; at temperature 1 the output follows the target; head directories round-trip
in shards."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _tiny import tiny_engine, tiny_hf_model, tiny_loaded

from draftgraph.attention.backend import Phase, TorchBackend
from draftgraph.config import SpecConfig
from draftgraph.engine.request import Request
from draftgraph.engine.sampling import SamplingParams
from draftgraph.engine.speculation import SpecPolicy
from draftgraph.models.chain_head import HeadConfig
from draftgraph.models.heads import load_head, random_head, save_head
from draftgraph.runtime.executor import ModelExecutor
from draftgraph.runtime.schema import StepBatch
from draftgraph.runtime.slot_space import SlotSpace
from draftgraph.spec import make_drafter
from draftgraph.spec.chain_head import ChainHeadDrafter

K = 4
SPEC = SpecConfig(method="ngram", num_draft_tokens=K, adaptive=False)  # method: see drafter=
GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3] * 5, list(range(40, 70))]


@pytest.fixture(scope="module")
def plain(hf):
    return [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, GREEDY)]


def _head_engine(hf, spec: str = "", catch_up: bool = True, **kw):
    head = random_head(tiny_loaded(hf).config, spec, seed=3)
    drafter = ChainHeadDrafter(head, K, catch_up=catch_up)
    return tiny_engine(hf, spec=SPEC, drafter=drafter, **kw), drafter


@pytest.mark.parametrize("spec", ["", "layers=2", "draft_vocab=64",
                                  "draft_vocab=64,share_lm_head=1"])
def test_a_random_head_is_lossless(hf, plain, spec):
    engine, drafter = _head_engine(hf, spec)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert engine.stats["num_draft_tokens"] > 100
    assert drafter.executor.slots is engine.slots
    assert drafter.executor.kv_pool is not engine.target.kv_pool
    assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots


def test_the_captured_hidden_states_are_the_streams_before_the_norm():
    """Against transformers' output_hidden_states (entry l + 1: the stream after layer l,
    before any norm); a 4-layer target so layers 0..2 are not the normed last one."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    hf = HFLlama(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512)).eval()
    engine, drafter = _head_engine(hf)
    ids = list(range(3, 20))
    assert drafter.capture.layer_ids == (1, 2)  # default_layer_ids(4): 2, 4 // 2, 4 - 3
    engine.target.forward(StepBatch(Phase.EXTEND, ids, [1], [len(ids)], [len(ids)],
                                    list(range(1, len(ids) + 1)), []))
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    got = drafter.capture.out[: len(ids)]
    for i, layer in enumerate((1, 2)):
        torch.testing.assert_close(got[:, i * 64 : (i + 1) * 64], ref[layer + 1][0],
                                   atol=1e-5, rtol=1e-5)


def _reference_kv(engine, drafter: ChainHeadDrafter, tokens: list[int]) -> list:
    """The head's K and V of every position of `tokens`, from scratch: a fresh target executor
    runs the sequence once as a prefill, and a fresh drafter writes its entries from that
    forward's features (per layer: [len, Hkv, D] each)."""
    n, dev = len(tokens), engine.device
    slots = SlotSpace(n + 8, 1, 1, n + 8, dev)
    target = ModelExecutor(engine.model, slots, 1, n + 8, dev, torch.float32,
                           engine.target.backend.name)
    ref = ChainHeadDrafter(drafter.head, drafter.k)
    ref.bind(target)
    sb = StepBatch(Phase.EXTEND, tokens, [1], [n], [n], list(range(1, n + 1)), [])
    target.forward(sb)
    ref.observe(sb)
    pool = ref.executor.kv_pool
    return [(k[1 : n + 1], v[1 : n + 1]) for k, v in zip(pool.k_buffers, pool.v_buffers,
                                                          strict=True)]


LONG = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
KV_PROMPT = [5, 6, 7, 8, 9, 10, 11]


class _Accepting(ChainHeadDrafter):
    """Drafts the plain greedy continuation (so drafts are accepted and the catch-up has
    entries to fix), fed with the head's own features, as a trained head would be."""

    def __init__(self, head, k, future: list[int], **kw) -> None:
        super().__init__(head, k, **kw)
        self.future = torch.tensor(future + [0] * (k + 2))

    def take(self, ctx, i, logits):
        bs = super().take(ctx, i, logits).shape[0]  # (it stages the next step)
        tok = self.future[(ctx.seq_lens[:bs] + i).clamp_max(len(self.future) - 1)]
        self.drafts[:bs, i].copy_(tok)
        self.step_ids[:bs].copy_(tok)
        return tok


class _OneAhead(ChainHeadDrafter):
    """Broken: every step writes and attends one position too far, so it reads the entry
    of the last token's position, which nothing has written this round."""

    def stage_step(self, ctx, i):
        bs = ctx.seq_lens.shape[0]
        torch.add(ctx.seq_lens, i + 1, out=self.step_seq_lens[:bs])
        self.step_loc[:bs].copy_(ctx.reserved_slots[:, i + 1])


def _kv_engine(hf, cls=ChainHeadDrafter, spec: str = "", **kw):
    head = random_head(tiny_loaded(hf).config, spec, seed=3)
    if cls is _Accepting:
        (out,) = tiny_engine(hf).generate([KV_PROMPT], LONG)
        kw["future"] = KV_PROMPT + out.token_ids
    drafter = cls(head, K, **kw)
    return tiny_engine(hf, spec=SPEC, drafter=drafter), drafter


def _max_kv_error(engine, drafter, steps: int = 12, poison: bool = False,
                  prompt: list[int] = KV_PROMPT) -> float:
    """Run one request step by step; after each step compare the head's KV of every position
    before the last token (the entries the next step may read) with the from-scratch values.
    `poison`: then fill the entries from the last token's position on (pending or rejected)
    with NaN, which would spread into every later entry that read them."""
    engine.add_request(prompt, LONG)
    pool = drafter.executor.kv_pool
    worst = 0.0
    for _ in range(steps):
        engine.step()
        (req,) = engine.scheduler.running
        n = req.num_tokens - 1  # entries 0 .. n - 1 are final
        table = engine.slots.req_pool.req_to_token[req.req_pool_idx]
        slots = table[:n]
        for layer, (k, v) in enumerate(_reference_kv(engine, drafter, req.token_slice(0, n))):
            err = max((pool.k_buffers[layer][slots] - k).abs().max().item(),
                      (pool.v_buffers[layer][slots] - v).abs().max().item())
            worst = max(worst, err if err == err else float("inf"))  # NaN: read poison
        if poison:
            ahead = table[n : n + K + 1]
            ahead = ahead[ahead > 0]  # slots the request holds past its final entries
            for buf in pool.k_buffers + pool.v_buffers:
                buf[ahead] = float("nan")
    return worst


@pytest.mark.parametrize("spec", ["", "layers=2"])
def test_the_head_kv_after_every_step_equals_a_from_scratch_computation(hf, spec):
    engine, drafter = _kv_engine(hf, _Accepting, spec)
    assert _max_kv_error(engine, drafter) < 1e-4
    s = engine.stats
    assert s["num_accepted_tokens"] == s["num_draft_tokens"] > 30  # catch-up had work


def test_a_head_that_skips_the_catch_up_keeps_stale_entries(hf):
    """Without the catch-up, accepted positions keep the chain's entries, made from the head's
    own guess of a feature the target has since computed."""
    engine, drafter = _kv_engine(hf, _Accepting, catch_up=False)
    assert _max_kv_error(engine, drafter) > 1e-2


def test_rejected_and_pending_positions_are_never_read(hf):
    """Entries from the last token's position on are poisoned after every step: a random
    head (nearly every draft rejected) never reads them, a head one position off does."""
    engine, drafter = _kv_engine(hf)
    assert _max_kv_error(engine, drafter, poison=True) < 1e-4
    assert engine.stats["num_accepted_tokens"] < engine.stats["num_draft_tokens"]
    engine, drafter = _kv_engine(hf, _OneAhead)
    assert _max_kv_error(engine, drafter, poison=True) > 1e-2


def _drafts_per_step(engine, drafter, steps: int = 10) -> list:
    engine.add_request(PROMPTS[2], GREEDY)
    engine.add_request(PROMPTS[0], GREEDY)
    seen = []
    for _ in range(steps):
        engine.step()
        seen.append(drafter.drafts[:2].clone())
    return seen


def test_the_fused_draft_and_the_per_step_fallback_give_the_same_drafts(hf, plain,
                                                                       monkeypatch):
    """The CPU's torch backend has no in-place draft-step update, so its steps run as the
    fallback (metadata rebuilt between steps); declared capable, the same body runs fused."""
    engine, drafter = _head_engine(hf)
    assert not engine.spec_graphs.body.fused_draft
    fallback = _drafts_per_step(engine, drafter)
    monkeypatch.setattr(TorchBackend, "draft_step_update", True)
    engine, drafter = _head_engine(hf)
    assert engine.spec_graphs.body.fused_draft
    fused = _drafts_per_step(engine, drafter)
    assert all(torch.equal(a, b) for a, b in zip(fallback, fused, strict=True))
    assert [o.token_ids for o in _head_engine(hf)[0].generate(PROMPTS, GREEDY)] == plain
    # a no-op advance: steps 1.. run on step 0's metadata (its slot, its positions)
    engine, drafter = _head_engine(hf)
    drafter.executor.backend.advance_metadata = lambda fb: None
    broken = _drafts_per_step(engine, drafter)
    assert not all(torch.equal(a, b) for a, b in zip(fused, broken, strict=True))
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain  # verify holds


def test_at_temperature_1_the_output_follows_the_target():
    from test_spec_draft_model import assert_head_follows_the_target

    assert_head_follows_the_target(_head_engine)


def test_a_request_that_cuts_to_top_k_still_follows_the_target():
    """The head drafts from its whole distribution (no sort in a draft step); the target's
    top-k cut applies in the verify, and the output is plain top-k sampling's."""
    from test_spec_draft_model import assert_head_follows_the_target

    assert_head_follows_the_target(_head_engine, top_k=3)


def test_a_head_directory_round_trips_in_shards(hf, tmp_path):
    cfg = tiny_loaded(hf).config
    head = random_head(cfg, "layers=2,draft_vocab=64", seed=1)
    names = save_head(head, str(tmp_path), shard_bytes=8192)
    assert len(names) > 3
    assert all(os.path.getsize(tmp_path / n) <= 8192 + 1024 for n in names)  # + header
    loaded = load_head(str(tmp_path), cfg)
    for (n1, a), (n2, b) in zip(head.state_dict().items(), loaded.state_dict().items(),
                                strict=True):
        assert n1 == n2 and torch.equal(a, b), n1
    drafter = make_drafter(SpecConfig(method="chain", draft_head=str(tmp_path)),
                           target_config=cfg)
    assert isinstance(drafter, ChainHeadDrafter) and drafter.head.lm_head is not None


def test_bad_heads_are_refused_with_the_reason(hf, tmp_path):
    cfg = tiny_loaded(hf).config
    with pytest.raises(ValueError, match="no config.json"):
        load_head(str(tmp_path), cfg)
    save_head(random_head(cfg), str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "target_hidden_size": 32}))
    with pytest.raises(ValueError, match="hidden size 32"):
        load_head(str(tmp_path), cfg)
    with pytest.raises(ValueError, match="reads target layers"):
        HeadConfig([0, 7], 64, 128).validate_for(cfg)
    with pytest.raises(ValueError, match="layers=N"):
        random_head(cfg, "depth=2")


def _recording(drafter: ChainHeadDrafter) -> list:
    """Each chain step's logits over the target's vocabulary, as the drafter takes them; at
    temperature 0 each draft is checked to be their argmax."""
    seen, take = [], drafter.take

    def recording_take(ctx, i, logits):
        full = drafter.target_vocab(logits)
        seen.append(full.clone())
        tok = take(ctx, i, logits)
        if ctx.greedy:  # the draft-vocabulary argmax, mapped, is the target-vocabulary one
            assert torch.equal(tok, full.argmax(-1))
        return tok

    drafter.take = recording_take
    return seen


def test_a_reduced_shared_vocabulary_drafts_the_heads_argmax_within_it(hf, plain):
    """reduce_vocab: over every token, the target's gathered LM-head rows are the full head's
    (bitwise) and give its logits (to the last bits: the target's own weight carries a
    oneDNN-packed copy, `--row-pack`, that the gathered rows do not, and the two libraries'
    products may round differently on a machine); over a subset, every draft is in it (its
    tokens' logits unchanged, -inf elsewhere), and the output stays lossless."""
    from draftgraph.models.heads import reduce_vocab

    cfg = tiny_loaded(hf).config
    head = random_head(cfg, "", seed=3)
    runs, weights = {}, {}
    subset = torch.arange(0, cfg.vocab_size, 2)  # the even tokens
    for name, h in (("full", head), ("all", reduce_vocab(head, torch.arange(cfg.vocab_size), cfg)),
                    ("even", reduce_vocab(head, subset, cfg))):
        drafter = ChainHeadDrafter(h, K)
        seen = _recording(drafter)
        engine = tiny_engine(hf, spec=SPEC, drafter=drafter)
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == plain
        assert drafter.lm_head.shape[0] == (h.head_config.draft_vocab_size or cfg.vocab_size)
        runs[name], weights[name] = torch.cat(seen), drafter.lm_head
    assert torch.equal(weights["all"], weights["full"])
    assert torch.allclose(runs["all"], runs["full"], rtol=0, atol=1e-6)
    even = runs["even"]
    assert torch.isinf(even[:, 1::2]).all() and torch.isfinite(even[:, ::2]).all()
    assert (even.argmax(-1) % 2 == 0).all()
    # step 0 of the first proposal reads the same inputs in both runs: same logits on the subset
    torch.testing.assert_close(even[0, ::2], runs["full"][0, ::2])


def test_a_reduced_shared_head_is_reduced_anew_as_its_whole_head_would_be(hf, tmp_path):
    """A chain head sharing the target's LM head has no weights per draft token, so a reduced
    one (as shipped) is its whole head's weights and d2t: reduced anew over another vocabulary
    (even a wider one) it is what reducing the whole head gives, through save and load too.
    A block head's Markov rows exist only over its d2t: a reduced one is refused."""
    from draftgraph.models.heads import reduce_vocab

    cfg = tiny_loaded(hf).config
    head = random_head(cfg, "", seed=3)
    even, thirds = torch.arange(0, cfg.vocab_size, 2), torch.arange(0, cfg.vocab_size, 3)
    save_head(reduce_vocab(head, even, cfg), str(tmp_path / "even"))
    shipped = load_head(str(tmp_path / "even"), cfg)
    again, direct = reduce_vocab(shipped, thirds, cfg), reduce_vocab(head, thirds, cfg)
    assert again.head_config == direct.head_config
    want = direct.state_dict()
    assert again.state_dict().keys() == want.keys()
    for name, t in again.state_dict().items():
        assert torch.equal(t, want[name]), name
    block = random_head(cfg, "block_size=4,markov_rank=8", seed=3, kind="block")
    with pytest.raises(ValueError, match="whole vocabulary"):
        reduce_vocab(reduce_vocab(block, even, cfg), thirds, cfg)


def test_a_drafter_with_its_own_kv_keeps_its_draft_length_under_the_adaptive_policy():
    """The default (adaptive) policy shortens an n-gram drafter's drafts after rejections, but
    a chain head runs all its k steps every step anyway: its draft length stays k, so it never
    pays for drafts it does not verify."""
    hf = tiny_hf_model(seed=0)
    head = random_head(tiny_loaded(hf).config, "", seed=3)  # ~nothing accepted
    engine = tiny_engine(hf, spec=SpecConfig(method="ngram", num_draft_tokens=K),
                         drafter=ChainHeadDrafter(head, K))
    engine.add_request([5, 9, 17, 33, 2, 61], SamplingParams(max_tokens=24, temperature=0,
                                                             ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    s = engine.stats
    assert s["num_drafts"] >= 15 and s["num_accepted_tokens"] <= 2
    assert s["num_draft_tokens"] == K * s["num_drafts"] - sum(range(K))  # k, then the tail cap
    ngram = SpecPolicy(SpecConfig(method="ngram", num_draft_tokens=K), K)
    chain = SpecPolicy(SpecConfig(method="chain", num_draft_tokens=K), K, keeps_kv=True)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=100), 0, [])
    for policy in (ngram, chain):
        policy.record(req, K, 0)
    assert ngram.max_draft(req) == K // 2 and chain.max_draft(req) == K
