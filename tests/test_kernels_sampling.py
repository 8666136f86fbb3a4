"""Sampling kernels vs their torch twins: uniforms, exponential-race draws (and their
distribution), the top-k / top-p cut."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from draftgraph.kernels import sampling as R  # noqa: E402
from draftgraph.kernels._triton import compiled_for_cpu_missing  # noqa: E402

if compiled_for_cpu_missing(R._race_chunk_kernel):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set "
                "(set it in the environment to run them on CPU)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_CHUNK = 64  # V = 1000: 15 full chunks and a tail of 40


def _inputs(n, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen) * 3
    seeds = torch.randint(0, 2**62, (n,), generator=gen)
    positions = torch.randint(0, 2**34, (n,), generator=gen)
    return logits.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE)


@pytest.mark.parametrize("stream", [0, 1, 2, 3])
def test_draws_equal_the_twin_on_probabilities(stream):
    logits, seeds, positions = _inputs(8, 1000)
    probs = torch.softmax(logits, dim=-1)
    probs[0, :500] = 0.0  # zero weights never win
    probs[1] = 0.0
    probs[1, 999] = 1.0  # a point mass in the tail chunk
    got = R.race_draw_triton(probs, seeds, positions, stream, chunk=SMALL_CHUNK)
    assert got.dtype == torch.int64
    assert torch.equal(got, R.race_draw_ref(probs, seeds, positions, stream))
    assert got[0] >= 500 and got[1] == 999


@pytest.mark.parametrize("width", [1, 7, 1000])
def test_uniforms_are_the_twins_bit_for_bit(width):
    _, seeds, positions = _inputs(5, 8, seed=4)
    for stream in (0, 1, 3):
        got = R.uniform_noise_triton(seeds, positions, stream, width, block=64)
        want = R.uniform_noise_ref(seeds, positions, stream, width)
        assert got.shape == (5, width) and torch.equal(got, want)
        assert bool(((got > 0) & (got < 1)).all())


def test_a_hash_that_rounds_to_one_gives_a_uniform_below_one():
    """(seed 674094508383, position 47, stream 0) hashes column 42297 to within 128 of 2^32,
    which fp32 rounds to 2^32: its uniform was exactly 1, -log(u) 0, and a weight-0 column's
    race key 0 / 0 = NaN won the draw (found by fuzzing the engine: seeded top_k = 1 emitted a
    token off the cut). Uniforms stay below 1, so a point mass draws its token."""
    vocab = 49152
    seeds, positions = (torch.tensor([x], device=DEVICE) for x in (674094508383, 47))
    for uniforms in (R.uniform_noise_ref, R.uniform_noise_triton):
        assert float(uniforms(seeds, positions, 0, vocab).max()) == R.U_MAX < 1.0
    w = torch.zeros(1, vocab, device=DEVICE)
    w[0, 5] = 1.0
    assert R.race_draw_ref(w, seeds, positions, 0).item() == 5
    assert R.race_draw_triton(w, seeds, positions, 0).item() == 5
    # a drafter's Gumbel-max draw: log(-log(1)) = -inf made that column win whatever its logit
    logits = torch.full((1, vocab), -30.0, device=DEVICE)
    logits[0, 5] = 30.0
    t = torch.ones(1, device=DEVICE)
    assert R.draft_sample_ref(logits, t, seeds, positions, 0)[0].item() == 5


def test_unnormalised_weights_draw_as_their_normalised_row():
    logits, seeds, positions = _inputs(6, 1000, seed=1)
    probs = torch.softmax(logits, dim=-1)
    a = R.race_draw_triton(probs, seeds, positions, 0, chunk=SMALL_CHUNK)
    b = R.race_draw_triton(probs * 37.0, seeds, positions, 0, chunk=SMALL_CHUNK)
    assert torch.equal(a, b)


def test_a_row_draws_the_same_alone_or_batched():
    logits, seeds, positions = _inputs(5, 1000, seed=3)
    probs = torch.softmax(logits, dim=-1)
    batched = R.race_draw_triton(probs, seeds, positions, 0, chunk=SMALL_CHUNK)
    for i in range(5):
        alone = R.race_draw_triton(probs[i : i + 1], seeds[i : i + 1], positions[i : i + 1],
                                   0, chunk=SMALL_CHUNK)
        assert alone.item() == batched[i].item()


def test_draws_follow_the_distribution():
    # one row per seed, 2000 draws over 6 tokens: a chi-square test against p
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    n = 2000
    probs = p[None].expand(n, -1).contiguous().to(DEVICE)
    seeds = torch.arange(n, device=DEVICE)
    positions = torch.full((n,), 7, device=DEVICE)
    draws = R.race_draw_triton(probs, seeds, positions, 0, chunk=SMALL_CHUNK).cpu()
    counts = torch.bincount(draws, minlength=6).float()
    expected = p * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5  # 5 degrees of freedom, p = 0.001
    # and another stream draws other tokens (independent uniforms)
    other = R.race_draw_triton(probs, seeds, positions, 3, chunk=SMALL_CHUNK).cpu()
    assert (other != draws).float().mean() > 0.5


def _cut_case(n=10, vocab=300, seed=5):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen) * 2
    t = torch.tensor([1.0, 0.7, 0.0, 1.3, 0.5, 2.0, 0.9, 1.0, 0.8, 1.0])[:n]
    top_p = torch.tensor([0.9, 1.0, 0.9, 0.5, 1.0, 0.95, 0.3, 1.0, 1e-6, 1.0])[:n]
    top_k = torch.tensor([0, 5, 0, 10, 0, 0, 3, 0, 0, vocab])[:n]
    probs = torch.softmax(logits / torch.where(t > 0, t, 1.0)[:, None], dim=-1)
    return [x.to(DEVICE) for x in (probs, t, top_p, top_k, logits.argmax(dim=-1))]


def test_the_cut_equals_the_sorting_twin():
    probs, t, top_p, top_k, argmax = _cut_case()
    want = R.cut_probs_ref(probs, t, top_p, top_k, argmax)
    got = R.cut_probs_triton(probs.clone(), t, top_p, top_k, argmax, block=64, chunk=64)
    assert torch.equal(got > 0, want > 0)  # the same tokens kept
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    kept = (got > 0).sum(dim=1).tolist()
    assert kept[1] == 5 and kept[3] <= 10 and kept[6] <= 3  # top-k, and the stricter of two
    assert kept[2] == 1 and got[2, argmax[2]] == 1.0  # temperature 0: the argmax alone
    assert kept[8] == 1  # a tiny top_p: the most likely token alone
    assert kept[4] == kept[7] == kept[9] == 300  # no cut: top_p 1, top_k off or = V


def test_rows_that_cut_nothing_are_left_as_they_are_and_ties_stay_together():
    probs, t, top_p, top_k, argmax = _cut_case()
    got = R.cut_probs_triton(probs.clone(), t, top_p, top_k, argmax, block=64, chunk=64)
    for i in (4, 7, 9):
        assert torch.equal(got[i], probs[i])  # bit for bit: not even renormalised
    tied = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]], device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    for top_p, top_k, want in ((0.5, 0, [1, 1, 1, 0, 0]), (1.0, 2, [1, 1, 1, 0, 0]),
                               (0.85, 0, [1, 1, 1, 1, 1]), (0.3, 0, [1, 0, 0, 0, 0])):
        args = (one, one * top_p, torch.tensor([top_k], device=DEVICE),
                torch.zeros(1, dtype=torch.int64, device=DEVICE))
        got = R.cut_probs_triton(tied.clone(), *args, block=64, chunk=64)
        assert (got[0] > 0).long().tolist() == want, (top_p, top_k)
        assert torch.equal(got > 0, R.cut_probs_ref(tied, *args) > 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_cut_equals_the_twin_at_model_vocabularies():
    for vocab in (49152, 128256):
        gen = torch.Generator().manual_seed(vocab)
        logits = (torch.randn(6, vocab, generator=gen) * 3).cuda()
        t = torch.tensor([0.7, 1.0, 0.7, 1.0, 0.0, 1.5], device="cuda")
        top_p = torch.tensor([0.9, 0.95, 1.0, 0.5, 0.9, 0.8], device="cuda")
        top_k = torch.tensor([0, 0, 50, 20, 0, 1000], device="cuda")
        probs = torch.softmax(logits / torch.where(t > 0, t, 1.0)[:, None], dim=-1)
        argmax = logits.argmax(dim=-1)
        want = R.cut_probs_ref(probs, t, top_p, top_k, argmax)
        got = R.cut_probs_triton(probs.clone(), t, top_p, top_k, argmax)
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
        # compiled: a row alone gets the bits it gets in the batch
        alone = R.cut_probs_triton(probs[:1].clone(), t[:1], top_p[:1], top_k[:1], argmax[:1])
        assert torch.equal(alone[0], got[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernel_draws_as_the_twin_on_the_gpu():
    for vocab in (49152, 128256):
        logits, seeds, positions = _inputs(64, vocab)
        probs = torch.softmax(logits / 0.7, dim=-1)
        got = R.race_draw(probs, seeds, positions, 0)
        ref = R.race_draw_ref(probs, seeds, positions, 0)
        assert (got == ref).float().mean() >= 0.98  # keys differ by an ulp of log at most


def test_a_threshold_deep_in_the_tail_and_across_chunks():
    """A row spanning 1 .. e^-80 cut by top-k at a token below 2^-62 (the last bin,
    searched from pattern 0), and a flat row whose top-k threshold is one value shared by
    tokens of every chunk: the twin's tokens kept."""
    vocab = 640
    logits = torch.stack([torch.linspace(0, -80, vocab), torch.zeros(vocab)])
    probs = torch.softmax(logits, dim=-1)
    args = (torch.ones(2), torch.ones(2), torch.tensor([600, 100]),
            torch.zeros(2, dtype=torch.int64))
    probs, args = probs.to(DEVICE), [a.to(DEVICE) for a in args]
    want = R.cut_probs_ref(probs, *args)
    got = R.cut_probs_triton(probs.clone(), *args, block=64, chunk=64)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    kept = (got > 0).sum(dim=1).tolist()
    assert kept[0] == 600 and bool((probs[0][got[0] > 0].min() < 2.0 ** -62).item())
    assert kept[1] == vocab  # all tied: the top 100 keep every token tied with the 100th


def test_a_rows_cut_does_not_depend_on_its_batch(monkeypatch):
    """The chunk launches spread a row over fewer programs as rows grow: the same chunks,
    the same sums, so a row alone, in its batch and over one program gets the same bits."""
    gen = torch.Generator().manual_seed(3)
    n, vocab = 6, 700
    logits = torch.randn(n, vocab, generator=gen) * (torch.rand(n, 1, generator=gen) * 6)
    t = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9, 0.5])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.3, 0.97, 1.0])
    top_k = torch.tensor([0, 40, 0, 5, 300, 0])
    probs = torch.softmax(logits / torch.where(t > 0, t, 1.0)[:, None], dim=-1)
    args = [x.to(DEVICE) for x in (t, top_p, top_k, logits.argmax(dim=-1))]
    probs = probs.to(DEVICE)
    batch = R.cut_probs_triton(probs.clone(), *args, block=64, chunk=128)
    for i in (0, 3, 4):
        alone = R.cut_probs_triton(probs[i:i + 1].clone(), *[a[i:i + 1] for a in args],
                                   block=64, chunk=128)
        assert torch.equal(alone[0], batch[i])
    monkeypatch.setattr(R, "CUT_PROGRAMS", 1)  # one program a row walks every chunk
    assert torch.equal(R.cut_probs_triton(probs.clone(), *args, block=64, chunk=128), batch)
    assert torch.equal(batch[5], probs[5]) and (batch[2] > 0).sum() == 1  # untouched; greedy
    assert torch.equal(batch > 0, R.cut_probs_ref(probs, *args) > 0)


@pytest.mark.parametrize("bins,width", [(64, 1), (16, 2), (8, 4)])
def test_the_cut_over_wider_bins_keeps_the_twins_tokens(bins, width):
    probs, t, top_p, top_k, argmax = _cut_case()
    want = R.cut_probs_ref(probs, t, top_p, top_k, argmax)
    got = R.cut_probs_triton(probs.clone(), t, top_p, top_k, argmax, block=64, chunk=64,
                             bins=bins, width=width)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_cut_equals_the_twin_on_random_settings(seed):
    gen = torch.Generator().manual_seed(seed)
    n, vocab = 12, 700
    scale = torch.rand(n, 1, generator=gen) * 6  # flat rows to peaked ones
    logits = torch.randn(n, vocab, generator=gen) * scale
    t = torch.rand(n, generator=gen) + 0.3
    top_p = torch.where(torch.rand(n, generator=gen) < 0.7, torch.rand(n, generator=gen), 1.0)
    top_k = torch.where(torch.rand(n, generator=gen) < 0.4,
                        torch.randint(1, vocab, (n,), generator=gen), 0)
    probs = torch.softmax(logits / t[:, None], dim=-1)
    args = [x.to(DEVICE) for x in (t, top_p, top_k, logits.argmax(dim=-1))]
    probs = probs.to(DEVICE)
    want = R.cut_probs_ref(probs, *args)
    got = R.cut_probs_triton(probs.clone(), *args, block=128, chunk=128)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def _rejection_inputs(bs, k, vocab, seed=0):
    """A verify step's inputs with every case in it: sampled and greedy requests, 0..k
    active drafts, drafts drawn from q (accepted or not), a target cut to top-k, and rows
    whose q is twice p (accepted half the time, their residual all zero: the fallback)."""
    from draftgraph.runtime.sampling import processed_probs

    gen = torch.Generator().manual_seed(seed)
    T = k + 1
    logits = torch.randn(bs, T, vocab, generator=gen) * 2
    top_k = torch.where(torch.rand(bs, generator=gen) < 0.3, 50, 0).repeat_interleave(T)
    # greedy requests decide on the argmax alone: their rows are not point masses here, so
    # a kernel that sampled them would be seen
    greedy = torch.rand(bs, generator=gen) < 0.25
    target = processed_probs(logits.view(-1, vocab), torch.full((bs * T,), 0.8),
                             torch.ones(bs * T), top_k).view(bs, T, vocab)
    draft = torch.softmax(logits[:, :k] + torch.randn(bs, k, vocab, generator=gen), dim=-1)
    draft[:4] = 2 * target[:4, :k]  # the residual's fallback
    drafts = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).view(bs, k)
    num_draft = torch.randint(0, k + 1, (bs,), generator=gen)
    num_draft[:4] = k
    seeds = torch.randint(0, 2**62, (bs,), generator=gen)
    positions = torch.randint(0, 2**34, (bs,), generator=gen)
    return drafts, num_draft, draft, target, seeds, positions, greedy, target.argmax(dim=-1)


def _reduced(args, vocab, keep):
    """The same step with q over a reduced vocabulary: the first `keep` target tokens in a
    shuffled order (q renormalised there, every draft inside it), and its index [V]."""
    drafts, num_draft, draft, *rest = args
    gen = torch.Generator().manual_seed(9)
    d2t = torch.randperm(keep, generator=gen)  # column -> target id
    q = draft[..., d2t] / draft[..., d2t].sum(-1, keepdim=True)
    drafts = d2t[torch.multinomial(q.reshape(-1, keep), 1, generator=gen).view(drafts.shape)]
    index = torch.full((vocab,), -1, dtype=torch.int32)
    index[d2t] = torch.arange(keep, dtype=torch.int32)
    return (drafts, num_draft, q, *rest), index


@pytest.mark.parametrize("reduced", [False, True])
def test_rejection_kernels_emit_the_twins_tokens(reduced):
    from draftgraph.runtime.sampling import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE
    from draftgraph.spec import verify

    bs, k = 40, 3
    args, index = _rejection_inputs(bs, k, 1000), None
    if reduced:
        args, index = _reduced(args, 1000, 600)
    want_out, want_lens = verify.rejection_sample(*args, draft_index=index)  # the twin (CPU)
    got_out, got_lens = R.rejection_sample_triton(
        *[a.to(DEVICE) for a in args], STREAM_ACCEPT, STREAM_SAMPLE, STREAM_RESIDUAL,
        None if index is None else index.to(DEVICE), chunk=SMALL_CHUNK)
    assert torch.equal(got_lens.cpu(), want_lens) and torch.equal(got_out.cpu(), want_out)
    # the cases the test means to cover are there
    drafts, num_draft, _, _, _, _, greedy, _ = args
    sampled = ~greedy
    assert bool((want_lens[sampled] == num_draft[sampled] + 1).any())  # all accepted
    assert bool((want_lens[sampled] <= num_draft[sampled]).any())  # a rejection
    assert bool((want_lens[:4] <= k).any()) and bool(greedy.any())
    final = want_out.gather(1, (want_lens - 1)[:, None]).squeeze(1)
    assert bool((final[sampled] != drafts.gather(
        1, (want_lens - 1).clamp_max(k - 1)[:, None]).squeeze(1)[sampled]).any())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_rejection_emits_the_twins_tokens_on_the_gpu():
    from draftgraph.spec import verify

    for vocab in (49152, 128256):
        args = _rejection_inputs(64, 4, vocab, seed=1)
        want_out, want_lens = verify.rejection_sample(*args)
        got_out, got_lens = verify.rejection_sample(*[a.cuda() for a in args])
        same = (got_out.cpu() == want_out).all(dim=1) & (got_lens.cpu() == want_lens)
        assert same.float().mean() >= 0.98  # keys differ by an ulp of log at most


def test_a_reduced_draft_vocabulary_reads_q_through_its_index():
    """The twin's expansion: q over V' read through the index equals q scattered onto the
    target's vocabulary by hand (0 outside V'), token for token."""
    from draftgraph.spec import verify

    args = _rejection_inputs(24, 3, 1000, seed=2)
    reduced, index = _reduced(args, 1000, 600)
    drafts, num_draft, q, *rest = reduced
    full = torch.zeros(*q.shape[:2], 1000)
    full[..., index >= 0] = q[..., index[index >= 0].long()]
    want = verify.rejection_sample(drafts, num_draft, full, *rest)
    got = verify.rejection_sample(*reduced, draft_index=index)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # a wrong index (q read at the target id) changes the outcome
    bad = verify.rejection_sample(*reduced, draft_index=torch.arange(1000, dtype=torch.int32)
                                  .where(torch.arange(1000) < 600, -1))
    assert not torch.equal(bad[1], want[1])


def test_draft_sampling_kernels_equal_the_twin():
    from draftgraph.runtime.sampling import STREAM_DRAFT

    logits, seeds, positions = _inputs(12, 1000, seed=6)
    logits[1, :200] = float("-inf")  # whole chunks masked out (a drafter's banned tokens)
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.3] * 3).to(DEVICE)  # a greedy row in four
    want_tok, want_q = R.draft_sample_ref(logits, temperature, seeds, positions, STREAM_DRAFT)
    got_tok, got_q = R.draft_sample_triton(logits, temperature, seeds, positions,
                                           STREAM_DRAFT, chunk=SMALL_CHUNK)
    assert torch.equal(got_tok, want_tok)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-8)
    greedy = temperature == 0
    assert torch.equal(got_tok[greedy], logits[greedy].argmax(-1))
    assert not torch.equal(got_tok[~greedy], logits[~greedy].argmax(-1))  # draws, not argmaxes
    torch.testing.assert_close(got_q[greedy], torch.softmax(logits[greedy], -1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_draft_sampling_equals_the_twin_on_the_gpu():
    for vocab in (16384, 49152, 128256):
        logits, seeds, positions = _inputs(64, vocab, seed=7)
        temperature = torch.tensor([0.7, 1.0, 0.0, 1.3] * 16, device="cuda")
        tok, q = R.draft_sample(logits, temperature, seeds, positions, 3)
        want_tok, want_q = R.draft_sample_ref(logits, temperature, seeds, positions, 3)
        assert (tok == want_tok).float().mean() >= 0.98  # keys differ by an ulp of log at most
        torch.testing.assert_close(q, want_q, rtol=1e-4, atol=1e-9)


def test_draft_draws_follow_their_distribution():
    """One row per seed, 4000 draws over 6 tokens at T = 0.5 (the Gumbel-max form of the
    race, on the twin: the kernel draws its tokens, above): a chi-square test against
    softmax(l / T); it fails against softmax(l), the temperature ignored."""
    from draftgraph.runtime.sampling import STREAM_DRAFT

    n = 4000
    logits = torch.tensor([1.0, 0.5, 0.2, -0.3, -1.0, 0.0])
    tok, _ = R.draft_sample_ref(logits.expand(n, 6), torch.full((n,), 0.5), torch.arange(n) * 7 + 1,
                                torch.full((n,), 11), STREAM_DRAFT)
    counts = torch.bincount(tok, minlength=6).double()

    def chi2(p):
        e = p.double() * n
        return float(((counts - e) ** 2 / e).sum())

    assert chi2(torch.softmax(logits / 0.5, 0)) < 20.5  # p = 0.001 at 5 degrees of freedom
    assert chi2(torch.softmax(logits, 0)) > 100
