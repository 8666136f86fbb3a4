"""Attention metadata built on the device: the Triton twins of `draftgraph.attention.metadata`.

Same signatures and the same values as the reference builders; every function here is
CUDA-graph capturable:
  - no host reads (`.item()`, `.tolist()`), no allocation, no value-dependent output sizes;
  - grids come from static sizes (bs = req_pool_indices.shape[0]);
  - loops inside a program are bounded by runtime lengths loaded from tensors, never by
    max_seq_len or a buffer's capacity.

A forward's metadata is one launch (`_metadata_kernel`, one program a request): each program
sums the extend lengths and list lengths of the requests before it (in blocks of SCAN_BLOCK,
so any bs works) for its offsets, records its slots and writes its lists, reading its own new
slots from out_cache_loc rather than back from the table. Tree rows read their root's slot
from the table, recorded by another program, so their lists take a second launch; so does
each further layer kind (a sliding window beside the full lists).

`bufs` / `lists` are duck-typed `MetadataBuffers` / `KVIndexLists` (kernels/ sits below
attention/ and does not import it).
"""

import torch

from draftgraph.kernels._triton import tl, triton

SCAN_BLOCK = 128  # rows per step of a single-program scan
COPY_BLOCK = 128  # entries per step of a per-row copy loop


# ---- kernels -----------------------------------------------------------------------------


@triton.jit
def _zero_i64():
    return tl.sum(tl.zeros([1], dtype=tl.int64), axis=0)


@triton.jit
def _metadata_kernel(
    req_pool_indices, seq_lens, extend_lens, out_cache_loc, req_to_token, r2t_stride,
    qo_indptr, positions, token_req,
    kv_indptr, kv_start, kv_indices, capacity, window, path_slots, path_stride, path_base,
    SLOTS: tl.constexpr, LISTS: tl.constexpr, SLIDING: tl.constexpr, PATHS: tl.constexpr,
    NEW: tl.constexpr, SCAN_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per request. Its offsets (first query token, first list entry) are sums
    # over the requests before it, each program summing its own prefix (bs is small, so this
    # beats a separate scan launch). SLOTS: qo_indptr, positions, token_req and the
    # req_to_token record of its new slots; LISTS: kv_start, kv_indptr and kv_indices of one
    # layer kind (a list starts at first_position - window + 1 when SLIDING).
    r = tl.program_id(0)
    ext = tl.load(extend_lens + r).to(tl.int64)
    seq_len = tl.load(seq_lens + r).to(tl.int64)
    req = tl.load(req_pool_indices + r).to(tl.int64)
    first_pos = seq_len - ext
    q0 = _zero_i64()
    d0 = _zero_i64()
    for b in range(0, r, SCAN_BLOCK):
        offs = b + tl.arange(0, SCAN_BLOCK)
        mask = offs < r
        e = tl.load(extend_lens + offs, mask=mask, other=0).to(tl.int64)
        q0 += tl.sum(e, axis=0)
        if LISTS:
            s = tl.load(seq_lens + offs, mask=mask, other=0).to(tl.int64)
            if SLIDING:
                d0 += tl.sum(s - tl.maximum(s - e - window + 1, 0), axis=0)
            else:
                d0 += tl.sum(s, axis=0)
    if SLOTS:
        if r == 0:
            tl.store(qo_indptr, q0)
        tl.store(qo_indptr + r + 1, q0 + ext)
        row = tl.zeros([BLOCK], dtype=tl.int64) + r
        for j in range(0, ext, BLOCK):
            offs = j + tl.arange(0, BLOCK)
            mask = offs < ext
            pos = first_pos + offs
            tl.store(positions + q0 + offs, pos, mask=mask)
            tl.store(token_req + q0 + offs, row, mask=mask)
            loc = tl.load(out_cache_loc + q0 + offs, mask=mask)
            tl.store(req_to_token + req * r2t_stride + pos, loc, mask=mask)
    if LISTS:
        if SLIDING:
            start = tl.maximum(first_pos - window + 1, 0)
        else:
            start = first_pos * 0
        count = seq_len - start
        if r == 0:
            tl.store(kv_indptr, d0)
        tl.store(kv_start + r, start)
        tl.store(kv_indptr + r + 1, d0 + count)
        # a list's entries: the request's table below its first new position, then (NEW) its
        # new slots straight from out_cache_loc, never read back from the table this program
        # has just written; a tree row (PATHS) reads positions from path_base[r] on from its
        # path instead
        if NEW:
            fresh = first_pos - start  # list index of the first new slot
        else:
            fresh = count
        src = req_to_token + req * r2t_stride + start
        new = out_cache_loc + q0 - fresh
        if PATHS:
            base = tl.load(path_base + r).to(tl.int64) - start
            path = path_slots + r.to(tl.int64) * path_stride - base
        for j in range(0, count, BLOCK):
            offs = j + tl.arange(0, BLOCK)
            mask = offs < count
            old = offs < fresh
            if PATHS:
                old = offs < base
                slot = tl.load(src + offs, mask=mask & old)
                slot = tl.where(old, slot, tl.load(path + offs, mask=mask & (offs >= base)))
            else:
                slot = tl.load(src + offs, mask=mask & old)
                slot = tl.where(old, slot, tl.load(new + offs, mask=mask & (offs >= fresh)))
            dst = d0 + offs
            tl.store(kv_indices + dst, slot, mask=mask & (dst < capacity))


@triton.jit(do_not_specialize=["bs"])
def _scan_inplace_kernel(indptr, bs, SCAN_BLOCK: tl.constexpr):
    # Single program: counts in indptr[1 : bs + 1] become their inclusive scan; indptr[0] = 0.
    total = _zero_i64()
    tl.store(indptr, total)
    for b in range(0, bs, SCAN_BLOCK):
        offs = b + tl.arange(0, SCAN_BLOCK)
        mask = offs < bs
        counts = tl.load(indptr + 1 + offs, mask=mask, other=0).to(tl.int64)
        tl.store(indptr + 1 + offs, tl.cumsum(counts, axis=0) + total, mask=mask)
        total += tl.sum(counts, axis=0)


@triton.jit
def _candidate_count_kernel(candidates, cand_stride, width, indptr, BLOCK: tl.constexpr):
    # One program per row: number of non-sentinel candidates, written to indptr[r + 1].
    r = tl.program_id(0)
    row = candidates + r.to(tl.int64) * cand_stride
    count = tl.zeros([BLOCK], dtype=tl.int64)
    for j in range(0, width, BLOCK):
        offs = j + tl.arange(0, BLOCK)
        c = tl.load(row + offs, mask=offs < width, other=-1)
        count += (c >= 0).to(tl.int64)
    tl.store(indptr + r + 1, tl.sum(count, axis=0))


@triton.jit
def _candidate_compact_kernel(
    candidates, cand_stride, width, indptr, indices, capacity, BLOCK: tl.constexpr
):
    # One program per row: its non-sentinel candidates, in order, from indices[indptr[r]].
    r = tl.program_id(0)
    row = candidates + r.to(tl.int64) * cand_stride
    dst0 = tl.load(indptr + r).to(tl.int64)
    for j in range(0, width, BLOCK):
        offs = j + tl.arange(0, BLOCK)
        c = tl.load(row + offs, mask=offs < width, other=-1)
        valid = c >= 0
        rank = tl.cumsum(valid.to(tl.int64), axis=0)  # inclusive
        dst = dst0 + rank - 1
        tl.store(indices + dst, c, mask=valid & (dst < capacity))
        dst0 += tl.sum(valid.to(tl.int64), axis=0)


# ---- host wrappers (shape arithmetic only) ----------------------------------------------


def _launch(req_pool_indices, seq_lens, extend_lens, out_cache_loc, req_to_token, bufs,
            lists=None, paths=None, slots=True) -> None:
    """One `_metadata_kernel` launch: the slots (`slots`) and/or one kind's lists (new slots
    from `out_cache_loc` when given, else from the table)."""
    bs = req_pool_indices.shape[0]
    if bs == 0:
        if slots:
            bufs.qo_indptr[:1].zero_()
        if lists is not None:
            lists.kv_indptr[:1].zero_()
        return
    # a list starts at first_position - window + 1; a draft block reaches one position further
    # back (its window is of context positions before the block)
    window = 0 if lists is None else (lists.window or 0) + (1 if lists.noncausal else 0)
    dummy = seq_lens
    new = out_cache_loc is not None and paths is None
    out_cache_loc = out_cache_loc if out_cache_loc is not None else dummy
    path_slots, path_base = (paths.slots, paths.base) if paths is not None else (dummy, dummy)
    _metadata_kernel[(bs,)](
        req_pool_indices, seq_lens, extend_lens, out_cache_loc, req_to_token,
        req_to_token.stride(0),
        bufs.qo_indptr if bufs is not None else dummy,
        bufs.positions if bufs is not None else dummy,
        bufs.token_req if bufs is not None else dummy,
        lists.kv_indptr if lists is not None else dummy,
        lists.kv_start if lists is not None else dummy,
        lists.kv_indices if lists is not None else dummy,
        lists.kv_indices.shape[0] if lists is not None else 0, window,
        path_slots, path_slots.stride(0), path_base,
        SLOTS=slots, LISTS=lists is not None, NEW=new,
        SLIDING=lists is not None and lists.window is not None, PATHS=paths is not None,
        SCAN_BLOCK=SCAN_BLOCK, BLOCK=COPY_BLOCK, num_warps=4,
    )


def build_positions_and_slots(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    bufs,
) -> None:
    """qo_indptr, positions, token_req; record out_cache_loc in req_to_token. One launch."""
    _launch(req_pool_indices, seq_lens, extend_lens, out_cache_loc, req_to_token, bufs)


def build_kv_index_lists(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    lists,
    paths=None,
    out_cache_loc: torch.Tensor | None = None,
) -> None:
    """kv_indptr / kv_indices / kv_start for one layer kind, one launch (tree rows' positions
    from `paths.base` on from their paths: `RowPaths`). A request's new slots (its last
    extend_lens positions) are read from `out_cache_loc` when given, else from the table
    (recorded there by `build_positions_and_slots` before).

    NOTE: the reference raises when the lists overflow kv_indices; this graph-safe version
    cannot read the total back, so it drops entries past the capacity instead. Buffers sized
    by `MetadataBuffers` never overflow for batches within its max_bs / max_num_tokens.
    """
    _launch(req_pool_indices, seq_lens, extend_lens, out_cache_loc, req_to_token, None,
            lists, paths, slots=False)


def build_metadata(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    bufs,
    draft_block: bool = False,
    paths=None,
) -> None:
    """All metadata of one forward: one launch for the slots and the first kind's lists,
    one more per further kind. Tree rows (`paths`) read their root's slot from the table,
    recorded there by another program of the same launch, so their lists wait for a launch
    of their own."""
    kinds = bufs.kinds(draft_block)
    first = None if paths is not None else bufs.lists[kinds[0]]
    _launch(req_pool_indices, seq_lens, extend_lens, out_cache_loc, req_to_token, bufs, first)
    for kind in kinds[first is not None:]:
        _launch(req_pool_indices, seq_lens, extend_lens, out_cache_loc, req_to_token, None,
                bufs.lists[kind], paths, slots=False)


def exclusive_scan_inplace(indptr: torch.Tensor, bs: int) -> None:
    """indptr[1 : bs + 1] holds counts; make indptr[: bs + 1] their CSR offsets, in place."""
    _scan_inplace_kernel[(1,)](indptr, bs, SCAN_BLOCK=SCAN_BLOCK, num_warps=4)


def compact_candidates(
    candidates: torch.Tensor, indptr_out: torch.Tensor, indices_out: torch.Tensor
) -> None:
    """Dense candidate slots [bs, W] with -1 sentinels -> CSR (indptr_out, indices_out).

    count (one program per row) -> in-place scan of indptr_out[1:] -> compact (one program
    per row, order preserved). Loops sweep the static width W, the candidates' own size.
    Entries of indices_out past the live part are left as they are.
    """
    bs, width = candidates.shape
    if bs:
        _candidate_count_kernel[(bs,)](candidates, candidates.stride(0), width, indptr_out,
                                       BLOCK=COPY_BLOCK, num_warps=4)
    exclusive_scan_inplace(indptr_out, bs)
    if bs:
        _candidate_compact_kernel[(bs,)](
            candidates, candidates.stride(0), width, indptr_out, indices_out,
            indices_out.shape[0], BLOCK=COPY_BLOCK, num_warps=4,
        )


def compact_candidates_ref(
    candidates: torch.Tensor, indptr_out: torch.Tensor, indices_out: torch.Tensor
) -> None:
    """Torch twin of `compact_candidates` (eager: reads the total back)."""
    bs = candidates.shape[0]
    valid = candidates >= 0
    indptr_out[0] = 0
    torch.cumsum(valid.sum(1), 0, out=indptr_out[1 : bs + 1])
    live = candidates[valid]  # row-major order = row after row, in order
    indices_out[: live.shape[0]] = live
