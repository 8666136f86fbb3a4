"""A draft tree's bookkeeping kernels (kernels/tree.py) vs their torch twins: every buffer a
step writes, equal to the bit, over whole trees grown step after step (ties in the scores,
requests past their draft budget, a mapped and an unmapped vocabulary); and the pick by hand."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from draftgraph.kernels import tree as T  # noqa: E402
from draftgraph.kernels._triton import compiled_for_cpu_missing  # noqa: E402

if compiled_for_cpu_missing(T._tree_grow_kernel):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set "
                "(set it in the environment to run them on CPU)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, V = 40, 97


def _bufs(m: int, w: int, d: int, gen: torch.Generator, h: int = H) -> T.TreeBuffers:
    total = w + (d - 1) * w * w

    def noise(*shape, dtype=torch.int64):  # stale contents: the kernels must not read them
        return torch.randint(0, 50, shape, generator=gen).to(DEVICE, dtype)

    return T.TreeBuffers(noise(m, total), noise(m, total, dtype=torch.float32),
                         noise(m, total), noise(m, w) % w, noise(2, m, w, d),
                         noise(m * w, h, dtype=torch.float32), noise(m * w), noise(4, m * w))


def _clone(b: T.TreeBuffers) -> T.TreeBuffers:
    return T.TreeBuffers(*(t.clone() for t in b))


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal to the bit, NaN where NaN."""
    return torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(0), y.nan_to_num(0))


def _grow_both(w: int, d: int, bs: int, vocab: bool, seed: int, nan: bool = False,
               h: int = H):
    """A whole tree grown by the kernel and by the twin, step by step, from the same random
    head outputs (scores rounded to 1/4: ties everywhere); every buffer compared after each
    step. `nan`: a NaN log-probability in every step's first row (ranked last); `h`: the
    streams' width (0: no features, the block's tree)."""
    gen = torch.Generator().manual_seed(seed)
    m = bs + 1  # a spare request row: buffers are sized for more than the batch
    a = _bufs(m, w, d, gen, h)
    b = _clone(a)
    vmap = torch.randperm(1000, generator=gen)[:V].to(DEVICE) if vocab else None
    ctx = T.TreeContext(torch.randint(3, 40, (bs,), generator=gen).to(DEVICE),
                        torch.randperm(bs, generator=gen).to(DEVICE) + 1,
                        torch.tensor([d, 0, 2, d + 3, 1][:bs]).to(DEVICE),
                        torch.randint(1, 500, (bs, 2 + d * w), generator=gen).to(DEVICE))
    for step in range(d):
        rows = bs * (1 if step == 0 else w)
        lp = (torch.randn(rows, V, generator=gen) * 2).round(decimals=0) / 4
        lp = torch.log_softmax(lp, dim=-1)
        top = lp.topk(w, dim=-1)
        if nan:
            top.values[0, -1] = float("nan")
        stream = torch.randn(rows, h, generator=gen).to(DEVICE)
        args = (step, top.values.to(DEVICE), top.indices.to(DEVICE), vmap, stream)
        stage = step + 1 < d
        T.tree_grow_triton(*args, a, ctx, stage)
        T.tree_grow_ref(*args, b, ctx, stage)
        for name, x, y in zip(T.TreeBuffers._fields, a, b, strict=True):
            assert _same(x, y), (name, step)
    return a, b, ctx


@pytest.mark.parametrize("w,d,bs,vocab,nan,h", [
    (4, 5, 3, True, False, H), (2, 4, 5, False, False, H), (1, 3, 2, True, False, H),
    (3, 2, 4, False, False, H), (4, 3, 3, True, True, H),
    (12, 5, 2, True, False, H),  # the widest at 63
    (4, 7, 3, True, False, 0)])  # the block's tree: no features to stage
def test_a_grown_tree_equals_the_twins_buffer_for_buffer(w, d, bs, vocab, nan, h):
    a, _, ctx = _grow_both(w, d, bs, vocab, seed=w * 10 + d, nan=nan, h=h)
    total = w + (d - 1) * w * w
    if d > 1:  # the last staged rows: live requests' KV lengths, dead ones the dummy row
        rows = a.t_rows[:, : bs * w].view(4, bs, w)
        live = ctx.max_draft >= d - 1
        assert torch.equal(rows[1, live], (ctx.seq_lens[live] + d - 1)[:, None].expand(-1, w))
        assert (rows[:, ~live] == torch.tensor([0, 1, 0, 1], device=DEVICE)[:, None, None]).all()
    for n in sorted({1, min(total, 2 * w + 1), total}):
        got = T.tree_pick_triton(a.node_score[:bs].contiguous(), a.node_tok[:bs].contiguous(),
                                 a.node_parent[:bs].contiguous(), _depths(w, d), ctx.max_draft,
                                 n)
        ref = T.tree_pick_ref(a.node_score[:bs], a.node_tok[:bs], a.node_parent[:bs],
                              _depths(w, d), ctx.max_draft, n)
        for x, y in zip(got, ref, strict=True):
            assert torch.equal(x, y), n
        assert ((got[1] >= 0) & (got[1] < torch.arange(1, n + 1, device=DEVICE))).all()
        # with an n-gram branch of 3 after the n nodes: written into the first n columns of
        # a wider proposal, the rest untouched; the count takes the branch's drafts within
        # the budget when all n nodes are
        wide = [torch.full((bs, n + 3), -7, dtype=torch.int64, device=DEVICE) for _ in range(3)]
        views = tuple(t[:, :n] for t in wide)
        for pick in (T.tree_pick_triton, T.tree_pick_ref):
            *cols, live = pick(a.node_score[:bs].contiguous(), a.node_tok[:bs].contiguous(),
                               a.node_parent[:bs].contiguous(), _depths(w, d),
                               ctx.max_draft, n, 3, views)
            for x, y, t in zip(cols, ref[:3], wide, strict=True):
                assert torch.equal(x, y) and (t[:, n:] == -7).all(), n
            want = torch.where(ref[3] == n, n + ctx.max_draft.clamp(max=3), ref[3])
            assert torch.equal(live, want), n


def _depths(w: int, d: int) -> torch.Tensor:
    total = w + (d - 1) * w * w
    return torch.tensor([1] * w + [2 + i // w ** 2 for i in range(total - w)], device=DEVICE)


def test_the_pick_by_hand():
    """Two depth-1 nodes and four children: the 4 best, ties to the lower id, parents as rows;
    a request with budget 1 ranks its children last and counts only its first two."""
    score = torch.tensor([[-1.0, -2.0, -1.5, -3.0, -2.5, -1.5],
                          [-1.0, -2.0, -1.5, -3.0, -2.5, -1.5]], device=DEVICE)
    tok = torch.arange(10, 16, device=DEVICE).expand(2, 6).contiguous()
    parent = torch.tensor([-1, -1, 0, 0, 1, 1], device=DEVICE).expand(2, 6).contiguous()
    depth = torch.tensor([1, 1, 2, 2, 2, 2], device=DEVICE)
    budget = torch.tensor([2, 1], device=DEVICE)
    for pick in (T.tree_pick_triton, T.tree_pick_ref):
        drafts, parents, depths, live = pick(score, tok, parent, depth, budget, 4)
        # request 0: -1 (0), -1.5 (2), -1.5 (5), -2 (1) -> node order 0 1 2 5
        assert drafts[0].tolist() == [10, 11, 12, 15]
        assert parents[0].tolist() == [0, 0, 1, 2] and depths[0].tolist() == [1, 1, 2, 2]
        # request 1: depth 2 is past its budget: 0, 1, then the first two children (2, 3)
        assert drafts[1].tolist() == [10, 11, 12, 13] and live.tolist() == [4, 2]


@pytest.mark.parametrize("n,vocab,w", [(3, 1000, 4), (2, 200, 1), (5, 130, 16)])
def test_top_logprobs_equal_log_softmax_topk(n, vocab, w):
    """Chunks of 64 (a partial last one), rows with a large spread: the W largest in order,
    their log-probabilities within float rounding of log_softmax's; ties go to the lower
    index."""
    gen = torch.Generator().manual_seed(vocab + w)
    x = (torch.randn(n, vocab, generator=gen) * 4).to(DEVICE)
    lp, idx = T.top_logprobs_triton(x, w, chunk=64)
    ref_lp, ref_idx = T.top_logprobs_ref(x, w)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-5)
    tied = torch.zeros(1, vocab, device=DEVICE)
    tied[0, [7, 70, vocab - 1]] = 1.0
    assert T.top_logprobs_triton(tied, 4, chunk=64)[1].tolist() == [[7, 70, vocab - 1, 0]]


def _verify_bufs(m: int, k: int, d: int, gen: torch.Generator) -> T.TreeVerify:
    """Stale contents everywhere (the kernels must overwrite what they own)."""
    t = 1 + k

    def noise(*shape):
        return torch.randint(0, 50, shape, generator=gen).to(DEVICE)

    return T.TreeVerify(noise(m, k), noise(m), noise(m * t), noise(m * t), noise(3, m * t),
                        noise(m * t, d), noise(m, t), (noise(m, t) % 3).to(torch.int8), noise(m, t),
                        noise(m, t, d), noise(m), noise(m, 1 + d), noise(2, m * d))


def _path_oracle(bufs: T.TreeVerify, bs: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """nxt [bs * t]: random tokens, except along the ancestors of a random live draft row,
    which carry the target's token after their parents (that row is accepted)."""
    nxt = torch.randint(0, 30, (bs * t,), generator=gen).to(DEVICE)
    for b in range(bs):
        rows = torch.nonzero(bufs.live[b, 1:t].cpu()).flatten() + 1
        row = int(rows[torch.randint(0, len(rows), (1,), generator=gen)]) if len(rows) else 0
        while row > 0:
            parent = int(bufs.parents[b, row])
            nxt[b * t + parent] = bufs.packed_ids[b * t + row]
            row = parent
    return nxt


@pytest.mark.parametrize("w,d,bs,vocab,k", [(4, 5, 3, True, None), (2, 4, 5, False, None),
                                            (1, 3, 2, True, None), (3, 2, 4, False, None),
                                            (8, 5, 2, True, 32),
                                            (12, 5, 2, True, 63)])  # the largest tree
def test_the_verify_pack_and_accept_equal_their_twins(w, d, bs, vocab, k):
    """A grown tree's pick packed as the verify's rows, then accepted against the target's
    tokens (one path planted per request, and wholly random ones), by the kernels and the
    twins: every buffer and output, the KV copy list and the writes into the position and
    token tables equal to the bit (requests past their budget and at 0 drafts among them)."""
    a, _, ctx = _grow_both(w, d, bs, vocab, seed=w * 10 + d)
    gen = torch.Generator().manual_seed(w + d + bs)
    total = w + (d - 1) * w * w
    k = k or min(total, 3 * w + 1)
    t = 1 + k
    drafts, parents, depths, live = T.tree_pick_ref(
        a.node_score[:bs], a.node_tok[:bs], a.node_parent[:bs], _depths(w, d), ctx.max_draft, k)
    slots = torch.randint(1, 500, (bs, t), generator=gen).to(DEVICE)
    vctx = T.TreeContext(ctx.seq_lens, ctx.req_pool_indices, ctx.max_draft, slots)
    last = torch.randint(0, 30, (bs,), generator=gen).to(DEVICE)
    got, ref = _verify_bufs(bs + 1, k, d, gen), None
    ref = T.TreeVerify(*(x.clone() for x in got))
    T.tree_pack_triton(drafts, live, parents, depths, last, vctx, got)
    T.tree_pack_ref(drafts, live, parents, depths, last, vctx, ref)
    for name, x, y in zip(T.TreeVerify._fields, got, ref, strict=True):
        assert torch.equal(x, y), name
    assert (got.draft_tokens[:bs] != 0).any()  # not a trivially empty proposal
    for trial in range(3):
        nxt = (_path_oracle(ref, bs, t, gen) if trial < 2 else
               torch.randint(0, 30, (bs * t,), generator=gen).to(DEVICE))
        logits = torch.randn(bs * t, 1000, generator=gen).to(DEVICE)  # mapped ids < 1000
        lse = torch.logsumexp(logits, dim=-1)
        r2t0 = torch.randint(0, 50, (8, 64), generator=gen).to(DEVICE)
        table0 = torch.randint(0, 50, (8, 64), generator=gen).to(DEVICE)
        r2t0[0, 0] = table0[0, 0] = 0  # the dummy row's first entry (the twin rewrites it)
        tables = []
        for fn, bufs in ((T.tree_accept_triton, got), (T.tree_accept_ref, ref)):
            r2t, table = r2t0.clone(), table0.clone()
            out = T.TreeOutputs(torch.full((bs, t), -7, device=DEVICE),
                                torch.full((bs, t), 9.0, device=DEVICE),
                                torch.zeros(bs, dtype=torch.int64, device=DEVICE),
                                torch.zeros(bs, dtype=torch.int64, device=DEVICE))
            fn(nxt, logits, lse, vctx, bufs, r2t, table, out)
            tables.append((r2t, table, out))
        (r2t_a, table_a, out_a), (r2t_b, table_b, out_b) = tables
        assert torch.equal(r2t_a, r2t_b) and torch.equal(table_a, table_b), trial
        assert not torch.equal(r2t_a, r2t0)  # budgets' slots recorded
        # accepted drafts recorded (the planted paths are taken where the budget allows)
        assert (out_a.accept_lens.max() > 1) == (trial < 2) == (not torch.equal(table_a, table0))
        for name, x, y in zip(T.TreeOutputs._fields, out_a, out_b, strict=True):
            assert _same(x, y), (name, trial)
        for name in ("accepted", "copy"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), (name, trial)
