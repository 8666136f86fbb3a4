"""The DSpark-style block drafter (`--speculative block`): random block heads of every shape are
lossless; the head's context KV after every step equals a from-scratch injection of the
target's hidden states (a drafter that skips the injection fails it); pending and rejected
positions are never read (a block one position off reads them); the in-graph proposal and the
eager-metadata fallback give the same drafts, and a builder that leaves the block's lists
undone is caught; the Markov head drafts left to right; the confidence head cuts blocks; at
temperature 1 the output follows the target; an n-gram branch beside the block is accepted
past the block's depth, losslessly, with the head's context KV moved along the accepted
branch; block head directories round-trip."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _tiny import tiny_engine, tiny_loaded, tree_accepts

from draftgraph.attention.backend import Phase, TorchBackend
from draftgraph.attention.metadata import build_positions_and_slots
from draftgraph.config import SpecConfig, TreeShape
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.block_head import BlockHead
from draftgraph.models.heads import load_head, random_head, save_head
from draftgraph.runtime.executor import ModelExecutor
from draftgraph.runtime.schema import StepBatch
from draftgraph.runtime.slot_space import SlotSpace
from draftgraph.spec import make_drafter
from draftgraph.spec.block import BlockHeadDrafter

SPEC = SpecConfig(method="ngram", adaptive=False)  # the method: see drafter=
GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3] * 5, list(range(40, 70))]
KV_PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def plain(hf):
    return [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, GREEDY)]


def _head(hf, spec: str = "block_size=5,window=8") -> BlockHead:
    return random_head(tiny_loaded(hf).config, spec, seed=3, kind="block")


def _engine(hf, spec: str = "block_size=5,window=8", cls=None, **kw):
    drafter = (cls or BlockHeadDrafter)(_head(hf, spec), **kw)
    return tiny_engine(hf, spec=SPEC, drafter=drafter), drafter


@pytest.mark.parametrize("spec,threshold", [
    ("block_size=5,window=8", None),
    ("block_size=8,window=3,layers=2", None),  # windows shorter than most prefixes
    ("block_size=6,markov_rank=8", None),
    ("block_size=6,markov_rank=8,confidence=1", 0.5),  # blocks cut short
    ("block_size=4,confidence=1", 0.0),  # never cut
])
def test_a_random_block_head_is_lossless(hf, plain, spec, threshold):
    engine, drafter = _engine(hf, spec, confidence_threshold=threshold)
    if threshold:
        _doubting(drafter)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    s = engine.stats
    assert s["num_draft_tokens"] > 40
    if threshold:  # the same head never cut drafts more (max_draft alone caps it)
        uncut, d = _engine(hf, spec, confidence_threshold=0.0)
        _doubting(d)
        uncut.generate(PROMPTS, GREEDY)
        assert s["num_draft_tokens"] < uncut.stats["num_draft_tokens"]
    assert drafter.executor.slots is engine.slots
    assert drafter.executor.kv_pool is not engine.target.kv_pool
    assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots


def _doubting(drafter: BlockHeadDrafter) -> None:
    """Confidence weights large enough that the head's ratings spread around 0.5."""
    with torch.no_grad():
        drafter.head.confidence.weight.normal_(0, 2.0,
                                               generator=torch.Generator().manual_seed(0))


# ---- the context KV -----------------------------------------------------------------------

def _reference_kv(engine, drafter: BlockHeadDrafter, tokens: list[int]) -> list:
    """The head's context K and V of every position of `tokens`, from scratch: a fresh target
    executor runs the sequence once as a prefill, and a fresh drafter injects its hidden
    states (per layer: [len, Hkv, D] each)."""
    n, dev = len(tokens), engine.device
    slots = SlotSpace(n + 8, 1, 1, n + 8, dev)
    target = ModelExecutor(engine.model, slots, 1, n + 8, dev, torch.float32,
                           engine.target.backend.name)
    ref = BlockHeadDrafter(drafter.head, drafter.block_size)
    ref.bind(target)
    sb = StepBatch(Phase.EXTEND, tokens, [1], [n], [n], list(range(1, n + 1)), [])
    target.forward(sb)
    ref.observe(sb)
    pool = ref.executor.kv_pool
    return [(k[1 : n + 1], v[1 : n + 1]) for k, v in zip(pool.k_buffers, pool.v_buffers,
                                                          strict=True)]


class _Accepting(BlockHeadDrafter):
    """Drafts the plain greedy continuation, so blocks are accepted and the injection has
    several accepted positions per step."""

    def __init__(self, head, future: list[int], **kw) -> None:
        super().__init__(head, **kw)
        self.future = torch.tensor(future + [0] * (self.k + 2))

    def run_step(self, ctx, i, fb):
        super().run_step(ctx, i, fb)
        bs = ctx.seq_lens.shape[0]
        idx = ctx.seq_lens[:, None] + torch.arange(self.k, device=ctx.seq_lens.device)  # [bs, k]
        self.drafts[:bs].copy_(self.future[idx.clamp_max(len(self.future) - 1)])


class _OneAhead(BlockHeadDrafter):
    """Broken: the block sits one position too far on (in the slots after the last token's),
    so its window takes in the last token's position, whose entry nothing has written yet."""

    def stage_step(self, ctx, i):
        super().stage_step(ctx, i)
        bs = ctx.seq_lens.shape[0]
        torch.add(ctx.seq_lens, self.k + 1, out=self.block_seq_lens[:bs])
        loc = self.block_loc[: bs * self.block_size].view(bs, self.block_size)
        loc[:, :-1] = ctx.reserved_slots[:, 1:]
        loc[:, -1] = 0


def _kv_engine(hf, cls=BlockHeadDrafter, spec: str = "block_size=5,window=8", **kw):
    if cls is _Accepting:
        (out,) = tiny_engine(hf).generate([KV_PROMPT], LONG)
        kw["future"] = KV_PROMPT + out.token_ids
    return _engine(hf, spec, cls, **kw)


def _max_kv_error(engine, drafter, steps: int = 12, prompt: list[int] = KV_PROMPT) -> float:
    """One request step by step; after each step, the head's context KV of every position
    before the last token (what later blocks may read) against the from-scratch values."""
    engine.add_request(prompt, LONG)
    pool = drafter.executor.kv_pool
    worst = 0.0
    for _ in range(steps):
        engine.step()
        (req,) = engine.scheduler.running
        n = req.num_tokens - 1  # positions 0 .. n - 1 are context now
        slots = engine.slots.req_pool.req_to_token[req.req_pool_idx][:n]
        for layer, (k, v) in enumerate(_reference_kv(engine, drafter, req.token_slice(0, n))):
            err = max((pool.k_buffers[layer][slots] - k).abs().max().item(),
                      (pool.v_buffers[layer][slots] - v).abs().max().item())
            worst = max(worst, err if err == err else float("inf"))
    return worst


@pytest.mark.parametrize("spec,chain", [("block_size=5,window=8", None),
                                        ("block_size=4,layers=2", None),
                                        ("block_size=5,window=8", 2)])
def test_the_context_kv_after_every_step_equals_a_from_scratch_injection(hf, spec, chain):
    """(chain 2: steps verify the block's first 2 drafts; its other 2 rows are never
    accepted, their K/V left for the next block to overwrite.)"""
    engine, drafter = _kv_engine(hf, _Accepting, spec, chain=chain)
    assert _max_kv_error(engine, drafter) < 1e-4
    s = engine.stats
    assert s["num_accepted_tokens"] == s["num_draft_tokens"] > 20  # several per step
    if chain:
        assert s["num_draft_tokens"] == 2 * s["num_drafts"]


def test_a_drafter_that_skips_the_injection_keeps_block_entries(hf):
    """Without the injection, accepted positions keep the block's own K/V (made from the mask
    token), never the target's context."""
    engine, drafter = _kv_engine(hf, _Accepting, inject=False)
    assert _max_kv_error(engine, drafter) > 1e-2


def _drafts_per_step(engine, drafter, steps: int = 10, poison: bool = False) -> list:
    """Drafts of two requests after each step; `poison`: the head's KV from each request's
    last-token position on (pending or rejected entries) set to NaN after every step."""
    engine.add_request(PROMPTS[2], GREEDY)
    engine.add_request(PROMPTS[0], GREEDY)
    pool, seen = drafter.executor.kv_pool, []
    for _ in range(steps):
        engine.step()
        seen.append(drafter.drafts[:2].clone())
        if poison:
            for req in engine.scheduler.running:
                n = req.num_tokens - 1
                ahead = engine.slots.req_pool.req_to_token[req.req_pool_idx][n : n + 8]
                ahead = ahead[ahead > 0]
                for buf in pool.k_buffers + pool.v_buffers:
                    buf[ahead] = float("nan")
    return seen


def _same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_pending_and_rejected_positions_are_never_read(hf):
    clean = _drafts_per_step(*_engine(hf))
    assert _same(clean, _drafts_per_step(*_engine(hf), poison=True))
    off = _drafts_per_step(*_engine(hf, cls=_OneAhead))
    assert not _same(off, _drafts_per_step(*_engine(hf, cls=_OneAhead), poison=True))


def test_in_graph_block_metadata_and_the_eager_fallback_give_the_same_drafts(hf, plain,
                                                                            monkeypatch):
    """The CPU's torch backend builds metadata eagerly, so the block's step runs as the
    fallback; declared capable, the same body builds it inside the (eager) proposal."""
    engine, drafter = _engine(hf)
    assert not engine.spec_graphs.body.fused_draft
    fallback = _drafts_per_step(engine, drafter)
    monkeypatch.setattr(TorchBackend, "in_graph_metadata", True)
    engine, drafter = _engine(hf)
    assert engine.spec_graphs.body.fused_draft
    fused = _drafts_per_step(engine, drafter)
    assert _same(fallback, fused)
    # a builder that writes positions and slots but leaves the block's lists as the previous
    # step left them
    engine, drafter = _engine(hf)
    backend = drafter.executor.backend
    real, stale = backend.build_metadata, {}

    def no_block_lists(fb):
        if fb.phase is not Phase.DRAFT_BLOCK or not stale:
            real(fb)
            if fb.phase is Phase.DRAFT_BLOCK:
                stale.update(backend._offsets)
            return
        build_positions_and_slots(fb.req_pool_indices, fb.seq_lens, fb.extend_lens,
                                  fb.out_cache_loc, backend.req_to_token, fb.meta)
        backend._offsets = dict(stale, qo=fb.meta.qo_indptr[: fb.bs + 1].tolist())

    backend.build_metadata = no_block_lists
    assert not _same(fused, _drafts_per_step(engine, drafter))
    while engine.has_unfinished():
        engine.step()
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain  # verify holds


# ---- Markov and confidence heads ----------------------------------------------------------

def test_the_markov_head_drafts_left_to_right(hf):
    """A Markov head that strongly favours `previous token + 1` makes every block count up
    from its anchor: draft j reads draft j - 1, not the block's input."""
    engine, drafter = _engine(hf, "block_size=6,markov_rank=128")
    head, vocab = drafter.head, tiny_loaded(hf).config.vocab_size
    with torch.no_grad():
        head.markov_in.weight.copy_(torch.eye(vocab, 128))
        head.markov_out.weight.copy_(1e3 * torch.roll(torch.eye(vocab, 128), 1, dims=0))
    engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(4):
        engine.step()
        (req,) = engine.scheduler.running
        anchor = req.token_slice(req.num_tokens - 1, req.num_tokens)[0]  # next block's anchor
        engine.step()
        drafts = drafter.drafts[0].tolist()
        assert drafts == [(anchor + j) % vocab for j in range(1, drafter.k + 1)]


@pytest.mark.parametrize("spec", ["block_size=5,window=8", "block_size=6,markov_rank=8"])
def test_a_reduced_vocabulary_drafts_the_heads_argmax_within_it(hf, plain, spec):
    """reduce_vocab: over every token the drafts are the whole-vocabulary head's, step for
    step; over the even tokens every draft is even, the first block's logits are the whole
    head's on the even tokens and its drafts (no Markov head) their argmax, mapped to target
    ids; the LM head holds the even rows alone, and the output stays lossless. (Drafts left
    as draft-vocabulary indices, unmapped, fail these checks.)"""
    from draftgraph.models.heads import reduce_vocab

    cfg = tiny_loaded(hf).config
    head = _head(hf, spec)
    even = torch.arange(0, cfg.vocab_size, 2)
    heads = {"full": head, "all": reduce_vocab(head, torch.arange(cfg.vocab_size), cfg),
             "even": reduce_vocab(head, even, cfg)}
    runs, first = {}, {}
    for name, h in heads.items():
        drafter = BlockHeadDrafter(h)
        seen, forward = [], h.logits
        h.logits = lambda rows, w, seen=seen, forward=forward: seen.append(
            forward(rows, w)) or seen[-1]
        engine = tiny_engine(hf, spec=SPEC, drafter=drafter)
        engine.add_request(PROMPTS[2], GREEDY)
        runs[name] = []
        while not seen or not first.get(name):
            engine.step()
            runs[name].append(drafter.drafts[:1].clone())
            if seen and name not in first:  # the step that made the first proposal
                first[name] = (seen[0].clone(), drafter.drafts[:1].clone())
        for _ in range(8):
            engine.step()
            runs[name].append(drafter.drafts[:1].clone())
        del h.logits
        engine = tiny_engine(hf, spec=SPEC, drafter=BlockHeadDrafter(h))
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain
        assert drafter.lm_head.shape[0] == (len(even) if name == "even" else cfg.vocab_size)
    assert _same(runs["all"], runs["full"])
    assert all((d % 2 == 0).all() for d in runs["even"])
    full_logits, full_drafts = first["full"]
    even_logits, even_drafts = first["even"]
    torch.testing.assert_close(even_logits, full_logits[:, even])
    if "markov" not in spec:
        assert torch.equal(even_drafts[0], even[even_logits.argmax(-1)])
        assert not torch.equal(even_drafts, full_drafts)  # some draft of the full head was odd
    # sampled drafts are drawn over the target's vocabulary with the odd tokens at 0
    drafter = BlockHeadDrafter(heads["even"])
    engine = tiny_engine(hf, spec=SPEC, drafter=drafter)
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=30, temperature=1.0, seed=7,
                                                  ignore_eos=True))
    drawn = []
    while engine.has_unfinished():
        engine.step()
        drawn.append(drafter.drafts[:1].clone())
    assert all((d % 2 == 0).all() for d in drawn) and len({int(t) for d in drawn for t in
                                                          d.flatten()}) > 4


def test_a_reduced_heads_markov_rows_are_stored_and_loaded_over_its_vocabulary(hf, tmp_path):
    """A reduced block head keeps the Markov head's rows d2t alone (V' x r, not V x r: the
    shipped head's files 4 MB smaller), its term the whole head's on d2t; a head saved with
    every row (before 2026-12-07) loads to the same weights."""
    from safetensors.torch import load_file, save_file

    from draftgraph.models.heads import reduce_vocab

    cfg = tiny_loaded(hf).config
    head = _head(hf, "block_size=6,markov_rank=8")
    even = torch.arange(0, cfg.vocab_size, 2)
    small = reduce_vocab(head, even, cfg)
    assert small.markov_out.weight.shape == (len(even), 8)
    prev = torch.tensor([3, 4, 11])
    torch.testing.assert_close(small.markov(prev), head.markov(prev)[:, even])
    save_head(small, str(tmp_path / "new"))
    (shard,) = (tmp_path / "new").glob("*.safetensors")
    assert load_file(shard)["markov_out.weight"].shape[0] == len(even)
    old = tmp_path / "old"
    save_head(small, str(old))
    (shard,) = old.glob("*.safetensors")
    tensors = load_file(shard)
    tensors["markov_out.weight"] = head.markov_out.weight.detach().clone()  # every row
    save_file(tensors, shard)
    for path in (tmp_path / "new", old):
        loaded = load_head(str(path), cfg)
        torch.testing.assert_close(loaded.markov(prev), small.markov(prev))


@pytest.mark.parametrize("bias,expect", [(8.0, "all"), (-8.0, "none")])
def test_the_confidence_head_cuts_the_block(hf, plain, bias, expect):
    engine, drafter = _engine(hf, "block_size=5,confidence=1", confidence_threshold=0.5)
    with torch.no_grad():
        drafter.head.confidence.weight.zero_()
        drafter.head.confidence.bias.fill_(bias)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain
    s = engine.stats
    if expect == "all":  # as many as max_draft allows: the same as a head without one
        uncut, _ = _engine(hf, "block_size=5")
        uncut.generate(PROMPTS, GREEDY)
        assert s["num_draft_tokens"] == uncut.stats["num_draft_tokens"] > 0
    else:
        assert s["num_draft_tokens"] == 0


def test_the_confidence_cut_stops_at_the_first_doubted_draft(hf):
    """Per request: the active count is the number of leading drafts rated >= threshold."""
    engine, drafter = _engine(hf, "block_size=6,confidence=1", confidence_threshold=0.5)
    head = drafter.head
    _doubting(drafter)
    seen = []
    real = head.accept_prob

    def spy(hidden, prev):
        conf = real(hidden, prev)
        seen.append(conf.view(-1, drafter.k).clone())
        return conf

    head.accept_prob = spy
    engine.add_request(PROMPTS[2], LONG)
    engine.add_request(PROMPTS[1], LONG)
    counts = set()
    engine.step()  # the prefill drafts nothing
    for _ in range(8):
        engine.step()
        conf = seen[-1]
        lead = (conf >= 0.5).long().cumprod(1).sum(1)
        assert drafter.num_drafts[:2].tolist() == lead.tolist()
        counts |= set(lead.tolist())
    assert len(counts) > 1  # the cut really varies


# ---- sampling ----------------------------------------------------------------------------

def test_at_temperature_1_the_output_follows_the_target():
    from test_spec_draft_model import assert_head_follows_the_target

    def make(target, **kw):
        drafter = BlockHeadDrafter(random_head(tiny_loaded(target).config, "block_size=3",
                                               seed=3, kind="block"))
        return tiny_engine(target, spec=SPEC, drafter=drafter, **kw), drafter

    assert_head_follows_the_target(make)


# ---- trees: an n-gram branch beside the block, a tree of the block's rows -------------------

# 4x4:10: 12 beam rows, more than its 10 verified drafts (a chain head's tree may not have)
BRANCH, WIDE, WIDE_NO_BRANCH = (TreeShape.parse(t) for t in ("1x4:4+g6", "2x4:8+g6", "4x4:10"))


def _tree_engine(hf, tree: TreeShape = BRANCH, cls=None, **kw):
    """A random head's blocks of 4 (with a Markov head, so siblings' children differ) drafting
    `tree`: the block and a branch of 6, or a tree of its rows."""
    return _engine(hf, "block_size=5,window=8,markov_rank=8", cls=cls, tree=tree, **kw)


@pytest.mark.parametrize("tree", [BRANCH, WIDE, WIDE_NO_BRANCH], ids=str)
def test_block_trees_are_lossless_and_a_branch_reaches_past_the_block(hf, tree):
    """1 + k verify rows a request (the block's 4 or the tree's nodes, and the branch's 6);
    the output is plain decoding's, greedy and seeded sampled; with a branch, steps accept more
    drafts than the block holds; a wide tree gives a node siblings (its parents repeat)."""
    engine, drafter = _tree_engine(hf, tree)
    accepted = tree_accepts(engine)
    assert [o.token_ids for o in engine.generate(PROMPTS, LONG)] == \
        [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, LONG)]
    assert (drafter.k, drafter.chain_k, drafter.reach) == (tree.verified, 4, tree.reach)
    assert accepted and max(accepted) <= tree.reach
    if tree.ngram:
        assert sum(a > 4 for a in accepted) >= 3, accepted  # measured: 3 either way
    parents = drafter.prop[1, 0, : tree.nodes].tolist()
    assert (len(set(parents)) < len(parents)) == (tree.width > 1), parents
    hot = SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True)
    engine, _ = _tree_engine(hf, tree)
    assert [o.token_ids for o in engine.generate(PROMPTS, hot)] == \
        [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, hot)]


@pytest.mark.parametrize("chain", [None, 2, 1])
def test_steps_over_the_cap_verify_the_block_alone(hf, plain, chain):
    """Steps of more requests than tree_max_bs verify the block (1 + 4 rows a request), or its
    first `chain` drafts (sampled: drawn left to right through the Markov head, as many as
    verified); the greedy output stays plain decoding's."""
    hot = SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True)
    engine, drafter = _tree_engine(hf, WIDE, chain=chain)
    drafter.tree_max_bs = 0  # every step the block alone
    assert all(len(o.token_ids) == 30 for o in engine.generate(PROMPTS, hot))
    assert drafter._probs.shape[1] == (chain or 4)  # the last sampled step's draws
    s = engine.stats
    assert 0 < s["num_draft_tokens"] <= (chain or 4) * s["num_drafts"]
    engine, drafter = _tree_engine(hf, WIDE, chain=chain)
    drafter.tree_max_bs = 1  # steps of 2 or 3 requests: the block alone
    body, rows = engine.spec_graphs.body, []
    fb = body._fb

    def spied(bs):
        out = fb(bs)
        rows.append((bs, body.tree_step(bs), out.input_ids.shape[0]))
        return out

    body._fb = spied
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain
    assert {(bs, n) for bs, tree, n in rows if not tree} >= {(3, 3 * (1 + (chain or 4)))}, rows


class _NoCopy(BlockHeadDrafter):
    """Broken: leaves the head's K/V of a tree's accepted nodes in the nodes' slots."""

    def after_accept(self, ctx, accept):
        super().after_accept(ctx, dataclasses.replace(accept, copy=None))


class _OracleRows(BlockHeadDrafter):
    """Its tree's rows rank the plain greedy continuation first (`future`), so every step
    accepts the tree's full depth through nodes that sit in columns other than their depths
    (the K/V move has work: the branch is not needed for it)."""

    def __init__(self, head, future: list[int], **kw) -> None:
        super().__init__(head, **kw)
        self.future = torch.tensor(future + [0] * (self.nb + 2))

    def _grow(self, ctx, logits):
        j = torch.arange(logits.shape[1])
        nxt = self.future[(ctx.seq_lens[:, None] + j).clamp_max(len(self.future) - 1)]
        super()._grow(ctx, logits.scatter(2, nxt[..., None], 1e4))


class _OracleNoCopy(_OracleRows, _NoCopy):
    pass


@pytest.mark.parametrize("tree", [BRANCH, WIDE, WIDE_NO_BRANCH], ids=str)
def test_the_context_kv_after_tree_steps_equals_a_from_scratch_injection(hf, tree):
    """After every step the head's context KV of every final position equals a from-scratch
    injection, positions accepted through the branch or through tree nodes off their depth's
    column included (their K/V moved from the nodes' slots with the target's); a drafter that
    skips the move keeps, at those positions, rejected drafts' entries."""
    oracle = tree.width > 1 and not tree.ngram  # 4x4:10: every step accepts 4 tree nodes
    kw = {}
    if oracle:
        (out,) = tiny_engine(hf).generate([PROMPTS[1]], LONG)
        kw["future"] = PROMPTS[1] + out.token_ids
    engine, drafter = _tree_engine(hf, tree, cls=_OracleRows if oracle else None, **kw)
    assert _max_kv_error(engine, drafter, steps=16, prompt=PROMPTS[1]) < 1e-4
    # measured: 16 with a branch (a random block accepts little), 60 = 15 steps x 4
    assert engine.stats["num_accepted_tokens"] >= (60 if oracle else 10)
    engine, drafter = _tree_engine(hf, tree, cls=_OracleNoCopy if oracle else _NoCopy, **kw)
    assert _max_kv_error(engine, drafter, steps=16, prompt=PROMPTS[1]) > 1e-2


def test_a_blocks_tree_shape_is_checked(hf):
    cfg = tiny_loaded(hf).config
    ok = SpecConfig(method="block", draft_head="random:block_size=5", tree=BRANCH)
    assert make_drafter(ok, target_config=cfg).k == 10
    assert make_drafter(dataclasses.replace(ok, tree=WIDE), target_config=cfg).k == 14
    for bad in ("1x3:3+g6", "1x5:5+g6", "2x5:8+g6"):  # a chain not the block; too deep
        spec = dataclasses.replace(ok, tree=TreeShape.parse(bad))
        with pytest.raises(ValueError, match="--speculative-tree 1x4:4"):
            make_drafter(spec, target_config=cfg)
    # fewer verified drafts than the block: its 5 rows' K/V would not fit the 1 + k reserved
    # slots (every step of every request failed with a size mismatch; found by fuzzing)
    for bad in ("2x2:3", "2x3:3", "2x2:2+g1"):
        spec = dataclasses.replace(ok, tree=TreeShape.parse(bad))
        with pytest.raises(ValueError, match=r"N \+ G >= 4"):
            make_drafter(spec, target_config=cfg)
    with pytest.raises(ValueError, match="--speculative-tree is for"):
        SpecConfig(method="ngram", tree=BRANCH)
    # beam rows ((depth - 1) x width): a chain head's write KV into the verified drafts'
    # slots, so they must fit them; a block's tree runs none
    assert SpecConfig(method="block", tree=WIDE_NO_BRANCH).tree == WIDE_NO_BRANCH
    with pytest.raises(ValueError, match=r"12 beam rows need .* <= verified drafts \(10\)"):
        SpecConfig(method="chain", tree=WIDE_NO_BRANCH)
    # with a tree, its steps without one verify num_draft_tokens of the block (at most all);
    # without a tree every step verifies the whole block
    for k, tree, chain in ((2, WIDE, 2), (9, WIDE, 4), (2, None, 4)):
        spec = dataclasses.replace(ok, tree=tree, num_draft_tokens=k)
        assert make_drafter(spec, target_config=cfg).chain_k == chain
    for chain in (0, 5):  # a chain step verifies 1 .. 4 of a block of 4
        with pytest.raises(ValueError, match="verifies 1..4 of them"):
            BlockHeadDrafter(_head(hf), chain=chain)


# ---- head directories and flags -----------------------------------------------------------

def test_block_head_directories_round_trip_and_make_the_drafter(hf, tmp_path):
    cfg = tiny_loaded(hf).config
    head = _head(hf, "block_size=6,markov_rank=4,confidence=1,window=16")
    save_head(head, str(tmp_path), shard_bytes=8192)
    loaded = load_head(str(tmp_path), cfg)
    assert isinstance(loaded, BlockHead) and loaded.head_config == head.head_config
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    spec = SpecConfig(method="block", draft_head=str(tmp_path), block_size=4,
                      confidence_threshold=0.2)
    drafter = make_drafter(spec, target_config=cfg)
    assert isinstance(drafter, BlockHeadDrafter)
    assert (drafter.k, drafter.threshold) == (3, 0.2)
    with pytest.raises(ValueError, match="is a block head; use --speculative block"):
        make_drafter(SpecConfig(method="chain", draft_head=str(tmp_path)), target_config=cfg)
    random_spec = SpecConfig(method="block", draft_head="random:block_size=7")
    assert make_drafter(random_spec, target_config=cfg).k == 6
    reduced = _head(hf, "block_size=4,markov_rank=4,draft_vocab=40")  # tokens 0..39
    save_head(reduced, str(tmp_path / "reduced"))
    again = load_head(str(tmp_path / "reduced"), cfg)
    assert again.head_config.draft_vocab_size == 40 and torch.equal(again.d2t, torch.arange(40))
    with pytest.raises(ValueError, match="no block head ships"):
        make_drafter(SpecConfig(method="block"), target_config=cfg, model="tiny")
    with pytest.raises(ValueError, match="--block-size"):
        SpecConfig(method="block", block_size=1)
    with pytest.raises(ValueError, match="are for --speculative block"):
        SpecConfig(method="chain", block_size=4)
