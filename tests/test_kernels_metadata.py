"""Triton metadata builders vs the torch references (interpreter mode on CPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from draftgraph.attention import metadata as ref  # noqa: E402
from draftgraph.kernels import metadata as tri  # noqa: E402
from draftgraph.kernels._triton import compiled_for_cpu_missing  # noqa: E402

if compiled_for_cpu_missing(tri._metadata_kernel):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set "
                "(set it in the environment to run them on CPU)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_BS, MAX_TOKENS, KV_CAP, MAX_CTX = 160, 320, 2048, 96
GARBAGE = -7777


def make_state(window, block=None):
    """`block` (W, block size): the buffers of a block drafter's executor."""
    bufs = {name: ref.MetadataBuffers(MAX_BS, MAX_TOKENS, KV_CAP, window, DEVICE)
            for name in ("ref", "tri")}
    if block:
        for b in bufs.values():
            b.add_block_lists(*block)
    gen = torch.Generator().manual_seed(1)
    # [MAX_BS + 1, MAX_CTX] int64: distinct slot ids so a wrong copy is visible
    r2t = torch.randperm(100_000, generator=gen)[: (MAX_BS + 1) * MAX_CTX]
    r2t = r2t.view(MAX_BS + 1, MAX_CTX).to(DEVICE)
    return bufs, {"ref": r2t.clone(), "tri": r2t.clone()}


def make_batch(seq_lens, extend_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    req_pool_indices = torch.randperm(MAX_BS, generator=gen)[:bs] + 1  # [bs] int64
    num_tokens = sum(extend_lens)
    out_cache_loc = torch.randperm(50_000, generator=gen)[:num_tokens] + 200_000  # [T] int64
    t = lambda x: torch.as_tensor(x, dtype=torch.int64).to(DEVICE)
    return t(req_pool_indices), t(seq_lens), t(extend_lens), t(out_cache_loc)


def poison(bufs):
    for x in bufs.all_tensors():
        x.fill_(GARBAGE)


def assert_same(bufs, r2t, batch, draft_block=False):
    req_pool_indices, seq_lens, extend_lens, out_cache_loc = batch
    bs, nt = req_pool_indices.shape[0], out_cache_loc.shape[0]
    a, b = bufs["ref"], bufs["tri"]
    assert torch.equal(a.qo_indptr[: bs + 1], b.qo_indptr[: bs + 1])
    assert torch.equal(a.positions[:nt], b.positions[:nt])
    assert torch.equal(a.token_req[:nt], b.token_req[:nt])
    assert torch.equal(r2t["ref"], r2t["tri"])
    for kind in a.kinds(draft_block):
        la, lb = a.lists[kind], b.lists[kind]
        total = int(la.kv_indptr[bs])
        assert torch.equal(la.kv_indptr[: bs + 1], lb.kv_indptr[: bs + 1]), kind
        assert torch.equal(la.kv_start[:bs], lb.kv_start[:bs]), kind
        assert torch.equal(la.kv_indices[:total], lb.kv_indices[:total]), kind
        # nothing past the live part is touched
        assert (lb.kv_indices[total:] == GARBAGE).all(), kind


def run_both(bufs, r2t, batch, draft_block=False):
    poison(bufs["ref"])
    poison(bufs["tri"])
    ref.build_metadata(*batch, r2t["ref"], bufs["ref"], draft_block)
    tri.build_metadata(*batch, r2t["tri"], bufs["tri"], draft_block)
    assert_same(bufs, r2t, batch, draft_block)


BATCHES = [
    # (seq_lens, extend_lens): prefill, decode, verify-like, empty rows, one row
    ([7], [7]),
    ([1], [1]),
    ([12, 30, 5], [12, 1, 5]),
    ([9, 0, 17, 4], [3, 0, 5, 0]),  # rows with count 0 (no new tokens / empty request)
    ([40, 41, 42], [1, 1, 1]),
    ([90, 3], [5, 3]),  # row longer than the copy block
]


@pytest.mark.parametrize("window", [None, 4, 33])
def test_triton_metadata_matches_reference_and_keeps_addresses(window):
    bufs, r2t = make_state(window)
    addresses = lambda: ([x.data_ptr() for b in bufs.values() for x in b.all_tensors()]
                         + [r2t["tri"].data_ptr()])
    before = addresses()
    for i, (seq_lens, extend_lens) in enumerate(BATCHES):
        run_both(bufs, r2t, make_batch(seq_lens, extend_lens, seed=i))
    assert addresses() == before


@pytest.mark.parametrize("bs", [127, 128, 129, 150])
def test_triton_metadata_scan_crosses_block_boundary(bs):
    # rows around the scan block size (128); short rows keep the interpreter fast
    gen = torch.Generator().manual_seed(bs)
    extend_lens = torch.randint(0, 3, (bs,), generator=gen)
    seq_lens = extend_lens + torch.randint(0, 4, (bs,), generator=gen)
    bufs, r2t = make_state(3)
    run_both(bufs, r2t, make_batch(seq_lens.tolist(), extend_lens.tolist(), seed=bs))


def test_noop_builder_is_caught():
    # the comparison must fail when the Triton side does nothing
    bufs, r2t = make_state(4)
    batch = make_batch([12, 30, 5], [12, 1, 5])
    poison(bufs["ref"])
    poison(bufs["tri"])
    ref.build_metadata(*batch, r2t["ref"], bufs["ref"])
    with pytest.raises(AssertionError):
        assert_same(bufs, r2t, batch)


def _candidates(bs, width, seed):
    gen = torch.Generator().manual_seed(seed)
    cand = torch.randint(0, 10_000, (bs, width), generator=gen)
    keep = torch.rand(bs, width, generator=gen) < 0.6
    cand[~keep] = -1
    if bs > 1:
        cand[1] = -1  # an empty row
    return cand.to(DEVICE)  # [bs, width] int64


@pytest.mark.parametrize("bs,width", [(1, 5), (4, 200), (130, 7)])
def test_compact_candidates_matches_reference(bs, width):
    cand = _candidates(bs, width, seed=bs * width)
    out = {}
    for name, fn in (("ref", tri.compact_candidates_ref), ("tri", tri.compact_candidates)):
        indptr = torch.full((bs + 3,), GARBAGE, dtype=torch.int64, device=DEVICE)
        indices = torch.full((bs * width + 5,), GARBAGE, dtype=torch.int64, device=DEVICE)
        fn(cand, indptr, indices)
        out[name] = (indptr, indices)
    (pa, ia), (pb, ib) = out["ref"], out["tri"]
    total = int(pa[bs])
    assert total == int((cand >= 0).sum())
    assert torch.equal(pa[: bs + 1], pb[: bs + 1])
    assert torch.equal(ia, ib)  # live part equal, the rest left untouched by both


def test_exclusive_scan_inplace():
    counts = torch.tensor([0, 3, 0, 0, 5, 1], dtype=torch.int64)
    indptr = torch.full((10,), GARBAGE, dtype=torch.int64, device=DEVICE)
    indptr[1:7] = counts.to(DEVICE)
    tri.exclusive_scan_inplace(indptr, 6)
    assert indptr[:7].tolist() == [0, 0, 3, 3, 3, 8, 9]
    assert (indptr[7:] == GARBAGE).all()


# draft blocks (seq_lens = prefix + block size): prefixes shorter than, equal to and longer than
# the window W = 6, and a prefix of 0 (a padded row)
BLOCK_BATCHES = [([5 + 2, 6 + 5, 9 + 5, 0 + 5], 5), ([1 + 8, 80 + 8], 8), ([30 + 2], 2)]


@pytest.mark.parametrize("seq_lens,gamma", BLOCK_BATCHES)
def test_draft_block_lists_hold_the_window_then_the_block(seq_lens, gamma):
    """In-graph block metadata equals the reference, and both are what the block sees: the
    last min(prefix, W) context slots of the request, then its block's own slots."""
    window = 6
    bufs, r2t = make_state(None, (window, gamma))
    batch = make_batch(seq_lens, [gamma] * len(seq_lens), seed=len(seq_lens))
    table = r2t["ref"].clone()
    addresses = [x.data_ptr() for x in bufs["tri"].all_tensors()]
    run_both(bufs, r2t, batch, draft_block=True)
    assert [x.data_ptr() for x in bufs["tri"].all_tensors()] == addresses
    req_pool_indices, _, _, out_cache_loc = batch
    lists = bufs["tri"].lists[ref.BLOCK]
    assert lists.noncausal and lists.window == window
    for r, n in enumerate(seq_lens):
        prefix = n - gamma
        start = max(0, prefix - window)
        row = lists.kv_indices[lists.kv_indptr[r] : lists.kv_indptr[r + 1]].tolist()
        context = table[req_pool_indices[r], start:prefix].tolist()
        block = out_cache_loc[r * gamma : (r + 1) * gamma].tolist()
        assert row == context + block, r
        assert int(lists.kv_start[r]) == start
        assert bufs["tri"].positions[r * gamma : (r + 1) * gamma].tolist() == list(
            range(prefix, n))


def test_a_noop_block_builder_is_caught():
    bufs, r2t = make_state(None, (6, 5))
    batch = make_batch([7, 11, 14], [5, 5, 5])
    poison(bufs["ref"])
    poison(bufs["tri"])
    ref.build_metadata(*batch, r2t["ref"], bufs["ref"], True)
    tri.build_positions_and_slots(*batch, r2t["tri"], bufs["tri"])  # the lists left undone
    with pytest.raises(AssertionError):
        assert_same(bufs, r2t, batch, draft_block=True)


@pytest.mark.parametrize("window", [None, 3])
def test_tree_rows_read_their_own_paths(window):
    """Draft-tree rows (`RowPaths`): each row's list is its request's slots below `base`, then
    its own path's; the Triton twin builds the same. A builder that ignores the paths (reads
    the table's racy entries instead) is caught by the explicit lists."""
    bufs, r2t = make_state(window)
    gen = torch.Generator().manual_seed(3)
    # two requests of 6 and 9 tokens (bases 6 and 9), 1 + 3 tree rows each: the root (depth
    # 0, the last token), two siblings at depth 1, a child of the second at depth 2; plus a
    # dead row (request row 0, position 0) as padded tree rows are
    reqs, bases, depths = [5, 11], [6, 9], [0, 1, 1, 2]
    P = 3
    rows, seq, base, paths, loc = [], [], [], [], []
    for req, n in zip(reqs, bases, strict=True):
        slots = (torch.randperm(1000, generator=gen)[:4] + 300_000).tolist()
        own = [[], [slots[1]], [slots[2]], [slots[2], slots[3]]]
        for i, d in enumerate(depths):
            rows.append(req), seq.append(n + d), base.append(n), loc.append(slots[i])
            paths.append(own[i] + [0] * (P - len(own[i])))
    rows.append(0), seq.append(1), base.append(1), loc.append(0), paths.append([0] * P)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)
    batch = (t(rows), t(seq), torch.ones(len(rows), dtype=torch.int64, device=DEVICE), t(loc))
    tree = ref.RowPaths(t(paths), t(base))
    for name, build in (("ref", ref.build_metadata), ("tri", tri.build_metadata)):
        poison(bufs[name])
        build(*batch, r2t[name], bufs[name], False, tree)
    for kind in bufs["ref"].kinds(False):
        la, lb = bufs["ref"].lists[kind], bufs["tri"].lists[kind]
        total = int(la.kv_indptr[len(rows)])
        assert torch.equal(la.kv_indptr[: len(rows) + 1], lb.kv_indptr[: len(rows) + 1])
        assert torch.equal(la.kv_indices[:total], lb.kv_indices[:total])
        for r in range(len(rows)):
            got = la.kv_indices[la.kv_indptr[r] : la.kv_indptr[r + 1]].tolist()
            pos = seq[r] - 1
            w = la.window
            start = 0 if w is None else max(0, pos - w + 1)
            table = r2t["ref"][rows[r]].tolist()
            want = [table[p] if p < base[r] else paths[r][p - base[r]]
                    for p in range(start, pos + 1)]
            assert got == want, (kind, r)
    # every row's position is the last of its list; the root's slot is recorded in the table
    assert bufs["ref"].positions[: len(rows)].tolist() == [s - 1 for s in seq]
    for req, n, first in zip(reqs, bases, (0, 4), strict=True):
        assert int(r2t["tri"][req, n - 1]) == loc[first]


def test_one_launch_lists_take_new_slots_from_out_cache_loc():
    """The one-launch build reads a request's new slots from out_cache_loc, never back from
    the table (which other programs of the launch may not have written yet): lists built
    against a table with nothing recorded equal the reference's, built after recording."""
    for window in (None, 4):
        bufs, r2t = make_state(window)
        batch = make_batch([12, 30, 5, 9], [12, 1, 5, 3], seed=4)
        poison(bufs["ref"])
        poison(bufs["tri"])
        ref.build_metadata(*batch, r2t["ref"], bufs["ref"])
        req_pool_indices, seq_lens, extend_lens, out_cache_loc = batch
        for kind in bufs["tri"].kinds(False):
            tri.build_kv_index_lists(req_pool_indices, seq_lens, extend_lens, r2t["tri"],
                                     bufs["tri"].lists[kind], out_cache_loc=out_cache_loc)
            la, lb = bufs["ref"].lists[kind], bufs["tri"].lists[kind]
            total = int(la.kv_indptr[4])
            assert torch.equal(la.kv_indptr[:5], lb.kv_indptr[:5]), kind
            assert torch.equal(la.kv_indices[:total], lb.kv_indices[:total]), kind
        # the table itself was not touched: nothing read back from it
        assert not torch.equal(r2t["ref"], r2t["tri"])


def test_tree_lists_wait_for_the_roots_slot():
    """Tree rows read their root's position from the table, written by the root's program:
    with the root last in the batch (the interpreter runs programs in order), the one-launch
    form lists a stale slot and `build_metadata`, which lists tree rows in a launch of their
    own, the root's."""
    bufs, r2t = make_state(None)
    req, n, slots = 7, 6, [300_001, 300_002, 300_003]
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)
    # two depth-1 siblings, then the root (depth 0, the last token at position n - 1)
    batch = (t([req] * 3), t([n + 1, n + 1, n]), t([1, 1, 1]), t(slots))
    tree = ref.RowPaths(t([[slots[0]], [slots[1]], [0]]), t([n] * 3))
    want = r2t["ref"][req, : n - 1].tolist() + [slots[2]]
    tri.build_metadata(*batch, r2t["tri"], bufs["tri"], False, tree)
    lists = bufs["tri"].lists[ref.FULL]
    for r in range(2):
        got = lists.kv_indices[lists.kv_indptr[r] : lists.kv_indptr[r + 1]].tolist()
        assert got == want + [slots[r]], r
    # the one-launch form on a fresh table: the siblings read the root's entry before it lands
    bufs, r2t = make_state(None)
    tri._launch(*batch, r2t["tri"], bufs["tri"], bufs["tri"].lists[ref.FULL], tree)
    lists = bufs["tri"].lists[ref.FULL]
    got = lists.kv_indices[lists.kv_indptr[0] : lists.kv_indptr[1]].tolist()
    assert got != want + [slots[0]]
