"""Async speculative steps on CPU: speculative step N + 1 is launched before step N is read.

Step N + 1 is staged as if step N emitted one token per request; the device shifts each row by
what step N did emit (its last token, seq_lens, KV slots, max_draft: kernels/tokens.py). On
CPU the graph sets run their bodies eagerly with the same contract as captured graphs.
Outputs must equal the synchronous engine's token for token (greedy, and seeded sampling with
fixed draft lengths), whatever finishes, aborts or arrives mid-run; every KV slot comes back;
and the steps really were launched ahead with accept lengths above one."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_engine, tiny_hf_model, tiny_loaded
from test_async_scheduling import _prompts, run_steps
from test_async_scheduling import count_refs as _count_refs

from draftgraph.config import SpecConfig, TreeShape
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.heads import random_head
from draftgraph.spec.chain_head import ChainHeadDrafter
from draftgraph.spec.drafter import Drafter, Proposal

K = 3
FIXED = SpecConfig(method="ngram", num_draft_tokens=K, adaptive=False)  # method: see drafter=
ADAPTIVE = SpecConfig(method="ngram", num_draft_tokens=K, ngram_min=1, ngram_max=3)


class RowOracle(Drafter):
    """Drafts each request's known future (set per request row by the test), wrong at every
    fifth position, so accept lengths vary over 1 .. 1 + k."""

    name = "row-oracle"

    def __init__(self, k: int, length: int = 256, rows: int = 16) -> None:
        super().__init__(k)
        self.future = torch.zeros(rows + 1, length, dtype=torch.int64)  # [rows, positions]

    def set(self, row: int, tokens: list[int]) -> None:
        t = torch.tensor(tokens)
        pos = torch.arange(len(t))
        self.future[row].zero_()
        self.future[row, : len(t)] = torch.where(pos % 5 == 3, (t + 1) % 128, t)

    def propose(self, ctx) -> Proposal:
        idx = ctx.seq_lens[:, None] + torch.arange(self.k)[None, :]  # [bs, k] draft positions
        drafts = self.future[ctx.req_pool_indices[:, None], idx.clamp_max(self.future.shape[1]
                                                                          - 1)]
        return Proposal(drafts, ctx.max_draft.clone())


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(seed=0)


def _engine(hf, async_on: bool, spec=FIXED, drafter=None, kv_tokens: int = 2048):
    engine = tiny_engine(hf, max_num_seqs=8, budget=64, kv_tokens=kv_tokens, spec=spec,
                         drafter=drafter)
    engine.async_scheduling = async_on  # on CPU off by default: eagerly nothing overlaps
    for graphs in (engine.decode_graphs, engine.spec_graphs):
        _count_refs(graphs)
    return engine


def _run(engine, prompts, params, futures=None, abort_at=None, late=None):
    """test_async_scheduling's driver; before each step the oracle (if any) learns each
    running request's future."""
    def teach(engine):
        for rid, req in engine.requests.items():
            if req.req_pool_idx:
                engine.drafter.set(req.req_pool_idx, futures[rid])

    return run_steps(engine, prompts, params, abort_at, late,
                     before_step=teach if futures is not None else None)


def _futures(hf, prompts, late=None):
    """Each request's plain greedy sequence (prompt + 60 tokens), by request id."""
    sp = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    named = {f"r{i}": p for i, p in enumerate(prompts)} | ({"late": late} if late else {})
    outs = tiny_engine(hf).generate(list(named.values()), sp)
    return {rid: p + o.token_ids for (rid, p), o in zip(named.items(), outs, strict=True)}


def test_async_speculative_steps_equal_sync_ones_greedy(hf):
    prompts = _prompts()
    futures = _futures(hf, prompts)
    stop = futures["r0"][len(prompts[0]) + 9]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=True)
              for n in (30, 17, 9, 25, 1)]
    params[0] = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=True,
                               stop_token_ids=[stop])
    plain = _run(tiny_engine(hf, max_num_seqs=8, budget=64), prompts, params)
    sync = _engine(hf, False, drafter=RowOracle(K))
    ref = _run(sync, prompts, params, futures)
    engine = _engine(hf, True, drafter=RowOracle(K))
    got = _run(engine, prompts, params, futures)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in ref.items()} == \
        {k: v[0] for k, v in plain.items()}
    assert {k: v[2] for k, v in got.items()} == {k: v[2] for k, v in ref.items()}
    assert ref["r0"][2] == "stop"
    for k in ref:
        torch.testing.assert_close(torch.tensor(got[k][1]), torch.tensor(ref[k][1]))
    assert sync.spec_graphs.refs == 0
    assert engine.spec_graphs.refs > 10  # speculative steps really were launched ahead
    # and the rows they shifted had emitted more than one token (accepted drafts)
    s = engine.stats
    assert s["num_accepted_tokens"] > s["num_drafts"] > 10
    assert s["num_accepted_tokens"] == sync.stats["num_accepted_tokens"]


def test_async_speculative_steps_equal_sync_ones_seeded_sampling(hf):
    """Fixed draft lengths: the device caps an ahead step's drafts by the room left exactly
    as the host caps a synchronous one, so seeded sampling draws the same tokens (the
    oracle drafts plain seeded sampling's output, wrong at every fifth position)."""
    prompts = _prompts(4)
    params = [SamplingParams(max_tokens=n, temperature=0.8, seed=3 + n, ignore_eos=True,
                             logprobs=True) for n in (20, 13, 26, 7)]
    plain = _run(tiny_engine(hf, max_num_seqs=8, budget=64), prompts, params)
    futures = {f"r{i}": p + plain[f"r{i}"][0] for i, p in enumerate(prompts)}
    ref = _run(_engine(hf, False, drafter=RowOracle(K)), prompts, params, futures)
    assert {k: v[0] for k, v in ref.items()} == {k: v[0] for k, v in plain.items()}
    engine = _engine(hf, True, drafter=RowOracle(K))
    got = _run(engine, prompts, params, futures)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in ref.items()}
    for k in ref:
        torch.testing.assert_close(torch.tensor(got[k][1]), torch.tensor(ref[k][1]))
    assert engine.spec_graphs.refs > 5
    assert engine.stats["num_accepted_tokens"] > 5  # rows shifted by accepted drafts


def test_async_adaptive_drafts_with_seeded_sampling_equal_sync_and_plain(hf):
    """The adaptive policy sets an ahead step's draft lengths before the step it follows is
    read, so async and sync steps draft different counts; point-mass drafts are verified
    against plain decoding's own draws, so both emit plain seeded sampling's tokens."""
    prompts = _prompts(4)
    params = [SamplingParams(max_tokens=n, temperature=0.9, seed=5 + n, ignore_eos=True)
              for n in (30, 17, 26, 9)]
    plain = _run(tiny_engine(hf, max_num_seqs=8, budget=64), prompts, params)
    futures = {f"r{i}": p + plain[f"r{i}"][0] for i, p in enumerate(prompts)}
    sync = _engine(hf, False, spec=ADAPTIVE, drafter=RowOracle(K))
    ref = _run(sync, prompts, params, futures)
    engine = _engine(hf, True, spec=ADAPTIVE, drafter=RowOracle(K))
    got = _run(engine, prompts, params, futures)
    tokens = {k: v[0] for k, v in plain.items()}
    assert {k: v[0] for k, v in ref.items()} == tokens
    assert {k: v[0] for k, v in got.items()} == tokens
    assert engine.spec_graphs.refs > 5 and engine.stats["num_accepted_tokens"] > 5
    assert engine.stats["num_draft_tokens"] != sync.stats["num_draft_tokens"]


def test_async_speculative_steps_survive_an_abort_and_a_late_arrival(hf):
    prompts = _prompts(4)
    late_prompt = _prompts(5)[4]
    futures = _futures(hf, prompts, late=late_prompt)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 4
    late = (late_prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    ref = _run(_engine(hf, False, drafter=RowOracle(K)), prompts, params, futures,
               abort_at=(4, 2), late=late)
    engine = _engine(hf, True, drafter=RowOracle(K))
    got = _run(engine, prompts, params, futures, abort_at=(4, 2), late=late)
    assert got["r2"][2] == ref["r2"][2] == "abort"
    for k in ("r0", "r1", "r3", "late"):
        assert got[k] == ref[k], k
    assert engine.spec_graphs.refs > 0


def test_async_speculative_steps_fall_back_when_kv_runs_short(hf):
    # an ahead step needs 1 + 2k slots per request: with a small pool the launch is skipped
    # (the normal path preempts), and the outputs still equal plain decoding
    prompts = _prompts(4)
    futures = _futures(hf, prompts)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 4
    plain = _run(tiny_engine(hf, max_num_seqs=8, budget=64), prompts, params)
    got = _run(_engine(hf, True, drafter=RowOracle(K), kv_tokens=110), prompts, params, futures)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in plain.items()}


def test_async_ngram_steps_switch_between_decode_and_speculative_graphs(hf):
    """An adaptive n-gram drafter on a random model backs off to draft length 0 (decode
    graphs) and probes again (speculative graphs); each switch takes one synchronous step,
    and both graph sets are launched ahead in between."""
    g = torch.Generator().manual_seed(3)
    base = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (6, 14, 9)]
    prompts = [b + b[: len(b) // 2] + b for b in base]
    params = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)] * 3
    plain = _run(tiny_engine(hf, max_num_seqs=8, budget=64), prompts, params)
    engine = _engine(hf, True, spec=ADAPTIVE)
    got = _run(engine, prompts, params)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in plain.items()}
    assert engine.spec_graphs.refs > 0 and engine.decode_graphs.refs > 0
    assert engine.stats["num_drafts"] > 0


def test_async_steps_with_a_chain_head_keep_its_kv_in_step(hf):
    """A drafter with its own KV (every step speculative): async equals sync and plain."""
    prompts = _prompts(3)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (25, 12, 18)]
    plain = _run(tiny_engine(hf, max_num_seqs=8, budget=64), prompts, params)
    outs = {}
    for async_on in (False, True):
        head = random_head(tiny_loaded(hf).config, "", seed=3)
        engine = _engine(hf, async_on, drafter=ChainHeadDrafter(head, K))
        outs[async_on] = _run(engine, prompts, params)
    assert outs[True] == outs[False]
    assert {k: v[0] for k, v in outs[True].items()} == {k: v[0] for k, v in plain.items()}
    assert engine.spec_graphs.refs > 10 and engine.decode_graphs.refs == 0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_async_steps_with_a_draft_tree_equal_sync_and_plain(hf, temperature):
    """A tree drafter (its rows' own KV paths, the accepted path's KV moved into place), with
    an oracle ranking the plain continuation first so trees are accepted deep: async equals
    sync and plain, greedy and seeded sampling."""
    from test_spec_tree import OracleTree

    tree = TreeShape(2, 3, 6)
    spec = SpecConfig(method="ngram", num_draft_tokens=tree.nodes, adaptive=False)
    prompt = _prompts(2)[1]
    params = [SamplingParams(max_tokens=40, temperature=temperature, top_k=50, seed=3,
                             ignore_eos=True)]
    plain = _run(tiny_engine(hf, max_num_seqs=8, budget=64), [prompt], params)
    outs, stats = {}, {}
    for async_on in (False, True):
        head = random_head(tiny_loaded(hf).config, "", seed=3)
        engine = _engine(hf, async_on, spec=spec,
                         drafter=OracleTree(head, tree, prompt + plain["r0"][0]))
        outs[async_on] = _run(engine, [prompt], params)
        stats[async_on] = engine.stats
    assert outs[True] == outs[False]
    assert outs[True]["r0"][0] == plain["r0"][0]
    assert engine.spec_graphs.refs > 5  # launched ahead
    assert stats[True]["num_accepted_tokens"] == stats[False]["num_accepted_tokens"] \
        >= 0.9 * tree.depth * stats[True]["num_drafts"]


def test_async_speculative_steps_with_sampling_controls_equal_sync_ones(hf):
    """Penalties and logit bias replay the extras twin; its counts fold the positions each
    ahead step's shifted seq_lens reach, so outputs still equal the synchronous engine's."""
    prompts = _prompts(3)
    controls = dict(temperature=0, ignore_eos=True, presence_penalty=0.5,
                    frequency_penalty=0.3, logit_bias={7: 2.0})
    plain = tiny_engine(hf).generate(prompts, SamplingParams(max_tokens=60, **controls))
    futures = {f"r{i}": p + o.token_ids for i, (p, o) in enumerate(zip(prompts, plain,
                                                                        strict=True))}
    params = [SamplingParams(max_tokens=n, logprobs=True, **controls) for n in (22, 15, 30)]
    ref = _run(_engine(hf, False, drafter=RowOracle(K)), prompts, params, futures)
    engine = _engine(hf, True, drafter=RowOracle(K))
    twin = engine.extras_graphs[engine.spec_graphs]
    _count_refs(twin)
    got = _run(engine, prompts, params, futures)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in ref.items()}
    for k in ref:
        torch.testing.assert_close(torch.tensor(got[k][1]), torch.tensor(ref[k][1]))
    assert twin.refs > 5  # the extras twin's steps were launched ahead
    assert engine.stats["num_accepted_tokens"] > 10  # and shifted by accepted drafts
