"""KV slots: the request-to-token table and the paged allocator of KV slots (the per-layer
K/V buffers themselves are `attention.kv_pool.KVPool`, one per model).

`req_to_token[row, pos]` is the KV slot holding position `pos` of the request in `row`.
Row 0 and page 0 (slots 0 .. page_size-1) are reserved: padded batch rows point at them, so
padding never writes a live request's KV.
"""

from __future__ import annotations

import torch


class OutOfKVSlots(RuntimeError):
    """The pool has too few free slots for this step; the scheduler retries later."""


class ReqToTokenPool:
    """Rows of the request-to-token table, one per live request."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str) -> None:
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        # [max_reqs + 1, max_context_len] int64; row 0 is the dummy request
        self.req_to_token = torch.zeros(max_reqs + 1, max_context_len, dtype=torch.int64,
                                        device=device)
        self._free_rows = list(range(max_reqs, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise OutOfKVSlots("no free request slot (raise --max-num-seqs)")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        assert 0 < row <= self.max_reqs and row not in self._free_rows, row
        self._free_rows.append(row)


class PagedAllocator:
    """Free-list allocator of KV slots in pages of `page_size` consecutive slots.

    A request owns whole pages; its positions fill them in order, so position p of a request
    lives in page `pages[p // page_size]` at offset `p % page_size`. With a prefix cache
    (`runtime/prefix_cache.py`, `cache`) the pages it keeps count as free: when the free list
    runs short, its unused blocks are evicted first.
    """

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        if self.num_pages < 2:
            raise ValueError(f"KV pool of {num_slots} slots is too small for page size {page_size}")
        # page 0 is reserved for the dummy slot
        try:
            self._free_pages = list(range(self.num_pages - 1, 0, -1))
        except MemoryError:
            raise ValueError(f"no memory for a KV pool of {num_slots} slots (--kv-cache-tokens "
                             "plus a page): lower --kv-cache-tokens") from None
        self.cache = None  # a PrefixCache whose unused blocks are evicted when pages run short

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def usable_slots(self) -> int:
        return (self.num_pages - 1) * self.page_size

    @property
    def num_free_slots(self) -> int:
        cached = self.cache.num_evictable_pages if self.cache is not None else 0
        return (len(self._free_pages) + cached) * self.page_size

    def extend(self, pages: list[int], cur_len: int, n: int) -> list[int]:
        """Slots for positions cur_len .. cur_len+n-1; new pages are appended to `pages`."""
        # NOTE: inline, with a page-size-1 path: this runs for every request of every step
        ps = self.page_size
        need_pages = max(0, -(-(cur_len + n - len(pages) * ps) // ps))
        if need_pages > len(self._free_pages) and self.cache is not None:
            self.cache.evict(need_pages - len(self._free_pages))
        if need_pages > len(self._free_pages):
            raise OutOfKVSlots(
                f"need {need_pages * ps} KV slots, "
                f"{self.num_free_slots} free (raise --kv-cache-tokens)"
            )
        if need_pages:  # the pages pop() would give, in that order, in one slice
            free = self._free_pages
            pages.extend(free[:-need_pages - 1:-1])
            del free[-need_pages:]
        if ps == 1:  # a page is a slot
            return pages[cur_len : cur_len + n]
        return [pages[p // ps] * ps + p % ps for p in range(cur_len, cur_len + n)]

    def truncate(self, pages: list[int], new_len: int) -> None:
        """Give back pages wholly past new_len (rejected speculative tokens)."""
        keep = -(-new_len // self.page_size)
        while len(pages) > keep:
            self._free_pages.append(pages.pop())

    def free(self, pages: list[int]) -> None:
        # reversed: the list pops from its end, so the next request gets these pages in
        # ascending order again (consecutive slots: a CPU attention reads them as a slice)
        self._free_pages.extend(reversed(pages))
        pages.clear()
