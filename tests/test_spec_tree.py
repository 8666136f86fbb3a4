"""Draft trees (`--speculative chain --speculative-tree WxD:N`, spec/tree.py): the ancestor rows
and the greedy walk by hand; output equals plain decoding with a random head (tiny model:
batches that draft trees, batches too large for them, greedy and seeded sampled requests
together; an oracle's sampled trees accepted to full depth) and with the shipped head on the
default model, whose accept length the tree raises over its chain; skipping the copy of the
accepted nodes' KV, or building tree rows' lists without their paths, breaks the equality
(the checks catch both)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from _tiny import tiny_engine, tiny_loaded, tree_accepts

import draftgraph.attention.metadata as metadata
from draftgraph.attention.kv_pool import KVPool
from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig, TreeShape
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.kernels.tree import accept_tree, ancestors
from draftgraph.models.heads import random_head
from draftgraph.spec.tree import TREE_MAX_BS, TreeHeadDrafter

SETS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "accept_sets_smollm2_ids.json"
TREE = TreeShape(4, 5, 16)
GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
HOT = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, top_k=40, seed=11,
                     ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3] * 5, list(range(40, 70))]


def test_tree_shapes_are_checked_and_named_by_the_flag():
    assert TreeShape.parse("4x5:16") == TreeShape(4, 5, 16)
    assert TreeShape(4, 5, 16).total == 4 + 4 * 16
    assert TreeShape.parse("8x5:32").total == 8 + 4 * 64
    assert TreeShape.parse("12x5:63").total == 12 + 4 * 144  # the most verified nodes
    branch = TreeShape.parse("8x5:27+g5")  # an n-gram branch of 5 beside 27 nodes
    assert branch == TreeShape(8, 5, 27, 5) and branch.verified == 32 and str(branch) == \
        "8x5:27+g5"
    for bad in ("4x5", "4x5:64", "2x2:7", "1x6:5", "17x1:17", "8x5:27+g37", "12x5:60+g4",
                "4x5:16+g"):
        with pytest.raises(ValueError, match="--speculative-tree"):
            TreeShape.parse(bad)
    # a chain head's (depth - 1) x width beam rows write KV into the verified drafts' slots
    for deep in ("8x6:16", "4x4:8", "8x6:32", "16x5:63", "8x5:24+g5"):
        with pytest.raises(ValueError, match="beam rows need"):
            SpecConfig(method="chain", tree=TreeShape.parse(deep))
    deep = TreeShape.parse("8x5:25+g8")  # a branch reaching past the tree's depth
    assert (deep.verified, deep.reach, branch.reach) == (33, 8, 5)
    with pytest.raises(ValueError, match="--speculative-tree is for --speculative chain"):
        SpecConfig(method="ngram", tree=TREE)


def test_the_cli_drafts_trees_by_default_on_one_gpu_only():
    """--speculative-tree auto: a chain head drafts AUTO_TREE trees in steps of up to
    AUTO_TREE_MAX_BS requests on one GPU, its chain of AUTO_TREE_CHAIN in the others; the
    chain (of SpecConfig's 4) on a CPU, under tensor parallelism, with an explicit
    --num-draft-tokens, or with --speculative-tree off; a shape given is drafted on any
    device."""
    from draftgraph.cli import parse_args
    from draftgraph.flags import (
        AUTO_TREE,
        AUTO_TREE_CHAIN,
        AUTO_TREE_MAX_BS,
        spec_config_from_args,
    )

    def spec(*flags, method="chain"):
        return spec_config_from_args(parse_args(["generate", "random:tiny", "hi",
                                                 "--speculative", method, *flags]))

    on = spec("--device", "cuda")
    assert (on.tree, on.tree_max_bs, on.num_draft_tokens) == (AUTO_TREE, AUTO_TREE_MAX_BS,
                                                              AUTO_TREE_CHAIN)
    assert AUTO_TREE_CHAIN == 3 < SpecConfig().num_draft_tokens
    for flags in (("--device", "cpu"), ("--device", "cuda", "--num-draft-tokens", "4"),
                  ("--device", "cuda", "--speculative-tree", "off"),
                  ("--device", "cuda", "--tensor-parallel-size", "2")):
        got = spec(*flags)
        assert got.tree is None and got.num_draft_tokens == 4, flags
    given = spec("--device", "cpu", "--speculative-tree", "2x4:8")
    assert (given.tree, given.tree_max_bs) == (TreeShape(2, 4, 8), TREE_MAX_BS)
    assert given.num_draft_tokens == AUTO_TREE_CHAIN
    assert spec("--device", "cpu", "--speculative-tree", "2x4:8", "--num-draft-tokens",
                "2").num_draft_tokens == 2
    assert spec("--device", "cuda", method="ngram").tree is None


def test_the_cli_gives_the_block_a_tree_of_its_rows_on_one_gpu(tmp_path):
    """--speculative block, --speculative-tree auto: on one GPU a tree of the block's rows
    (AUTO_BLOCK_TREE: width, nodes, n-gram branch) as deep as the block, whose size comes
    from --block-size or the head's directory (the shipped head's 8 for the default model);
    none on a CPU or for a random head."""
    from draftgraph.cli import parse_args
    from draftgraph.flags import (
        AUTO_BLOCK_TREE,
        AUTO_TREE_CHAIN,
        AUTO_TREE_MAX_BS,
        spec_config_from_args,
    )

    def spec(model, *flags):
        return spec_config_from_args(parse_args(["generate", model, "hi", "--speculative",
                                                 "block", *flags]))

    w, n, g = AUTO_BLOCK_TREE
    on = spec("default", "--device", "cuda")
    assert (on.tree, on.tree_max_bs) == (TreeShape(w, 7, n, g), AUTO_TREE_MAX_BS)
    # its steps without a tree verify the block's first AUTO_TREE_CHAIN drafts, or as asked
    assert on.num_draft_tokens == AUTO_TREE_CHAIN
    assert spec("default", "--device", "cuda", "--num-draft-tokens", "5").num_draft_tokens == 5
    assert spec("default", "--device", "cuda", "--block-size", "5").tree == TreeShape(w, 4, n, g)
    # a block of 2 grows w + w * w nodes, fewer than n: all of them are verified
    assert spec("default", "--device", "cuda", "--block-size", "3").tree == \
        TreeShape(w, 2, w + w * w, g)
    (tmp_path / "config.json").write_text('{"kind": "block", "block_size": 17}')
    assert spec("random:tiny", "--device", "cuda", "--draft-head", str(tmp_path)).tree == \
        TreeShape(w, 16, n, g)  # 15 x 4 beam rows: more than the 43 verified, the block's
    assert spec("default", "--device", "cpu").tree is None
    assert spec("random:tiny", "--device", "cuda", "--draft-head", "random").tree is None
    assert spec("default", "--device", "cuda", "--speculative-tree", "off").tree is None
    assert spec("default", "--device", "cpu", "--speculative-tree", "1x7:7+g4").tree == \
        TreeShape(1, 7, 7, 4)


def test_steps_over_the_drafters_batch_cap_draft_chains(hf, plain):
    """A drafter capped at 2 requests: steps of 3 draft chains, of 2 or 1 trees; lossless."""
    drafter = TreeHeadDrafter(random_head(tiny_loaded(hf).config, "", seed=3), TREE, max_bs=2)
    spec = SpecConfig(method="ngram", num_draft_tokens=TREE.nodes, adaptive=False)
    engine = tiny_engine(hf, 8, spec=spec, drafter=drafter)
    body, done = engine.spec_graphs.body, set()
    verify = body._forward_and_accept

    def counted(bs, greedy):  # steps that completed (a failed one is re-run in halves)
        verify(bs, greedy)
        done.add((bs, body.tree_step(bs)))

    body._forward_and_accept = counted
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (10, 20, 30)]
    ref = [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, params)]
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == ref
    assert done == {(3, False), (2, True), (1, True)}


def test_ancestors_and_the_greedy_walk_by_hand():
    # rows: 0 root; 1, 2 at depth 1; 3 (child of 2), 4 (child of 1) at depth 2; 5 (of 3)
    parents = torch.tensor([[0, 0, 0, 2, 1, 3]])
    depths = torch.tensor([[0, 1, 1, 2, 2, 3]])
    anc = ancestors(parents, depths, 3)
    assert anc[0].tolist() == [[0, 0, 0], [1, 0, 0], [2, 0, 0], [2, 3, 0], [1, 4, 0],
                               [2, 3, 5]]
    tokens = torch.tensor([[7, 10, 11, 12, 13, 14]])
    live = torch.ones(1, 6, dtype=torch.bool)

    def accept(argmax):
        return accept_tree(tokens, parents, anc, depths, live, torch.tensor([argmax]))

    # the target: after the root 11, after row 2 12, after row 3 99 (no child carries it)
    path, lens = accept([11, 0, 12, 99, 0, 0])
    assert path.tolist() == [[0, 2, 3, 0]] and lens.tolist() == [3]
    path, lens = accept([11, 0, 12, 14, 0, 0])  # row 5 carries it: the whole path
    assert path.tolist() == [[0, 2, 3, 5]] and lens.tolist() == [4]
    live[0, 5] = False  # past the request's draft budget: never accepted
    assert accept([11, 0, 12, 14, 0, 0])[1].tolist() == [3]
    # the other branch: row 1, then no child of it carries 0; row 4 carries 13 but its
    # parent row 1 is not on the path (the target wanted 10 there)
    path, lens = accept([10, 0, 12, 14, 0, 0])
    assert path.tolist() == [[0, 1, 0, 0]] and lens.tolist() == [2]
    path, lens = accept([11, 13, 12, 0, 0, 0])
    assert path.tolist() == [[0, 2, 3, 0]] and lens.tolist() == [3]
    assert accept([99, 13, 12, 14, 0, 0])[1].tolist() == [1]  # nothing: the bonus token only


@pytest.fixture(scope="module")
def plain(hf):
    return [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, GREEDY)]


def _tree_engine(hf, tree: TreeShape = TREE, max_num_seqs: int = 8, chain: int | None = None):
    drafter = TreeHeadDrafter(random_head(tiny_loaded(hf).config, "", seed=3), tree,
                              chain=chain)
    spec = SpecConfig(method="chain", tree=tree, adaptive=False)
    # a step's token budget fits three requests' 1 + nodes rows
    return tiny_engine(hf, max_num_seqs, budget=max(64, 3 * (1 + tree.verified)), kv_tokens=4096,
                       spec=spec, drafter=drafter), drafter


def _count_tree_steps(engine) -> list:
    """The verify steps that took the tree path: (requests, greedy) each."""
    body = engine.spec_graphs.body
    seen = []
    accept = body._accept_tree

    def counted(bs, logits, greedy):
        seen.append((bs, greedy))
        accept(bs, logits, greedy)

    body._accept_tree = counted
    return seen


def test_a_steps_rows_follow_its_context_not_the_last_proposal(hf):
    """Tree or chain is the step's own (`DraftContext.tree`): the per-step fallback rebuilds a
    replayed graph's step metadata after other graphs were captured, so a drafter that
    remembered its last proposal's shape would build a chain's lists for a tree step."""
    engine, drafter = _tree_engine(hf)
    body = engine.spec_graphs.body
    tree = body._ctx(1, True)
    chain = dataclasses.replace(tree, tree=False)  # a step with top-N, say
    assert tree.tree and body._ctx(1, False).tree  # greedy and sampled steps draft trees
    drafter.begin(chain)  # the last proposal drafted the chain
    assert drafter.step_fb(tree, 1).paths is not None
    assert drafter.step_fb(chain, 1).paths is None
    drafter.begin(tree)
    assert drafter.step_fb(chain, 1).paths is None


@pytest.mark.parametrize("tree", [TREE, TreeShape(1, 3, 3), TreeShape(2, 3, 6),
                                  TreeShape(8, 5, 32), TreeShape(4, 5, 12, 4),
                                  TreeShape(8, 5, 27, 5),  # n-gram branches
                                  TreeShape(12, 5, 63)])  # the largest: 64 verify rows
def test_a_random_head_drafting_trees_is_lossless(hf, plain, tree):
    engine, drafter = _tree_engine(hf, tree)
    seen = _count_tree_steps(engine)
    body, short = engine.spec_graphs.body, []
    pack = body._pack_tree

    def checked(ctx, prop):  # a step records 0 past a request's drafts (its last tokens)
        pack(ctx, prop)
        for row, n in enumerate(prop.num_drafts.tolist()):
            if n < tree.verified:
                short.append(body.draft_tokens[row, n:].abs().sum().item())

    body._pack_tree = checked
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain
    assert short and not any(short)
    if tree.verified > 16:  # the large trees sampled too: plain seeded sampling's tokens
        assert engine.generate(PROMPTS[:1], HOT)[0].token_ids == \
            tiny_engine(hf).generate(PROMPTS[:1], HOT)[0].token_ids
    assert len(seen) > 20 and max(seen)[0] == len(PROMPTS)  # trees, the three together
    assert engine.stats["num_draft_tokens"] > 20 * tree.verified
    assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots


def test_an_ngram_branch_beside_the_tree_is_accepted_and_lossless(hf):
    """4x5:12+g4 (the same 17 verify rows as 4x5:16) with a random head on the tiny model,
    whose greedy output falls into cycles a prompt lookup predicts: plain decoding's tokens,
    most steps accept a path through the branch's rows (13 .. 16), and the accepted drafts
    are several times the tree's alone."""
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, params)]
    runs = {}
    for shape in (TreeShape(4, 5, 16), TreeShape(4, 5, 12, 4)):
        engine, _ = _tree_engine(hf, shape)
        body, through_branch = engine.spec_graphs.body, []
        accept = body._accept_tree

        def counted(bs, logits, greedy, body=body, shape=shape, seen=through_branch,
                    accept=accept):
            accept(bs, logits, greedy)
            seen.append(int((body.tv.accepted[:bs] > shape.nodes).any(dim=1).sum()))

        body._accept_tree = counted
        assert [o.token_ids for o in engine.generate(PROMPTS, params)] == plain
        runs[shape.ngram] = (sum(through_branch), len(through_branch),
                             engine.stats["num_accepted_tokens"])
    assert runs[0][0] == 0  # no branch rows without a branch
    steps_through, steps, accepted = runs[4]
    assert steps_through > steps / 3, runs  # measured: 25 of 39 steps
    assert accepted > 2 * runs[0][2], runs  # measured: 68 against 20


DEEP = TreeShape(4, 3, 8, 8)  # 17 verify rows; the branch reaches depth 8, the tree 3


def _deep_engine(hf):
    """A random head's trees with DEEP's branch."""
    drafter = TreeHeadDrafter(random_head(tiny_loaded(hf).config, "", seed=3), DEEP)
    spec = SpecConfig(method="chain", tree=DEEP, adaptive=False)
    return tiny_engine(hf, spec=spec, drafter=drafter), drafter


def test_a_branch_deeper_than_the_tree_accepts_past_its_depth(hf):
    """DEEP on the tiny model's cycles: steps accept more drafts than the tree is deep (all
    through the branch), the output stays plain decoding's, greedy and seeded sampled; the
    step's tree buffers and the head's catch-up take the branch's reach, not the depth."""
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, params)]
    engine, drafter = _tree_engine(hf, DEEP)
    body, accepted = engine.spec_graphs.body, tree_accepts(engine)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == plain
    assert body.tv.path.shape[1] == drafter.reach == DEEP.ngram
    assert sorted(drafter.cu) == [DEEP.depth, DEEP.reach]  # the chain's catch-up, the tree's
    assert int(drafter.cu[DEEP.reach][1][0]) == DEEP.ngram
    deeper = sum(a > DEEP.depth for a in accepted)
    assert deeper >= 5 and max(accepted) > DEEP.depth + 2, accepted
    engine, _ = _tree_engine(hf, DEEP)
    assert engine.generate(PROMPTS[:1], HOT)[0].token_ids == \
        tiny_engine(hf).generate(PROMPTS[:1], HOT)[0].token_ids


def test_the_head_kv_past_the_trees_depth_is_caught_up(hf, monkeypatch):
    """After every step the head's KV of every final position equals a from-scratch
    computation, positions accepted through the branch past the tree's depth included; a
    catch-up that covers only the tree's depth (entries past it sent to the dummy slot)
    leaves those positions' entries stale."""
    from test_spec_chain_head import _max_kv_error

    import draftgraph.spec.chain_head as chain_head

    engine, drafter = _deep_engine(hf)
    assert _max_kv_error(engine, drafter, steps=26, prompt=PROMPTS[2]) < 1e-4
    # measured: 29, 21 of them in steps that accepted 8, 8 and 5 drafts
    assert engine.stats["num_accepted_tokens"] >= 25
    stage = chain_head.stage_catch_up

    def short(*args):  # the catch-up of the tree's depth only
        stage(*args)
        cu = args[-1]
        cu.loc.view(-1, DEEP.reach)[:, DEEP.depth:] = 0

    monkeypatch.setattr(chain_head, "stage_catch_up", short)
    engine, drafter = _deep_engine(hf)
    assert _max_kv_error(engine, drafter, steps=26, prompt=PROMPTS[2]) > 1e-2


def test_batches_too_large_for_trees_draft_chains_and_sampled_batches_trees(hf, plain):
    prompts = [[i, i + 1, i + 2] for i in range(3, 3 + 2 * TREE_MAX_BS)]
    ref = [o.token_ids for o in tiny_engine(hf, 16).generate(prompts, GREEDY)]
    engine, _ = _tree_engine(hf, max_num_seqs=16)
    seen = _count_tree_steps(engine)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == ref
    assert seen and max(seen)[0] <= TREE_MAX_BS  # the full batch drafted chains
    # a sampled request beside greedy ones drafts trees too: plain sampling's tokens
    engine, _ = _tree_engine(hf)
    seen = _count_tree_steps(engine)
    params = [GREEDY] * len(PROMPTS) + [HOT]
    outs = engine.generate(PROMPTS + [[9, 9, 9]], params)
    assert [o.token_ids for o in outs[:3]] == plain[:3]
    assert outs[3].token_ids == tiny_engine(hf).generate([[9, 9, 9]], HOT)[0].token_ids
    assert (1, False) in seen  # the sampled request's steps drafted trees


@pytest.mark.parametrize("chain", [None, 3])
def test_a_tree_drafters_chain_steps_verify_its_chain_not_the_trees_rows(hf, plain,
                                                                         monkeypatch, chain):
    """Steps that draft no tree (too many requests) run the head `chain` times (at most D:
    D by default) and verify 1 + chain rows a request, not the tree's 1 + k (before: 17 a
    request for 4x5:16, 33 for the auto shape), and their catch-up has `chain` entries a
    request, not the tree's reach; the tokens stay plain decoding's, and sampled chain steps
    take the chain's distributions."""
    import draftgraph.spec.chain_head as chain_head

    c = chain or TREE.depth
    engine, drafter = _tree_engine(hf, max_num_seqs=8, chain=chain)
    drafter.tree_max_bs = 1  # every step of two or more requests drafts the chain
    body, rows, heads, entries = engine.spec_graphs.body, [], [], []
    forward, run_step, stage = body._forward_and_accept, drafter.run_step, \
        chain_head.stage_catch_up

    def counted(bs, greedy):
        rows.append((bs, body.tree_step(bs), body._fb(bs).input_ids.shape[0]))
        forward(bs, greedy)

    def head_step(ctx, i, fb):
        heads.append((ctx.seq_lens.shape[0], ctx.tree, i))
        run_step(ctx, i, fb)

    def staged(*args):
        entries.append((args[3].shape[0], args[5] is not None, args[-1].ids.shape[0]))
        stage(*args)

    body._forward_and_accept, drafter.run_step = counted, head_step
    monkeypatch.setattr(chain_head, "stage_catch_up", staged)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain
    chains = {(bs, n) for bs, tree, n in rows if not tree}
    assert chains and all(n == bs * (1 + c) for bs, n in chains), rows
    assert body.chain_k == drafter.chain_k == c < body.k == TREE.verified
    # each chain proposal ran the head c times; each chain step's catch-up c entries a request
    assert {i for bs, tree, i in heads if not tree} == set(range(c)), heads
    m = drafter.executor.max_bs
    assert {e for bs, tree, e in entries if bs > 1} == {m * c}, entries
    # sampled chain steps: the chain's distributions go to rejection sampling
    engine, drafter = _tree_engine(hf, max_num_seqs=8, chain=chain)
    drafter.tree_max_bs = 1
    seen = _count_tree_steps(engine)
    outs = engine.generate(PROMPTS, HOT)
    assert all(len(o.token_ids) == HOT.max_tokens for o in outs)
    assert engine.stats["num_draft_tokens"] > 0 and (len(PROMPTS), False) not in seen


class _AcceptingChain(TreeHeadDrafter):
    """Its chain steps draft the plain greedy continuation (`future`), so they accept every
    draft and the catch-up has entries to fix (test_spec_chain_head's `_Accepting`)."""

    def __init__(self, head, shape, future: list[int], **kw) -> None:
        super().__init__(head, shape, **kw)
        self.future = torch.tensor(future + [0] * (shape.reach + 2))

    def take(self, ctx, i, logits):
        bs = super().take(ctx, i, logits).shape[0]
        tok = self.future[(ctx.seq_lens[:bs] + i).clamp_max(len(self.future) - 1)]
        self.drafts[:bs, i].copy_(tok)
        self.step_ids[:bs].copy_(tok)
        return tok


def test_a_tree_drafters_short_chain_keeps_the_head_kv_exact(hf):
    """Chain steps of 3 drafts from a drafter whose trees reach 8 (DEEP): every draft is
    accepted, and after every step the head's KV of every final position equals a
    from-scratch computation (the catch-up's 3 entries a request cover what a chain step
    accepts); a catch-up one entry short leaves entries stale."""
    from test_spec_chain_head import KV_PROMPT, LONG, _max_kv_error

    import draftgraph.spec.chain_head as chain_head

    def run(short: bool) -> tuple[float, dict]:
        (out,) = tiny_engine(hf).generate([KV_PROMPT], LONG)
        head = random_head(tiny_loaded(hf).config, "", seed=3)
        drafter = _AcceptingChain(head, DEEP, KV_PROMPT + out.token_ids, chain=3)
        spec = SpecConfig(method="chain", tree=DEEP, adaptive=False)
        engine = tiny_engine(hf, spec=spec, drafter=drafter)
        drafter.tree_max_bs = 0  # every step drafts the chain
        stage = chain_head.stage_catch_up

        def staged(*args):
            stage(*args)
            if short:
                args[-1].loc.view(-1, 3)[:, 2] = 0
        chain_head.stage_catch_up = staged
        try:
            return _max_kv_error(engine, drafter, steps=12, prompt=KV_PROMPT), engine.stats
        finally:
            chain_head.stage_catch_up = stage

    err, stats = run(short=False)
    assert err < 1e-4
    # the prefill, then 11 steps of 3 drafts, all accepted
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] == 33
    assert run(short=True)[0] > 1e-2


def test_a_tree_drafters_chain_steps_give_plain_logprobs_top_n_and_penalties(hf):
    """Top-N alternatives and penalties send a tree drafter's steps down the chain (their
    tails read a chain): tokens, logprobs and top-N alternatives, written 1 + D wide and
    copied into the results, equal plain decoding's."""
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=True,
                             top_logprobs=3),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                             repetition_penalty=1.3, presence_penalty=0.5)]
    ref = tiny_engine(hf).generate(PROMPTS[:2], params)
    engine, _ = _tree_engine(hf)
    seen = _count_tree_steps(engine)
    outs = engine.generate(PROMPTS[:2], params)
    assert not seen  # no tree step: every one ran the chain
    assert engine.stats["num_draft_tokens"] > 0
    for got, want in zip(outs, ref, strict=True):
        assert got.token_ids == want.token_ids
    assert outs[0].logprobs == pytest.approx(ref[0].logprobs, abs=1e-4)
    assert [[t for t, *_ in top] for top in outs[0].top_logprobs] == \
        [[t for t, *_ in top] for top in ref[0].top_logprobs]


class OracleTree(TreeHeadDrafter):
    """A random head whose every row ranks the plain continuation's next token first, with
    log-probability ~0 (the rest ~-1e4): the true path is always drafted and accepted as deep
    as the tree goes, while its nodes sit at rows other than their depths (so the KV copy
    moves them); one request (`future`: its prompt and plain output)."""

    def __init__(self, head, shape: TreeShape, future: list[int]) -> None:
        super().__init__(head, shape)
        self.future = torch.tensor(future + [0] * (shape.depth + 2))

    def bind(self, target) -> None:
        super().bind(target)
        self.future = self.future.to(target.device)

    def _expand(self, ctx, i, logits, stream):
        bs, w = ctx.seq_lens.shape[0], self.shape.width
        seq = self.step_seq_lens[:bs] if i == 0 else self.t_seq[: bs * w]
        nxt = self.future[seq.clamp_max(len(self.future) - 1)]
        logits = logits.scatter(1, nxt[:, None], 1e4)
        super()._expand(ctx, i, logits, stream)


def oracle_run(engine_for, plain_of, prompt: list[int], shape: TreeShape = TREE,
               params: SamplingParams = GREEDY):
    """(tokens, plain tokens, stats) of one request drafted by an OracleTree; engine_for(d)
    builds the engine, plain_of(prompt, params) the plain output."""
    ref = plain_of(prompt, params)
    engine, drafter = engine_for(lambda head: OracleTree(head, shape, prompt + ref))
    (out,) = engine.generate([prompt], params)
    return out.token_ids, ref, engine.stats


def _oracle_engine(hf):
    def engine_for(make):
        drafter = make(random_head(tiny_loaded(hf).config, "", seed=3))
        spec = SpecConfig(method="ngram", num_draft_tokens=TREE.nodes, adaptive=False)
        return tiny_engine(hf, spec=spec, drafter=drafter), drafter

    def plain_of(prompt, params):
        return tiny_engine(hf).generate([prompt], params)[0].token_ids
    return engine_for, plain_of


def test_an_accepted_path_is_moved_into_place(hf):
    """The oracle's true path is accepted to full depth every round; without the KV copy the
    next rounds read the accepted positions' slots holding other nodes' K / V."""
    tokens, ref, s = oracle_run(*_oracle_engine(hf), PROMPTS[2])
    assert tokens == ref
    assert s["num_accepted_tokens"] >= 0.9 * TREE.depth * s["num_drafts"]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(KVPool, "copy_slots", lambda self, src, dst: None)
        tokens, ref, _ = oracle_run(*_oracle_engine(hf), PROMPTS[2])
    assert tokens != ref


def test_a_sampled_tree_takes_plain_samplings_draws(hf):
    """Sampled steps draft trees: with the oracle ranking plain seeded sampling's own
    continuation first, the target's draw at every row is that token, so the trees are
    accepted to full depth and the output is plain sampling's (drawing at other positions,
    or taking the argmax, breaks both)."""
    tokens, ref, s = oracle_run(*_oracle_engine(hf), PROMPTS[2], params=HOT)
    assert tokens == ref
    assert s["num_accepted_tokens"] >= 0.9 * TREE.depth * s["num_drafts"]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    sets = json.loads(SETS.read_text())
    return sets["mtbench"][:3] + sets["humaneval"][:3]


def _run(loaded, prompts, spec: SpecConfig, max_num_seqs: int = 8, stats: bool = False):
    engine = LLMEngine(EngineConfig(model="default", cache=CacheConfig(kv_cache_tokens=4096),
                                    scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
                                    spec=spec), loaded=loaded)
    outs = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0,
                                                   ignore_eos=True))
    s = engine.stats
    if stats:
        return s
    return [o.token_ids for o in outs], 1 + s["num_accepted_tokens"] / max(s["num_drafts"], 1)


@pytest.fixture(scope="module")
def real_plain(default_model, prompts):
    return _run(default_model, prompts, SpecConfig())[0]


def test_the_shipped_head_drafts_trees_losslessly_and_accepts_more(default_model, prompts,
                                                                    real_plain):
    tokens, chain = _run(default_model, prompts, SpecConfig(method="chain", adaptive=False))
    assert tokens == real_plain
    tokens, tree = _run(default_model, prompts, SpecConfig(method="chain", tree=TREE))
    assert tokens == real_plain
    # measured on these prompts: chain (k = 4) 1.88, tree 4x5:16 2.41 (the head of stop 58)
    assert tree > chain + 0.4, (chain, tree)


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# each shipped head's offline walks (`tree_accept.py --head <head> --sets <these sets' first 3
# prompts> --num-prompts 3 --max-tokens 48 --trees <keys>`, CPU fp32), and the engine's arms
OFFLINE = {
    "chain": ("tree_accept_engine_check_cpu_fp32.json",
              ((SpecConfig(method="chain", adaptive=False), "1x4:4"),
               (SpecConfig(method="chain", tree=TREE), "4x5:16"))),
    "block": ("tree_accept_engine_check_block_cpu_fp32.json",
              ((SpecConfig(method="block", adaptive=False), "1x7:7"),
               (SpecConfig(method="block", tree=TreeShape(4, 7, 16)), "4x7:16"))),
}


@pytest.mark.parametrize("kind", ["chain", "block"])
@pytest.mark.parametrize("name", ["mtbench", "humaneval"])
def test_the_engines_trees_accept_what_the_offline_walk_measured(default_model, kind, name):
    """benchmarks/tree_accept.py grows the same trees from scratch (the head's entries over
    the whole sequence, a tree mask; for the block head its one forward at every position,
    the training loss's `block_forward`) along the target's outputs; the engine, one request
    at a time, must make the same rounds and accept the same tokens, for the head's chain
    (the block of 8) too."""
    file, arms = OFFLINE[kind]
    offline = json.loads((RESULTS / file).read_text())["sets"][name]
    prompts = json.loads(SETS.read_text())[name][:3]
    for spec, key in arms:
        s = _run(default_model, prompts, spec, max_num_seqs=1, stats=True)
        assert (s["num_drafts"], s["num_accepted_tokens"]) == (
            offline[key]["rounds"], offline[key]["accepted"]), key


@pytest.mark.parametrize("broken", ["no KV copy", "lists without paths"])
def test_a_tree_step_missing_a_piece_is_caught(default_model, prompts, real_plain,
                                               monkeypatch, broken):
    if broken == "no KV copy":  # accepted nodes' K / V left in their drafting slots
        monkeypatch.setattr(KVPool, "copy_slots", lambda self, src, dst: None)
    else:  # every tree row reads its request's table (its siblings' racy entries)
        build = metadata.build_kv_index_lists
        monkeypatch.setattr(metadata, "build_kv_index_lists", lambda *a: build(*a[:5]))
    tokens, _ = _run(default_model, prompts, SpecConfig(method="chain", tree=TREE))
    assert tokens != real_plain
