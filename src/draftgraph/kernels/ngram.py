"""Prompt-lookup n-gram drafts straight from the token table: one launch, graph-capturable.

    ngram_propose_triton(token_table, rows, lens, min_n, max_n, k) -> (drafts [bs, k], num [bs])

Request i's tokens are token_table[rows[i], :lens[i]]. For n from max_n down to min_n the
suffix is its last n tokens; the match is the last earlier window equal to it that ends before
the suffix does (a token follows it); the drafts are the (up to k) tokens after the window,
0-padded, for the longest n with a match (spec/ngram.py states the rule; its
`NgramProposer.propose` is the torch twin, `propose_ref` the python one).

One program per request walks its own tokens (lens[i], not the table's width) in blocks of
BLOCK window ends: for each end e the match length with the suffix grows one offset at a time,
so every n shares the compares of the shorter ones, and the last end per n is kept.
"""

from __future__ import annotations

import torch

from draftgraph.kernels._triton import next_pow2, tl, triton


@triton.jit
def _ngram_kernel(table, table_stride, rows, lens, drafts, stride_d, num, k,
                  MIN_N: tl.constexpr, MAX_N: tl.constexpr, N_BLOCK: tl.constexpr,
                  K_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(rows + r).to(tl.int64)
    length = tl.load(lens + r).to(tl.int64)
    base = table + row * table_stride
    ns = tl.arange(0, N_BLOCK)
    best = tl.zeros([N_BLOCK], dtype=tl.int64) - 1  # per n: the last end of a match
    for e0 in range(0, length - 1, BLOCK):
        e = e0 + tl.arange(0, BLOCK).to(tl.int64)  # window ends
        live = e <= length - 2  # a token follows the window
        run = live
        for d in tl.static_range(1, MAX_N + 1):
            # the suffix's d-th token from the end (-2: none, never equal to a token)
            s = tl.load(base + tl.maximum(length - d, 0))
            s = tl.where(length - d >= 0, s, -2)
            # the window's token d - 1 before its end (-1 before the row's start)
            t = tl.load(base + e - d + 1, mask=live & (e - d + 1 >= 0), other=-1)
            run = run & (t == s)
            if d >= MIN_N:
                last = tl.max(tl.where(run, e, -1), axis=0)
                best = tl.where(ns == d, tl.maximum(best, last), best)
    n_star = tl.max(tl.where(best >= 0, ns, -1), axis=0)  # the longest n with a match
    end = tl.sum(tl.where(ns == n_star, best, 0), axis=0)
    end = tl.where(n_star >= 0, end, -1)
    j = tl.arange(0, K_BLOCK)
    ends = tl.zeros([K_BLOCK], dtype=tl.int64) + end
    idx = ends + 1 + j
    valid = (ends >= 0) & (idx < length) & (j < k)
    tok = tl.load(base + idx, mask=valid, other=0)
    tl.store(drafts + r * stride_d + j, tok, mask=j < k)
    tl.store(num + r, tl.sum(valid.to(tl.int64), axis=0))


def ngram_propose_triton(token_table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                         min_n: int, max_n: int, k: int, block: int = 1024, *,
                         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts [bs, k] int64 (0-padded) and their counts [bs] int64 for the requests whose
    tokens are token_table[rows[i], :lens[i]]; the drafts written into `out` when given (a
    [bs, k] view with unit column stride: the columns of a wider proposal, say)."""
    bs = rows.shape[0]
    drafts = torch.empty(bs, k, dtype=torch.int64, device=rows.device) if out is None else out
    assert drafts.shape == (bs, k) and drafts.stride(1) == 1
    num = torch.empty(bs, dtype=torch.int64, device=rows.device)
    if bs == 0:
        return drafts, num
    assert token_table.stride(1) == 1, "the token table's rows must be contiguous"
    _ngram_kernel[(bs,)](
        token_table, token_table.stride(0), rows, lens, drafts, drafts.stride(0), num, k,
        MIN_N=min_n, MAX_N=max_n, N_BLOCK=next_pow2(max_n + 1), K_BLOCK=next_pow2(k),
        BLOCK=block, num_warps=4,
    )
    return drafts, num
