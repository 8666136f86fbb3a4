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

    pack_chain(drafts, num_drafts, last_tokens, seq_lens, rows, slots, token_table, out)

A verify step's packed rows: request b's last token and its num_drafts[b] drafts (drafts [bs,
k]) one after another (rows qo_start[b] .. qo_start[b] + num_drafts[b], qo_start the exclusive
prefix sum of 1 + num_drafts), in its KV slots slots[b, 0 ..]; the rows past the live ones
dead (token 0, slot 0); the drafts kept (0 past each count), extend and KV lengths, and the
packed row of every request's logit row j (`ChainPack.logit_rows`: qo_start[b] + j, clamped);
the tokens recorded in the token table at their positions. One launch (the twin,
`pack_chain_ref`, is ~35 small ops).

    stage_catch_up(tokens, accept_lens, verify_seq_lens, seq_lens, slots, path, total, out)

A chain head's catch-up after a verify (spec/chain_head.py): request b's emitted tokens 0 ..
m - 1 (tokens [bs, >= m], -1 read as 0) at its reserved slots 1 .. m, KV length seq_lens + m;
the packed rows of the target features they read (path [bs, 1 + m], a tree's accepted rows,
or None: a chain's rows 0 .. m, offset by the request's packed start, the exclusive prefix sum
of 1 + verify_seq_lens - seq_lens; clamped to total - 1), and the row of its new last feature
(path[accept_lens - 1]). One launch (the twin is ~16 small ops).

    draft_take(logits, vocab, i, seq_lens, reserved_slots, out, stage)

A chain drafter's greedy draft i (spec/chain.py): the argmax of each row of logits [bs, V']
over the drafter's vocabulary, mapped to the target's ids (vocab [V'], or None), recorded as
drafts[:, i] and fed as the next step's token; with `stage`, the next step's KV length
seq_lens + i + 1 and slot reserved_slots[:, i + 1] too. Two launches: the argmax's chunk
stage (`kernels.argmax`), then one program a row (the twin is ~7 small ops).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftgraph.kernels._triton import next_pow2, pdl_kwargs, pdl_wait, tl, triton, triton_usable
from draftgraph.kernels.argmax import chunk_partials, row_argmax


@dataclass
class AheadInputs:
    """A speculative step's inputs that move with the previous step's accept lengths."""

    slots: torch.Tensor  # [bs, 1 + 2k] int64: KV slots staged for seq_lens - 1 .. + 2k
    slots_out: torch.Tensor  # [bs, 1 + k] int64, contiguous: this step's KV slots
    max_draft: torch.Tensor  # [bs] int64, in place
    seq_limit: torch.Tensor  # [bs] int64: min(prompt + max_tokens, max_model_len) tokens


@dataclass
class ChainPack:
    """A step body's verify buffers `pack_chain` writes (persistent, [max_bs ...])."""

    draft_tokens: torch.Tensor  # [max_bs, k] int64: the drafts, 0 past each count
    num_drafts: torch.Tensor  # [max_bs] int64
    extend_lens: torch.Tensor  # [max_bs] int64: 1 + num_drafts
    verify_seq_lens: torch.Tensor  # [max_bs] int64: seq_lens + num_drafts
    packed_ids: torch.Tensor  # [max_bs * (1 + k)] int64
    packed_loc: torch.Tensor  # [max_bs * (1 + k)] int64
    logit_rows: torch.Tensor  # [max_bs * (1 + k)] int64: request b's row j at b (1 + k) + j


@dataclass
class CatchUp:
    """`stage_catch_up`'s outputs (persistent, [max_bs * m] / [max_bs])."""

    ids: torch.Tensor  # [max_bs * m] int64: the entries' tokens
    loc: torch.Tensor  # [max_bs * m] int64: their KV slots
    seq: torch.Tensor  # [max_bs] int64: KV length after them
    feat_rows: torch.Tensor  # [max_bs * m] int64: the capture rows their features come from
    last_rows: torch.Tensor  # [max_bs] int64: the capture row of the request's last feature


@dataclass
class ChainSteps:
    """A chain drafter's per-step inputs `draft_take` writes (persistent, [max_bs ...])."""

    ids: torch.Tensor  # [max_bs] int64: the next step's token (the draft just taken)
    seq_lens: torch.Tensor  # [max_bs] int64: the next step's KV length
    loc: torch.Tensor  # [max_bs] int64: the next step's KV slot
    drafts: torch.Tensor  # [max_bs, k] int64


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


def pack_chain_ref(drafts: torch.Tensor, num_drafts: torch.Tensor, last_tokens: torch.Tensor,
                   seq_lens: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                   token_table: torch.Tensor, out: ChainPack) -> None:
    bs, k = drafts.shape
    T = 1 + k
    dev = drafts.device
    out.num_drafts[:bs].copy_(num_drafts)
    torch.where(torch.arange(k, device=dev) < num_drafts[:, None], drafts,
                drafts.new_zeros(()), out=out.draft_tokens[:bs])
    ext = 1 + num_drafts
    out.extend_lens[:bs].copy_(ext)
    out.verify_seq_lens[:bs].copy_(seq_lens + num_drafts)
    qo_end = ext.cumsum(0)
    start = qo_end - ext
    t = torch.arange(bs * T, device=dev)
    r = torch.searchsorted(qo_end, t, right=True).clamp_max(bs - 1)  # [bs*T] request
    j = t - start[r]  # [bs*T] index inside the request's 1 + d tokens
    live = j < ext[r]
    jc = j.clamp(0, T - 1)
    cand = torch.where(j == 0, last_tokens[r], out.draft_tokens[r, (jc - 1).clamp_min(0)])
    out.packed_ids[: bs * T].copy_(torch.where(live, cand, 0))
    out.packed_loc[: bs * T].copy_(torch.where(live, slots[r, jc], 0))
    out.logit_rows[: bs * T].copy_((start[:, None] + torch.arange(T, device=dev))
                                   .clamp_max(bs * T - 1).flatten())
    # dead rows write the dummy row 0's first entry (0)
    token_table[torch.where(live, rows[r], 0), torch.where(live, seq_lens[r] - 1 + jc, 0)] = \
        out.packed_ids[: bs * T]


@triton.jit(do_not_specialize=["bs"])
def _pack_chain_kernel(drafts, num_in, last, seq_lens, rows, slots, table, draft_tokens,
                       num_out, extend_lens, verify_seq_lens, packed_ids, packed_loc,
                       logit_rows, bs, stride_drafts, stride_slots, stride_table,
                       K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_wait(PDL)
    T = K + 1
    b = tl.arange(0, BLOCK)
    bm = b < bs
    num = tl.load(num_in + b, mask=bm, other=0)
    tl.store(num_out + b, num, mask=bm)
    ext = tl.where(bm, 1 + num, 0)
    tl.store(extend_lens + b, ext, mask=bm)
    seq = tl.load(seq_lens + b, mask=bm, other=1)
    tl.store(verify_seq_lens + b, seq + num, mask=bm)
    start = (tl.cumsum(ext.to(tl.int32), axis=0) - ext).to(tl.int64)
    total = tl.sum(ext, axis=0)
    j = tl.arange(0, BLOCK_T)
    dm = bm[:, None] & (j >= 1)[None, :] & (j <= K)[None, :]
    jd = tl.maximum(j - 1, 0)
    d = tl.load(drafts + b[:, None] * stride_drafts + jd[None, :], mask=dm, other=0)
    d = tl.where(jd[None, :] < num[:, None], d, 0)
    tl.store(draft_tokens + b[:, None] * K + jd[None, :], d, mask=dm)
    tok = tl.where(j[None, :] == 0, tl.load(last + b, mask=bm, other=0)[:, None], d)
    live = bm[:, None] & (j[None, :] < ext[:, None])
    t = start[:, None] + j[None, :]
    tl.store(packed_ids + t, tok, mask=live)
    loc = tl.load(slots + b[:, None] * stride_slots + j[None, :], mask=live, other=0)
    tl.store(packed_loc + t, loc, mask=live)
    rm = bm[:, None] & (j < T)[None, :]
    tl.store(logit_rows + b[:, None] * T + j[None, :], tl.minimum(t, bs * T - 1), mask=rm)
    row = tl.load(rows + b, mask=bm, other=0).to(tl.int64)
    tl.store(table + row[:, None] * stride_table + seq[:, None] - 1 + j[None, :], tok,
             mask=live)
    # the rows past the live ones: dead (token 0, slot 0)
    tail = tl.arange(0, BLOCK * BLOCK_T)
    tm = (tail >= total) & (tail < bs * T)
    tl.store(packed_ids + tail, tl.zeros_like(tail).to(tl.int64), mask=tm)
    tl.store(packed_loc + tail, tl.zeros_like(tail).to(tl.int64), mask=tm)


def pack_chain_triton(drafts: torch.Tensor, num_drafts: torch.Tensor,
                      last_tokens: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor,
                      slots: torch.Tensor, token_table: torch.Tensor, out: ChainPack) -> None:
    bs, k = drafts.shape
    num_drafts = num_drafts.contiguous()  # a no-op as drafters give it
    # drafts may be a column prefix of a wider proposal (a tree drafter's chain)
    assert drafts.stride(1) == 1 and slots.stride(1) == 1 and token_table.stride(1) == 1
    assert out.draft_tokens.is_contiguous()
    _pack_chain_kernel[(1,)](
        drafts, num_drafts, last_tokens, seq_lens, rows, slots, token_table, out.draft_tokens,
        out.num_drafts, out.extend_lens, out.verify_seq_lens, out.packed_ids, out.packed_loc,
        out.logit_rows, bs, drafts.stride(0), slots.stride(0), token_table.stride(0),
        K=k, BLOCK=max(2, next_pow2(bs)), BLOCK_T=max(2, next_pow2(k + 1)),
        **pdl_kwargs(drafts),
    )


def pack_chain(drafts: torch.Tensor, num_drafts: torch.Tensor, last_tokens: torch.Tensor,
               seq_lens: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
               token_table: torch.Tensor, out: ChainPack) -> None:
    """Kernel only on CUDA (like `record_last_tokens`); the twin elsewhere."""
    if drafts.is_cuda and triton_usable(drafts):
        pack_chain_triton(drafts, num_drafts, last_tokens, seq_lens, rows, slots, token_table,
                          out)
    else:
        pack_chain_ref(drafts, num_drafts, last_tokens, seq_lens, rows, slots, token_table,
                       out)


def stage_catch_up_ref(tokens: torch.Tensor, accept_lens: torch.Tensor,
                       verify_seq_lens: torch.Tensor, seq_lens: torch.Tensor,
                       slots: torch.Tensor, path: torch.Tensor | None, total: int,
                       out: CatchUp) -> None:
    bs, m = seq_lens.shape[0], out.ids.shape[0] // out.seq.shape[0]
    ext = 1 + verify_seq_lens - seq_lens  # verified tokens per request, packed
    qo_start = ext.cumsum(0) - ext
    if path is None:  # a chain's row j is j
        path = torch.arange(1 + m, device=seq_lens.device).expand(bs, 1 + m)
    rows = (qo_start[:, None] + path).clamp_max(total - 1)  # [bs, 1 + m]
    out.ids[: bs * m].copy_(tokens[:, :m].clamp_min(0).flatten())
    out.loc[: bs * m].copy_(slots[:, 1 : 1 + m].flatten())
    torch.add(seq_lens, m, out=out.seq[:bs])
    out.feat_rows[: bs * m].copy_(rows[:, :m].flatten())
    out.last_rows[:bs].copy_(rows.gather(1, (accept_lens - 1)[:, None]).squeeze(1))


@triton.jit(do_not_specialize=["bs"])
def _stage_catch_up_kernel(tokens, accept_lens, verify_seq_lens, seq_lens, slots, path, ids,
                           loc, seq_out, feat_rows, last_rows, bs, total, stride_tok,
                           stride_slots, stride_path, M: tl.constexpr, HAS_PATH: tl.constexpr,
                           BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.arange(0, BLOCK)
    bm = b < bs
    seq = tl.load(seq_lens + b, mask=bm, other=0)
    ext = tl.where(bm, 1 + tl.load(verify_seq_lens + b, mask=bm, other=0) - seq, 0)
    start = (tl.cumsum(ext.to(tl.int32), axis=0) - ext).to(tl.int64)
    tl.store(seq_out + b, seq + M, mask=bm)
    j = tl.arange(0, BLOCK_M)
    pm = bm[:, None] & (j <= M)[None, :]
    em = bm[:, None] & (j < M)[None, :]
    if HAS_PATH:
        p = tl.load(path + b[:, None] * stride_path + j[None, :], mask=pm, other=0)
    else:
        p = tl.zeros([BLOCK, BLOCK_M], tl.int64) + j[None, :]
    rows = tl.minimum(start[:, None] + p, total - 1)
    out = b[:, None] * M + j[None, :]
    tl.store(feat_rows + out, rows, mask=em)
    tok = tl.load(tokens + b[:, None] * stride_tok + j[None, :], mask=em, other=0)
    tl.store(ids + out, tl.maximum(tok, 0), mask=em)
    tl.store(loc + out, tl.load(slots + b[:, None] * stride_slots + 1 + j[None, :], mask=em,
                                other=0), mask=em)
    a = tl.load(accept_lens + b, mask=bm, other=1)
    last = tl.sum(tl.where(j[None, :] == (a - 1)[:, None], rows, 0), axis=1)
    tl.store(last_rows + b, last, mask=bm)


def stage_catch_up_triton(tokens: torch.Tensor, accept_lens: torch.Tensor,
                          verify_seq_lens: torch.Tensor, seq_lens: torch.Tensor,
                          slots: torch.Tensor, path: torch.Tensor | None, total: int,
                          out: CatchUp) -> None:
    bs, m = seq_lens.shape[0], out.ids.shape[0] // out.seq.shape[0]
    assert tokens.stride(1) == 1 and slots.stride(1) == 1
    assert path is None or path.stride(1) == 1
    _stage_catch_up_kernel[(1,)](
        tokens, accept_lens, verify_seq_lens, seq_lens, slots,
        path if path is not None else tokens, out.ids, out.loc, out.seq, out.feat_rows,
        out.last_rows, bs, total, tokens.stride(0), slots.stride(0),
        path.stride(0) if path is not None else 0, M=m, HAS_PATH=path is not None,
        BLOCK=max(2, next_pow2(bs)), BLOCK_M=max(2, next_pow2(m + 1)),
        **pdl_kwargs(seq_lens),
    )


def stage_catch_up(tokens: torch.Tensor, accept_lens: torch.Tensor,
                   verify_seq_lens: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
                   path: torch.Tensor | None, total: int, out: CatchUp) -> None:
    """Kernel only on CUDA; the twin elsewhere."""
    if seq_lens.is_cuda and triton_usable(seq_lens):
        stage_catch_up_triton(tokens, accept_lens, verify_seq_lens, seq_lens, slots, path,
                              total, out)
    else:
        stage_catch_up_ref(tokens, accept_lens, verify_seq_lens, seq_lens, slots, path, total,
                           out)


def record_take(tok: torch.Tensor, i: int, seq_lens: torch.Tensor,
                reserved_slots: torch.Tensor, out: ChainSteps, stage: bool) -> torch.Tensor:
    """Drafts tok [bs] (target ids) as drafts[:, i] and the next step's token; with `stage`
    the next step's KV length and slot (torch ops: `draft_take`'s twin, and a sampled take's
    whole record). Returns the drafts' column."""
    bs = tok.shape[0]
    out.drafts[:bs, i].copy_(tok)
    out.ids[:bs].copy_(tok)
    if stage:
        torch.add(seq_lens, i + 1, out=out.seq_lens[:bs])
        out.loc[:bs].copy_(reserved_slots[:, i + 1])
    return out.drafts[:bs, i]


def draft_take_ref(logits: torch.Tensor, vocab: torch.Tensor | None, i: int,
                   seq_lens: torch.Tensor, reserved_slots: torch.Tensor, out: ChainSteps,
                   stage: bool) -> torch.Tensor:
    tok = row_argmax(logits)  # (on CUDA the argmax kernels: the A arm is what it was)
    return record_take(vocab[tok] if vocab is not None else tok, i, seq_lens, reserved_slots,
                       out, stage)


@triton.jit(do_not_specialize=["col"])
def _draft_take_kernel(part_max, part_idx, vocab_map, drafts, ids, seq_lens, reserved, seq_out,
                       loc_out, col, vocab, num_chunks, stride_drafts, stride_reserved,
                       HAS_VOCAB: tl.constexpr, STAGE: tl.constexpr, BLOCK_C: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cmask = c < num_chunks
    m = tl.load(part_max + row * num_chunks + c, mask=cmask, other=float("-inf"))
    i = tl.load(part_idx + row * num_chunks + c, mask=cmask, other=0)
    # the smallest index among the chunks holding the row's max: torch's first index
    tok = tl.min(tl.where((m == tl.max(m, axis=0)) & cmask, i, vocab), axis=0).to(tl.int64)
    if HAS_VOCAB:
        tok = tl.load(vocab_map + tok).to(tl.int64)
    tl.store(drafts + row * stride_drafts + col, tok)
    tl.store(ids + row, tok)
    if STAGE:
        tl.store(seq_out + row, tl.load(seq_lens + row) + col + 1)
        tl.store(loc_out + row, tl.load(reserved + row * stride_reserved + col + 1))


def draft_take_triton(logits: torch.Tensor, vocab: torch.Tensor | None, i: int,
                      seq_lens: torch.Tensor, reserved_slots: torch.Tensor, out: ChainSteps,
                      stage: bool) -> torch.Tensor:
    bs, width = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if bs == 0:
        return out.drafts[:0, i]
    assert out.drafts.stride(1) == 1 and reserved_slots.stride(1) == 1
    part_max, part_idx, _ = chunk_partials(logits)
    num_chunks = part_max.shape[1]
    block_c = max(next_pow2(num_chunks), 2)
    _draft_take_kernel[(bs,)](
        part_max, part_idx, vocab if vocab is not None else part_idx, out.drafts, out.ids,
        seq_lens, reserved_slots, out.seq_lens, out.loc, i, width, num_chunks,
        out.drafts.stride(0), reserved_slots.stride(0), HAS_VOCAB=vocab is not None,
        STAGE=stage, BLOCK_C=block_c, num_warps=1 if block_c <= 256 else 4,
        **pdl_kwargs(logits),
    )
    return out.drafts[:bs, i]


def draft_take(logits: torch.Tensor, vocab: torch.Tensor | None, i: int,
               seq_lens: torch.Tensor, reserved_slots: torch.Tensor, out: ChainSteps,
               stage: bool) -> torch.Tensor:
    """Kernel only on CUDA; the twin elsewhere. Returns the drafts taken, [bs] (a view of
    out.drafts)."""
    if logits.is_cuda and triton_usable(logits):
        return draft_take_triton(logits, vocab, i, seq_lens, reserved_slots, out, stage)
    return draft_take_ref(logits, vocab, i, seq_lens, reserved_slots, out, stage)
