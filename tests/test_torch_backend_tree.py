"""TorchBackend's tree rows (decode rows with key paths of their own, `RowPaths`): without
exact rows a request's run of tree rows attends in one SDPA call over the keys below its
base and every row's path, each row masked to its own list; the outputs equal one call per
row over its own list (the exact-rows path), full and sliding-window layers."""

from __future__ import annotations

import pytest
import torch

from draftgraph.attention.backend import ForwardBatch, Phase, TorchBackend
from draftgraph.attention.kv_pool import KVPool
from draftgraph.attention.metadata import MetadataBuffers, RowPaths

HQ, HKV, D = 6, 2, 16


def _tree_forward(window):
    """Two requests (bases 9 and 6) of four tree rows each (the root at depth 0, two siblings
    at depth 1, a child of the second at depth 2), then a dead row, over a pool of random
    keys; a table whose slots do not run consecutively."""
    g = torch.Generator().manual_seed(5)
    pool = KVPool(1, 400, HKV, D, torch.float32, "cpu")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g))
    r2t = torch.randperm(300, generator=g)[:4 * 40].view(4, 40) + 50
    meta = MetadataBuffers(16, 16, 1024, window, "cpu")
    rows, seq, base, paths, loc = [], [], [], [], []
    for req, n in ((1, 9), (3, 6)):
        s = (torch.randperm(40, generator=g)[:4] + 360).tolist()
        own = [[], [s[1]], [s[2]], [s[2], s[3]]]
        for i, d in enumerate((0, 1, 1, 2)):
            rows.append(req), seq.append(n + d), base.append(n), loc.append(s[i])
            paths.append(own[i] + [0] * (3 - len(own[i])))
    rows.append(0), seq.append(1), base.append(1), loc.append(0), paths.append([0] * 3)
    t = lambda x: torch.tensor(x, dtype=torch.int64)
    fb = ForwardBatch(Phase.DECODE, t(loc) * 0, t(rows), t(seq), torch.ones(9, dtype=torch.int64),
                      t(loc), meta, paths=RowPaths(t(paths), t(base)))
    backend = TorchBackend(pool, r2t, window, D ** -0.5)
    q = torch.randn(9, HQ, D, generator=g)
    k = torch.randn(9, HKV, D, generator=g)
    v = torch.randn(9, HKV, D, generator=g)
    return backend, fb, q, k, v


@pytest.mark.parametrize("window", [None, 3])
def test_a_requests_tree_rows_in_one_call_equal_one_call_a_row(window):
    backend, fb, q, k, v = _tree_forward(window)
    backend.build_metadata(fb)
    kind = "sliding" if window else "full"
    assert sorted(backend._trees[kind]) == [0, 4]  # two runs of four rows; the dead row alone
    grouped = backend.forward(q, k, v, 0, window is not None, fb)
    backend.exact_rows = True  # each row its own call over its own list
    backend.build_metadata(fb)
    assert backend._trees == {}
    per_row = backend.forward(q, k, v, 0, window is not None, fb)
    torch.testing.assert_close(grouped, per_row, rtol=1e-5, atol=1e-6)
    # the control: a run whose rows all see each other's paths is not each row's list
    backend.exact_rows = False
    backend.build_metadata(fb)
    for r, (e, idx, mask) in backend._trees[kind].items():
        backend._trees[kind][r] = (e, idx, mask | (mask.sum(0, keepdim=True) > 0))
    leaky = backend.forward(q, k, v, 0, window is not None, fb)
    assert not torch.allclose(leaky, per_row, rtol=1e-5, atol=1e-6)
