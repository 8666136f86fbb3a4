"""Attention metadata built on the device: the Triton twins of `draftgraph.attention.metadata`.

Same signatures and the same values as the reference builders; every function here is
CUDA-graph capturable:
  - no host reads (`.item()`, `.tolist()`), no allocation, no value-dependent output sizes;
  - grids come from static sizes (bs = req_pool_indices.shape[0]);
  - loops inside a program are bounded by runtime lengths loaded from tensors, never by
    max_seq_len or a buffer's capacity.

Ragged lists follow count -> scan -> compact. The scan runs in a single program over bs in
blocks of SCAN_BLOCK with a running total, so any bs works.

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
def _positions_and_slots_kernel(
    req_pool_indices, seq_lens, extend_lens, out_cache_loc, req_to_token, r2t_stride,
    qo_indptr, positions, token_req,
    SCAN_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per request. Its query offset is the sum of the extend lengths before it
    # (bs is small, so each program summing its own prefix beats a separate scan launch).
    r = tl.program_id(0)
    ext = tl.load(extend_lens + r).to(tl.int64)
    seq_len = tl.load(seq_lens + r).to(tl.int64)
    req = tl.load(req_pool_indices + r).to(tl.int64)
    q0 = _zero_i64()
    for b in range(0, r, SCAN_BLOCK):
        offs = b + tl.arange(0, SCAN_BLOCK)
        q0 += tl.sum(tl.load(extend_lens + offs, mask=offs < r, other=0).to(tl.int64), axis=0)
    if r == 0:
        tl.store(qo_indptr, q0)
    tl.store(qo_indptr + r + 1, q0 + ext)
    first_pos = seq_len - ext
    row = tl.zeros([BLOCK], dtype=tl.int64) + r
    for j in range(0, ext, BLOCK):
        offs = j + tl.arange(0, BLOCK)
        mask = offs < ext
        pos = first_pos + offs
        tl.store(positions + q0 + offs, pos, mask=mask)
        tl.store(token_req + q0 + offs, row, mask=mask)
        loc = tl.load(out_cache_loc + q0 + offs, mask=mask)
        tl.store(req_to_token + req * r2t_stride + pos, loc, mask=mask)


@triton.jit(do_not_specialize=["bs"])
def _kv_count_scan_kernel(
    seq_lens, extend_lens, kv_indptr, kv_start, bs, window,
    SLIDING: tl.constexpr, SCAN_BLOCK: tl.constexpr,
):
    # Single program: kv_start and the per-row counts, scanned with a running total into
    # kv_indptr[1:] (the counts are scanned in registers, never re-read from memory).
    total = _zero_i64()
    tl.store(kv_indptr, total)
    for b in range(0, bs, SCAN_BLOCK):
        offs = b + tl.arange(0, SCAN_BLOCK)
        mask = offs < bs
        seq_len = tl.load(seq_lens + offs, mask=mask, other=0).to(tl.int64)
        if SLIDING:
            ext = tl.load(extend_lens + offs, mask=mask, other=0).to(tl.int64)
            start = tl.maximum(seq_len - ext - window + 1, 0)
        else:
            start = seq_len * 0
        counts = seq_len - start
        tl.store(kv_start + offs, start, mask=mask)
        tl.store(kv_indptr + 1 + offs, tl.cumsum(counts, axis=0) + total, mask=mask)
        total += tl.sum(counts, axis=0)


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
def _kv_compact_kernel(
    req_pool_indices, seq_lens, req_to_token, r2t_stride, kv_indptr, kv_start, kv_indices,
    capacity, path_slots, path_stride, path_base, BLOCK: tl.constexpr, PATHS: tl.constexpr,
):
    # One program per request: kv_indices[indptr[r] + j] = req_to_token[req, start + j]; a tree
    # row (PATHS) reads positions from path_base[r] on from its path instead.
    r = tl.program_id(0)
    req = tl.load(req_pool_indices + r).to(tl.int64)
    start = tl.load(kv_start + r)
    count = tl.load(seq_lens + r).to(tl.int64) - start
    dst0 = tl.load(kv_indptr + r)
    src = req_to_token + req * r2t_stride + start
    if PATHS:
        base = tl.load(path_base + r).to(tl.int64) - start
        path = path_slots + r.to(tl.int64) * path_stride - base
    for j in range(0, count, BLOCK):
        offs = j + tl.arange(0, BLOCK)
        mask = offs < count
        if PATHS:
            slot = tl.load(src + offs, mask=mask & (offs < base))
            slot = tl.where(offs < base, slot, tl.load(path + offs, mask=mask & (offs >= base)))
        else:
            slot = tl.load(src + offs, mask=mask)
        dst = dst0 + offs
        tl.store(kv_indices + dst, slot, mask=mask & (dst < capacity))


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


def build_positions_and_slots(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    bufs,
) -> None:
    """qo_indptr, positions, token_req; record out_cache_loc in req_to_token. One launch."""
    bs = req_pool_indices.shape[0]
    if bs == 0:
        bufs.qo_indptr[:1].zero_()
        return
    _positions_and_slots_kernel[(bs,)](
        req_pool_indices, seq_lens, extend_lens, out_cache_loc, req_to_token,
        req_to_token.stride(0), bufs.qo_indptr, bufs.positions, bufs.token_req,
        SCAN_BLOCK=SCAN_BLOCK, BLOCK=COPY_BLOCK, num_warps=1,
    )


def build_kv_index_lists(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    lists,
    paths=None,
) -> None:
    """kv_indptr / kv_indices / kv_start for one layer kind: count+scan, then compact (tree
    rows' positions from `paths.base` on from their paths: `RowPaths`).

    NOTE: the reference raises when the lists overflow kv_indices; this graph-safe version
    cannot read the total back, so it drops entries past the capacity instead. Buffers sized
    by `MetadataBuffers` never overflow for batches within its max_bs / max_num_tokens.
    """
    bs = req_pool_indices.shape[0]
    # the count kernel starts a list at first_position - window + 1; a draft block reaches
    # one position further back (its window is of context positions before the block)
    window = (lists.window or 0) + (1 if lists.noncausal else 0)
    _kv_count_scan_kernel[(1,)](
        seq_lens, extend_lens, lists.kv_indptr, lists.kv_start, bs, window,
        SLIDING=lists.window is not None, SCAN_BLOCK=SCAN_BLOCK, num_warps=4,
    )
    if bs == 0:
        return
    slots, base = (paths.slots, paths.base) if paths is not None else (seq_lens, seq_lens)
    _kv_compact_kernel[(bs,)](
        req_pool_indices, seq_lens, req_to_token, req_to_token.stride(0), lists.kv_indptr,
        lists.kv_start, lists.kv_indices, lists.kv_indices.shape[0], slots,
        slots.stride(0), base, BLOCK=COPY_BLOCK, PATHS=paths is not None, num_warps=4,
    )


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
    """All metadata of one forward, in dependency order (slots before index lists); a draft
    block builds its own lists alone; tree rows read their paths."""
    build_positions_and_slots(req_pool_indices, seq_lens, extend_lens, out_cache_loc,
                              req_to_token, bufs)
    for kind in bufs.kinds(draft_block):
        build_kv_index_lists(req_pool_indices, seq_lens, extend_lens, req_to_token,
                             bufs.lists[kind], paths)


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
