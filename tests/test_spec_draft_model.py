"""A separate draft model as chain drafter (k draft steps inside the speculative step): the
target as its own draft accepts every draft; any draft model stays lossless; the per-step
metadata advance matters; at temperature 1 the output follows the target's distribution."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_engine, tiny_hf_model, tiny_loaded

from draftgraph.attention.backend import TorchBackend
from draftgraph.config import SpecConfig
from draftgraph.engine.sampling import SamplingParams
from draftgraph.spec.draft_model import DraftModelDrafter

K = 4
SPEC = SpecConfig(method="ngram", num_draft_tokens=K, adaptive=False)  # method: see drafter=
GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3] * 5, list(range(40, 70))]


@pytest.fixture(scope="module")
def plain(hf):
    return [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, GREEDY)]


def _draft_engine(hf, draft_hf, **kw):
    drafter = DraftModelDrafter(tiny_loaded(draft_hf).model, K)
    return tiny_engine(hf, spec=SPEC, drafter=drafter, **kw), drafter


def test_the_target_as_its_own_draft_model_accepts_every_draft(hf, plain):
    """(It caught a hole: without the chain's last step writing the k-th draft's KV, a fully
    accepted round left that position empty in the draft cache: 63 of 79 drafts accepted.)"""
    engine, drafter = _draft_engine(hf, hf)
    assert not engine.spec_graphs.body.fused_draft  # the CPU's torch backend: per step
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    s = engine.stats
    assert s["num_draft_tokens"] > 40 and s["num_accepted_tokens"] == s["num_draft_tokens"]
    assert all(o.metrics["accept_len_mean"] > K for o in outs)
    # the draft model has its own KV pool over the shared slot space
    assert drafter.executor.kv_pool is not engine.target.kv_pool
    assert drafter.executor.slots is engine.slots
    assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots


def test_a_no_op_metadata_advance_loses_acceptance_but_never_output(hf, plain, monkeypatch):
    # declared capable, the torch backend runs the fused chain (advance in place)
    monkeypatch.setattr(TorchBackend, "draft_step_update", True)
    engine, drafter = _draft_engine(hf, hf)
    assert engine.spec_graphs.body.fused_draft
    drafter.executor.backend.advance_metadata = lambda fb: None  # steps 1.. reuse step 0's
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain  # verification keeps it lossless
    s = engine.stats
    # with the advance every draft is accepted (the test above); without it drafts go wrong
    assert s["num_accepted_tokens"] < s["num_draft_tokens"]


def test_a_different_draft_model_is_lossless(hf, plain):
    engine, _ = _draft_engine(hf, tiny_hf_model(seed=9))
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert engine.stats["num_draft_tokens"] > 0


def test_a_draft_model_with_another_vocabulary_is_refused(hf):
    with pytest.raises(ValueError, match="--draft-model has a vocabulary of 64 tokens"):
        _draft_engine(hf, tiny_hf_model(seed=1, vocab=64))


def _chi2_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square test of equal distributions over bins (counts a, b)."""
    keep = (a + b) >= 10
    rest = torch.stack([a[~keep].sum(), b[~keep].sum()])
    a = torch.cat([a[keep], rest[:1]]).double()
    b = torch.cat([b[keep], rest[1:]]).double()
    n_a, n_b = a.sum(), b.sum()
    tot = a + b
    ea, eb = tot * n_a / (n_a + n_b), tot * n_b / (n_a + n_b)
    mask = tot > 0
    stat = (((a - ea) ** 2 / ea)[mask].sum() + ((b - eb) ** 2 / eb)[mask].sum())
    df = int(mask.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def _peaked(seed: int, vocab: int):
    """A tiny random model with a peaked next-token distribution (scaled LM head)."""
    hf = tiny_hf_model(seed=seed, vocab=vocab)
    with torch.no_grad():
        hf.lm_head.weight.mul_(6.0)
    return hf


def _pair_counts(engine, n: int, vocab: int, batch: int = 128, top_k: int = 0) -> torch.Tensor:
    """Histogram of the first two sampled tokens (as one joint bin) over n seeds. The first
    comes from the prefill, the second from a speculative step with one draft (max_tokens 3
    leaves room for one)."""
    counts = torch.zeros(vocab * vocab, dtype=torch.int64)
    for start in range(0, n, batch):
        ps = [SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, seed=s,
                             ignore_eos=True)
              for s in range(start, start + batch)]
        for o in engine.generate([[3, 1, 4, 1, 5]] * batch, ps):
            counts[o.token_ids[0] * vocab + o.token_ids[1]] += 1
    return counts


def assert_head_follows_the_target(make, top_k: int = 0) -> None:
    """For a drafter head that samples its drafts: the first token a speculative step emits,
    drafted from the head's own q, has plain sampling's distribution (p-value > 1e-3); the same
    drafts verified against a wrong (uniform) q are biased (p-value < 1e-3).
    `make(target, **engine_kw)` gives (engine, drafter) over the target. With top_k the
    requests cut the target's distribution (the drafts come from the head's whole q)."""
    vocab, n, batch = 8, 512, 128
    target = _peaked(3, vocab)
    kw = dict(max_num_seqs=batch, budget=1024)
    plain = _pair_counts(tiny_engine(target, **kw), n, vocab, batch, top_k)
    pvalues = {}
    for arm in ("true_q", "wrong_q"):
        engine, drafter = make(target, **kw)
        real = drafter.finish

        def finish(ctx, real=real, arm=arm):
            p = real(ctx)
            assert p.draft_probs is not None  # the head samples from its own distribution
            if arm == "wrong_q":
                p.draft_probs = torch.full_like(p.draft_probs, 1.0 / vocab)
            return p

        drafter.finish = finish
        spec = _pair_counts(engine, n, vocab, batch, top_k)
        assert engine.stats["num_draft_tokens"] == n  # one draft per request
        pvalues[arm] = _chi2_pvalue(plain, spec)
    if top_k:  # the cut is real: no pair outside the top-k tokens is ever emitted
        assert (plain > 0).sum() <= top_k * top_k
    assert pvalues["true_q"] > 1e-3 and pvalues["wrong_q"] < 1e-3, pvalues


def test_at_temperature_1_the_output_follows_the_target():
    """The second token is the first a speculative step emits: drafted by a different model
    from its own distribution q, then accepted (min(1, p/q)) or resampled from the residual.
    Against plain sampling: the same distribution (p-value > 1e-3). The control verifies the
    same drafts against a wrong q (uniform): the test must see that bias (p-value < 1e-3).
    Point-mass verification of the same drafts stays unbiased but accepts fewer."""
    vocab, n, batch = 8, 512, 128
    target, draft = _peaked(3, vocab), _peaked(4, vocab)
    kw = dict(max_num_seqs=batch, budget=1024)
    plain = _pair_counts(tiny_engine(target, **kw), n, vocab, batch)
    pvalues, accepted = {}, {}
    for arm in ("true_q", "wrong_q", "point_mass"):
        engine, drafter = _draft_engine(target, draft, **kw)
        real = drafter.finish  # the proposal a chain hands to verification

        def finish(ctx, real=real, arm=arm):
            p = real(ctx)
            if arm == "wrong_q":
                p.draft_probs = torch.full_like(p.draft_probs, 1.0 / vocab)
            elif arm == "point_mass":
                p.draft_probs = None
            return p

        drafter.finish = finish
        spec = _pair_counts(engine, n, vocab, batch)
        assert engine.stats["num_draft_tokens"] == n  # one draft per request
        pvalues[arm] = _chi2_pvalue(plain, spec)
        accepted[arm] = engine.stats["num_accepted_tokens"]
    assert pvalues["true_q"] > 1e-3 and pvalues["point_mass"] > 1e-3, pvalues
    assert pvalues["wrong_q"] < 1e-3, pvalues
    assert accepted["true_q"] > accepted["point_mass"], accepted
