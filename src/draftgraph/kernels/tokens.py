"""The step's last tokens, resolved on the device and recorded in the token table.

    record_last_tokens(ids, prev_tokens, token_table, rows, seq_lens)

ids [bs] holds each request's last token, or -(j + 1) for "the token row j of the previous
step sampled" (async scheduling launches a step before the host has read the previous one's
tokens; they stay on the device). In place: ids[i] becomes the resolved token, and
token_table[rows[i], seq_lens[i] - 1] = ids[i]. One launch, graph-capturable; the twin is
`record_last_tokens_ref`.
"""

from __future__ import annotations

import torch

from draftgraph.kernels._triton import next_pow2, tl, triton, triton_usable


@triton.jit
def _record_last_tokens_kernel(ids, prev, table, rows, seq_lens, bs, table_stride, num_prev,
                               prev_stride, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < bs
    t = tl.load(ids + offs, mask=mask, other=0)
    j = tl.minimum(tl.maximum(-t - 1, 0), num_prev - 1)
    from_prev = tl.load(prev + j * prev_stride, mask=mask & (t < 0), other=0)
    t = tl.where(t < 0, from_prev, t)
    tl.store(ids + offs, t, mask=mask)
    row = tl.load(rows + offs, mask=mask, other=0).to(tl.int64)
    pos = tl.load(seq_lens + offs, mask=mask, other=1).to(tl.int64) - 1
    tl.store(table + row * table_stride + pos, t, mask=mask)


def record_last_tokens_triton(ids, prev_tokens, token_table, rows, seq_lens) -> None:
    bs = ids.shape[0]
    if bs == 0:
        return
    assert ids.is_contiguous() and token_table.stride(1) == 1
    _record_last_tokens_kernel[(1,)](
        ids, prev_tokens, token_table, rows, seq_lens, bs, token_table.stride(0),
        prev_tokens.shape[0], prev_tokens.stride(0), BLOCK=max(16, next_pow2(bs)),
    )


def record_last_tokens_ref(ids, prev_tokens, token_table, rows, seq_lens) -> None:
    prev = prev_tokens[(-ids - 1).clamp(0, prev_tokens.shape[0] - 1)]
    ids.copy_(torch.where(ids < 0, prev, ids))
    token_table[rows, seq_lens - 1] = ids


def record_last_tokens(ids, prev_tokens, token_table, rows, seq_lens) -> None:
    """Kernel only on CUDA (like `ops`): on CPU, even in the interpreter, the twin runs."""
    if ids.is_cuda and triton_usable(ids):
        record_last_tokens_triton(ids, prev_tokens, token_table, rows, seq_lens)
    else:
        record_last_tokens_ref(ids, prev_tokens, token_table, rows, seq_lens)
