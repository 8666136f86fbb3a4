"""PagedAllocator: slots handed out in the free list's pop order (a lone request's slots run
consecutively), all or nothing when the pool runs dry, pages given back whole."""

import random

import pytest
import torch

from draftgraph.runtime.kv_cache import OutOfKVSlots, PagedAllocator


class PopAllocator:
    """The allocator's rule written one page at a time: the reference."""

    def __init__(self, num_slots: int, page_size: int) -> None:
        self.ps = page_size
        self.free = list(range(num_slots // page_size - 1, 0, -1))

    def extend(self, pages: list[int], cur_len: int, n: int) -> list[int]:
        need = max(0, -(-(cur_len + n - len(pages) * self.ps) // self.ps))
        if need > len(self.free):
            raise OutOfKVSlots("")
        for _ in range(need):
            pages.append(self.free.pop())
        return [pages[p // self.ps] * self.ps + p % self.ps for p in range(cur_len, cur_len + n)]


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_matches_page_by_page(page_size):
    rng = random.Random(page_size)
    a, ref = PagedAllocator(400, page_size), PopAllocator(400, page_size)
    owned: dict[int, tuple[list[int], list[int], int]] = {}
    for step in range(300):
        rid = rng.randrange(12)
        pages, ref_pages, length = owned.get(rid, ([], [], 0))
        if rng.random() < 0.2 and pages:  # the request ends: its pages go back
            a.free(pages)
            ref.free.extend(reversed(ref_pages))
            ref_pages.clear()
            owned.pop(rid)
            continue
        n = rng.choice([1, 1, 3, 17, 40])
        try:
            want = ref.extend(ref_pages, length, n)
        except OutOfKVSlots:
            with pytest.raises(OutOfKVSlots):
                a.extend(pages, length, n)
            assert pages == ref_pages  # nothing taken on failure
            continue
        assert a.extend(pages, length, n) == want, step
        assert pages == ref_pages and a._free_pages == ref.free
        owned[rid] = (pages, ref_pages, length + n)


def test_a_lone_request_gets_consecutive_slots():
    a = PagedAllocator(64)
    pages: list[int] = []
    assert a.extend(pages, 0, 5) == [1, 2, 3, 4, 5]
    assert a.extend(pages, 5, 3) == [6, 7, 8]
    a.free(pages)
    again: list[int] = []
    assert a.extend(again, 0, 8) == list(range(1, 9))  # given back in ascending order
    assert a.extend([], 0, 55) == list(range(9, 64))
    with pytest.raises(OutOfKVSlots):
        a.extend([], 0, 1)


def test_a_kv_pool_past_the_memory_is_an_error_naming_the_flag():
    """An allocation the machine cannot make (here ~4 PB) is a ValueError that says to lower
    --kv-cache-tokens, not the allocator's RuntimeError."""
    from draftgraph.attention.kv_pool import KVPool

    with pytest.raises(ValueError, match="no memory for a KV pool of 100000000000 slots .*"
                                         "lower --kv-cache-tokens"):
        KVPool(30, 10**11, 3, 64, torch.float32, "cpu")
