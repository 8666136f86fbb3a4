"""A step's raw inputs resolved on the device, and its last tokens recorded in the token table.

    record_last_tokens(ids, prev_tokens, prev_accept_lens, token_table, rows, seq_lens,
                       ahead=None)

Async scheduling launches step N + 1 before the host has read step N; what step N emitted
stays on the device. ids [bs] holds each request's last token, or -(j + 1) for "the last token
row j of the previous step emitted": prev_tokens[j, prev_accept_lens[j] - 1] (prev_tokens
[max_bs, 1 + k], prev_accept_lens [max_bs]; a decode step emits one token, accept length 1).
In place: ids[i] becomes the resolved token, and token_table[rows[i], seq_lens[i] - 1] = ids[i].

A speculative step (`ahead` = AheadInputs) also learns how far the previous step moved each
referring row: step N emits a_j in 1..1 + k tokens, so step N + 1 was staged for a_j = 1 and
shifts by a_j - 1 on the device: seq_lens[i] += a_j - 1, its 1 + k KV slots are
slots[i, a_j - 1 : a_j + k] of the 1 + 2k slots staged for the positions seq_lens - 1 ..
seq_lens - 1 + 2k (written to slots_out, contiguous), and max_draft[i] is capped by the room
left, seq_limit[i] - seq_lens[i] - 1 (the host's own cap, for the sequence it could not see).
Rows that carry their token are left as staged.

One launch, graph-capturable; the twin is `record_last_tokens_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftgraph.kernels._triton import next_pow2, tl, triton, triton_usable


@dataclass
class AheadInputs:
    """A speculative step's inputs that move with the previous step's accept lengths."""

    slots: torch.Tensor  # [bs, 1 + 2k] int64: KV slots staged for seq_lens - 1 .. + 2k
    slots_out: torch.Tensor  # [bs, 1 + k] int64, contiguous: this step's KV slots
    max_draft: torch.Tensor  # [bs] int64, in place
    seq_limit: torch.Tensor  # [bs] int64: min(prompt + max_tokens, max_model_len) tokens


@triton.jit(do_not_specialize=["bs"])
def _record_last_tokens_kernel(ids, prev, prev_accept, table, rows, seq_lens, slots, slots_out,
                               max_draft, seq_limit, bs, table_stride, num_prev, prev_stride,
                               slots_stride, T: tl.constexpr, SPEC: tl.constexpr,
                               BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < bs
    t = tl.load(ids + offs, mask=mask, other=0)
    ref = mask & (t < 0)
    j = tl.minimum(tl.maximum(-t - 1, 0), num_prev - 1)
    a = tl.maximum(tl.load(prev_accept + j, mask=ref, other=1), 1)
    from_prev = tl.load(prev + j * prev_stride + a - 1, mask=ref, other=0)
    t = tl.where(ref, from_prev, t)
    tl.store(ids + offs, t, mask=mask)
    row = tl.load(rows + offs, mask=mask, other=0).to(tl.int64)
    seq = tl.load(seq_lens + offs, mask=mask, other=1).to(tl.int64)
    if SPEC:
        shift = tl.where(ref, a - 1, 0)
        seq = seq + shift
        tl.store(seq_lens + offs, seq, mask=ref)
        cols = tl.arange(0, BLOCK_T)
        m2 = mask[:, None] & (cols < T)[None, :]
        s = tl.load(slots + offs[:, None] * slots_stride + shift[:, None] + cols[None, :],
                    mask=m2, other=0)
        tl.store(slots_out + offs[:, None] * T + cols[None, :], s, mask=m2)
        md = tl.load(max_draft + offs, mask=ref, other=0)
        room = tl.load(seq_limit + offs, mask=ref, other=0) - seq - 1
        tl.store(max_draft + offs, tl.maximum(tl.minimum(md, room), 0), mask=ref)
    tl.store(table + row * table_stride + seq - 1, t, mask=mask)


def record_last_tokens_triton(ids, prev_tokens, prev_accept_lens, token_table, rows, seq_lens,
                              ahead: AheadInputs | None = None) -> None:
    bs = ids.shape[0]
    if bs == 0:
        return
    assert ids.is_contiguous() and token_table.stride(1) == 1 and prev_tokens.stride(1) == 1
    if ahead is not None:
        t = ahead.slots_out.shape[1]
        assert ahead.slots_out.is_contiguous() and ahead.slots.stride(1) == 1
        args = (ahead.slots, ahead.slots_out, ahead.max_draft, ahead.seq_limit)
        slots_stride = ahead.slots.stride(0)
    else:
        t, args, slots_stride = 1, (ids, ids, ids, ids), 0  # unused
    _record_last_tokens_kernel[(1,)](
        ids, prev_tokens, prev_accept_lens, token_table, rows, seq_lens, *args, bs,
        token_table.stride(0), prev_tokens.shape[0], prev_tokens.stride(0), slots_stride,
        T=t, SPEC=ahead is not None, BLOCK=max(16, next_pow2(bs)), BLOCK_T=next_pow2(t),
    )


def record_last_tokens_ref(ids, prev_tokens, prev_accept_lens, token_table, rows, seq_lens,
                           ahead: AheadInputs | None = None) -> None:
    ref = ids < 0
    j = (-ids - 1).clamp(0, prev_tokens.shape[0] - 1)
    a = prev_accept_lens[j].clamp_min(1)
    ids.copy_(torch.where(ref, prev_tokens[j, a - 1], ids))
    if ahead is not None:
        shift = torch.where(ref, a - 1, 0)
        seq_lens.add_(shift)
        t = ahead.slots_out.shape[1]
        cols = shift[:, None] + torch.arange(t, device=ids.device)
        ahead.slots_out.copy_(ahead.slots.gather(1, cols))
        room = ahead.seq_limit - seq_lens - 1
        ahead.max_draft.copy_(torch.where(ref, ahead.max_draft.minimum(room).clamp_min(0),
                                          ahead.max_draft))
    token_table[rows, seq_lens - 1] = ids


def record_last_tokens(ids, prev_tokens, prev_accept_lens, token_table, rows, seq_lens,
                       ahead: AheadInputs | None = None) -> None:
    """Kernel only on CUDA (like `ops`): on CPU, even in the interpreter, the twin runs."""
    if ids.is_cuda and triton_usable(ids):
        record_last_tokens_triton(ids, prev_tokens, prev_accept_lens, token_table, rows,
                                  seq_lens, ahead)
    else:
        record_last_tokens_ref(ids, prev_tokens, prev_accept_lens, token_table, rows, seq_lens,
                               ahead)
