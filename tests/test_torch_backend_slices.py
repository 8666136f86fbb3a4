"""TorchBackend reads a request's keys as a slice of the pool where its slots run consecutively
(no gather), and gets the gathered result's bits; the allocator hands freed slots out in
ascending order again, so a lone request's slots do run."""

import pytest
import torch

from draftgraph.attention.backend import ForwardBatch, Phase, TorchBackend
from draftgraph.attention.kv_pool import KVPool
from draftgraph.attention.metadata import FULL, SLIDING, MetadataBuffers, run_starts
from draftgraph.runtime.kv_cache import PagedAllocator

HQ, HKV, D, S = 4, 2, 16, 40


def test_run_starts():
    ind = torch.tensor([5, 6, 7, 9, 8, 3, 10, 11, -1, -1])
    assert run_starts(ind, torch.tensor([0, 3, 5, 6, 6, 8])).tolist() == [5, -1, 3, -1, 10]
    assert run_starts(ind, torch.tensor([0, 0])).tolist() == [-1]


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("exact_rows", [False, True])
def test_slices_give_the_gathered_bits(window, exact_rows):
    """Request 0 owns slots 10 .. 10 + S - 1, request 1 the same K/V at shuffled slots; a
    verify of 3 rows each (the last of them written now) attends to the same bits."""
    g = torch.Generator().manual_seed(0)
    pool = KVPool(1, 256, HKV, D, torch.float32, "cpu")
    r2t = torch.zeros(3, 64, dtype=torch.int64)
    run = torch.arange(10, 10 + S)
    shuffled = 100 + torch.randperm(S, generator=g)
    r2t[1, :S], r2t[2, :S] = run, shuffled
    k_old = torch.randn(S, HKV, D, generator=g)
    v_old = torch.randn(S, HKV, D, generator=g)
    for slots in (run, shuffled):  # every position but the 3 the verify writes
        pool.k_buffers[0][slots[: S - 3]] = k_old[: S - 3]
        pool.v_buffers[0][slots[: S - 3]] = v_old[: S - 3]
    backend = TorchBackend(pool, r2t, window, D ** -0.5)
    backend.exact_rows = exact_rows
    bufs = MetadataBuffers(2, 8, 128, window)
    loc = torch.cat([run[S - 3 :], shuffled[S - 3 :]])
    fb = ForwardBatch(Phase.VERIFY, torch.zeros(6, dtype=torch.int64), torch.tensor([1, 2]),
                      torch.tensor([S, S]), torch.tensor([3, 3]), loc, bufs)
    backend.build_metadata(fb)
    kind = SLIDING if window else FULL
    lo = S - 3 - window + 1 if window else 0  # the first key the verify rows see
    assert backend._offsets[kind][2] == [10 + lo, -1]  # request 0's keys are a slice
    q = torch.randn(3, HQ, D, generator=g).repeat(2, 1, 1)
    k_new, v_new = k_old[S - 3 :].repeat(2, 1, 1), v_old[S - 3 :].repeat(2, 1, 1)
    out = backend.forward(q, k_new, v_new, 0, window is not None, fb)
    assert torch.equal(out[:3], out[3:])
    last = S - window if window else 0  # the keys the last row (position S - 1) sees
    ref = torch.nn.functional.scaled_dot_product_attention(  # that row, by hand
        q[2][:, None], *(t[last:].repeat_interleave(HQ // HKV, 1).transpose(0, 1)
                         for t in (k_old, v_old)), scale=D ** -0.5)
    torch.testing.assert_close(out[2], ref[:, 0], rtol=1e-5, atol=1e-5)


def test_freed_slots_come_back_ascending():
    a = PagedAllocator(64)
    first, second, third = [], [], []
    assert a.extend(first, 0, 5) == [1, 2, 3, 4, 5]
    assert a.extend(second, 0, 3) == [6, 7, 8]
    a.free(first)
    assert a.extend(third, 0, 4) == [1, 2, 3, 4]
    assert a.extend(third, 4, 2) == [5, 9]
