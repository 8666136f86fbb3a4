"""Attention over the KV pool through CSR index lists (kv_indptr / kv_indices / kv_start).

Visibility is the same as `TorchBackend`: key j of request r sits at position
kpos = kv_start[r] + j and is visible to a query at position qpos iff kpos <= qpos and, for a
sliding window W, qpos - kpos < W. A query row that sees no key gets zeros.

Both kernels are GQA-aware: a program owns one KV head and all the query heads of its group,
so each K/V tile is read once per KV head. Grids come from static sizes only (batch size,
number of query tokens), loops from runtime lengths, so both are CUDA-graph capturable.

- `decode_attention`: one query per row, split-KV (flash-decoding), one launch. A row is a
  request (decode, a draft chain step) or a query token of a multi-token request (verify:
  its part of the request's list, the keys a decode row at its position would own, so a
  verify row is computed exactly as that decode row). Grid
  (rows, num_kv_heads, num_splits): each program writes its partial (acc / sum, log2-sum-exp)
  into caller-owned scratch, then bumps a per-(row, KV head) counter; the last of the
  num_splits programs to arrive combines all partials and writes the output, then resets the
  counter to 0 for the next launch (graph replay). This saves a second (reduce) launch and
  its gap in the graph: 1.4-1.8 us + 0.5-0.7 us per layer on an H200 at batch 1, against
  3-7 us for the split kernel. No program waits on another, so any order or concurrency of
  the programs is correct. num_splits == 1 writes the output directly (no scratch, no counter).
- `extend_attention`: variable query lengths (qo_indptr): prefill, chunked prefill, a draft
  block.
  A tile holds TOKENS_PER_TILE query tokens x GROUP heads as its rows. Grid
  (cdiv(T, TOKENS_PER_TILE) + bs, num_kv_heads) bounds the number of tiles; each program finds
  its (request, tile) from qo_indptr and exits when it has none. The KV loop is clipped to the
  keys the tile can see (causal end, window start).

Softmax runs in base 2 with fp32 statistics and accumulation.
"""

import math
from typing import NamedTuple

import torch

from draftgraph.kernels._triton import cdiv, next_pow2, pdl_kwargs, pdl_wait, tl, triton

_LOG2E = 1.4426950408889634
# running-max start inside kernels is -1.0e30: finite, so exp2(m_old - m_new) never sees
# inf - inf (Triton kernels cannot read plain module globals)


@triton.jit
def _online_softmax(qk, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    # one tile's step of the online softmax: scores qk (log2 units, masked -inf) and values v
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_tile(
    q_tile, qpos, row_mask, m_i, l_i, acc,
    k_cache, v_cache, kv_indices_row, kv_start, kv_hi_mask_len, n0,
    hkv, stride_ks, stride_kh, stride_vs, stride_vh, sm_scale_log2, window,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr, NONCAUSAL: tl.constexpr,
):
    # One online-softmax step over keys n0 .. n0 + BLOCK_N of a row's list (< kv_hi_mask_len).
    # NONCAUSAL (a draft block): every listed key is visible to every row.
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = offs_n < kv_hi_mask_len
    d_mask = offs_d < HEAD_DIM
    slot = tl.load(kv_indices_row + offs_n, mask=n_mask, other=0).to(tl.int64)
    k = tl.load(k_cache + slot[None, :] * stride_ks + hkv * stride_kh + offs_d[:, None],
                mask=n_mask[None, :] & d_mask[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    # V is gathered right after K, before the q.k dot, so both loads are in flight together
    # (a load is issued where it appears and waited for at first use). Where Triton pipelines
    # the loop (num_stages=2 on sm_90) it already prefetches both with cp.async; this order
    # keeps one round trip per tile where it does not.
    v = tl.load(v_cache + slot[:, None] * stride_vs + hkv * stride_vh + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    qk = tl.dot(q_tile, k, input_precision=DOT_PRECISION) * sm_scale_log2  # [rows, BLOCK_N]
    kpos = kv_start + offs_n
    if NONCAUSAL:
        visible = n_mask[None, :] & row_mask[:, None]
    else:
        visible = n_mask[None, :] & (kpos[None, :] <= qpos[:, None]) & row_mask[:, None]
    if SLIDING:
        visible = visible & (qpos[:, None] - kpos[None, :] < window)
    qk = tl.where(visible, qk, float("-inf"))
    return _online_softmax(qk, v, m_i, l_i, acc, DOT_PRECISION)


@triton.jit
def _attend_full_tile(
    q_tile, m_i, l_i, acc, k_cache, v_cache, kv_indices_row, n0, hkv,
    stride_ks, stride_kh, stride_vs, stride_vh, sm_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # `_attend_tile` over keys n0 .. n0 + BLOCK_N that every row sees: no key or row masks
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    slot = tl.load(kv_indices_row + offs_n).to(tl.int64)
    k = tl.load(k_cache + slot[None, :] * stride_ks + hkv * stride_kh + offs_d[:, None],
                mask=d_mask[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    v = tl.load(v_cache + slot[:, None] * stride_vs + hkv * stride_vh + offs_d[None, :],
                mask=d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    qk = tl.dot(q_tile, k, input_precision=DOT_PRECISION) * sm_scale_log2
    return _online_softmax(qk, v, m_i, l_i, acc, DOT_PRECISION)


@triton.jit
def _combine_splits(
    mid_o, mid_lse, o, r, hkv, live,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Output of the GROUP query heads of KV head hkv from the partials of splits 0 .. live - 1:
    # weights exp2(lse - max lse); a split that saw no key has lse = -inf and weight 0, a head
    # that saw no key at all gets zeros. CHUNK splits at a time, in order, each chunk's weights
    # rescaled to the running max (as an online softmax); with one chunk (MAX_SPLITS <= CHUNK)
    # that is exactly one weighted sum. A given `live` always adds the same values in the
    # same order, so the output depends only on the row's own splits (batch invariance).
    # Loads are .cg (L2, not L1): other programs wrote these.
    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    head = hkv * GROUP + offs_g
    m = tl.zeros([BLOCK_G], dtype=tl.float32) + -1.0e30
    total = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for c0 in tl.static_range(0, MAX_SPLITS, CHUNK):
        if c0 < live:
            s_mask = (c0 + offs_c) < live
            lse = tl.load(mid_lse + r * stride_ml_b + head[:, None] * stride_ml_h + c0
                          + offs_c[None, :], mask=g_mask[:, None] & s_mask[None, :],
                          other=float("-inf"), cache_modifier=".cg")  # [BLOCK_G, CHUNK]
            # issued together with the lse load: every live split wrote its partial in this
            # launch (zeros when it saw no key), and its weight is 0 then
            part = tl.load(mid_o + r * stride_mo_b + head[:, None, None] * stride_mo_h
                           + (c0 + offs_c)[None, :, None] * stride_mo_s + offs_d[None, None, :],
                           mask=g_mask[:, None, None] & s_mask[None, :, None]
                           & d_mask[None, None, :], other=0.0,
                           cache_modifier=".cg")  # [BLOCK_G, CHUNK, BLOCK_D]
            seen = lse > float("-inf")
            m_new = tl.maximum(m, tl.max(tl.where(seen, lse, -1.0e30), axis=1))
            alpha = tl.exp2(m - m_new)
            w = tl.where(seen, tl.exp2(lse - m_new[:, None]), 0.0)
            total = total * alpha + tl.sum(w, axis=1)
            acc = acc * alpha[:, None] + tl.sum(part * w[:, :, None], axis=1)
            m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(o + r * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(o.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _attend_split(
    q_tile, qpos, h_mask, k_cache, v_cache, kv_indices_row, kv_first, lo, hi, hkv,
    stride_ks, stride_kh, stride_vs, stride_vh, sm_scale_log2, window,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # keys lo .. hi of a row's list in BLOCK_N tiles: (normalised output, log2-sum-exp)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) + -1.0e30
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q_tile, qpos, h_mask, m_i, l_i, acc, k_cache, v_cache, kv_indices_row, kv_first,
            hi, n0, hkv, stride_ks, stride_kh, stride_vs, stride_vh, sm_scale_log2, window,
            HEAD_DIM, BLOCK_N, BLOCK_D, SLIDING, DOT_PRECISION, False,
        )
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _decode_split_kernel(
    q, k_cache, v_cache, o, kv_indptr, kv_indices, kv_start, positions, mid_o, mid_lse,
    kv_counters, token_req, qo_indptr, num_reqs, sm_scale_log2, window,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MIN_TILES: tl.constexpr, TOKEN_ROWS: tl.constexpr, SPLIT_LEN: tl.constexpr,
    MAX_SPLITS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)  # every program, before its first load (the keys, the lists)
    # TOKEN_ROWS: a program row is a query token of a multi-token request (verify), which
    # attends over the part of its request's list that a decode row at its position would
    # own (the same list, splits and tiles: the decode row's arithmetic).
    # SPLIT_LEN == 0: NUM_SPLITS splits per row, of a length that follows the row's keys.
    # SPLIT_LEN > 0 (batch-invariant plan): splits of SPLIT_LEN keys, as many as the row needs
    # (<= MAX_SPLITS), program `split` taking splits split, split + NUM_SPLITS, ...: a row's
    # splits then depend on its own length only, never on the batch's program count.
    r = tl.program_id(0).to(tl.int64)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    if TOKEN_ROWS:
        if r >= tl.load(qo_indptr + num_reqs):
            # padding past the live tokens: a zero output, never the buffer's old bytes (a
            # NaN there would flow into the dead token's K / V, stored in the dummy slot that
            # padded rows attend to)
            if split == 0:
                pad_h = hkv * GROUP + tl.arange(0, BLOCK_H)
                pad_d = tl.arange(0, BLOCK_D)
                tl.store(o + r * stride_ot + pad_h[:, None] * stride_oh + pad_d[None, :],
                         tl.zeros([BLOCK_H, BLOCK_D], dtype=o.dtype.element_ty),
                         mask=(tl.arange(0, BLOCK_H) < GROUP)[:, None]
                         & (pad_d < HEAD_DIM)[None, :])
            return
        req = tl.load(token_req + r)
    else:
        req = r
    row0 = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - row0
    kv_first = tl.load(kv_start + req)
    if TOKEN_ROWS:
        pos = tl.load(positions + r)
        first = kv_first
        if SLIDING:
            first = tl.maximum(kv_first, pos - window + 1)
        row0 += first - kv_first
        kv_len = tl.minimum(kv_len - (first - kv_first), pos + 1 - first)
        kv_first = first

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    head = hkv * GROUP + offs_h
    q_tile = tl.load(q + r * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                     mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    q_tile = q_tile.to(k_cache.dtype.element_ty)  # [BLOCK_H, BLOCK_D]
    qpos = tl.zeros([BLOCK_H], dtype=tl.int64) + tl.load(positions + r)
    mask = h_mask[:, None] & d_mask[None, :]
    mo_row = mid_o + r * stride_mo_b + head[:, None] * stride_mo_h + offs_d[None, :]
    ml_row = mid_lse + r * stride_ml_b + head * stride_ml_h

    if SPLIT_LEN == 0:
        # each split takes a BLOCK_N-aligned chunk of at least MIN_TILES tiles; short rows
        # leave the later splits empty (they only report an empty partial)
        split_len = (kv_len + NUM_SPLITS * BLOCK_N - 1) // (NUM_SPLITS * BLOCK_N) * BLOCK_N
        split_len = tl.maximum(split_len, MIN_TILES * BLOCK_N)
        lo = split * split_len
        out, lse = _attend_split(
            q_tile, qpos, h_mask, k_cache, v_cache, kv_indices + row0, kv_first, lo,
            tl.minimum(kv_len, lo + split_len), hkv, stride_ks, stride_kh, stride_vs, stride_vh,
            sm_scale_log2, window, HEAD_DIM, BLOCK_H, BLOCK_N, BLOCK_D, SLIDING, DOT_PRECISION,
        )
        if NUM_SPLITS == 1:
            tl.store(o + r * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(o.dtype.element_ty), mask=mask)
            return
        tl.store(mo_row + split * stride_mo_s, out, mask=mask)
        tl.store(ml_row + split, lse, mask=h_mask)
        live = NUM_SPLITS
    else:
        live = tl.cdiv(kv_len, SPLIT_LEN)
        for s in range(split, live, NUM_SPLITS):
            out, lse = _attend_split(
                q_tile, qpos, h_mask, k_cache, v_cache, kv_indices + row0, kv_first,
                s * SPLIT_LEN, tl.minimum(kv_len, (s + 1) * SPLIT_LEN), hkv, stride_ks,
                stride_kh, stride_vs, stride_vh, sm_scale_log2, window, HEAD_DIM, BLOCK_H,
                BLOCK_N, BLOCK_D, SLIDING, DOT_PRECISION,
            )
            tl.store(mo_row + s * stride_mo_s, out, mask=mask)
            tl.store(ml_row + s, lse, mask=h_mask)
    # NOTE: the last of the NUM_SPLITS programs of (r, hkv) to arrive combines. The CTA
    # barrier orders every thread's partial stores before the one (scalar, one-thread)
    # atomic, whose release at gpu scope publishes them; the last program's acquire on the
    # same counter, broadcast to its threads through a barrier, makes every split's stores
    # visible to its loads. It resets the counter with a plain store: the other programs
    # have all counted already, and the next launch starts after this one ends.
    tl.debug_barrier()
    counter = kv_counters + r * tl.num_programs(1) + hkv
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == NUM_SPLITS - 1:
        _combine_splits(
            mid_o, mid_lse, o, r, hkv, live, stride_mo_b, stride_mo_h, stride_mo_s,
            stride_ml_b, stride_ml_h, stride_ot, stride_oh,
            GROUP, HEAD_DIM, MAX_SPLITS, CHUNK, BLOCK_G, BLOCK_D,
        )
        tl.store(counter, 0)


@triton.jit(do_not_specialize=["bs", "max_tiles", "split_tiles"])
def _extend_kernel(
    q, k_cache, v_cache, o, qo_indptr, kv_indptr, kv_indices, kv_start, positions, bs,
    sm_scale_log2, window, mid_o, mid_lse, counters, max_tiles, split_tiles,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SCAN_BLOCK: tl.constexpr, SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NONCAUSAL: tl.constexpr, NUM_SPLITS: tl.constexpr, UNMASKED_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # every program, before its first load (the request table)
    pid = tl.program_id(0)
    hkv = tl.program_id(1)
    # split-KV: programs max_tiles .. are the splits 1 .. NUM_SPLITS - 1 of the first
    # split_tiles tiles (program t < max_tiles is tile t's split 0, or the whole tile)
    split = pid * 0
    if NUM_SPLITS > 1:
        if pid >= max_tiles:
            split = 1 + (pid - max_tiles) // split_tiles
            pid = (pid - max_tiles) % split_tiles
    # find this program's (request, tile): tiles are numbered request after request
    zero = tl.sum(tl.zeros([1], dtype=tl.int64), axis=0)
    tiles_before = zero
    r = zero
    tile = zero
    found = zero
    for b in range(0, bs, SCAN_BLOCK):
        offs = b + tl.arange(0, SCAN_BLOCK)
        mask = offs < bs
        q_lo = tl.load(qo_indptr + offs, mask=mask, other=0)
        q_hi = tl.load(qo_indptr + offs + 1, mask=mask, other=0)
        num_tiles = (q_hi - q_lo + TOKENS_PER_TILE - 1) // TOKENS_PER_TILE
        incl = tl.cumsum(num_tiles, axis=0) + tiles_before
        excl = incl - num_tiles
        hit = mask & (excl <= pid) & (pid < incl)
        r += tl.sum(tl.where(hit, offs, 0), axis=0)
        tile += tl.sum(tl.where(hit, pid - excl, 0), axis=0)
        found += tl.sum(hit.to(tl.int64), axis=0)
        tiles_before += tl.sum(num_tiles, axis=0)
    if found == 0:
        return

    q_start = tl.load(qo_indptr + r)
    q_len = tl.load(qo_indptr + r + 1) - q_start
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tile * TOKENS_PER_TILE + offs_m // GROUP  # token within the request
    head = hkv * GROUP + offs_m % GROUP
    row_mask = (offs_m < TOKENS_PER_TILE * GROUP) & (tok < q_len)
    d_mask = offs_d < HEAD_DIM
    t = q_start + tok
    q_tile = tl.load(q + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                     mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_tile = q_tile.to(k_cache.dtype.element_ty)  # [BLOCK_M, BLOCK_D]
    qpos = tl.load(positions + t, mask=row_mask, other=0)

    row0 = tl.load(kv_indptr + r)
    kv_len = tl.load(kv_indptr + r + 1) - row0
    kv_first = tl.load(kv_start + r)
    # keys this tile can see: up to its last query position; for a window, from its first;
    # a draft block sees its whole list
    if NONCAUSAL:
        hi = kv_len
    else:
        hi = tl.minimum(kv_len, tl.max(tl.where(row_mask, qpos, -1), axis=0) - kv_first + 1)
    if SLIDING:
        min_qpos = tl.min(tl.where(row_mask, qpos, 1 << 62), axis=0)
        lo = tl.maximum(min_qpos - window + 1 - kv_first, 0) // BLOCK_N * BLOCK_N
    else:
        lo = zero

    o_rows = o + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    o_mask = row_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS > 1:
        if pid < split_tiles:
            # split-KV (causal only): program `split` of the tile takes the split-th of
            # NUM_SPLITS BLOCK_N-aligned chunks of the tile's keys lo .. hi (the longest loop
            # NUM_SPLITS times shorter), its partial goes to scratch, and the last of the
            # tile's programs to arrive combines them (the decode kernel's protocol, below)
            per = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), NUM_SPLITS) * BLOCK_N
            s_lo = lo + split * per
            part, lse = _attend_split(
                q_tile, qpos, row_mask, k_cache, v_cache, kv_indices + row0, kv_first, s_lo,
                tl.minimum(hi, s_lo + per), hkv, stride_ks, stride_kh, stride_vs, stride_vh,
                sm_scale_log2, window, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, SLIDING,
                DOT_PRECISION,
            )
            tile_slot = pid * tl.num_programs(1) + hkv  # this (tile, KV head)
            first_split = tile_slot * NUM_SPLITS
            tl.store(mid_o + ((first_split + split) * BLOCK_M + offs_m[:, None]) * BLOCK_D
                     + offs_d[None, :], part)
            tl.store(mid_lse + (first_split + split) * BLOCK_M + offs_m, lse)
            # NOTE: as in `_decode_split_kernel`: the barrier orders the CTA's partial stores
            # before its one gpu-scope release; the last arrival's acquire makes every
            # split's stores visible to its loads (.cg: from L2); it resets the counter for
            # the next launch with a plain store (everyone has counted)
            tl.debug_barrier()
            counter = counters + tile_slot
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:
                m = tl.zeros([BLOCK_M], dtype=tl.float32) + -1.0e30
                total = tl.zeros([BLOCK_M], dtype=tl.float32)
                acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                for sp in tl.static_range(NUM_SPLITS):
                    lse_s = tl.load(mid_lse + (first_split + sp) * BLOCK_M + offs_m,
                                    cache_modifier=".cg")
                    part_s = tl.load(mid_o + ((first_split + sp) * BLOCK_M + offs_m[:, None])
                                     * BLOCK_D + offs_d[None, :], cache_modifier=".cg")
                    seen = lse_s > float("-inf")
                    m_new = tl.maximum(m, tl.where(seen, lse_s, -1.0e30))
                    alpha = tl.exp2(m - m_new)
                    w = tl.where(seen, tl.exp2(lse_s - m_new), 0.0)
                    total = total * alpha + w
                    acc = acc * alpha[:, None] + part_s * w[:, None]
                    m = m_new
                out = acc / tl.where(total > 0, total, 1.0)[:, None]
                tl.store(o_rows, out.to(o.dtype.element_ty), mask=o_mask)
                tl.store(counter, 0)
            return
    # the whole tile in this program (unsplit, or a tile past the split ones)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + -1.0e30
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    masked_lo = lo
    if UNMASKED_FIRST:
        if not SLIDING:
            # key tiles every row of the tile sees (below its first query position, or the
            # whole list for a draft block) need no mask: the same values as through the
            # mask (a `where` whose condition is all true), fewer operations a tile
            if NONCAUSAL:
                full = hi
            else:
                full = tl.min(tl.where(row_mask, qpos, 1 << 62), axis=0) - kv_first + 1
            masked_lo = tl.maximum(tl.minimum(full, hi), 0) // BLOCK_N * BLOCK_N
            for n0 in range(lo, masked_lo, BLOCK_N):
                m_i, l_i, acc = _attend_full_tile(
                    q_tile, m_i, l_i, acc, k_cache, v_cache, kv_indices + row0, n0, hkv,
                    stride_ks, stride_kh, stride_vs, stride_vh, sm_scale_log2, HEAD_DIM,
                    BLOCK_N, BLOCK_D, DOT_PRECISION,
                )
    for n0 in range(masked_lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q_tile, qpos, row_mask, m_i, l_i, acc, k_cache, v_cache, kv_indices + row0,
            kv_first, hi, n0, hkv, stride_ks, stride_kh, stride_vs, stride_vh, sm_scale_log2,
            window, HEAD_DIM, BLOCK_N, BLOCK_D, SLIDING, DOT_PRECISION, NONCAUSAL,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_rows, out.to(o.dtype.element_ty), mask=o_mask)


# ---- host wrappers -----------------------------------------------------------------------


def _check(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int]:
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads for {num_kv_heads} KV heads")
    assert q.stride(2) == 1 and k_cache.stride(2) == 1, "attention needs a contiguous head_dim"
    return num_q_heads, num_kv_heads, head_dim


def _precision(dtype: torch.dtype) -> str:
    # fp32 models stay exact (no TF32 rounding of q.k and p.v)
    return "ieee" if dtype == torch.float32 else "tf32"


class DecodeConfig(NamedTuple):
    block_n: int = 64  # keys per tile
    min_tiles: int = 1  # fewest tiles per split: short rows use fewer splits
    num_warps: int = 4
    num_stages: int = 2
    # keys per split: 0 = a row's keys over num_splits splits (the split follows the batch
    # size's plan); > 0 = fixed, a row taking as many splits as its keys need (batch-invariant)
    split_len: int = 0


def decode_num_splits(bs: int, num_kv_heads: int, max_splits: int = 32,
                      target_programs: int = 256) -> int:
    """Splits per row for decode: enough programs to fill the GPU at small batch. A power of
    two <= max_splits; fixed by shapes only, so a captured graph keeps its launch config."""
    want = max(1, target_programs // max(1, bs * num_kv_heads))
    return min(next_pow2(want), 1 << (max(1, max_splits).bit_length() - 1))


# (group, head_dim, batch bucket) -> (num_splits, config): measured on an H200 by
# `python benchmarks/bench_attention.py` (benchmarks/results/attn_tune_h200.json; us per layer
# at 512 / 4096 keys, bf16, the untuned plan's in brackets). Other keys take the heuristic below,
# which agrees with these picks except for num_stages.
DECODE_TUNED: dict[tuple[int, int, int], tuple[int, DecodeConfig]] = {
    (3, 64, 1): (32, DecodeConfig(32, 1, 4, 2)),  # SmolLM2-135M: 4.11 / 8.57 (4.38 / 13.76)
    (4, 128, 1): (32, DecodeConfig(32, 1, 4, 2)),  # Llama-3.1-8B: 5.54 / 13.08 (7.25 / 20.04)
    # attn_tune_llama-3.1-8b_bs4_bs8_h200.json; bucket 8 also plans 5-8 verify rows of one request
    (4, 128, 4): (4, DecodeConfig(128, 1, 4, 2)),  # 7.29 / 28.18 (8.56 / 46.54)
    (4, 128, 8): (4, DecodeConfig(128, 1, 4, 2)),  # 9.71 / 38.71 (13.39 / 82.17)
    (4, 64, 8): (4, DecodeConfig(128, 1, 4, 2)),  # Llama-3.2-1B: 7.46 / 25.79 (9.32 / 54.59)
    (4, 64, 32): (1, DecodeConfig(128, 1, 4, 3)),  # 13.89 / 75.85 (27.05 / 201.57)
    (4, 64, 64): (1, DecodeConfig(128, 1, 4, 2)),  # 21.47 / 125.83 (32.51 / 221.97)
}


def decode_plan(bs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                max_splits: int) -> tuple[int, DecodeConfig]:
    """(num_splits, config) of a decode batch: the tuned entry, else enough programs to fill
    the GPU with short tiles when a row has many splits and long ones when it has few."""
    cap = 1 << (max(1, max_splits).bit_length() - 1)
    key = (num_q_heads // num_kv_heads, head_dim, min(next_pow2(max(bs, 1)), 64))
    if key in DECODE_TUNED:
        splits, cfg = DECODE_TUNED[key]
        return min(splits, cap), cfg
    splits = decode_num_splits(bs, num_kv_heads, max_splits)
    return splits, DecodeConfig(block_n=32 if splits >= 16 else 64 if splits > 4 else 128)


# The batch-invariant plan (`--deterministic`): one tile size and one split length for every
# batch size, so a row's arithmetic depends on its own keys only. The split length is the
# engine's longest list over INVARIANT_MAX_SPLITS, in whole tiles; the batch size still picks
# how many programs share a row's splits (scheduling only).
INVARIANT_BLOCK_N = 64
INVARIANT_MAX_SPLITS = 32


def invariant_split_len(max_len: int, max_splits: int = INVARIANT_MAX_SPLITS,
                        block_n: int = INVARIANT_BLOCK_N) -> int:
    """Keys per split such that max_splits splits cover max_len keys, in whole tiles."""
    return block_n * max(1, cdiv(cdiv(max_len, max_splits), block_n))


def invariant_decode_plan(bs: int, num_kv_heads: int, max_len: int,
                          max_splits: int = INVARIANT_MAX_SPLITS) -> tuple[int, DecodeConfig]:
    """(programs per row, config) of the batch-invariant plan for a batch of bs rows whose
    lists hold at most max_len keys: scratch of max_splits splits per row."""
    split_len = invariant_split_len(max_len, max_splits)
    programs = min(decode_num_splits(bs, num_kv_heads, max_splits),
                   next_pow2(cdiv(max_len, split_len)))
    return programs, DecodeConfig(INVARIANT_BLOCK_N, 1, 4, 2, split_len)


def decode_scratch_rows(max_bs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                        max_splits: int, rows_per_request: int = 1,
                        max_rows: int | None = None) -> int:
    """The most (row, split) partials any decode batch of <= max_bs requests needs, each of up
    to `rows_per_request` query rows (verify) and at most `max_rows` rows in all, whether its
    plan is its requests' (exact rows) or its rows'."""
    def rows(bs: int) -> int:
        return min(bs * rows_per_request, max_rows or bs * rows_per_request)

    def splits(n: int) -> int:
        return decode_plan(n, num_q_heads, num_kv_heads, head_dim, max_splits)[0]

    return max(max(rows(bs) * splits(bs) for bs in range(1, max_bs + 1)),
               max(r * splits(r) for r in range(1, rows(max_bs) + 1)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_start: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    scale: float,
    out: torch.Tensor,
    *,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    kv_counters: torch.Tensor | None = None,
    num_splits: int = 1,
    config: DecodeConfig | None = None,
    token_rows: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """One query per row: a request (q, out [bs, Hq, D]; positions [bs], the query positions).
    `config` sets the tile (keys per step), the fewest tiles a split takes, warps and stages.

    token_rows = (token_req, qo_indptr, num_reqs): the rows are the query tokens of
    multi-token requests (q, out [T, Hq, D], positions [T]; the lists are per request, as for
    `extend_attention`), each computed exactly as a decode row at its position would be: over
    its request's keys up to its position (within its window), in the same splits and tiles.
    Rows at or past qo_indptr[num_reqs] are padding and left unwritten.

    With num_splits > 1 (a power of two), mid_o [>= bs, Hq, >= num_splits, D] fp32,
    mid_lse [>= bs, Hq, >= num_splits] fp32 and kv_counters [>= bs * Hkv] int32 are
    caller-owned scratch. kv_counters must be all zero before the first call; every call
    leaves it all zero again.

    With config.split_len > 0 (the batch-invariant plan) a row's keys go in splits of that
    length, num_splits programs sharing them; the scratch (needed then at any num_splits) has
    a slot per split, mid_o [>= bs, Hq, S, D] and mid_lse [>= bs, Hq, S] with S * split_len
    >= the longest list."""
    bs = q.shape[0]
    num_q_heads, num_kv_heads, head_dim = _check(q, k_cache)
    if bs == 0:
        return out
    group = num_q_heads // num_kv_heads
    cfg = config or DecodeConfig()
    assert num_splits == next_pow2(num_splits), "num_splits must be a power of two"
    if num_splits > 1 or cfg.split_len:
        assert mid_o is not None and mid_lse is not None and kv_counters is not None, (
            "split-KV decode (num_splits > 1) needs scratch: mid_o, mid_lse and kv_counters"
        )
        assert kv_counters.dtype == torch.int32 and kv_counters.numel() >= bs * num_kv_heads, (
            f"kv_counters must be int32 with >= {bs} x {num_kv_heads} entries, got "
            f"{kv_counters.dtype} with {kv_counters.numel()}"
        )
        mo_strides, ml_strides = mid_o.stride()[:3], mid_lse.stride()[:2]
        max_splits = mid_o.shape[2] if cfg.split_len else num_splits
    else:
        max_splits = 1
        mid_o, mid_lse, kv_counters = out, out, out  # unused
        mo_strides, ml_strides = (0, 0, 0), (0, 0)
    _decode_split_kernel[(bs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, kv_indptr, kv_indices, kv_start, positions, mid_o, mid_lse,
        kv_counters, *(token_rows or (positions, positions, 0)), scale * _LOG2E, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        *mo_strides, *ml_strides,
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_H=max(16, next_pow2(group)), BLOCK_G=next_pow2(group), BLOCK_N=cfg.block_n,
        BLOCK_D=next_pow2(head_dim), SLIDING=window is not None,
        DOT_PRECISION=_precision(q.dtype), MIN_TILES=cfg.min_tiles,
        TOKEN_ROWS=token_rows is not None, SPLIT_LEN=cfg.split_len, MAX_SPLITS=max_splits,
        CHUNK=min(next_pow2(max_splits), 32), **pdl_kwargs(q),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_start: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    scale: float,
    out: torch.Tensor,
    bs: int,
    block_m: int = 64,
    block_n: int | None = None,
    noncausal: bool = False,
    num_warps: int = 4,
    num_stages: int | None = None,
    num_splits: int = 1,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    unmasked_first: bool | None = None,
) -> torch.Tensor:
    """Variable-length queries, causal by position (`noncausal`: a draft block, every row sees
    its request's whole list; window None). q, out [T, Hq, D]; positions [T]; qo_indptr
    [bs + 1]; the KV lists already hold the new tokens' slots. num_splits > 1 (causal
    only): each tile's keys in that many programs, combined by the last to finish, through
    caller-owned fp32 scratch `mid_o` / `mid_lse` and int32 `counters`, zero between
    launches (`extend_scratch` sizes them; `extend_num_splits` picks the count).
    unmasked_first (default EXTEND_UNMASKED_FIRST): a tile's key tiles that all its rows see
    run without masks. block_n and num_stages default to the tuned plan (`extend_block_n`,
    EXTEND_NUM_STAGES)."""
    if unmasked_first is None:
        unmasked_first = EXTEND_UNMASKED_FIRST
    num_tokens = q.shape[0]
    num_q_heads, num_kv_heads, head_dim = _check(q, k_cache)
    block_n = block_n or extend_block_n(head_dim)
    num_stages = num_stages or EXTEND_NUM_STAGES
    if num_tokens == 0 or bs == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_m = max(block_m, next_pow2(group))
    tokens_per_tile = block_m // group
    max_tiles = cdiv(num_tokens, tokens_per_tile) + bs
    if noncausal:
        num_splits = 1
    split_tiles = 0
    if num_splits > 1:
        split_tiles = _split_tiles(num_tokens, bs, tokens_per_tile)
        partials = split_tiles * num_kv_heads * num_splits
        if (mid_o is None or mid_lse is None or counters is None
                or mid_o.numel() < partials * block_m * next_pow2(head_dim)
                or mid_lse.numel() < partials * block_m
                or counters.numel() < split_tiles * num_kv_heads):
            raise ValueError(f"extend attention in {num_splits} splits needs scratch for "
                             f"{partials} partials of {block_m} rows (extend_scratch)")
    else:
        mid_o = mid_lse = counters = out  # never read
    # programs: every tile's first (or only) split, then the other splits of the first
    # split_tiles tiles (where a step's tiles are: requests' tiles come first, and a step
    # padded for a graph has few requests with tokens)
    _extend_kernel[(max_tiles + (num_splits - 1) * split_tiles, num_kv_heads)](
        q, k_cache, v_cache, out, qo_indptr, kv_indptr, kv_indices, kv_start, positions, bs,
        scale * _LOG2E, window or 0, mid_o, mid_lse, counters, max_tiles, split_tiles,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, TOKENS_PER_TILE=tokens_per_tile,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(head_dim), SCAN_BLOCK=128,
        SLIDING=window is not None and not noncausal, DOT_PRECISION=_precision(q.dtype),
        NONCAUSAL=noncausal, NUM_SPLITS=num_splits, UNMASKED_FIRST=unmasked_first,
        num_warps=num_warps,
        num_stages=num_stages, **pdl_kwargs(q),
    )
    return out


# A tile's key tiles below its first query position (all of them for a draft block) skip
# the causal / length masks: the FlashAttention loop's split into full and diagonal tiles.
# The same arithmetic as the masked loop's (equal bit for bit in the interpreter), but the
# GPU compiles the two loops apart, so a row's rounding may follow where its tile starts:
# never under the batch-invariant plan. The tiles: 3 stages of cp.async prefetch, 128 keys
# a tile for heads of <= 64 dims (64 above). H100, bf16, us a layer (stop 56,
# benchmarks/results/extend_stop56/extend_sweep_h100.json; masked, 64 keys, 2 stages before):
# SmolLM2 (9 / 3 x 64) 512 tokens 15.9 -> 11.0, 4096 168.5 -> 103.8, two 512-token prompts
# beside 64 decode rows 32.3 -> 26.5; Llama-3.1-8B (32 / 8 x 128) 31.9 -> 21.2,
# 904 -> 489, 153 -> 98. The unmasked loop alone gave -13 % at 4096 tokens, nothing at 512.
EXTEND_UNMASKED_FIRST = True
EXTEND_NUM_STAGES = 3


def extend_block_n(head_dim: int) -> int:
    """Keys per tile of the extend kernel: 128 for small heads, 64 for 128-dim heads (whose
    128-key tiles, 3 stages deep, ran 19 % slower at 4096 tokens)."""
    return 128 if head_dim <= 64 else 64


# Split-KV extend (`extend_attention(num_splits=)`): a prefill's kernel time is its longest
# key loop, ~2 us a 64-key tile on an H200 whatever the tile count (a 512-token prompt of
# SmolLM2: 78 programs, the last looping over 8 tiles, 16 us a layer, 36 % of the prefill's
# GPU time; benchmarks/results/prefill_graphs_smollm2-135m_h200.json). Splitting every tile's
# keys over more programs, up to EXTEND_TARGET_PROGRAMS in all, shortens that loop while the
# grid is small. EXTEND_MAX_SPLITS = 1 turns it off, the default: on the H100 (stop 56,
# benchmarks/results/extend_stop56/extend_sweep_h100.json, 64-key tiles, 2 stages) 2 splits
# took 15.9 -> 14.5 us at 512 tokens and every other case got slower, while the tuned tiles
# above (3 stages) took 11.0 unsplit; splits on those tiles are unmeasured (the sweep's split
# arms now take them). The batch-invariant mode never splits (a row's arithmetic would follow
# the step's token count).
EXTEND_MAX_SPLITS = 1
EXTEND_TARGET_PROGRAMS = 512
# tiles split beyond the step's tokens' own: requests whose last tile is partial (a step's
# live requests come first in its tile order; the rest of its rows, padding, have none)
EXTEND_SPLIT_SLACK = 4


def _split_tiles(num_tokens: int, bs: int, tokens_per_tile: int) -> int:
    """The first tiles that a split plan splits (the others run whole: correct, unsplit)."""
    return cdiv(num_tokens, tokens_per_tile) + min(bs, EXTEND_SPLIT_SLACK)


def extend_num_splits(num_tokens: int, bs: int, num_q_heads: int, num_kv_heads: int,
                      block_m: int = 64, max_splits: int | None = None,
                      target: int = EXTEND_TARGET_PROGRAMS) -> int:
    """Programs per tile for an extend step of `num_tokens` tokens in `bs` requests: enough
    to bring its split tiles' programs up to `target`, at most max_splits
    (EXTEND_MAX_SPLITS)."""
    max_splits = EXTEND_MAX_SPLITS if max_splits is None else max_splits
    group = num_q_heads // num_kv_heads
    tiles = _split_tiles(num_tokens, bs, max(block_m, next_pow2(group)) // group)
    return max(1, min(max_splits, target // (tiles * num_kv_heads)))


def extend_scratch(head_dim: int, device, block_m: int = 64,
                   target: int = EXTEND_TARGET_PROGRAMS) -> dict:
    """Scratch for every split plan `extend_num_splits` gives under `target` (its partials
    never outnumber the target): mid_o, mid_lse fp32 and zeroed int32 counters."""
    return dict(mid_o=torch.empty(target * block_m * next_pow2(head_dim), dtype=torch.float32,
                                  device=device),
                mid_lse=torch.empty(target * block_m, dtype=torch.float32, device=device),
                counters=torch.zeros(target, dtype=torch.int32, device=device))


def attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_start: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    scale: float,
    noncausal: bool = False,
) -> torch.Tensor:
    """Torch twin of both kernels (decode: qo_indptr = arange(bs + 1)), per request in fp32.
    Rows that see no key are zero; `noncausal`: every row sees its request's whole list."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[1]
    qo, kvp, starts = qo_indptr.tolist(), kv_indptr.tolist(), kv_start.tolist()
    for r in range(len(qo) - 1):
        q0, q1 = qo[r], qo[r + 1]
        if q1 == q0:
            continue
        idx = kv_indices[kvp[r] : kvp[r + 1]]
        kr = k_cache[idx].float().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, S, D]
        vr = v_cache[idx].float().repeat_interleave(group, 1).transpose(0, 1)
        qr = q[q0:q1].float().transpose(0, 1)  # [Hq, L, D]
        qpos = positions[q0:q1, None]
        kpos = starts[r] + torch.arange(idx.shape[0], device=q.device)[None, :]
        visible = (kpos <= qpos) | noncausal
        if window is not None and not noncausal:
            visible &= qpos - kpos < window
        scores = (qr @ kr.transpose(1, 2)) * scale
        scores = scores.masked_fill(~visible, -math.inf)
        probs = torch.softmax(scores, -1).nan_to_num(0.0)  # all-masked rows -> 0
        out[q0:q1] = (probs @ vr).transpose(0, 1).to(q.dtype)
    return out
