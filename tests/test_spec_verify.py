"""Speculative acceptance: greedy chain acceptance, rejection sampling, stop truncation."""

import pytest
import torch

from draftgraph.runtime.sampling import processed_probs
from draftgraph.spec import verify
from draftgraph.spec.verify import (
    first_stop_index,
    greedy_accept,
    greedy_accept_from_argmax,
    rejection_sample,
)

# ---------------------------------------------------------------- greedy acceptance


def _logits_with_argmax(argmax: list[list[int]], vocab: int) -> torch.Tensor:
    """[bs, len, vocab] fp32 logits whose argmax per row is the given token."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor(argmax)
    logits = torch.randn(*ids.shape, vocab, generator=gen)
    return logits.scatter(2, ids[..., None], 10.0)


def test_verify_accepts_prefix_until_first_mismatch() -> None:
    logits = _logits_with_argmax([[5, 6, 7, 8, 9]], vocab=16)
    draft_tokens = torch.tensor([[5, 6, 1, 8]])  # third draft disagrees with the target
    out, accept_lens = greedy_accept(draft_tokens, torch.tensor([4]), logits)
    assert accept_lens.tolist() == [3]
    assert out.tolist() == [[5, 6, 7, -1, -1]]  # target's token at the mismatch, then -1


def test_verify_full_accept_emits_bonus_token() -> None:
    logits = _logits_with_argmax([[5, 6, 7, 8, 9]], vocab=16)
    out, accept_lens = greedy_accept(torch.tensor([[5, 6, 7, 8]]), torch.tensor([4]), logits)
    assert accept_lens.tolist() == [5]
    assert out.tolist() == [[5, 6, 7, 8, 9]]


def test_verify_mixed_num_draft_tokens_and_inactive_drafts_never_accepted() -> None:
    chains = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 0], [3, 3, 3, 3, 3], [9, 8, 7, 6, 5]]
    logits = _logits_with_argmax(chains, vocab=16)
    # every row's drafts match the target chain, padded ones included: only active count
    draft_tokens = torch.tensor([row[:4] for row in chains])
    num_draft_tokens = torch.tensor([0, 2, 4, 1])
    out, accept_lens = greedy_accept(draft_tokens, num_draft_tokens, logits)
    assert accept_lens.tolist() == [1, 3, 5, 2]
    assert out.tolist() == [
        [5, -1, -1, -1, -1],  # no drafts: just the target's argmax of row 0
        [1, 2, 3, -1, -1],
        [3, 3, 3, 3, 3],
        [9, 8, -1, -1, -1],
    ]


def test_verify_self_drafting_accepts_everything() -> None:
    gen = torch.Generator().manual_seed(1)
    bs, k, vocab = 32, 5, 40
    logits = torch.randn(bs, k + 1, vocab, generator=gen)
    draft_tokens = logits.argmax(dim=-1)[:, :k]  # the target's own chain
    num_draft_tokens = torch.randint(0, k + 1, (bs,), generator=gen)
    out, accept_lens = greedy_accept(draft_tokens, num_draft_tokens, logits)
    assert torch.equal(accept_lens, num_draft_tokens + 1)
    assert torch.equal(out[:, 0], logits[:, 0].argmax(dim=-1))


def test_verify_from_a_precomputed_argmax_equals_verify_from_logits() -> None:
    # the step graphs pass the argmax of their one argmax + logsumexp pass over the logits
    gen = torch.Generator().manual_seed(2)
    bs, k, vocab = 16, 4, 12
    logits = torch.randn(bs, k + 1, vocab, generator=gen)
    target_argmax = logits.argmax(dim=-1)
    # drafts that follow the target for a random number of tokens, then disagree
    draft_tokens = target_argmax[:, :k].clone()
    diverge = torch.randint(0, k + 1, (bs,), generator=gen)
    wrong = torch.arange(k)[None, :] >= diverge[:, None]
    draft_tokens = torch.where(wrong, (draft_tokens + 1) % vocab, draft_tokens)
    num_draft_tokens = torch.randint(0, k + 1, (bs,), generator=gen)
    out, lens = greedy_accept_from_argmax(draft_tokens, num_draft_tokens, target_argmax)
    want_out, want_lens = greedy_accept(draft_tokens, num_draft_tokens, logits)
    assert torch.equal(out, want_out) and torch.equal(lens, want_lens)
    assert torch.equal(lens, torch.minimum(diverge, num_draft_tokens) + 1)


# ---------------------------------------------------------------- rejection sampling


def test_rejection_sample_greedy_rows_equal_greedy_accept() -> None:
    gen = torch.Generator().manual_seed(2)
    bs, k, vocab = 64, 4, 50
    logits = torch.randn(bs, k + 1, vocab, generator=gen)
    # drafts follow the argmax chain with some mutations, so accept lengths vary
    draft_tokens = logits.argmax(dim=-1)[:, :k].clone()
    mutate = torch.rand(bs, k, generator=gen) < 0.25
    draft_tokens[mutate] = torch.randint(0, vocab, (int(mutate.sum()),), generator=gen)
    num_draft_tokens = torch.randint(0, k + 1, (bs,), generator=gen)
    greedy_mask = torch.rand(bs, generator=gen) < 0.5
    temperature = torch.where(greedy_mask, 0.0, 0.9)
    rows = bs * (k + 1)
    target_probs = processed_probs(
        logits.view(rows, vocab), temperature.repeat_interleave(k + 1),
        torch.full((rows,), 0.95), torch.full((rows,), 20)).view(bs, k + 1, vocab)
    draft_probs = torch.softmax(torch.randn(bs, k, vocab, generator=gen), dim=-1)
    seeds = torch.arange(bs) * 7 + 3
    positions = torch.randint(0, 1000, (bs,), generator=gen)

    want_out, want_lens = greedy_accept(draft_tokens, num_draft_tokens, logits)
    assert 1 < want_lens.float().mean() < k  # the test sees partial acceptance
    for probs in (draft_probs, None):
        out, accept_lens = rejection_sample(draft_tokens, num_draft_tokens, probs,
                                            target_probs, seeds, positions, greedy_mask)
        assert torch.equal(out[greedy_mask], want_out[greedy_mask])
        assert torch.equal(accept_lens[greedy_mask], want_lens[greedy_mask])
        # sampled rows: accepted drafts, one emitted token, then -1
        assert bool(((accept_lens >= 1) & (accept_lens <= num_draft_tokens + 1)).all())
        slots = torch.arange(k + 1)[None, :]
        padded = torch.cat([draft_tokens, torch.full((bs, 1), -1)], dim=1)
        prefix = slots < (accept_lens - 1)[:, None]
        assert torch.equal(out[prefix], padded[prefix])
        assert bool((out[slots >= accept_lens[:, None]] == -1).all())
        assert bool((out[slots < accept_lens[:, None]] >= 0).all())


def test_rejection_sample_is_a_pure_function_of_seed_and_position() -> None:
    gen = torch.Generator().manual_seed(3)
    bs, k, vocab = 16, 3, 12
    target_probs = torch.softmax(torch.randn(bs, k + 1, vocab, generator=gen), dim=-1)
    draft_probs = torch.softmax(torch.randn(bs, k, vocab, generator=gen), dim=-1)
    draft_tokens = torch.randint(0, vocab, (bs, k), generator=gen)
    num_draft_tokens = torch.full((bs,), k)
    seeds, positions = torch.arange(bs) + 100, torch.arange(bs) * 3
    greedy_mask = torch.zeros(bs, dtype=torch.bool)
    args = (draft_tokens, num_draft_tokens, draft_probs, target_probs, seeds, positions)
    out, lens = rejection_sample(*args, greedy_mask)
    # the same request alone draws the same tokens as inside the batch
    row = 5
    alone = [a[row:row + 1] for a in args] + [greedy_mask[row:row + 1]]
    out_alone, lens_alone = rejection_sample(*alone)
    assert torch.equal(out_alone[0], out[row]) and lens_alone.item() == lens[row].item()
    # another seed draws differently somewhere in the batch
    out_other, _ = rejection_sample(*args[:4], seeds + 1, positions, greedy_mask)
    assert not torch.equal(out_other, out)


# statistical tests: a fixed target p and draft q over a small vocabulary
P0 = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.10, 0.05])
Q0 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])
P1 = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.10, 0.10])
Q1 = torch.tensor([0.30, 0.10, 0.30, 0.10, 0.10, 0.10])
P2 = torch.tensor([0.20, 0.05, 0.05, 0.05, 0.05, 0.60])
NUM_SAMPLES = 200_000
TV_THRESHOLD = 0.01  # a correct sampler sits near 0.003 at 200k samples


def _tv_threshold(n: int) -> float:
    """TV_THRESHOLD scaled to n samples (sampling noise shrinks as 1 / sqrt(n))."""
    return TV_THRESHOLD * (NUM_SAMPLES / n) ** 0.5


def _tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=p.numel()).to(torch.float64)
    return 0.5 * (counts / counts.sum() - p.to(torch.float64)).abs().sum().item()


def _spec_round(point_mass: bool, draft_token: int | None = None):
    """One verify step (k = 2) for NUM_SAMPLES independent requests that share p and q.

    Drafts are drawn from q; draft_token fixes every first draft (a deterministic drafter)."""
    gen = torch.Generator().manual_seed(4)
    n, k = NUM_SAMPLES, 2
    q = torch.stack([Q0, Q1])  # [k, vocab]
    draft_tokens = torch.multinomial(q, n, replacement=True, generator=gen).T  # [n, k]
    if draft_token is not None:
        draft_tokens[:, 0] = draft_token
    target_probs = torch.stack([P0, P1, P2])[None].expand(n, k + 1, -1)
    draft_probs = None if point_mass else q[None].expand(n, k, -1)
    seeds = torch.arange(n, dtype=torch.int64) * 31 + 17
    positions = torch.full((n,), 57, dtype=torch.int64)
    return rejection_sample(draft_tokens, torch.full((n,), k), draft_probs, target_probs,
                            seeds, positions, torch.zeros(n, dtype=torch.bool))


def _always_accept(draft_tokens, draft_probs, target_probs):
    return torch.ones(draft_tokens.shape, dtype=target_probs.dtype)


def _never_resample_residual(target_row, draft_row):
    return target_row


@pytest.mark.parametrize("point_mass,draft_token", [(False, None), (True, None), (True, 0)])
def test_rejection_sample_first_token_follows_target(point_mass, draft_token) -> None:
    out, _ = _spec_round(point_mass, draft_token)
    assert _tv(out[:, 0], P0) < TV_THRESHOLD


def _coupled_always_accept(draft_tokens, num_draft_tokens, target_probs, seeds, positions):
    bonus = target_probs.argmax(dim=-1).gather(1, num_draft_tokens[:, None]).squeeze(1)
    return verify._emit(draft_tokens, num_draft_tokens, bonus), num_draft_tokens + 1


def _coupled_unconditioned_redraw(draft_tokens, num_draft_tokens, target_probs, seeds,
                                  positions):
    """Accepts like the coupled rule but emits, at the first mismatch, a fresh draw that is
    not conditioned on differing from the draft (over-weights the rejected token)."""
    out, lens = _COUPLED(draft_tokens, num_draft_tokens, target_probs, seeds, positions)
    row = (lens - 1)[:, None, None].expand(-1, 1, target_probs.shape[-1])
    fresh = verify.sample_from_probs(target_probs.gather(1, row).squeeze(1), seeds + 1,
                                     positions + lens - 1)
    return out.scatter(1, (lens - 1)[:, None], fresh[:, None]), lens


_COUPLED = verify._coupled_accept


@pytest.mark.parametrize("point_mass,draft_token", [(False, None), (True, None), (True, 0)])
@pytest.mark.parametrize("broken", ["always_accept", "wrong_residual"])
def test_rejection_sample_statistical_test_catches_broken_samplers(
        monkeypatch, broken, point_mass, draft_token) -> None:
    if point_mass:  # point-mass drafts take the coupled rule
        monkeypatch.setattr(verify, "_coupled_accept", _coupled_always_accept
                            if broken == "always_accept" else _coupled_unconditioned_redraw)
    else:
        monkeypatch.setattr(verify, *(("_accept_probs", _always_accept)
                                      if broken == "always_accept"
                                      else ("_residual_weights", _never_resample_residual)))
    out, _ = _spec_round(point_mass, draft_token)
    assert _tv(out[:, 0], P0) > 2 * TV_THRESHOLD


@pytest.mark.parametrize("point_mass,draft_token", [(False, None), (True, 0)])
def test_rejection_sample_later_tokens_follow_target_given_acceptance(
        point_mass, draft_token) -> None:
    out, accept_lens = _spec_round(point_mass, draft_token)
    second, third = out[accept_lens >= 2, 1], out[accept_lens == 3, 2]
    assert second.numel() > NUM_SAMPLES // 10 and third.numel() > NUM_SAMPLES // 50
    assert _tv(second, P1) < _tv_threshold(second.numel())
    assert _tv(third, P2) < _tv_threshold(third.numel())  # the bonus token


def test_rejection_sample_identical_draft_and_target_accepts_everything() -> None:
    n, k, vocab = 1000, 3, 6
    probs = P0[None, None].expand(n, k + 1, vocab)
    gen = torch.Generator().manual_seed(5)
    draft_tokens = torch.multinomial(P0, n * k, replacement=True, generator=gen).view(n, k)
    num_draft_tokens = torch.full((n,), k)
    _, accept_lens = rejection_sample(draft_tokens, num_draft_tokens, probs[:, :k], probs,
                                      torch.arange(n), torch.zeros(n, dtype=torch.int64),
                                      torch.zeros(n, dtype=torch.bool))
    assert bool((accept_lens == k + 1).all())


def test_residual_falls_back_to_target_when_draft_equals_target() -> None:
    target_row = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    residual = verify._residual_weights(target_row, target_row)
    assert torch.equal(residual, target_row)
    residual = verify._residual_weights(target_row,
                                        torch.tensor([[1.0, 0, 0], [0.2, 0.3, 0.5]]))
    # row 0: max(0, p - q), unnormalised (a race draw needs none); row 1: all 0, so p itself
    assert torch.equal(residual, torch.tensor([[0.0, 0.5, 0.0], [0.2, 0.3, 0.5]]))


def test_spec_verify_is_static_shape() -> None:
    """On the meta device any data-dependent shape or host read (.item, nonzero, boolean
    indexing) raises, so passing here means the functions can be captured in a graph."""
    bs, k, vocab = 4, 3, 10
    meta = dict(device="meta")
    draft_tokens = torch.zeros(bs, k, dtype=torch.int64, **meta)
    num_draft_tokens = torch.zeros(bs, dtype=torch.int64, **meta)
    target = torch.zeros(bs, k + 1, vocab, **meta)
    out, lens = greedy_accept(draft_tokens, num_draft_tokens, target)
    assert out.shape == (bs, k + 1) and lens.shape == (bs,)
    for draft_probs in (torch.zeros(bs, k, vocab, **meta), None):
        out, lens = rejection_sample(draft_tokens, num_draft_tokens, draft_probs, target,
                                     num_draft_tokens, num_draft_tokens,
                                     torch.zeros(bs, dtype=torch.bool, **meta))
        assert out.shape == (bs, k + 1) and lens.shape == (bs,) and lens.dtype == torch.int64
    lens = first_stop_index(out, lens, torch.zeros(2, dtype=torch.int64, **meta),
                            num_draft_tokens)
    assert lens.shape == (bs,)


# ---------------------------------------------------------------- stop truncation


def test_first_stop_index_keeps_stop_token_and_drops_the_rest() -> None:
    eos = torch.tensor([2, 50])
    output_tokens = torch.tensor([
        [7, 2, 9, 4, 5],  # EOS in the middle of the accepted run
        [7, 8, 9, 50, -1],  # the second EOS id, as the last accepted token
        [7, 8, 9, -1, -1],  # no stop token
        [2, 8, -1, -1, -1],  # stop on the first token
        [7, 8, 9, -1, -1],  # a stop id past accept_lens does not count (below: len 2)
    ])
    accept_lens = torch.tensor([5, 4, 3, 2, 2])
    output_tokens[4, 2] = 2
    lens = first_stop_index(output_tokens, accept_lens, eos)
    assert lens.tolist() == [2, 4, 3, 1, 2]


def test_first_stop_index_caps_at_remaining_max_tokens() -> None:
    output_tokens = torch.tensor([[7, 8, 9, 4, 5], [7, 2, 9, 4, 5], [7, 8, 9, 4, 5]])
    accept_lens = torch.tensor([5, 5, 5])
    remaining = torch.tensor([3, 4, 10])
    lens = first_stop_index(output_tokens, accept_lens, torch.tensor([2]), remaining)
    assert lens.tolist() == [3, 2, 5]


def test_first_stop_index_per_request_stop_ids_padded_with_minus_one() -> None:
    output_tokens = torch.tensor([[7, 2, 9, -1], [7, 2, 9, -1], [7, 8, 9, -1]])
    stop_token_ids = torch.tensor([[2, -1], [-1, -1], [9, 8]])  # row 1: ignore_eos
    lens = first_stop_index(output_tokens, torch.tensor([3, 3, 3]), stop_token_ids)
    assert lens.tolist() == [2, 3, 2]


def _prefix_cut(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """The definition, row by row in sorted order: the shortest prefix whose mass reaches
    top_p, at most top_k long (<= 0: any length), renormalised."""
    out = torch.zeros_like(probs)
    for i, row in enumerate(probs):
        values, order = row.sort(descending=True)
        n = int((values.cumsum(0) < top_p).sum()) + 1
        n = min(n, top_k) if top_k > 0 else n
        out[i, order[:n]] = values[:n] / values[:n].sum()
    return out


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.9, 0), (0.5, 0), (1.0, 5), (0.8, 3),
                                         (0.3, 1)])
def test_processed_probs_cut_is_the_sorted_prefix(top_p, top_k) -> None:
    gen = torch.Generator().manual_seed(5)
    n, vocab = 6, 40
    logits = torch.randn(n, vocab, generator=gen) * 2
    t = torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0, 0.9])
    got = processed_probs(logits, t, torch.full((n,), top_p), torch.full((n,), top_k))
    want = _prefix_cut(torch.softmax(logits / t[:, None], dim=-1), top_p, top_k)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert bool(((got > 0).sum(dim=1) >= 1).all())


def test_processed_probs_keeps_tokens_tied_with_the_last_kept_and_greedy_rows_a_point() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0], [0.0, 3.0, 1.0, 3.0]])
    got = processed_probs(logits, torch.tensor([1.0, 0.0]), torch.ones(2),
                          torch.tensor([2, 0]))
    # row 0: top-2 cuts at the value of the second token, its twin (token 2) stays
    assert (got[0] > 0).tolist() == [True, True, True, False]
    assert got[0, 1] == got[0, 2]
    torch.testing.assert_close(got[0].sum(), torch.tensor(1.0))
    assert got[1].tolist() == [0.0, 1.0, 0.0, 0.0]  # temperature 0: the first argmax


def test_a_row_that_cuts_nothing_is_the_same_beside_a_row_that_cuts() -> None:
    """Its probabilities are its softmax, bit for bit, whether a batch-mate cuts (the sort
    runs) or none does (on the CPU the sort is skipped): a seeded draw cannot depend on
    batch-mates."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4096, generator=gen) * 3
    t = torch.tensor([0.7, 0.7])
    soft = torch.softmax(logits[0] / 0.7, dim=-1)
    assert not torch.equal(soft / soft.sum(), soft)  # renormalising it would change its bits
    alone = processed_probs(logits[:1], t[:1], torch.ones(1), torch.zeros(1, dtype=torch.long))
    both = processed_probs(logits, t, torch.tensor([1.0, 0.5]),
                           torch.zeros(2, dtype=torch.long))
    assert torch.equal(alone[0], both[0])
    assert torch.equal(alone[0], soft)
    assert (both[1] > 0).sum() < 4096  # the batch-mate did cut
