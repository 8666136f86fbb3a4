"""Decode (split-KV) and extend attention kernels vs the per-request torch twin."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from draftgraph.attention.metadata import MetadataBuffers, build_metadata  # noqa: E402
from draftgraph.kernels import attention as attn  # noqa: E402
from draftgraph.kernels._triton import compiled_for_cpu_missing  # noqa: E402

if compiled_for_cpu_missing(attn._extend_kernel):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set "
                "(set it in the environment to run them on CPU)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HQ, HKV, D = 6, 2, 64  # GQA group of 3
NUM_SLOTS = 1024
SCALE = D**-0.5
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def setup(seq_lens, extend_lens, window, dtype, seed=0):
    """KV cache with random contents and the reference metadata of one batch."""
    gen = torch.Generator().manual_seed(seed)
    bs, num_tokens = len(seq_lens), sum(extend_lens)
    k_cache = torch.randn(NUM_SLOTS, HKV, D, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(NUM_SLOTS, HKV, D, generator=gen).to(DEVICE, dtype)
    req_to_token = torch.randperm(NUM_SLOTS, generator=gen)[: bs * 200].view(bs, 200).to(DEVICE)
    bufs = MetadataBuffers(bs, max(num_tokens, 1), 2048, window, DEVICE)
    req_pool_indices = torch.arange(bs, device=DEVICE)
    seq_t = torch.tensor(seq_lens, device=DEVICE)
    ext_t = torch.tensor(extend_lens, device=DEVICE)
    out_cache_loc = torch.stack([req_to_token[r, s - e + i] for r, (s, e)
                                 in enumerate(zip(seq_lens, extend_lens, strict=True))
                                 for i in range(e)]) if num_tokens else torch.zeros(0).long()
    build_metadata(req_pool_indices, seq_t, ext_t, out_cache_loc.to(DEVICE), req_to_token, bufs)
    q = torch.randn(num_tokens, HQ, D, generator=gen).to(DEVICE, dtype)
    lists = bufs.lists["sliding" if window else "full"]
    return q, k_cache, v_cache, bufs, lists


def reference(q, k_cache, v_cache, bufs, lists, bs):
    nt = q.shape[0]
    return attn.attention_ref(q, k_cache, v_cache, bufs.qo_indptr[: bs + 1],
                              lists.kv_indptr[: bs + 1], lists.kv_indices, lists.kv_start[:bs],
                              bufs.positions[:nt], lists.window, SCALE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 5])
def test_extend_attention_matches_reference(dtype, window):
    # prefill longer than a tile, an empty request, a one-token request, a verify-like chunk
    seq_lens, extend_lens = [30, 4, 1, 70], [30, 0, 1, 4]
    q, k_cache, v_cache, bufs, lists = setup(seq_lens, extend_lens, window, dtype)
    bs = len(seq_lens)
    out = torch.full_like(q, float("nan"))
    attn.extend_attention(q, k_cache, v_cache, bufs.qo_indptr, lists.kv_indptr, lists.kv_indices,
                          lists.kv_start, bufs.positions, lists.window, SCALE, out, bs)
    expect = reference(q, k_cache, v_cache, bufs, lists, bs)
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("rows", ["few", "many"])
def test_split_extend_attention_matches_reference_launch_after_launch(num_splits, window,
                                                                      rows, monkeypatch):
    """Split-KV extend: each tile's keys in num_splits programs (some of them empty: a
    one-token request, a tile that sees fewer keys than splits), combined by the last to
    arrive; partial scratch starts as NaN (a combine that read an unwritten partial shows
    up) and the counters end at zero, so a second launch (a graph replay) is right too.
    "many": more requests with a partial tile than the plan's slack (none here), so the
    last two tiles run whole beside the split ones."""
    dtype = torch.float32
    seq_lens, extend_lens = [150, 4, 1, 70], [150, 0, 1, 4]
    if rows == "many":
        monkeypatch.setattr(attn, "EXTEND_SPLIT_SLACK", 0)
        assert attn._split_tiles(155, 4, 64 // 3) == 8  # of 8 + 1 + 1 tiles
    q, k_cache, v_cache, bufs, lists = setup(seq_lens, extend_lens, window, dtype)
    bs = len(seq_lens)
    scratch = attn.extend_scratch(D, DEVICE, target=256)
    scratch["mid_o"].fill_(float("nan"))
    scratch["mid_lse"].fill_(float("nan"))
    expect = reference(q, k_cache, v_cache, bufs, lists, bs)
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        attn.extend_attention(q, k_cache, v_cache, bufs.qo_indptr, lists.kv_indptr,
                              lists.kv_indices, lists.kv_start, bufs.positions, lists.window,
                              SCALE, out, bs, block_n=32, num_splits=num_splits, **scratch)
        torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])
        assert not scratch["counters"].any()
    # the partials were written: the splits really ran apart
    assert not torch.isnan(scratch["mid_lse"][: bs * num_splits]).all()
    with pytest.raises(ValueError, match="scratch"):
        attn.extend_attention(q, k_cache, v_cache, bufs.qo_indptr, lists.kv_indptr,
                              lists.kv_indices, lists.kv_start, bufs.positions, lists.window,
                              SCALE, out, bs, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_n", [16, 32])
def test_unmasked_key_tiles_first_give_the_masked_values(dtype, block_n):
    """`unmasked_first`: the key tiles below a tile's first query position run without
    masks. A long prompt (tiles with several full key tiles, and the diagonal ones), a
    verify-like chunk deep in its list, a one-token request and an empty one: the output is
    the reference's, and in the interpreter bit-equal to the masked loop's (a GPU compiles the
    two loops apart); a boundary one tile too far lets a diagonal tile's future keys in: the
    reference check fails."""
    seq_lens, extend_lens = [150, 4, 1, 70], [150, 0, 1, 4]
    q, k_cache, v_cache, bufs, lists = setup(seq_lens, extend_lens, None, dtype)
    bs = len(seq_lens)
    outs = []
    for unmasked in (False, True):
        out = torch.full_like(q, float("nan"))
        attn.extend_attention(q, k_cache, v_cache, bufs.qo_indptr, lists.kv_indptr,
                              lists.kv_indices, lists.kv_start, bufs.positions, None, SCALE,
                              out, bs, block_n=block_n, unmasked_first=unmasked)
        outs.append(out)
    expect = reference(q, k_cache, v_cache, bufs, lists, bs)
    torch.testing.assert_close(outs[1].float(), expect.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    if DEVICE == "cpu":
        assert torch.equal(outs[0], outs[1])


def test_extend_plan_by_head_size():
    """The tuned extend tiles (stop 56's H100 sweep): 128 keys a tile for 64-dim heads, 64
    for 128-dim ones, 3 stages, unmasked key tiles first."""
    assert attn.extend_block_n(64) == 128 and attn.extend_block_n(128) == 64
    assert attn.EXTEND_NUM_STAGES == 3 and attn.EXTEND_UNMASKED_FIRST


def test_extend_num_splits_fills_the_target_and_keeps_to_the_scratch():
    # 512 tokens of SmolLM2's heads (9 / 3): 25 tiles + 2 -> 81 programs a split
    assert attn.extend_num_splits(512, 2, 9, 3, max_splits=8) == 6
    assert attn.extend_num_splits(512, 2, 9, 3, max_splits=4) == 4
    # the captured prefill's 257 rows (most of them empty): the slack, not the rows, counts
    assert attn.extend_num_splits(512, 257, 9, 3, max_splits=8) == 5
    assert attn.extend_num_splits(8192, 65, 9, 3, max_splits=8) == 1  # a big grid: none
    assert attn.extend_num_splits(512, 2, 9, 3, max_splits=1) == 1
    for tokens in (1, 16, 100, 512, 1000, 4096):
        for bs in (1, 5, 65):
            s = attn.extend_num_splits(tokens, bs, 32, 8, max_splits=8)
            tiles = attn._split_tiles(tokens, bs, 16)  # 16 tokens of a group of 4 a tile
            assert tiles == -(-tokens // 16) + min(bs, attn.EXTEND_SPLIT_SLACK)
            assert s == 1 or tiles * 8 * s <= attn.EXTEND_TARGET_PROGRAMS


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window,block_n,unmasked", [(7, 64, False), (40, 16, True)])
def test_draft_block_attention_is_noncausal_over_window_and_block(dtype, window, block_n,
                                                                  unmasked):
    """DRAFT_BLOCK: every row of a block sees its request's whole list (the last W context
    keys and the whole block), whatever its position; against the twin and against plain
    softmax attention over exactly those keys. With `unmasked_first` and small key tiles, a
    list's whole tiles run without masks (a 45-key list: two of 16, then a masked one)."""
    gamma = 5
    seq_lens = [3 + gamma, 60 + gamma, 0 + gamma]  # prefixes shorter and longer than W
    gen = torch.Generator().manual_seed(3)
    bs = len(seq_lens)
    k_cache = torch.randn(NUM_SLOTS, HKV, D, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(NUM_SLOTS, HKV, D, generator=gen).to(DEVICE, dtype)
    req_to_token = torch.randperm(NUM_SLOTS, generator=gen)[: bs * 200].view(bs, 200).to(DEVICE)
    bufs = MetadataBuffers(bs, bs * gamma, 2048, None, DEVICE)
    bufs.add_block_lists(window, gamma)
    seq_t = torch.tensor(seq_lens, device=DEVICE)
    loc = torch.stack([req_to_token[r, n - gamma + i] for r, n in enumerate(seq_lens)
                       for i in range(gamma)])
    build_metadata(torch.arange(bs, device=DEVICE), seq_t, torch.full_like(seq_t, gamma), loc,
                   req_to_token, bufs, draft_block=True)
    lists = bufs.lists["block"]
    q = torch.randn(bs * gamma, HQ, D, generator=gen).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    attn.extend_attention(q, k_cache, v_cache, bufs.qo_indptr, lists.kv_indptr, lists.kv_indices,
                          lists.kv_start, bufs.positions, None, SCALE, out, bs, noncausal=True,
                          block_n=block_n, unmasked_first=unmasked)
    twin = attn.attention_ref(q, k_cache, v_cache, bufs.qo_indptr[: bs + 1],
                              lists.kv_indptr[: bs + 1], lists.kv_indices, lists.kv_start[:bs],
                              bufs.positions[: bs * gamma], None, SCALE, noncausal=True)
    torch.testing.assert_close(out.float(), twin.float(), atol=TOL[dtype], rtol=TOL[dtype])
    for r, n in enumerate(seq_lens):
        keys = req_to_token[r, max(0, n - gamma - window) : n]  # window, then the block
        kr = k_cache[keys].float().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
        vr = v_cache[keys].float().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
        qr = q[r * gamma : (r + 1) * gamma].float().transpose(0, 1)
        expect = torch.softmax(qr @ kr.transpose(1, 2) * SCALE, -1) @ vr
        torch.testing.assert_close(out[r * gamma : (r + 1) * gamma].float(),
                                   expect.transpose(0, 1), atol=TOL[dtype], rtol=TOL[dtype])
    causal = torch.full_like(q, float("nan"))  # the causal kernel differs on the same lists
    attn.extend_attention(q, k_cache, v_cache, bufs.qo_indptr, lists.kv_indptr, lists.kv_indices,
                          lists.kv_start, bufs.positions, None, SCALE, causal, bs)
    assert not torch.allclose(causal.float(), out.float(), atol=1e-2)


def decode_scratch(bs, num_splits):
    """Caller-owned split-KV scratch. Partials start as NaN, so a combine that read a split's
    partial before (or without) it being written shows up; the counters start at zero, as the
    backend allocates them."""
    nan = float("nan")
    return dict(mid_o=torch.full((bs, HQ, num_splits, D), nan, device=DEVICE),
                mid_lse=torch.full((bs, HQ, num_splits), nan, device=DEVICE),
                kv_counters=torch.zeros(bs * HKV, dtype=torch.int32, device=DEVICE))


def splits_with_keys(kv_indptr, num_splits, block_n, min_tiles=1):
    """Per row, how many of the decode kernel's splits hold at least one key."""
    kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
    chunk = [max(-(-n // (num_splits * block_n)) * block_n, min_tiles * block_n)
             for n in kv_lens]  # the kernel's split_len
    return [-(-n // c) if n else 0 for n, c in zip(kv_lens, chunk, strict=True)]


def decode_twice(q, args, scratch, num_splits, block_n, min_tiles=1):
    """Run decode_attention twice on the same scratch (a graph replay reuses it): the counters
    must be zero after each call and both calls must give the same output."""
    outs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        attn.decode_attention(q, *args, SCALE, out, **scratch, num_splits=num_splits,
                              config=attn.DecodeConfig(block_n, min_tiles))
        assert (scratch["kv_counters"] == 0).all(), "the combining program must reset its counter"
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
    return outs[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_attention_matches_reference(dtype, window, num_splits):
    # one-token context, a short one, one longer than every split's chunk
    seq_lens, block_n = [1, 9, 150], 16
    bs = len(seq_lens)
    q, k_cache, v_cache, bufs, lists = setup(seq_lens, [1] * bs, window, dtype, seed=1)
    if num_splits > 1 and window != 5:  # the comparison covers a combine over several splits
        assert max(splits_with_keys(lists.kv_indptr[: bs + 1], num_splits, block_n)) >= 3
    args = (k_cache, v_cache, lists.kv_indptr, lists.kv_indices, lists.kv_start, bufs.positions,
            lists.window)
    out = decode_twice(q, args, decode_scratch(bs, num_splits), num_splits, block_n)
    expect = reference(q, k_cache, v_cache, bufs, lists, bs)
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])


def decode_rows_of(seq_lens, extend_lens, window, dtype, num_splits, block_n, pad=0):
    """A verify-like batch through the decode kernel's token rows, and each of its rows
    computed alone as the decode row at its position (same KV, same request table)."""
    bs = len(seq_lens)
    q, k_cache, v_cache, bufs, lists = setup(seq_lens, extend_lens, window, dtype, seed=6)
    t = q.shape[0]
    q = torch.cat([q, torch.randn(pad, HQ, D, device=DEVICE).to(dtype)])  # padding rows
    out = torch.full_like(q, float("nan"))
    scratch = decode_scratch(t + pad, num_splits)
    for _ in range(2):  # a replay reuses the scratch: the counters come back to zero
        attn.decode_attention(q, k_cache, v_cache, lists.kv_indptr, lists.kv_indices,
                              lists.kv_start, bufs.positions, lists.window, SCALE, out,
                              **scratch, num_splits=num_splits,
                              config=attn.DecodeConfig(block_n),
                              token_rows=(bufs.token_req, bufs.qo_indptr, bs))
        assert (scratch["kv_counters"] == 0).all()
    # the decode rows: request r at position p is a decode batch row with seq_len p + 1
    pos = bufs.positions[:t].tolist()
    req = bufs.token_req[:t].tolist()
    meta = MetadataBuffers(t, t, 4096, window, DEVICE)
    req_to_token = torch.zeros(bs, 200, dtype=torch.int64, device=DEVICE)  # from the lists
    for r in range(bs):
        lo, hi = lists.kv_indptr[r].item(), lists.kv_indptr[r + 1].item()
        first = lists.kv_start[r].item()
        req_to_token[r, first : first + hi - lo] = lists.kv_indices[lo:hi]
    build_metadata(torch.tensor(req, device=DEVICE), torch.tensor(pos, device=DEVICE) + 1,
                   torch.ones(t, dtype=torch.int64, device=DEVICE),
                   torch.stack([req_to_token[r, p] for r, p in zip(req, pos, strict=True)]),
                   req_to_token, meta)
    dl = meta.lists["sliding" if window else "full"]
    alone = torch.full_like(q[:t], float("nan"))
    attn.decode_attention(q[:t], k_cache, v_cache, dl.kv_indptr, dl.kv_indices, dl.kv_start,
                          meta.positions, dl.window, SCALE, alone, **decode_scratch(t, num_splits),
                          num_splits=num_splits, config=attn.DecodeConfig(block_n))
    return q, out, alone, reference(q[:t], k_cache, v_cache, bufs, lists, bs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_verify_rows_through_the_decode_kernel_are_its_decode_rows(dtype, window, num_splits):
    # verify chunks of 5, 1 and 3 tokens and two padding rows past the live tokens; the last
    # chunk's rows (positions 63..65) own 64..66 keys, so their decode rows split at 16 or 32
    # keys (4 splits): a row that took its request's whole list would split differently
    out_q, out, alone, expect = decode_rows_of([9, 150, 66], [5, 1, 3], window, dtype,
                                               num_splits, 16, pad=2)
    t = expect.shape[0]
    torch.testing.assert_close(out[:t].float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # bitwise the decode rows (on a GPU this is the claim: the same splits, tiles and order)
    assert torch.equal(out[:t], alone)
    # padding rows (prefilled with NaN) get zeros: a dead token's K / V, stored in the dummy
    # slot that padded rows attend to, never comes from the buffer's old bytes
    assert (out[t:] == 0).all(), "padding rows keep the buffer's old bytes"


def test_decode_attention_mixed_rows_and_empty_list():
    # hand-made lists: row 0 sees three keys (shorter than one split's chunk), row 1 sees
    # nothing (count 0: zeros), row 2 sees 100 keys spread over all four splits
    num_splits, block_n = 4, 16
    q, k_cache, v_cache, bufs, lists = setup([3, 3, 3], [1, 1, 1], None, torch.float32, seed=2)
    gen = torch.Generator().manual_seed(5)
    kv_indptr = torch.tensor([0, 3, 3, 103], device=DEVICE)
    kv_indices = torch.cat([torch.tensor([5, 9, 11]),
                            torch.randperm(NUM_SLOTS, generator=gen)[:100]]).to(DEVICE)
    kv_start = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    positions = torch.tensor([2, 2, 99], device=DEVICE)
    assert splits_with_keys(kv_indptr, num_splits, block_n) == [1, 0, 4]
    args = (k_cache, v_cache, kv_indptr, kv_indices, kv_start, positions, None)
    out = decode_twice(q, args, decode_scratch(3, num_splits), num_splits, block_n)
    qo_indptr = torch.arange(4, device=DEVICE)
    expect = attn.attention_ref(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_start,
                                positions, None, SCALE)
    assert (out[1] == 0).all()
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)


def test_decode_attention_short_rows_use_fewer_splits_with_min_tiles():
    # 150 keys over 8 splits of >= 3 tiles of 16: 4 splits hold keys (48 each), 4 are empty
    num_splits, block_n, min_tiles = 8, 16, 3
    q, k_cache, v_cache, bufs, lists = setup([150, 20], [1, 1], None, torch.float32, seed=4)
    assert splits_with_keys(lists.kv_indptr[:3], num_splits, block_n, min_tiles) == [4, 1]
    args = (k_cache, v_cache, lists.kv_indptr, lists.kv_indices, lists.kv_start, bufs.positions,
            lists.window)
    out = decode_twice(q, args, decode_scratch(2, num_splits), num_splits, block_n, min_tiles)
    expect = reference(q, k_cache, v_cache, bufs, lists, 2)
    torch.testing.assert_close(out.float(), expect.float(), atol=2e-5, rtol=2e-5)


def test_decode_plan_takes_the_tuned_entry(monkeypatch):
    tuned = (4, attn.DecodeConfig(32, 2, 8, 3))
    monkeypatch.setitem(attn.DECODE_TUNED, (3, 64, 1), tuned)
    assert attn.decode_plan(1, 9, 3, 64, 16) == tuned
    assert attn.decode_plan(1, 9, 3, 64, 2) == (2, tuned[1])  # capped by the scratch
    monkeypatch.delitem(attn.DECODE_TUNED, (3, 64, 8), raising=False)
    monkeypatch.delitem(attn.DECODE_TUNED, (3, 64, 128), raising=False)
    # untuned: many splits take short tiles, few splits long ones
    assert attn.decode_plan(8, 9, 3, 64, 16) == (16, attn.DecodeConfig(block_n=32))
    assert attn.decode_plan(128, 9, 3, 64, 16) == (1, attn.DecodeConfig(block_n=128))


def test_decode_scratch_covers_every_batch_size():
    rows = attn.decode_scratch_rows(40, 9, 3, 64, 32)
    assert rows == max(bs * attn.decode_plan(bs, 9, 3, 64, 32)[0] for bs in range(1, 41))
    assert rows < 40 * 32  # smaller than max_bs x max_splits


def test_decode_attention_split_kv_needs_counters():
    q, k_cache, v_cache, bufs, lists = setup([3], [1], None, torch.float32)
    scratch = decode_scratch(1, 2)
    del scratch["kv_counters"]
    with pytest.raises(AssertionError, match="kv_counters"):
        attn.decode_attention(q, k_cache, v_cache, lists.kv_indptr, lists.kv_indices,
                              lists.kv_start, bufs.positions, None, SCALE, torch.empty_like(q),
                              **scratch, num_splits=2)


def test_decode_num_splits_is_a_power_of_two_within_scratch():
    for bs in (1, 2, 3, 64, 256):
        for max_splits in (1, 12, 16):
            n = attn.decode_num_splits(bs, 3, max_splits)
            assert n & (n - 1) == 0 and 1 <= n <= max_splits
    assert attn.decode_num_splits(1, 3, 16) == 16  # batch 1 spreads the row over the GPU


# ---- the batch-invariant plan (`--deterministic`): fixed split length ----------------------


def invariant_decode(q, args, slots, programs, split_len, block_n=16, token_rows=None):
    """decode_attention under a fixed split length, twice on the same scratch (a replay)."""
    scratch = decode_scratch(q.shape[0], slots)
    cfg = attn.DecodeConfig(block_n, 1, 4, 2, split_len)
    outs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        attn.decode_attention(q, *args, SCALE, out, **scratch, num_splits=programs, config=cfg,
                              token_rows=token_rows)
        assert (scratch["kv_counters"] == 0).all(), "the combining program must reset its counter"
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    return outs[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 40])
def test_invariant_plan_matches_reference_and_ignores_the_program_count(dtype, window):
    """Splits of 32 keys (150 keys: 5 splits, over 8 slots) shared by 1, 2, 4 or 8 programs:
    values as the twin's, bits the same for every program count (the batch size's part of
    the plan), and the same for a row run alone as in its batch. The old plan (split length
    following num_splits) does change the bits with the program count."""
    seq_lens = [1, 9, 150, 0 + 1]
    bs = len(seq_lens)
    q, k_cache, v_cache, bufs, lists = setup(seq_lens, [1] * bs, window, dtype, seed=7)
    args = (k_cache, v_cache, lists.kv_indptr, lists.kv_indices, lists.kv_start, bufs.positions,
            lists.window)
    outs = [invariant_decode(q, args, 8, p, 32) for p in (1, 2, 4, 8)]
    expect = reference(q, k_cache, v_cache, bufs, lists, bs)
    torch.testing.assert_close(outs[0].float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    # row 2 alone (a batch of one, at index 0) is bitwise its row in the batch
    ip, idx = lists.kv_indptr, lists.kv_indices
    alone_args = (k_cache, v_cache, torch.stack([ip[2] - ip[2], ip[3] - ip[2]]),
                  idx[ip[2] : ip[3]], lists.kv_start[2:3], bufs.positions[2:3], lists.window)
    alone = invariant_decode(q[2:3].contiguous(), alone_args, 8, 4, 32)
    assert torch.equal(alone[0], outs[0][2])
    if dtype == torch.float32 and window is None:
        old = [decode_twice(q, args, decode_scratch(bs, p), p, 16) for p in (2, 8)]
        assert not torch.equal(old[0][2], old[1][2]), "the old plan's bits follow num_splits"


def test_invariant_plan_verify_rows_are_decode_rows():
    """Verify rows (token rows) under the fixed split length: bitwise the decode rows at
    their positions, the decode batch run with another program count."""
    seq_lens, extend_lens = [9, 150, 66], [5, 1, 3]
    bs = len(seq_lens)
    q, k_cache, v_cache, bufs, lists = setup(seq_lens, extend_lens, None, torch.float16, seed=6)
    t = q.shape[0]
    args = (k_cache, v_cache, lists.kv_indptr, lists.kv_indices, lists.kv_start, bufs.positions,
            lists.window)
    out = invariant_decode(q, args, 8, 2, 32, token_rows=(bufs.token_req, bufs.qo_indptr, bs))
    pos, req = bufs.positions[:t].tolist(), bufs.token_req[:t].tolist()
    meta = MetadataBuffers(t, t, 4096, None, DEVICE)
    req_to_token = torch.zeros(bs, 200, dtype=torch.int64, device=DEVICE)
    for r in range(bs):
        lo, hi = lists.kv_indptr[r].item(), lists.kv_indptr[r + 1].item()
        req_to_token[r, : hi - lo] = lists.kv_indices[lo:hi]
    build_metadata(torch.tensor(req, device=DEVICE), torch.tensor(pos, device=DEVICE) + 1,
                   torch.ones(t, dtype=torch.int64, device=DEVICE),
                   torch.stack([req_to_token[r, p] for r, p in zip(req, pos, strict=True)]),
                   req_to_token, meta)
    dl = meta.lists["full"]
    alone = invariant_decode(q, (k_cache, v_cache, dl.kv_indptr, dl.kv_indices, dl.kv_start,
                                 meta.positions, None), 8, 8, 32)
    assert torch.equal(out, alone)
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, bufs, lists,
                                                      bs).float(), atol=3e-3, rtol=3e-3)


def test_invariant_plan_shapes():
    assert attn.invariant_split_len(8192) == 256
    assert attn.invariant_split_len(100) == attn.INVARIANT_BLOCK_N
    assert attn.invariant_split_len(8192, 32, 64) * 32 >= 8192
    programs, cfg = attn.invariant_decode_plan(1, 3, 8192)
    assert cfg.split_len == 256 and programs == 32
    # the batch size changes the programs, never the tiles or the split length
    programs64, cfg64 = attn.invariant_decode_plan(64, 3, 8192)
    assert cfg64 == cfg and programs64 < programs
