"""Row argmax + logsumexp kernel (two-stage, chunked) vs its torch twin."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from draftgraph.kernels import argmax as A  # noqa: E402
from draftgraph.kernels._triton import compiled_for_cpu_missing  # noqa: E402

if compiled_for_cpu_missing(A._argmax_lse_chunk_kernel):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set "
                "(set it in the environment to run them on CPU)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter computes bf16 wrongly: bf16 only on a GPU
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# small slices keep the interpreter fast and still give many chunks and a partial last one:
# V = 1000 is 15 full chunks of 64 and a tail of 40
SMALL_CHUNK, V = 64, 1000
NEG_INF = float("-inf")


def randn(*shape, dtype=torch.float32, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def assert_matches_reference(logits, chunk=SMALL_CHUNK):
    idx, lse = A.argmax_lse_triton(logits, chunk=chunk)
    ref_idx, ref_lse = A.argmax_lse_ref(logits)
    assert idx.dtype == torch.int64 and lse.dtype == torch.float32
    assert idx.shape == lse.shape == (logits.shape[0],)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=0.0)
    return idx, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_argmax_lse_matches_reference_on_random_rows(dtype, n):
    # fp16 rows of 1000 values hold repeated maxima now and then: ties must agree too
    assert_matches_reference(randn(n, V, dtype=dtype, seed=n))


def test_default_chunk_with_a_partial_tail_matches_reference():
    logits = randn(2, 2 * A.CHUNK + 37, seed=5)
    logits[1, -1] = 100.0  # the max in the tail of the default-size last chunk
    idx, _ = assert_matches_reference(logits, chunk=A.CHUNK)
    assert idx[1].item() == 2 * A.CHUNK + 36


def test_strided_rows_are_read_through_their_stride():
    wide = randn(3, V + 24, seed=7)
    logits = wide[:, :V]  # rows V + 24 apart: the padding must never be read
    wide[:, V:] = 1e4
    assert logits.stride(0) == V + 24
    idx, _ = assert_matches_reference(logits)
    assert (idx < V).all()


def test_ties_resolve_to_the_first_index_across_and_within_chunks():
    logits = randn(4, V, seed=1)
    logits[0, [70, 200, 990]] = 50.0  # chunks 1, 3 and the partial last one
    logits[1, [10, 20]] = 50.0  # inside chunk 0
    logits[2, [63, 64]] = 50.0  # the last column of chunk 0 and the first of chunk 1
    logits[3] = 2.5  # every column ties
    idx, _ = assert_matches_reference(logits)
    assert idx.tolist() == [70, 10, 63, 0]


def test_max_in_the_last_partial_chunk_wins_and_masked_tail_never_does():
    # every logit negative: a masked tail read as 0 (or any finite value) would win
    logits = -1.0 - torch.rand(3, V, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    logits[0, 999] = -0.5  # the last column
    logits[1, 960] = -0.5  # the first column of the partial last chunk
    logits[2, 0] = -0.5  # chunk 0, with the partial last chunk holding lower values
    idx, lse = assert_matches_reference(logits)
    assert idx.tolist() == [999, 960, 0]
    assert torch.isfinite(lse).all()


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # interpreter's log(0)
def test_neg_inf_entries_chunks_and_rows():
    logits = randn(4, V, seed=3)
    logits[0, ::3] = NEG_INF  # scattered -inf
    logits[1, : 3 * SMALL_CHUNK] = NEG_INF  # whole chunks of -inf
    logits[1, 500] = 40.0
    logits[2] = NEG_INF  # a row entirely -inf: index 0 and lse -inf, like torch
    logits[3] = NEG_INF
    logits[3, V - 1] = 1.5  # one finite value, in the partial last chunk
    idx, lse = assert_matches_reference(logits)
    assert idx.tolist()[1:] == [500, 0, V - 1]
    assert lse[2].item() == NEG_INF
    assert lse[3].item() == pytest.approx(1.5)
    assert not torch.isnan(lse).any()


def test_nan_rows_give_the_nan_index_like_torch():
    # a NaN row (overflowed activations) must still index inside the vocabulary: the graph
    # gathers logits and table rows with these tokens
    logits = randn(3, V, seed=5)
    logits[0, 700] = float("nan")
    logits[1] = float("nan")
    logits[2, 10] = float("nan")
    logits[2, 900] = float("nan")
    idx, lse = A.argmax_lse_triton(logits, chunk=SMALL_CHUNK)
    assert idx.tolist() == torch.argmax(logits, dim=-1).tolist() == [700, 0, 10]
    assert torch.isnan(lse).all()


def test_logprob_from_lse_equals_log_softmax():
    # what the step graphs emit: logit of the token minus lse
    logits = randn(5, V, seed=4)
    tokens = torch.tensor([[0], [999], [123], [64], [500]], device=DEVICE)
    _, lse = A.argmax_lse_triton(logits, chunk=SMALL_CHUNK)
    logprobs = logits.gather(1, tokens).squeeze(1) - lse
    ref = torch.log_softmax(logits, -1).gather(1, tokens).squeeze(1)
    torch.testing.assert_close(logprobs, ref, rtol=1e-5, atol=1e-5)


def test_argmax_lse_writes_into_given_buffers_with_the_argmax_logprob():
    logits = randn(5, V, seed=9)
    logits[3, 17] = NEG_INF
    logits[4] = NEG_INF  # an all -inf row: NaN logprob, like the gather path
    out = torch.full((5,), -1, dtype=torch.int64, device=DEVICE)
    lp = torch.full((5,), 7.0, device=DEVICE)
    idx, lse = A.argmax_lse_triton(logits, chunk=SMALL_CHUNK, out=out, top_logprob=lp)
    assert idx.data_ptr() == out.data_ptr()
    ref_idx, ref_lse = A.argmax_lse_ref(logits)
    assert torch.equal(out, ref_idx)
    expect = logits.float().gather(1, ref_idx[:, None])[:, 0] - ref_lse
    torch.testing.assert_close(lp[:4], expect[:4], rtol=1e-5, atol=1e-5)
    assert torch.isnan(lp[4]) and torch.isnan(expect[4])
    # the twin fills the same buffers
    out2, lp2 = torch.zeros_like(out), torch.zeros_like(lp)
    A.argmax_lse_ref(logits, out=out2, top_logprob=lp2)
    assert torch.equal(out2, ref_idx)
    torch.testing.assert_close(lp2[:4], expect[:4])


@pytest.mark.parametrize("bs,k", [(1, 4), (6, 4), (3, 1), (5, 16)])
def test_the_greedy_emit_equals_the_verify_tails_torch_path(bs, k):
    """Drafts that match the argmax for a random prefix, at every count 0 .. k: tokens,
    logprobs and accept lengths equal to `spec.verify.emit`'s torch path (which runs on the
    CPU), and each request's run is its matching prefix, then the argmax."""
    from draftgraph.spec.verify import emit

    g = torch.Generator().manual_seed(bs * 10 + k)
    t, vocab = 1 + k, 50
    logits = torch.randn(bs * t, vocab, generator=g)
    argmax = logits.argmax(dim=-1).view(bs, t)
    prefix = torch.randint(0, k + 1, (bs,), generator=g)
    drafts = torch.where(torch.arange(k) < prefix[:, None], argmax[:, :k],
                         (argmax[:, :k] + 1) % vocab)
    num = torch.randint(0, k + 1, (bs,), generator=g)
    zeros = torch.zeros(bs, dtype=torch.int64)
    ref_tok, ref_lens, ref_lp = emit(logits, drafts, num, None, zeros.float(), zeros.float() + 1,
                                     zeros, zeros, zeros, True)
    am, lse = (x.to(DEVICE) for x in A.argmax_lse_ref(logits))  # emit's, bit for bit
    out_tok = torch.full((bs + 1, t + 2), -9, dtype=torch.int64, device=DEVICE)[:bs, :t]
    out_lp = torch.full((bs, t), 3.0, device=DEVICE)
    lens = A.greedy_emit_triton(am, logits.to(DEVICE), lse, drafts.to(DEVICE), num.to(DEVICE),
                                out_tok, out_lp)
    assert torch.equal(out_tok.cpu(), ref_tok) and torch.equal(lens.cpu(), ref_lens)
    assert torch.equal(out_lp.cpu(), ref_lp)
    accepted = torch.minimum(prefix, num)
    assert torch.equal(lens.cpu(), accepted + 1)
    for b in range(bs):
        a = int(accepted[b])
        assert out_tok[b].tolist() == [*drafts[b, :a].tolist(), int(argmax[b, a])] + [-1] * (k - a)
