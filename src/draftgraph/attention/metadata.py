"""Attention metadata from raw inputs: the reference (plain torch) builders.

Raw inputs of one forward (all int64, on the model's device):
  req_pool_indices [bs]          row of `req_to_token` owned by each request
  seq_lens         [bs]          KV length of each request *after* this forward
  extend_lens      [bs]          new tokens of each request in this forward (decode: 1)
  out_cache_loc    [num_tokens]  KV slot each new token is written to

Derived, written into caller-owned buffers (`MetadataBuffers`):
  qo_indptr  [bs + 1]            CSR offsets of each request's query tokens
  positions  [num_tokens]        absolute position of each new token
  token_req  [num_tokens]        batch row of each new token
  req_to_token[req, pos] = out_cache_loc   (the KV write slots, recorded in the table)
  per layer kind (full, sliding window W, draft block with context window W):
    kv_indptr  [bs + 1]          counts written into kv_indptr[1:], scanned in place
    kv_indices [capacity]        KV slots of the visible context, request after request
    kv_start   [bs]              position of each request's first listed KV slot

A sliding layer with window W lets a query at position p see positions p - W + 1 .. p, so a
request's list starts at max(0, first_query_position - W + 1); the attention kernel masks the
rest per query row. A draft block (phase DRAFT_BLOCK: its extend_lens tokens at the end of the
sequence) sees the last W context positions before it and the whole block, non-causally: its
list starts at max(0, first_block_position - W) and ends with the block's own slots, and every
query row of the block sees all of it (`noncausal`). Entries past a buffer's live part are left
as they are and never read (a builder never sweeps the whole capacity).

Tree rows (`RowPaths`, a draft tree's nodes): decode-shaped rows (extend_lens 1), each with a
list of its own. Row r's positions below `base[r]` are its request's (`req_to_token`), the
positions base[r] .. seq_lens[r] - 1 are its path's slots `path[r, :]` (its ancestors', then
its own), so siblings at one position each see their own branch and no mask is needed. A
tree row's `req_to_token` write (its position, its slot) is left to race with its siblings':
positions from `base` on are read from the paths, never from the table, and the step that
accepts a path rewrites them.

The Triton twins in `draftgraph.kernels.metadata` must produce exactly these values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

FULL = "full"
SLIDING = "sliding"
BLOCK = "block"  # a draft block's window of context + the block itself (DRAFT_BLOCK only)


@dataclass
class RowPaths:
    """Per-row key paths of tree rows (see the module docstring)."""

    slots: torch.Tensor  # [R, P] int64: slots of positions base .. base + P - 1 of row r
    base: torch.Tensor  # [R] int64: the first position read from `slots`


@dataclass
class KVIndexLists:
    """CSR list of visible KV slots for one layer kind."""

    kv_indptr: torch.Tensor  # [max_bs + 1] int64
    kv_indices: torch.Tensor  # [capacity] int64, -1 where empty
    kv_start: torch.Tensor  # [max_bs] int64
    window: int | None  # None for full attention
    noncausal: bool = False  # a draft block: every query row sees every listed key

    def first_visible(self, seq_lens: torch.Tensor, extend_lens: torch.Tensor) -> torch.Tensor:
        """Position of each request's first listed key [bs]."""
        if self.window is None:
            return torch.zeros_like(seq_lens)
        reach = self.window if self.noncausal else self.window - 1
        return (seq_lens - extend_lens - reach).clamp_min(0)


class MetadataBuffers:
    """Persistent metadata buffers sized for the largest batch they will ever describe.

    NOTE: the tensors are allocated once and only written in place afterwards, so CUDA graphs
    may capture their addresses.
    """

    def __init__(
        self,
        max_bs: int,
        max_num_tokens: int,
        kv_capacity: int,
        sliding_window: int | None,
        device: torch.device | str = "cpu",
    ) -> None:
        dev = torch.device(device)
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.kv_capacity = kv_capacity
        self.qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
        self.token_req = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
        self.lists: dict[str, KVIndexLists] = {FULL: self._lists(dev, kv_capacity, None)}
        if sliding_window:
            cap = min(kv_capacity, max_bs * (sliding_window + max_num_tokens))
            self.lists[SLIDING] = self._lists(dev, cap, sliding_window)

    def _lists(self, dev: torch.device, capacity: int, window: int | None) -> KVIndexLists:
        return KVIndexLists(
            kv_indptr=torch.zeros(self.max_bs + 1, dtype=torch.int64, device=dev),
            kv_indices=torch.full((capacity,), -1, dtype=torch.int64, device=dev),
            kv_start=torch.zeros(self.max_bs, dtype=torch.int64, device=dev),
            window=window,
        )

    def add_block_lists(self, window: int, block_size: int) -> None:
        """The lists of phase DRAFT_BLOCK (a drafter's executor, before any capture)."""
        cap = self.max_bs * (window + block_size)
        self.lists[BLOCK] = dataclasses.replace(
            self._lists(self.qo_indptr.device, cap, window), noncausal=True)

    def kinds(self, draft_block: bool) -> list[str]:
        """The layer kinds a forward builds lists for: the block's alone in DRAFT_BLOCK."""
        if draft_block:
            return [BLOCK]
        return [kind for kind in self.lists if kind != BLOCK]

    def all_tensors(self) -> list[torch.Tensor]:
        out = [self.qo_indptr, self.positions, self.token_req]
        for lists in self.lists.values():
            out += [lists.kv_indptr, lists.kv_indices, lists.kv_start]
        return out


def build_positions_and_slots(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    bufs: MetadataBuffers,
) -> None:
    """qo_indptr, positions, token_req; record out_cache_loc in req_to_token.

    Tokens past sum(extend_lens) are dead (a static-shape verify step packs fewer live tokens
    than its capacity): they get a valid position and row, and write no `req_to_token` entry.
    """
    bs = req_pool_indices.shape[0]
    num_tokens = out_cache_loc.shape[0]
    bufs.qo_indptr[0] = 0
    torch.cumsum(extend_lens, 0, out=bufs.qo_indptr[1 : bs + 1])
    t = torch.arange(num_tokens, device=seq_lens.device)
    token_req = torch.searchsorted(bufs.qo_indptr[1 : bs + 1], t, right=True).clamp_max(bs - 1)
    live = t < bufs.qo_indptr[bs]
    positions = (seq_lens - extend_lens)[token_req] + t - bufs.qo_indptr[token_req]
    positions = torch.where(live, positions, 0)
    bufs.token_req[:num_tokens] = token_req
    bufs.positions[:num_tokens] = positions
    req_to_token[req_pool_indices[token_req[live]], positions[live]] = out_cache_loc[live]


def build_kv_index_lists(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    lists: KVIndexLists,
    paths: RowPaths | None = None,
) -> None:
    """kv_indptr / kv_indices / kv_start for one layer kind (full or sliding window); tree
    rows' positions from `paths.base` on from their paths."""
    bs = req_pool_indices.shape[0]
    start = lists.first_visible(seq_lens, extend_lens)
    counts = seq_lens - start
    lists.kv_start[:bs] = start
    lists.kv_indptr[0] = 0
    torch.cumsum(counts, 0, out=lists.kv_indptr[1 : bs + 1])
    total = int(lists.kv_indptr[bs])
    if total > lists.kv_indices.shape[0]:
        raise RuntimeError(
            f"kv_indices capacity {lists.kv_indices.shape[0]} < {total} visible KV entries"
        )
    row = torch.repeat_interleave(torch.arange(bs, device=seq_lens.device), counts,
                                  output_size=total)
    col = torch.arange(total, device=seq_lens.device) - lists.kv_indptr[row] + start[row]
    if paths is None:
        lists.kv_indices[:total] = req_to_token[req_pool_indices[row], col]
        return
    base = paths.base[row]
    from_table = col < base
    table = req_to_token[req_pool_indices[row], torch.where(from_table, col, 0)]
    on_path = (col - base).clamp(0, paths.slots.shape[1] - 1)
    lists.kv_indices[:total] = torch.where(from_table, table, paths.slots[row, on_path])


def run_starts(kv_indices: torch.Tensor, kv_indptr: torch.Tensor) -> torch.Tensor:
    """[bs] int64: for each request's list (kv_indptr [bs + 1]), its first slot where its
    slots run consecutively (s, s + 1, ...: the keys are a slice of the pool), else -1 (and
    -1 for an empty list)."""
    lo, hi = kv_indptr[:-1], kv_indptr[1:]
    total = int(kv_indptr[-1])
    if total == 0:
        return torch.full_like(lo, -1)
    ind = kv_indices[:total]
    breaks = (ind[1:] != ind[:-1] + 1).to(torch.int64)  # [total - 1]
    before = torch.cat([breaks.new_zeros(1), breaks.cumsum(0)])  # [total]: breaks up to i
    first = lo.clamp(max=total - 1)
    last = torch.maximum(hi - 1, lo).clamp(max=total - 1)
    return torch.where((hi > lo) & (before[last] == before[first]), ind[first], -1)


def build_metadata(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    bufs: MetadataBuffers,
    draft_block: bool = False,
    paths: RowPaths | None = None,
) -> None:
    """All metadata of one forward, in dependency order (slots before index lists); a draft
    block builds its own lists alone; tree rows read their paths."""
    build_positions_and_slots(req_pool_indices, seq_lens, extend_lens, out_cache_loc,
                              req_to_token, bufs)
    for kind in bufs.kinds(draft_block):
        build_kv_index_lists(req_pool_indices, seq_lens, extend_lens, req_to_token,
                             bufs.lists[kind], paths)
