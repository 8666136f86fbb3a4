"""Attention backends: build metadata from raw inputs and run attention over the KV pool.

A backend declares what it can do, and callers read these, never guess:
  in_graph_metadata  its metadata builders are graph-capturable (no host sync, no allocation),
                     so a CUDA graph replay derives metadata itself from the raw inputs;
  draft_step_update  `advance_metadata` moves decode-shaped metadata to the next draft step in
                     place, inside a graph; without it the base class rebuilds the metadata
                     eagerly (logged once, naming the backend);
  fused_kv_store     `attend` reads K/V that a fused projection kernel already stored;
  kernels            phase -> the kernel it runs; `kernel_for` raises on any other phase, so a
                     new phase never silently takes a default kernel.
A step body rebuilds metadata eagerly between its captured parts for a backend without
`in_graph_metadata` and logs that once.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from draftgraph.attention.kv_pool import KVPool
from draftgraph.attention.metadata import (
    BLOCK,
    FULL,
    SLIDING,
    KVIndexLists,
    MetadataBuffers,
    RowPaths,
    build_metadata,
    run_starts,
)

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    EXTEND = "extend"  # prefill / chunked prefill
    DECODE = "decode"
    VERIFY = "verify"
    DRAFT_CHAIN = "draft_chain"
    DRAFT_BLOCK = "draft_block"


@dataclass
class ForwardBatch:
    """The raw inputs of one forward plus the metadata buffers derived from them."""

    phase: Phase
    input_ids: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64, KV length after this forward
    extend_lens: torch.Tensor  # [bs] int64, new tokens per request
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    meta: MetadataBuffers
    # tree rows (a draft tree's nodes as decode rows): each row's own key path
    paths: RowPaths | None = None
    # what every layer of this forward may share (kernels.ops.rope_tables), built once
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def bs(self) -> int:
        return self.req_pool_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.meta.positions[: self.num_tokens]

    def lists(self, sliding: bool) -> KVIndexLists:
        """The KV lists a layer attends over: a draft block's own in DRAFT_BLOCK."""
        if self.phase is Phase.DRAFT_BLOCK:
            return self.meta.lists[BLOCK]
        return self.meta.lists[SLIDING if sliding else FULL]


class AttentionBackend:
    name = "base"
    in_graph_metadata = False
    draft_step_update = False
    fused_kv_store = False  # `attend` reads K/V a fused projection kernel already stored
    kernels: dict[Phase, str] = {}
    # verify rows computed exactly as the decode row at each position (the Triton backend's
    # verify rows always are; TorchBackend then attends row by row)
    exact_rows = False
    _logged_rebuild = False

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, sliding_window: int | None,
                 scale: float) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.sliding_window = sliding_window
        self.scale = scale

    def build_metadata(self, fb: ForwardBatch) -> None:
        raise NotImplementedError

    def kernel_for(self, phase: Phase) -> str:
        """The kernel this backend runs for `phase`; raises for a phase it does not handle."""
        kernel = self.kernels.get(phase)
        if kernel is None:
            raise NotImplementedError(
                f"attention backend {self.name!r} has no kernel for phase {phase.value} "
                f"(it handles {', '.join(p.value for p in self.kernels)})")
        return kernel

    def advance_metadata(self, fb: ForwardBatch) -> None:
        """`fb`'s raw inputs have moved one draft step on (seq_lens + 1, the next slots):
        bring its metadata along. Without `draft_step_update` this is the eager fallback, a
        full rebuild, logged once per backend."""
        if not self._logged_rebuild:
            logger.info("attention backend %r has no in-place draft-step update: draft "
                        "metadata is rebuilt eagerly per step", self.name)
            self._logged_rebuild = True
        self.build_metadata(fb)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                sliding: bool, fb: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                 fb: ForwardBatch) -> None:
        """Only write the new tokens' K/V [T, Hkv, D] at fb.out_cache_loc (a drafter's KV
        catch-up reads no attention output from its last layer). The pool is a cache, never
        part of an autograd graph: values are detached (a write in grad mode would otherwise
        tie the pool's one tensor, every layer's K and V, to the writer's graph)."""
        k_cache = self.kv_pool.k_buffers[layer_id]
        v_cache = self.kv_pool.v_buffers[layer_id]
        k_cache[fb.out_cache_loc] = k.detach().to(k_cache.dtype)
        v_cache[fb.out_cache_loc] = v.detach().to(v_cache.dtype)


def _keys(k_cache: torch.Tensor, v_cache: torch.Tensor, idx: torch.Tensor, run: int, lo: int,
          hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V [S, Hkv, D] of a request's list entries lo .. hi - 1 (slots idx): slices of
    the pool where its slots run consecutively from slot `run` (no gather: a decode row's
    attention 2-3x faster on the CPU), else gathered."""
    if run >= 0:
        return k_cache[run + lo : run + hi], v_cache[run + lo : run + hi]
    return k_cache[idx[lo:hi]], v_cache[idx[lo:hi]]


class TorchBackend(AttentionBackend):
    """Reference backend: torch metadata builders and per-request SDPA. Eager only. With
    `exact_rows`, a verify chunk attends one row at a time over the keys the decode row at
    that position owns (the decode row's own SDPA call), not under one causal mask; without,
    a request's tree rows (`RowPaths`: decode rows with lists of their own) attend in one
    call over their shared prefix and all their paths, each row masked to its own list."""

    name = "torch"
    kernels = {Phase.EXTEND: "sdpa", Phase.DECODE: "sdpa", Phase.VERIFY: "sdpa",
               Phase.DRAFT_CHAIN: "sdpa", Phase.DRAFT_BLOCK: "sdpa"}

    def build_metadata(self, fb: ForwardBatch) -> None:
        build_metadata(fb.req_pool_indices, fb.seq_lens, fb.extend_lens, fb.out_cache_loc,
                       self.req_to_token, fb.meta, fb.phase is Phase.DRAFT_BLOCK, fb.paths)
        # NOTE: the per-request loop needs the offsets on the host: read them once here,
        # for every layer of this forward (this backend is eager-only)
        bs = fb.bs
        self._offsets = {"qo": fb.meta.qo_indptr[: bs + 1].tolist()}
        self._positions = fb.positions.tolist() if self.exact_rows else None
        self._trees = {}
        for kind in fb.meta.kinds(fb.phase is Phase.DRAFT_BLOCK):
            lists = fb.meta.lists[kind]
            indptr = lists.kv_indptr[: bs + 1]
            self._offsets[kind] = (indptr.tolist(), lists.kv_start[:bs].tolist(),
                                   run_starts(lists.kv_indices, indptr).tolist())
            if fb.paths is not None and not self.exact_rows:
                self._trees[kind] = self._tree_groups(fb, lists, *self._offsets[kind][:2])

    def _tree_groups(self, fb: ForwardBatch, lists: KVIndexLists, indptr: list[int],
                     start: list[int]) -> dict[int, tuple]:
        """Runs of two or more tree rows of one request (the same request row and path base,
        so the same keys below the base): {first row: (end row, the keys' slots [S], mask
        [R, S])}, the keys the run's lowest-starting list below the base, then every row's
        path entries; a row sees the shared keys within its window and its own entries."""
        bs = fb.bs
        reqs, base = fb.req_pool_indices.tolist(), fb.paths.base[:bs].tolist()
        pos = [n - 1 for n in fb.seq_lens.tolist()]  # a tree row's position: its last key's
        dev, ind, groups, r = fb.seq_lens.device, lists.kv_indices, {}, 0
        while r < bs:
            e = r + 1
            while e < bs and reqs[e] == reqs[r] and base[e] == base[r]:
                e += 1
            if e - r > 1:
                b, lo = base[r], min(start[r:e])
                j = start.index(lo, r, e)
                shared = max(0, b - lo)
                parts = [ind[indptr[j] : indptr[j] + shared]]
                kpos, own = list(range(lo, lo + shared)), [-1] * shared
                for i in range(r, e):
                    t0 = indptr[i] + max(0, b - start[i])
                    parts.append(ind[t0 : indptr[i + 1]])
                    n = indptr[i + 1] - t0
                    kpos += range(pos[i] - n + 1, pos[i] + 1)
                    own += [i] * n
                kp = torch.tensor(kpos, device=dev)[None, :]
                qp = torch.tensor(pos[r:e], device=dev)[:, None]
                ow = torch.tensor(own, device=dev)[None, :]
                rows = torch.arange(r, e, device=dev)[:, None]
                mask = (kp <= qp) & ((ow < 0) | (ow == rows))
                if lists.window is not None:
                    mask &= qp - kp < lists.window
                groups[r] = (e, torch.cat(parts), mask)
            r = e
        return groups

    def forward(self, q, k, v, layer_id, sliding, fb):
        self.kernel_for(fb.phase)
        k_cache = self.kv_pool.k_buffers[layer_id]
        v_cache = self.kv_pool.v_buffers[layer_id]
        self.store_kv(k, v, layer_id, fb)
        lists = fb.lists(sliding)
        qo = self._offsets["qo"]
        kv_indptr, kv_start, run = self._offsets[BLOCK if lists.noncausal else
                                                 SLIDING if sliding else FULL]
        out = torch.zeros_like(q)  # dead packed tokens (past the live ones) read zeros
        by_row = self.exact_rows and fb.phase is Phase.VERIFY
        trees = self._trees.get(BLOCK if lists.noncausal else SLIDING if sliding else FULL, {})
        done = 0  # rows below it were attended with their tree run
        for r in range(fb.bs):
            if r < done:
                continue
            if r in trees:  # a run of tree rows (decode rows: row i is token i), one call
                done, idx, mask = trees[r]
                qr = q[r:done].transpose(0, 1)[None]  # [1, Hq, R, D]
                kr = k_cache[idx].transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, S, D]
                vr = v_cache[idx].transpose(0, 1)[None].to(q.dtype)
                o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask,
                                                   scale=self.scale, enable_gqa=True)
                out[r:done] = o[0].transpose(0, 1)
                continue
            q0, q1 = qo[r], qo[r + 1]
            if q1 == q0:
                continue
            idx = lists.kv_indices[kv_indptr[r] : kv_indptr[r + 1]]
            if not by_row:
                kv = _keys(k_cache, v_cache, idx, run[r], 0, idx.shape[0])
                out[q0:q1] = self._sdpa(q[q0:q1], *kv, kv_start[r], q0, lists, fb)
                continue
            for t in range(q0, q1):  # each row over the keys its decode row would own
                pos = self._positions[t]
                first = kv_start[r] if lists.window is None else max(
                    kv_start[r], pos - lists.window + 1)
                kv = _keys(k_cache, v_cache, idx, run[r], first - kv_start[r],
                           pos + 1 - kv_start[r])
                out[t : t + 1] = self._sdpa(q[t : t + 1], *kv, first, t, lists, fb)
        return out

    def _sdpa(self, q, k, v, kv_start: int, q0: int, lists, fb: ForwardBatch) -> torch.Tensor:
        """Attention of the query rows q [L, Hq, D] (tokens q0.. of the batch) over the keys
        k / v [S, Hkv, D], the first at position kv_start."""
        n, s = q.shape[0], k.shape[0]
        # NOTE: 4-D [1, H, L, D] inputs take SDPA's fused CPU kernel (3-D ones its math path:
        # 4-6x slower for a prefill chunk, 5x for a decode row on 2 cores). Its rounding of a
        # row depends on the chunk around it, so exact rows attend a verify row alone: the
        # same call, on the same keys, as the decode row at its position
        kr = k.transpose(0, 1)[None]  # [1, Hkv, S, D]
        vr = v.transpose(0, 1)[None]
        qr = q.transpose(0, 1)[None]  # [1, Hq, L, D]
        mask, causal = None, False  # a draft block sees its whole list
        if not lists.noncausal and lists.window is None and n == s > 1:
            causal = True  # the request's first chunk: its positions are the list's
        elif not lists.noncausal and (n > 1 or lists.window is not None):
            qpos = fb.positions[q0 : q0 + n, None]
            kpos = kv_start + torch.arange(s, device=q.device)[None, :]
            mask = kpos <= qpos
            if lists.window is not None:
                mask &= qpos - kpos < lists.window
        o = F.scaled_dot_product_attention(qr, kr.to(q.dtype), vr.to(q.dtype), attn_mask=mask,
                                           is_causal=causal, scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1)
