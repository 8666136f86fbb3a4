"""A draft tree's bookkeeping (spec/tree.py) in three launches a step: each row's W likeliest
tokens; the beam's children scored, the next beam chosen and its rows staged; and one launch
to pick the verified nodes. Its verify (spec/step.py) in one launch each side of the forward:
the rows packed, and the tree accepted.

    top_logprobs(logits, W) -> (top_lp, top_idx) [rows, W]: each row's W likeliest tokens
    tree_grow(step, top_lp, top_idx, vocab, stream, bufs, ctx, stage)
        the step's nodes (W children of each of its R rows: R = 1 at step 0, else W) written
        with their cumulative scores; with `stage`, the W best of them become the next step's
        rows (their tokens, parents' streams, paths, KV rows)
    tree_pick(node_score, node_tok, node_parent, node_depth, max_draft, n)
        -> (drafts, parents, depths, live): the n best nodes (past a request's budget ranked
        last), in node order, parents as rows
    tree_pack(drafts, num_drafts, parents, depths, last_tokens, ctx, bufs: TreeVerify)
        the proposal as the verify's rows (tokens, slots, KV lengths, paths, ancestors)
    tree_accept(nxt, logits, lse, ctx, bufs, req_to_token, token_table, out: TreeOutputs)
        the deepest path the target agrees with: the emitted run and its logprobs, the path,
        the KV copy list, the positions' slots and the accepted drafts recorded

Twins: `top_logprobs_ref`, `tree_grow_ref`, `tree_pick_ref`, `tree_pack_ref`,
`tree_accept_ref` (the torch ops spec/ ran before: a beam step was ~40 launches of a few us
and a 64 us torch.topk, the pick ~30, the pack ~60 with `ancestors`, the acceptance ~50). The
public functions dispatch: the Triton kernels on CUDA, the twins elsewhere; tests call the
`*_triton` launchers (the interpreter on CPU). One program per request (the pick, the grow) or
per row and chunk (the top-W): W <= 16 beam rows, at most W + (D - 1) W^2 <= 16 + 63 x 16 =
1024 nodes (the TreeShape bounds: (D - 1) W <= N <= 63), everything in registers.

Choosing (both): the best by score, ties to the lower node index, exactly torch.sort(stable,
descending)'s order, a NaN score ranked last (as -inf: every pick a distinct node, so the
outputs are always filled); the twins sort, the kernels take the maximum k times.

NOTE: node ids are depth-major (the root's W children, then each step's W x W, beam row-major)
and a child never outscores its parent (log-probabilities add), so the best n are a tree: a
kept node's parent is kept, at a smaller index, hence an earlier row.
NOTE: a step's paths go to the other half of `beam_path` [2, m, W, D] (step i's rows read half
i % 2), so a request's program reads its parents' paths and writes its children's without
a hazard between threads; columns past a row's depth are 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from draftgraph.kernels._triton import next_pow2, pdl_kwargs, pdl_wait, tl, triton, triton_usable
from draftgraph.kernels.argmax import chunk_max_sumexp, combined_lse


class TreeBuffers(NamedTuple):
    """A tree drafter's persistent buffers (m = requests, total = nodes, r = m * W rows)."""

    node_tok: torch.Tensor  # [m, total] int64
    node_score: torch.Tensor  # [m, total] fp32, cumulative draft log-probability
    node_parent: torch.Tensor  # [m, total] int64, the parent node (-1: the last token)
    beam_node: torch.Tensor  # [m, W] int64, the nodes the current step's rows feed
    beam_path: torch.Tensor  # [2, m, W, D] int64, a row's slots at depths 1 .. (half i % 2)
    t_feat: torch.Tensor  # [r, H] the rows' input features (their parents' streams)
    t_ids: torch.Tensor  # [r] int64, the rows' tokens
    t_rows: torch.Tensor  # [4, r] int64: request row, KV length, slot, path base


def tree_buffers(width: int, depth: int, m: int, feat: int, dtype: torch.dtype,
                 device) -> tuple[TreeBuffers, torch.Tensor]:
    """A tree drafter's buffers for up to m requests (`feat`: the width of the rows' input
    features, the head's stream; 0 for a block's tree, whose rows feed no head step) and each
    node's depth [total]. Nodes are depth-major: W at depth 1, then each step's W x W
    children (beam row-major); a beam row's slots at depths 1 .. D sit in half i % 2 of
    beam_path for step i."""
    w, r = width, m * width
    total = w + (depth - 1) * w ** 2

    def zeros(*shape, dtype=torch.int64):
        return torch.zeros(*shape, dtype=dtype, device=device)

    bufs = TreeBuffers(zeros(m, total), zeros(m, total, dtype=torch.float32), zeros(m, total),
                       zeros(m, w), zeros(2, m, w, depth), zeros(r, feat, dtype=dtype),
                       zeros(r), zeros(4, r))
    node_depth = torch.tensor([1] * w + [2 + i // w ** 2 for i in range(total - w)],
                              dtype=torch.int64, device=device)
    return bufs, node_depth


class TreeContext(NamedTuple):
    """The step's raw inputs the staging reads ([bs] int64 each; reserved_slots [bs, S])."""

    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    max_draft: torch.Tensor
    reserved_slots: torch.Tensor


def _lo(step: int, w: int) -> int:
    """First node id of the nodes step `step` creates."""
    return 0 if step == 0 else w + (step - 1) * w * w


# ---- top-W log-probabilities ---------------------------------------------------------------


def top_logprobs_ref(logits: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [n, W] fp32, indices [n, W] int64): each row's W largest log_softmax values,
    largest first."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(w, dim=-1)
    return top.values, top.indices


TOP_CHUNK = 1024


@triton.jit
def _top_chunk_kernel(
    logits, part_val, part_idx, part_max, part_sum, vocab, stride_row, num_chunks,
    W: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < vocab
    x, m, s = chunk_max_sumexp(logits, row, cols, mask, stride_row)
    out = row * num_chunks + chunk
    tl.store(part_max + out, m)
    tl.store(part_sum + out, s)
    for w in tl.static_range(W):  # the chunk's W largest, ties to the lower column
        best = tl.max(x, axis=0)
        p = tl.min(tl.where((x == best) & mask, cols, vocab - 1), axis=0)
        tl.store(part_val + out * W + w, best)
        tl.store(part_idx + out * W + w, p)
        x = tl.where(cols == p, float("-inf"), x)


@triton.jit
def _top_combine_kernel(
    part_val, part_idx, part_max, part_sum, top_lp, top_idx, vocab, num_chunks,
    W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_CW: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cm = c < num_chunks
    m = tl.load(part_max + row * num_chunks + c, mask=cm, other=float("-inf"))
    s = tl.load(part_sum + row * num_chunks + c, mask=cm, other=0.0)
    _, lse = combined_lse(m, s)
    k = tl.arange(0, BLOCK_CW)
    km = k < num_chunks * W
    v = tl.load(part_val + row * num_chunks * W + k, mask=km, other=float("-inf"))
    idx = tl.load(part_idx + row * num_chunks * W + k, mask=km, other=0)
    taken = k < 0
    for w in tl.static_range(W):  # candidates in column order per chunk: ties to the lower
        avail = km & ~taken
        best = tl.max(tl.where(avail, v, float("-inf")), axis=0)
        p = tl.min(tl.where(avail & (v == best), idx, vocab), axis=0)
        p = tl.minimum(p, vocab - 1)
        taken = taken | (avail & (idx == p))
        tl.store(top_lp + row * W + w, best - lse)
        tl.store(top_idx + row * W + w, p.to(tl.int64))


def top_logprobs_triton(logits: torch.Tensor, w: int, chunk: int = TOP_CHUNK,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as `top_logprobs_ref` (ties to the lower index; values from a chunked logsumexp,
    so within a few ulps of log_softmax's), two launches: each chunk's W largest and partial
    logsumexp, then the row's W largest of those. torch.topk over a 16k row took 64 us on an
    H100 (four of them a tree step)."""
    assert logits.dim() == 2
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    dev = logits.device
    num_chunks = -(-vocab // chunk)
    part_val = torch.empty(n, num_chunks, w, dtype=torch.float32, device=dev)
    part_idx = torch.empty(n, num_chunks, w, dtype=torch.int32, device=dev)
    part_max = torch.empty(n, num_chunks, dtype=torch.float32, device=dev)
    part_sum = torch.empty(n, num_chunks, dtype=torch.float32, device=dev)
    top_lp = torch.empty(n, w, dtype=torch.float32, device=dev)
    top_idx = torch.empty(n, w, dtype=torch.int64, device=dev)
    pdl = pdl_kwargs(logits)
    _top_chunk_kernel[(n, num_chunks)](
        logits, part_val, part_idx, part_max, part_sum, vocab, logits.stride(0), num_chunks,
        W=w, CHUNK=chunk, num_warps=4, **pdl)
    _top_combine_kernel[(n,)](
        part_val, part_idx, part_max, part_sum, top_lp, top_idx, vocab, num_chunks, W=w,
        BLOCK_C=max(2, next_pow2(num_chunks)), BLOCK_CW=max(2, next_pow2(num_chunks * w)),
        num_warps=1, **pdl)
    return top_lp, top_idx


def top_logprobs(logits: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.is_cuda and triton_usable(logits):
        return top_logprobs_triton(logits, w)
    return top_logprobs_ref(logits, w)


# ---- grow ----------------------------------------------------------------------------------


def tree_grow_ref(step: int, top_lp: torch.Tensor, top_idx: torch.Tensor,
                  vocab: torch.Tensor | None, stream: torch.Tensor, bufs: TreeBuffers,
                  ctx: TreeContext, stage: bool) -> None:
    """top_lp / top_idx [bs * R, W]: each row's W likeliest tokens (log-probabilities, ids in
    the drafter's vocabulary, mapped through `vocab` when given); stream [bs * R, H] the
    rows' output streams (their children's input features)."""
    bs = ctx.seq_lens.shape[0]
    w = top_lp.shape[1]
    rows = top_lp.shape[0] // bs
    lo, count = _lo(step, w), rows * w
    tok = (vocab[top_idx] if vocab is not None else top_idx).view(bs, count)
    if step == 0:
        score = top_lp.view(bs, count)
        parent = torch.full_like(tok, -1)
    else:
        beam = bufs.beam_node[:bs]  # [bs, W]
        score = (bufs.node_score[:bs].gather(1, beam)[..., None]
                 + top_lp.view(bs, w, w)).view(bs, count)
        parent = beam.repeat_interleave(w, 1)
    bufs.node_tok[:bs, lo : lo + count] = tok
    bufs.node_score[:bs, lo : lo + count] = score
    bufs.node_parent[:bs, lo : lo + count] = parent
    if not stage:
        return
    rank = torch.nan_to_num(score, nan=float("-inf"))  # a NaN node ranks last
    pick = torch.sort(rank, dim=1, descending=True, stable=True).indices[:, :w]  # [bs, W]
    prow = pick // w  # the row of this step that made it: its stream, its path
    bufs.beam_node[:bs] = lo + pick
    h = stream.shape[1]
    r = bs * w
    bufs.t_feat[:r].copy_(stream.view(bs, rows, h).gather(
        1, prow[..., None].expand(bs, w, h)).view(r, h))
    d = bufs.beam_path.shape[3]
    old = bufs.beam_path[step % 2, :bs].gather(1, prow[..., None].expand(bs, w, d))
    col = torch.arange(d, device=pick.device)
    slot = ctx.reserved_slots[:, 1 + step * w : 1 + (step + 1) * w]  # [bs, W]
    bufs.beam_path[(step + 1) % 2, :bs] = torch.where(
        col == step, slot[..., None], torch.where(col < step, old, 0))
    bufs.t_ids[:r].copy_(tok.gather(1, pick).flatten())
    n = ctx.seq_lens[:, None].expand(bs, w)
    live = (ctx.max_draft >= step + 1)[:, None]
    staged = torch.stack([torch.where(live, ctx.req_pool_indices[:, None].expand(bs, w), 0),
                          torch.where(live, n + step + 1, 1), torch.where(live, slot, 0),
                          torch.where(live, n, 1)])
    bufs.t_rows[:, :r].copy_(staged.view(4, r))


@triton.jit
def _vocab_tokens(vocab, idx, mask, HAS_VOCAB: tl.constexpr):
    """Token ids of draft-vocabulary indices (through the map when the drafter has one)."""
    if HAS_VOCAB:
        tok = tl.load(vocab + idx, mask=mask, other=0).to(tl.int64)
    else:
        tok = idx.to(tl.int64)
    return tok


@triton.jit
def _tree_grow_kernel(
    top_lp, top_idx, vocab, stream, node_tok, node_score, node_parent, beam_node, path_in,
    path_out, t_feat, t_ids, t_rows, seq_lens, req_pool_indices, max_draft, reserved_slots,
    step, lo, total, hidden, stride_stream, stride_feat, stride_rows, stride_res0, stride_res1,
    W: tl.constexpr, R: tl.constexpr, D: tl.constexpr, C_P: tl.constexpr, W_P: tl.constexpr,
    D_P: tl.constexpr, BLOCK_H: tl.constexpr, FIRST: tl.constexpr, STAGE: tl.constexpr,
    HAS_VOCAB: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_P)
    cm = c < W * R
    row = c // W
    src = (b * R + row) * W + c % W
    lp = tl.load(top_lp + src, mask=cm, other=float("-inf"))
    idx = tl.load(top_idx + src, mask=cm, other=0)
    tok = _vocab_tokens(vocab, idx, cm, HAS_VOCAB)
    base = b * total + lo
    if FIRST:
        score = lp
        parent = tl.full([C_P], -1, tl.int64)
    else:
        parent = tl.load(beam_node + b * W + row, mask=cm, other=0)
        score = tl.load(node_score + b * total + parent, mask=cm, other=0.0) + lp
    tl.store(node_tok + base + c, tok, mask=cm)
    tl.store(node_score + base + c, score, mask=cm)
    tl.store(node_parent + base + c, parent, mask=cm)
    if STAGE:
        # the W best (ties to the lower index, a NaN last); a reduction waits for every
        # thread's loads, so beam_node is read above before it is written below
        rank = tl.where(score != score, float("-inf"), score)
        wv = tl.arange(0, W_P)
        wm = wv < W
        taken = c < 0
        pick = tl.zeros([W_P], tl.int64)
        for w in tl.static_range(W):
            avail = cm & ~taken
            best = tl.max(tl.where(avail, rank, float("-inf")), axis=0)
            p = tl.min(tl.where(avail & (rank == best), c, C_P), axis=0)
            taken = taken | (c == p)
            pick = tl.where(wv == w, p, pick)
        prow = pick // W
        tl.store(beam_node + b * W + wv, lo + pick, mask=wm)
        psrc = (b * R + prow) * W + pick % W
        pidx = tl.load(top_idx + psrc, mask=wm, other=0)
        ptok = _vocab_tokens(vocab, pidx, wm, HAS_VOCAB)
        out_row = b * W + wv
        tl.store(t_ids + out_row, ptok, mask=wm)
        h = tl.arange(0, BLOCK_H)
        for h0 in range(0, hidden, BLOCK_H):
            hm = wm[:, None] & ((h0 + h) < hidden)[None, :]
            x = tl.load(stream + (b * R + prow)[:, None] * stride_stream + (h0 + h)[None, :],
                        mask=hm)
            tl.store(t_feat + out_row[:, None] * stride_feat + (h0 + h)[None, :], x, mask=hm)
        d = tl.arange(0, D_P)
        slot = tl.load(reserved_slots + b * stride_res0 + (1 + step * W + wv) * stride_res1,
                       mask=wm, other=0)
        old = tl.load(path_in + (b * W + prow)[:, None] * D + d[None, :],
                      mask=wm[:, None] & (d < step)[None, :], other=0)
        new = tl.where(d[None, :] == step, slot[:, None], old)
        tl.store(path_out + out_row[:, None] * D + d[None, :], new,
                 mask=wm[:, None] & (d < D)[None, :])
        n = tl.load(seq_lens + b)
        live = tl.load(max_draft + b) >= step + 1
        req = tl.load(req_pool_indices + b)
        zero = tl.zeros([W_P], tl.int64)
        tl.store(t_rows + out_row, tl.where(live, zero + req, 0), mask=wm)
        tl.store(t_rows + stride_rows + out_row, tl.where(live, zero + n + step + 1, 1), mask=wm)
        tl.store(t_rows + 2 * stride_rows + out_row, tl.where(live, slot, 0), mask=wm)
        tl.store(t_rows + 3 * stride_rows + out_row, tl.where(live, zero + n, 1), mask=wm)


def tree_grow_triton(step: int, top_lp: torch.Tensor, top_idx: torch.Tensor,
                     vocab: torch.Tensor | None, stream: torch.Tensor, bufs: TreeBuffers,
                     ctx: TreeContext, stage: bool) -> None:
    """Same semantics as `tree_grow_ref`, one launch."""
    bs = ctx.seq_lens.shape[0]
    w = top_lp.shape[1]
    rows = top_lp.shape[0] // bs
    d = bufs.beam_path.shape[3]
    top_lp, top_idx = top_lp.contiguous(), top_idx.contiguous()
    hidden, feat = stream.shape[1], bufs.t_feat
    if hidden == 0:  # no features to stage (the block's tree): a live pointer stands in
        stream = feat = top_lp
    assert stream.stride(1) == 1 and feat.stride(1) == 1
    _tree_grow_kernel[(bs,)](
        top_lp, top_idx, vocab if vocab is not None else top_idx, stream, bufs.node_tok,
        bufs.node_score, bufs.node_parent, bufs.beam_node, bufs.beam_path[step % 2],
        bufs.beam_path[(step + 1) % 2], feat, bufs.t_ids, bufs.t_rows, ctx.seq_lens,
        ctx.req_pool_indices, ctx.max_draft, ctx.reserved_slots, step, _lo(step, w),
        bufs.node_tok.shape[1], hidden, stream.stride(0), feat.stride(0),
        bufs.t_rows.stride(0), ctx.reserved_slots.stride(0), ctx.reserved_slots.stride(1),
        W=w, R=rows, D=d, C_P=max(2, next_pow2(rows * w)), W_P=max(2, next_pow2(w)),
        D_P=max(2, next_pow2(d)), BLOCK_H=min(256, max(16, next_pow2(hidden))),
        FIRST=step == 0, STAGE=stage, HAS_VOCAB=vocab is not None, num_warps=4,
        **pdl_kwargs(stream),
    )


def tree_grow(step: int, top_lp: torch.Tensor, top_idx: torch.Tensor,
              vocab: torch.Tensor | None, stream: torch.Tensor, bufs: TreeBuffers,
              ctx: TreeContext, stage: bool) -> None:
    if stream.is_cuda and triton_usable(stream):
        tree_grow_triton(step, top_lp, top_idx, vocab, stream, bufs, ctx, stage)
    else:
        tree_grow_ref(step, top_lp, top_idx, vocab, stream, bufs, ctx, stage)


# ---- pick ----------------------------------------------------------------------------------


def tree_pick_ref(node_score: torch.Tensor, node_tok: torch.Tensor, node_parent: torch.Tensor,
                  node_depth: torch.Tensor, max_draft: torch.Tensor, n: int, branch: int = 0,
                  out: tuple | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """node_* [bs, total] (node_depth [total]), max_draft [bs] -> drafts, parents (0: the last
    token, i: draft i - 1), depths [bs, n] int64 in node order, live [bs] (the kept nodes
    within the budget: they lead). branch: an n-gram branch of that many drafts follows the
    n nodes (spec/tree.py): when all n are within the budget, live counts its drafts within
    it too (min(max_draft, branch) more). out: (drafts, parents, depths) views [bs, n] to write
    into (the first columns of the proposal's, say)."""
    bs = node_score.shape[0]
    depth = node_depth.expand(bs, -1)
    # nodes past a request's draft budget are never verified: ranked last
    score = torch.where(depth <= max_draft[:, None], node_score, float("-inf"))
    score = torch.nan_to_num(score, nan=float("-inf"))  # a NaN node ranks last
    keep = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :n]
    keep = keep.sort(dim=1).values  # node order: parents first
    row_of = torch.zeros_like(node_parent)
    row_of.scatter_(1, keep, torch.arange(1, n + 1, device=keep.device).expand(bs, n))
    parent = node_parent.gather(1, keep)
    parents = torch.where(parent < 0, 0, row_of.gather(1, parent.clamp_min(0)))
    depths = depth.gather(1, keep)
    live = (depths <= max_draft[:, None]).sum(dim=1)
    if branch:
        live = torch.where(live == n, n + torch.clamp(max_draft, max=branch), live)
    drafts = node_tok.gather(1, keep)
    if out is None:
        return drafts, parents, depths, live
    for dst, src in zip(out, (drafts, parents, depths), strict=True):
        dst.copy_(src)
    return (*out, live)


@triton.jit
def _tree_pick_kernel(
    node_score, node_tok, node_parent, node_depth, max_draft, row_of, drafts, parents, depths,
    live, total, stride_o, n_pick, BRANCH: tl.constexpr, T_P: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, T_P)
    tm = t < total
    depth = tl.load(node_depth + t, mask=tm, other=0)
    md = tl.load(max_draft + b)
    score = tl.load(node_score + b * total + t, mask=tm, other=float("-inf"))
    score = tl.where((depth <= md) & (score == score), score, float("-inf"))  # NaN last
    chosen = t < 0
    # a loop, not unrolled: one compile serves every count, where an unrolled pick's code
    # (and compile time) grew with it (GPU tests picking all 100 nodes of a 4x7 tree sat in
    # compiles)
    for _ in range(n_pick):
        avail = tm & ~chosen
        best = tl.max(tl.where(avail, score, float("-inf")), axis=0)
        p = tl.min(tl.where(avail & (score == best), t, T_P), axis=0)
        chosen = chosen | (t == p)
    rank = tl.cumsum(chosen.to(tl.int32), axis=0).to(tl.int64)  # a kept node's row (1 ..)
    tl.store(row_of + b * total + t, rank, mask=chosen)
    tl.debug_barrier()  # every kept node's row is stored before a child reads its parent's
    parent = tl.load(node_parent + b * total + t, mask=chosen, other=-1)
    prow = tl.load(row_of + b * total + tl.maximum(parent, 0), mask=chosen & (parent >= 0),
                   other=0)
    out = b * stride_o + rank - 1
    tl.store(drafts + out, tl.load(node_tok + b * total + t, mask=chosen, other=0), mask=chosen)
    tl.store(parents + out, prow, mask=chosen)
    tl.store(depths + out, depth, mask=chosen)
    count = tl.sum((chosen & (depth <= md)).to(tl.int64), axis=0)
    tl.store(live + b, tl.where(count == n_pick, n_pick + tl.minimum(md, BRANCH), count))


def tree_pick_triton(node_score: torch.Tensor, node_tok: torch.Tensor,
                     node_parent: torch.Tensor, node_depth: torch.Tensor,
                     max_draft: torch.Tensor, n: int, branch: int = 0, out: tuple | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same semantics as `tree_pick_ref`, one launch (inside a capture the outputs and the
    row scratch come from the graph's pool)."""
    bs, total = node_score.shape
    assert node_score.is_contiguous() and node_tok.is_contiguous() and node_parent.is_contiguous()
    dev = node_score.device
    if out is None:
        out = tuple(torch.empty(bs, n, dtype=torch.int64, device=dev) for _ in range(3))
    drafts, parents, depths = out
    assert all(t.shape == (bs, n) and t.stride() == drafts.stride() and t.stride(1) == 1
               for t in out)
    live = torch.empty(bs, dtype=torch.int64, device=dev)
    row_of = torch.empty(bs, total, dtype=torch.int64, device=dev)
    _tree_pick_kernel[(bs,)](
        node_score, node_tok, node_parent, node_depth, max_draft, row_of, drafts, parents,
        depths, live, total, drafts.stride(0), n, BRANCH=branch,
        T_P=max(2, next_pow2(total)), num_warps=4,
        **pdl_kwargs(node_score),
    )
    return drafts, parents, depths, live


def tree_pick(node_score: torch.Tensor, node_tok: torch.Tensor, node_parent: torch.Tensor,
              node_depth: torch.Tensor, max_draft: torch.Tensor, n: int, branch: int = 0,
              out: tuple | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if node_score.is_cuda and triton_usable(node_score):
        return tree_pick_triton(node_score, node_tok, node_parent, node_depth, max_draft, n,
                                branch, out)
    return tree_pick_ref(node_score, node_tok, node_parent, node_depth, max_draft, n, branch,
                         out)


# ---- the verify's rows: pack and accept ----------------------------------------------------


class TreeVerify(NamedTuple):
    """A step body's tree-verify buffers (m = requests, T = 1 + k rows each, D = depth):
    written by `tree_pack`, read by `tree_accept` and the verify forward."""

    draft_tokens: torch.Tensor  # [max_bs, k] int64: the proposal's drafts, 0 past its count
    num_drafts: torch.Tensor  # [max_bs] int64
    packed_ids: torch.Tensor  # [max_bs * T] int64: the rows' tokens (last token, drafts)
    packed_loc: torch.Tensor  # [max_bs * T] int64: their KV slots (a dead row's: 0)
    rows: torch.Tensor  # [3, m * T] int64: request row, KV length, path base (dead: 0, 1, 1)
    path: torch.Tensor  # [m * T, D] int64: a row's slots at depths 1 .. its own
    parents: torch.Tensor  # [m, T] int64: the parent row (the root's: 0)
    live: torch.Tensor  # [m, T] int8: 1 within the request's draft budget (no bool pointers)
    depths: torch.Tensor  # [m, T] int64 (the root's: 0)
    anc: torch.Tensor  # [m, T, D] int64: `ancestors`
    verify_seq_lens: torch.Tensor  # [max_bs] int64: the request's packed rows (T) past seq_lens
    accepted: torch.Tensor  # [m, 1 + D] int64: `tree_accept`'s path rows
    copy: torch.Tensor  # [2, m * D] int64: `tree_accept`'s KV copy, sources then destinations


def ancestors(parents: torch.Tensor, depths: torch.Tensor, depth: int) -> torch.Tensor:
    """[bs, R, depth] int64: row i's ancestor at depth j + 1 (itself at its own depth), as a
    row index; 0 past the row's depth. parents / depths [bs, R] (row 0 the root: depth 0)."""
    bs, R = parents.shape
    out = torch.zeros(bs, R, depth + 1, dtype=torch.int64, device=parents.device)
    cur = torch.arange(R, device=parents.device).expand(bs, R)
    d = depths
    for _ in range(depth):  # up one level a pass; a finished row writes the spare column
        out.scatter_(2, torch.where(d > 0, d - 1, depth)[..., None], cur[..., None])
        cur = parents.gather(1, cur)
        d = d - 1
    return out[..., :depth]


def accept_tree(tokens: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor,
                depths: torch.Tensor, live: torch.Tensor, target_argmax: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance along a tree: (path rows [bs, 1 + D] (row 0, then the accepted row
    at each depth; 0 past the accept length), accept_lens [bs] = accepted drafts + 1).

    tokens / parents / depths / live / target_argmax [bs, R]: each row's token, its parent
    row, its depth (row 0, the root, is 0), whether it may be accepted, the target's argmax
    after it; anc [bs, R, D]: `ancestors`. A row is on the accepted path when it and each of
    its ancestors carries the target's argmax after its parent; siblings carry distinct
    tokens, so at most one row a depth is, and the deepest one ends the path (the first
    such row on a tie). A fixed number of ops whatever the depth (no walk)."""
    bs, R, D = anc.shape
    match = (tokens == target_argmax.gather(1, parents)) & live  # [bs, R]
    on = match.gather(1, anc.reshape(bs, -1)).view(bs, R, D)
    below = torch.arange(D, device=anc.device) < depths[..., None]  # [bs, R, D]
    ok = (on | ~below).all(dim=2)  # the root (depth 0) always
    last = torch.where(ok, depths, -1).argmax(dim=1)  # [bs]: the deepest accepted row
    path = torch.cat([torch.zeros_like(last)[:, None], anc[torch.arange(bs, device=anc.device),
                                                           last]], dim=1)
    return path, depths.gather(1, last[:, None]).squeeze(1) + 1


def tree_pack_ref(drafts: torch.Tensor, num_drafts: torch.Tensor, parents: torch.Tensor,
                  depths: torch.Tensor, last_tokens: torch.Tensor, ctx: TreeContext,
                  bufs: TreeVerify) -> None:
    """A tree proposal (drafts / parents (0: the last token, i: draft i - 1) / depths [bs, k]
    in node order, num_drafts [bs]) as the verify's rows: request b's last token and its k
    drafts at rows b (1 + k) + i, each at position seq_lens + depth - 1 in its own reserved
    slot, its list the request's keys below seq_lens, then its path (its ancestors' slots
    and its own); rows past the request's budget (max_draft) go to the dummy row 0, slot 0."""
    bs, k = drafts.shape
    T, D = 1 + k, bufs.anc.shape[2]
    r = bs * T
    dev = drafts.device
    bufs.num_drafts[:bs].copy_(num_drafts)
    torch.where(torch.arange(k, device=dev) < num_drafts[:, None], drafts, drafts.new_zeros(()),
                out=bufs.draft_tokens[:bs])
    zero = torch.zeros(bs, 1, dtype=torch.int64, device=dev)
    depth = torch.cat([zero, depths], dim=1)  # [bs, T]
    parent = torch.cat([zero, parents], dim=1)
    live = depth <= ctx.max_draft[:, None]
    bufs.parents[:bs].copy_(parent)
    bufs.live[:bs].copy_(live)
    bufs.depths[:bs].copy_(depth)
    n = ctx.seq_lens[:, None]
    bufs.packed_ids[:r].copy_(torch.cat([last_tokens[:, None], bufs.draft_tokens[:bs]],
                                        dim=1).flatten())
    slots = ctx.reserved_slots[:, :T]
    bufs.packed_loc[:r].copy_(torch.where(live, slots, 0).flatten())
    rows = torch.stack([ctx.req_pool_indices[:, None].expand(bs, T), n + depth, n.expand(bs, T)])
    # a dead row's (0, 1, 1), built on the device: a host tensor cannot be copied in a capture
    dead = (torch.arange(3, device=dev) != 0)[:, None, None]
    bufs.rows[:, :r].copy_(torch.where(live, rows, dead).view(3, r))
    anc = ancestors(parent, depth, D)  # [bs, T, D] rows
    bufs.anc[:bs].copy_(anc)
    bufs.path[:r].copy_(slots.gather(1, anc.reshape(bs, -1)).view(r, D))
    bufs.verify_seq_lens[:bs].copy_(ctx.seq_lens + k)


@triton.jit
def _tree_pack_kernel(
    drafts, num_drafts_in, parents_in, depths_in, last_tokens, seq_lens, req_pool_indices,
    max_draft, reserved_slots, draft_tokens, num_drafts, packed_ids, packed_loc, rows, path,
    parents, live, depths, anc, verify_seq_lens, stride_res0, stride_res1, stride_rows,
    K: tl.constexpr, D: tl.constexpr, T_P: tl.constexpr, D_P: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    T = K + 1
    i = tl.arange(0, T_P)
    im = i < T
    dm = (i >= 1) & im  # the draft rows
    di = tl.maximum(i - 1, 0)
    num = tl.load(num_drafts_in + b)
    tl.store(num_drafts + b, num)
    tok = tl.load(drafts + b * K + di, mask=dm, other=0)
    tok = tl.where(di < num, tok, 0)
    tl.store(draft_tokens + b * K + di, tok, mask=dm)
    tok = tl.where(i == 0, tl.load(last_tokens + b), tok)
    parent = tl.load(parents_in + b * K + di, mask=dm, other=0)
    depth = tl.load(depths_in + b * K + di, mask=dm, other=0)
    ok = depth <= tl.load(max_draft + b)
    out = b * T + i
    tl.store(parents + out, parent, mask=im)
    tl.store(live + out, ok.to(tl.int8), mask=im)
    tl.store(depths + out, depth, mask=im)
    tl.store(packed_ids + out, tok, mask=im)
    slot = tl.load(reserved_slots + b * stride_res0 + i * stride_res1, mask=im, other=0)
    tl.store(packed_loc + out, tl.where(ok, slot, 0), mask=im)
    n = tl.load(seq_lens + b)
    zero = tl.zeros([T_P], tl.int64)
    tl.store(rows + out, tl.where(ok, zero + tl.load(req_pool_indices + b), 0), mask=im)
    tl.store(rows + stride_rows + out, tl.where(ok, n + depth, 1), mask=im)
    tl.store(rows + 2 * stride_rows + out, tl.where(ok, zero + n, 1), mask=im)
    # ancestors: up one level a pass, the row at depth d + 1 into column d (0 past the depth)
    j = tl.arange(0, D_P)
    a = tl.zeros([T_P, D_P], tl.int64)
    cur = i.to(tl.int64)
    d = depth
    for _ in tl.static_range(D):
        a = tl.where((j[None, :] == (d - 1)[:, None]) & (d > 0)[:, None], cur[:, None], a)
        up = tl.load(parents_in + b * K + tl.maximum(cur - 1, 0), mask=im & (cur > 0), other=0)
        cur = tl.where(cur > 0, up, 0)
        d = d - 1
    am = im[:, None] & (j < D)[None, :]
    tl.store(anc + out[:, None] * D + j[None, :], a, mask=am)
    ps = tl.load(reserved_slots + b * stride_res0 + a * stride_res1, mask=am, other=0)
    tl.store(path + out[:, None] * D + j[None, :], ps, mask=am)
    tl.store(verify_seq_lens + b, n + K)


def tree_pack_triton(drafts: torch.Tensor, num_drafts: torch.Tensor, parents: torch.Tensor,
                     depths: torch.Tensor, last_tokens: torch.Tensor, ctx: TreeContext,
                     bufs: TreeVerify) -> None:
    """Same semantics as `tree_pack_ref`, one launch (the twin is ~40)."""
    bs, k = drafts.shape
    D = bufs.anc.shape[2]
    drafts, parents, depths = drafts.contiguous(), parents.contiguous(), depths.contiguous()
    num_drafts = num_drafts.contiguous()
    res = ctx.reserved_slots
    _tree_pack_kernel[(bs,)](
        drafts, num_drafts, parents, depths, last_tokens, ctx.seq_lens, ctx.req_pool_indices,
        ctx.max_draft, res, bufs.draft_tokens, bufs.num_drafts, bufs.packed_ids,
        bufs.packed_loc, bufs.rows, bufs.path, bufs.parents, bufs.live, bufs.depths, bufs.anc,
        bufs.verify_seq_lens, res.stride(0), res.stride(1), bufs.rows.stride(0),
        K=k, D=D, T_P=max(2, next_pow2(k + 1)), D_P=max(2, next_pow2(D)), num_warps=1,
        **pdl_kwargs(drafts),
    )


def tree_pack(drafts: torch.Tensor, num_drafts: torch.Tensor, parents: torch.Tensor,
              depths: torch.Tensor, last_tokens: torch.Tensor, ctx: TreeContext,
              bufs: TreeVerify) -> None:
    if drafts.is_cuda and triton_usable(drafts):
        tree_pack_triton(drafts, num_drafts, parents, depths, last_tokens, ctx, bufs)
    else:
        tree_pack_ref(drafts, num_drafts, parents, depths, last_tokens, ctx, bufs)


class TreeOutputs(NamedTuple):
    """Where `tree_accept` writes a step's results ([bs, 1 + k] / [bs] views)."""

    tokens: torch.Tensor  # int64, -1 past the accept length
    logprobs: torch.Tensor  # fp32, columns 0 .. D written
    accept_lens: torch.Tensor
    num_drafts: torch.Tensor


def tree_accept_ref(nxt: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor,
                    ctx: TreeContext, bufs: TreeVerify, req_to_token: torch.Tensor,
                    token_table: torch.Tensor, out: TreeOutputs) -> None:
    """Acceptance of the packed tree against nxt [bs * T] (the target's token after each row:
    its argmax, or a sampled step's draw): the emitted run (the path's drafts, then the
    target's token after the last) into out.tokens, with the raw distribution's logprobs
    (logits [bs * T, V], lse [bs * T]); the path's rows into bufs.accepted; the KV copy that
    moves depth j's accepted node into reserved slot j (j >= the accept length: the slot
    itself) into bufs.copy; reserved slots 1 .. max_draft recorded in req_to_token at their
    positions, the accepted drafts in token_table."""
    bs, T = ctx.seq_lens.shape[0], bufs.parents.shape[1]
    D = bufs.anc.shape[2]
    dev = nxt.device
    tokens = bufs.packed_ids[: bs * T].view(bs, T)
    path, lens = accept_tree(tokens, bufs.parents[:bs], bufs.anc[:bs], bufs.depths[:bs],
                             bufs.live[:bs] != 0, nxt.view(bs, T))
    rows = torch.arange(bs, device=dev)[:, None] * T + path  # [bs, 1 + D]
    emitted = nxt[rows]  # row j's token: the draft at depth j + 1 on the path
    j = torch.arange(1 + D, device=dev)
    out.tokens[:, : 1 + D].copy_(torch.where(j < lens[:, None], emitted, -1))
    out.tokens[:, 1 + D :].fill_(-1)
    out.logprobs[:, : 1 + D].copy_(logits[rows, emitted] - lse[rows])
    out.accept_lens.copy_(lens)
    out.num_drafts.copy_(bufs.num_drafts[:bs])
    bufs.accepted[:bs].copy_(path)
    # a node's row is >= its depth, and copy_slots reads every source before it writes
    took = j[None, 1:] < lens[:, None]  # [bs, D]
    slots = ctx.reserved_slots
    dst = slots[:, 1 : 1 + D]
    bufs.copy[0, : bs * D].copy_(torch.where(took, slots.gather(1, path[:, 1:]), dst).flatten())
    bufs.copy[1, : bs * D].copy_(dst.flatten())
    rec = j[None, 1:] <= ctx.max_draft[:, None]
    req = torch.where(rec, ctx.req_pool_indices[:, None], 0)
    pos = torch.where(rec, ctx.seq_lens[:, None] - 1 + j[1:], 0)
    req_to_token[req, pos] = torch.where(rec, dst, 0)
    token_table[torch.where(took, req, 0), torch.where(took, pos, 0)] = \
        torch.where(took, emitted[:, :D], 0)


@triton.jit
def _tree_accept_kernel(
    nxt, logits, lse, seq_lens, req_pool_indices, max_draft, reserved_slots, packed_ids,
    parents, live, depths, anc, num_drafts, accepted, copy, req_to_token, token_table,
    out_tokens, out_logprobs, out_accept, out_num_drafts, stride_logits, stride_res0,
    stride_res1, stride_r2t, stride_table, stride_tok, stride_lp, stride_copy,
    T: tl.constexpr, D: tl.constexpr, T_P: tl.constexpr, D_P: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, T_P)
    im = i < T
    j = tl.arange(0, D_P)
    jm = j < D
    am = im[:, None] & jm[None, :]
    row0 = b * T
    depth = tl.load(depths + row0 + i, mask=im, other=0)
    # row i is on the path when every ancestor a (itself included) carries the target's
    # token after its parent and is live
    a = tl.load(anc + (row0 + i)[:, None] * D + j[None, :], mask=am, other=0)
    pa = tl.load(parents + row0 + a, mask=am, other=0)
    hit = (tl.load(packed_ids + row0 + a, mask=am, other=-1)
           == tl.load(nxt + row0 + pa, mask=am, other=-2))
    hit = hit & (tl.load(live + row0 + a, mask=am, other=0) != 0)
    bad = am & (j[None, :] < depth[:, None]) & ~hit
    ok = im & (tl.sum(bad.to(tl.int32), axis=1) == 0)
    score = tl.where(ok, depth, -1)
    best = tl.max(score, axis=0)
    last = tl.min(tl.where(score == best, i, T_P), axis=0).to(tl.int64)  # the first deepest
    lens = tl.sum(tl.where(i == last, depth, 0), axis=0) + 1
    # the emitted run: column c reads row path[c] (path[0] = 0, the root)
    c = tl.arange(0, T_P)
    cm = c < T
    pm = (c >= 1) & (c <= D)
    p = tl.load(anc + (row0 + last) * D + tl.maximum(c - 1, 0), mask=pm, other=0)
    e = tl.load(nxt + row0 + p, mask=c <= D, other=0)
    tl.store(out_tokens + b * stride_tok + c, tl.where(c < lens, e, -1), mask=cm)
    lp = tl.load(logits + (row0 + p) * stride_logits + e, mask=c <= D, other=0.0)
    lp = lp - tl.load(lse + row0 + p, mask=c <= D, other=0.0)
    tl.store(out_logprobs + b * stride_lp + c, lp, mask=c <= D)
    tl.store(out_accept + b, lens)
    tl.store(out_num_drafts + b, tl.load(num_drafts + b))
    tl.store(accepted + b * (1 + D) + c, p, mask=c <= D)
    # KV copy: depth c's accepted node into reserved slot c (c >= lens: the slot itself)
    dst = tl.load(reserved_slots + b * stride_res0 + c * stride_res1, mask=pm, other=0)
    src = tl.load(reserved_slots + b * stride_res0 + p * stride_res1, mask=pm, other=0)
    took = pm & (c < lens)
    q = b * D + c - 1
    tl.store(copy + q, tl.where(took, src, dst), mask=pm)
    tl.store(copy + stride_copy + q, dst, mask=pm)
    # reserved slots 1 .. max_draft at their positions; the accepted drafts in the table
    req = tl.load(req_pool_indices + b)
    pos = tl.load(seq_lens + b) - 1 + c
    rec = pm & (c <= tl.load(max_draft + b))
    tl.store(req_to_token + req * stride_r2t + pos, dst, mask=rec)
    # the draft at depth c is the token emitted at column c - 1
    prev = tl.load(nxt + row0 + tl.load(anc + (row0 + last) * D + tl.maximum(c - 2, 0),
                                        mask=(c >= 2) & pm, other=0), mask=pm, other=0)
    tl.store(token_table + req * stride_table + pos, prev, mask=took)


def tree_accept_triton(nxt: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor,
                       ctx: TreeContext, bufs: TreeVerify, req_to_token: torch.Tensor,
                       token_table: torch.Tensor, out: TreeOutputs) -> None:
    """Same semantics as `tree_accept_ref`, one launch (the twin is ~45)."""
    bs, T = ctx.seq_lens.shape[0], bufs.parents.shape[1]
    D = bufs.anc.shape[2]
    assert logits.stride(1) == 1 and out.tokens.stride(1) == 1 and out.logprobs.stride(1) == 1
    assert req_to_token.stride(1) == 1 and token_table.stride(1) == 1
    res = ctx.reserved_slots
    _tree_accept_kernel[(bs,)](
        nxt, logits, lse, ctx.seq_lens, ctx.req_pool_indices, ctx.max_draft, res,
        bufs.packed_ids, bufs.parents, bufs.live, bufs.depths, bufs.anc, bufs.num_drafts,
        bufs.accepted, bufs.copy, req_to_token, token_table, out.tokens, out.logprobs,
        out.accept_lens, out.num_drafts, logits.stride(0), res.stride(0), res.stride(1),
        req_to_token.stride(0), token_table.stride(0), out.tokens.stride(0),
        out.logprobs.stride(0), bufs.copy.stride(0),
        T=T, D=D, T_P=max(2, next_pow2(T)), D_P=max(2, next_pow2(D)), num_warps=1,
        **pdl_kwargs(nxt),
    )


def tree_accept(nxt: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, ctx: TreeContext,
                bufs: TreeVerify, req_to_token: torch.Tensor, token_table: torch.Tensor,
                out: TreeOutputs) -> None:
    if nxt.is_cuda and triton_usable(nxt):
        tree_accept_triton(nxt, logits, lse, ctx, bufs, req_to_token, token_table, out)
    else:
        tree_accept_ref(nxt, logits, lse, ctx, bufs, req_to_token, token_table, out)
