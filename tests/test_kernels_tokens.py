"""record_last_tokens: device-resolved step inputs (async scheduling) and the token table."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from draftgraph.kernels import tokens as T  # noqa: E402
from draftgraph.kernels._triton import compiled_for_cpu_missing  # noqa: E402

if compiled_for_cpu_missing(T._record_last_tokens_kernel):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set "
                "(set it in the environment to run them on CPU)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("bs", [1, 5, 40])
def test_record_last_tokens_matches_reference(bs):
    g = torch.Generator().manual_seed(bs)
    # a decode step's tokens: [max_bs, 1], accept length 1
    prev = torch.randint(0, 1000, (48, 1), generator=g).to(DEVICE)
    accept = torch.ones(48, dtype=torch.int64, device=DEVICE)
    # every other row refers to a previous step's row, the rest carry their token
    given = torch.randint(0, 1000, (bs,), generator=g)
    refs = -(torch.randperm(48, generator=g)[:bs] + 1)
    ids = torch.where(torch.arange(bs) % 2 == 1, refs, given).to(DEVICE)
    rows = (torch.randperm(50, generator=g)[:bs] + 1).to(DEVICE)
    seq = torch.randint(1, 30, (bs,), generator=g).to(DEVICE)
    table = torch.full((51, 32), -7, dtype=torch.int64, device=DEVICE)
    ids_ref, table_ref = ids.clone(), table.clone()
    T.record_last_tokens_triton(ids, prev, accept, table, rows, seq)
    T.record_last_tokens_ref(ids_ref, prev, accept, table_ref, rows, seq)
    assert torch.equal(ids, ids_ref)
    assert torch.equal(table, table_ref)
    # the values themselves: references resolved, tokens kept, one table entry per row
    odd = torch.arange(bs) % 2 == 1
    assert torch.equal(ids[odd.to(DEVICE)], prev[(-refs[odd] - 1).to(DEVICE), 0])
    assert torch.equal(ids[~odd.to(DEVICE)], given[~odd].to(DEVICE))
    assert torch.equal(table[rows, seq - 1], ids)
    assert int((table != -7).sum()) == bs


def test_a_reference_to_a_spare_row_reads_its_first_column_and_shifts_nothing():
    """A prefill behind the step in flight leaves its first tokens in the results' spare rows
    (max_bs ..; engine/first_tokens.py), whose accept length a speculative graph set never
    writes (0): a reference there reads column 0 as a length-1 row would, and the row's
    seq_lens, KV slots and max_draft stay as staged, beside a row of the step before that
    does shift."""
    k, max_bs = 2, 4
    prev = torch.arange(2 * max_bs * (1 + k), device=DEVICE).view(2 * max_bs, 1 + k) + 100
    accept = torch.zeros(2 * max_bs, dtype=torch.int64, device=DEVICE)
    accept[1] = 3  # row 1 of the step before emitted 3 tokens
    ids = torch.tensor([-(max_bs + 2 + 1), -(1 + 1)], device=DEVICE)  # spare row 2, row 1
    rows = torch.tensor([3, 5], device=DEVICE)
    seq0 = torch.tensor([9, 12], device=DEVICE)
    slots = torch.arange(2 * (1 + 2 * k), device=DEVICE).view(2, 1 + 2 * k) + 1
    md0 = torch.tensor([k, k], device=DEVICE)
    limit = torch.tensor([100, 100], device=DEVICE)
    for fn in (T.record_last_tokens_triton, T.record_last_tokens_ref):
        got_ids, seq, max_draft = ids.clone(), seq0.clone(), md0.clone()
        out = torch.zeros(2, 1 + k, dtype=torch.int64, device=DEVICE)
        table = torch.full((8, 32), -7, dtype=torch.int64, device=DEVICE)
        fn(got_ids, prev, accept, table, rows, seq, T.AheadInputs(slots, out, max_draft, limit))
        assert got_ids.tolist() == [int(prev[max_bs + 2, 0]), int(prev[1, 2])], fn
        assert seq.tolist() == [9, 14] and max_draft.tolist() == [k, k]
        assert torch.equal(out[0], slots[0, : 1 + k]) and torch.equal(out[1], slots[1, 2:])
        assert table[3, 8] == got_ids[0] and table[5, 13] == got_ids[1]


@pytest.mark.parametrize("bs", [1, 6, 33])
def test_speculative_step_inputs_shift_by_the_previous_accept_lengths(bs):
    """A speculative step launched ahead is staged as if the previous step emitted one token;
    a referring row moves by what it did emit (a - 1): its last token is the previous row's
    a-th, seq_lens grows by a - 1, its KV slots start a - 1 into the 1 + 2k staged ones, and
    max_draft is capped by the room left. Rows carrying their token stay as staged."""
    k = 3
    g = torch.Generator().manual_seed(100 + bs)
    prev = torch.randint(0, 1000, (40, 1 + k), generator=g).to(DEVICE)
    accept = torch.randint(1, 2 + k, (40,), generator=g).to(DEVICE)
    given = torch.randint(0, 1000, (bs,), generator=g)
    refs = -(torch.randperm(40, generator=g)[:bs] + 1)
    odd = torch.arange(bs) % 2 == 1
    ids = torch.where(odd, refs, given).to(DEVICE)
    rows = (torch.randperm(50, generator=g)[:bs] + 1).to(DEVICE)
    seq = torch.randint(2, 30, (bs,), generator=g).to(DEVICE)
    slots = torch.randint(1, 10_000, (bs, 1 + 2 * k), generator=g).to(DEVICE)
    max_draft = torch.randint(0, k + 1, (bs,), generator=g).to(DEVICE)
    # some rows near their limit: the room caps their drafts
    seq_limit = (seq + torch.randint(1, 3 + 2 * k, (bs,), generator=g).to(DEVICE))
    table = torch.full((51, 48), -7, dtype=torch.int64, device=DEVICE)
    args = [ids, prev, accept, table, rows, seq]
    ahead = [slots, torch.zeros(bs, 1 + k, dtype=torch.int64, device=DEVICE), max_draft,
             seq_limit]
    ref_args = [x.clone() for x in args]
    ref_ahead = [x.clone() for x in ahead]
    seq0, md0 = seq.clone(), max_draft.clone()
    T.record_last_tokens_triton(*args, T.AheadInputs(*ahead))
    T.record_last_tokens_ref(*ref_args, T.AheadInputs(*ref_ahead))
    for got, want in zip(args + ahead, ref_args + ref_ahead, strict=True):
        assert torch.equal(got, want)
    # the values, against a row-by-row reading of the contract
    capped = 0
    for i in range(bs):
        if odd[i]:
            j = int(-refs[i] - 1)
            a = int(accept[j])
            assert int(ids[i]) == int(prev[j, a - 1])
            assert int(seq[i]) == int(seq0[i]) + a - 1
            assert torch.equal(ahead[1][i], slots[i, a - 1 : a + k])
            room = int(seq_limit[i]) - int(seq[i]) - 1
            assert int(max_draft[i]) == max(0, min(int(md0[i]), room))
            capped += int(max_draft[i]) < int(md0[i])
        else:
            assert int(ids[i]) == int(given[i])
            assert int(seq[i]) == int(seq0[i])
            assert torch.equal(ahead[1][i], slots[i, : 1 + k])
            assert int(max_draft[i]) == int(md0[i])
        assert int(table[rows[i], seq[i] - 1]) == int(ids[i])
    assert int((table != -7).sum()) == bs
    if bs > 6:
        assert capped > 0  # the cap was exercised


@pytest.mark.parametrize("bs,k,wider", [(1, 4, 0), (3, 4, 0), (7, 16, 0), (33, 1, 0),
                                        (3, 5, 27)])
def test_the_chain_pack_equals_its_twin(bs, k, wider):
    """A verify's packed rows from drafts of every count 0 .. k (past each count the drafter
    left junk): every buffer the kernel writes, the stale tail past the live rows, and the
    token table, equal to the twin's; then the values themselves. wider: the drafts are the
    first k columns of a wider proposal (a tree drafter's chain of D)."""
    g = torch.Generator().manual_seed(bs * 100 + k)
    t = 1 + k
    m = bs + 2  # buffers sized for more than the batch

    def noise(*shape):
        return torch.randint(100, 200, shape, generator=g).to(DEVICE)

    drafts = noise(bs, k + wider)[:, :k]
    num = torch.randint(0, k + 1, (bs,), generator=g).to(DEVICE)
    num[0] = k
    last = noise(bs)
    seq = torch.randint(1, 20, (bs,), generator=g).to(DEVICE)
    rows = (torch.randperm(60, generator=g)[:bs] + 1).to(DEVICE)
    slots = noise(bs, 1 + 2 * k)[:, :t]  # a view of the staged slots, as the step passes
    table0 = torch.full((61, 48), -7, dtype=torch.int64, device=DEVICE)
    table0[0, 0] = 0  # the dummy row's first entry (the twin's dead rows write it)
    got = T.ChainPack(noise(m, k), noise(m), noise(m), noise(m), noise(m * t), noise(m * t),
                      noise(m * t))
    ref = T.ChainPack(*(x.clone() for x in vars(got).values()))
    table, table_ref = table0.clone(), table0.clone()
    T.pack_chain_triton(drafts, num, last, seq, rows, slots, table, got)
    T.pack_chain_ref(drafts, num, last, seq, rows, slots, table_ref, ref)
    for name in vars(got):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert torch.equal(table, table_ref)
    # request 0 drafted k: its rows 0 .. k are its last token and drafts, in its slots
    assert got.packed_ids[:t].tolist() == [last[0].item(), *drafts[0].tolist()]
    assert got.packed_loc[:t].tolist() == slots[0].tolist()
    assert table[rows[0], seq[0] - 1 : seq[0] + k].tolist() == got.packed_ids[:t].tolist()
    n = int((1 + num).sum())
    assert (got.packed_ids[n : bs * t] == 0).all() and (got.packed_loc[n : bs * t] == 0).all()
    for b in range(bs):  # drafts past the count are 0; logit rows follow the packing
        assert (got.draft_tokens[b, num[b]:] == 0).all()
        start = int((1 + num[:b]).sum())
        assert got.logit_rows[b * t : b * t + t].tolist() == [
            min(start + j, bs * t - 1) for j in range(t)]


@pytest.mark.parametrize("bs,m,tree", [(1, 4, False), (5, 4, False), (3, 5, True),
                                       (9, 2, True)])
def test_the_catch_up_staging_equals_its_twin(bs, m, tree):
    """A chain head's catch-up inputs after a verify (a chain's packed rows of varied lengths,
    or a tree's accepted path): every buffer equal to the twin's, and by hand for one row."""
    g = torch.Generator().manual_seed(bs * 10 + m)
    k = 3 * m if tree else m
    t = 1 + k
    seq = torch.randint(1, 40, (bs,), generator=g).to(DEVICE)
    drafts = torch.full((bs,), k) if tree else torch.randint(0, k + 1, (bs,), generator=g)
    vseq = seq + drafts.to(DEVICE)
    lens = (torch.randint(0, 1 << 30, (bs,), generator=g) % (drafts.clamp_max(m) + 1) + 1)
    tokens = torch.randint(-1, 90, (bs, t), generator=g).to(DEVICE)
    slots = torch.randint(1, 500, (bs, t), generator=g).to(DEVICE)
    path = None
    if tree:  # depth j's accepted row, 0 past the accept length
        path = torch.zeros(bs, 1 + m, dtype=torch.int64)
        for b in range(bs):
            rows = torch.randperm(k, generator=g)[: m] + 1
            path[b, 1 : int(lens[b])] = rows[: int(lens[b]) - 1]
        path = path.to(DEVICE)
    lens = lens.to(DEVICE)
    cap = bs + 1

    def bufs():
        return T.CatchUp(*(torch.full((n,), -5, device=DEVICE)
                           for n in (cap * m, cap * m, cap, cap * m, cap)))

    got, ref = bufs(), bufs()
    total = bs * t
    T.stage_catch_up_triton(tokens, lens, vseq, seq, slots, path, total, got)
    T.stage_catch_up_ref(tokens, lens, vseq, seq, slots, path, total, ref)
    for name in vars(got):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    b = bs - 1  # the last request: its packed start is the others' verified rows
    start = int((1 + vseq[:b] - seq[:b]).sum())
    p = path[b] if tree else torch.arange(1 + m, device=DEVICE)
    assert got.feat_rows[b * m : b * m + m].tolist() == (start + p[:m]).clamp_max(
        total - 1).tolist()
    assert got.last_rows[b].item() == min(start + int(p[lens[b] - 1]), total - 1)
    assert got.ids[b * m : b * m + m].tolist() == tokens[b, :m].clamp_min(0).tolist()
    assert got.loc[b * m : b * m + m].tolist() == slots[b, 1 : 1 + m].tolist()
    assert got.seq[b].item() == seq[b].item() + m


def _steps(bs, k, fill):
    z = lambda *s: torch.full(s, fill, dtype=torch.int64, device=DEVICE)
    return T.ChainSteps(z(bs + 3), z(bs + 3), z(bs + 3), z(bs + 3, k))


@pytest.mark.parametrize("bs,width,mapped", [(1, 3000, True), (5, 1024, False), (3, 77, True)])
def test_the_draft_take_equals_its_twin(bs, width, mapped):
    """A chain step's greedy take: the argmax of each row (ties to the first index: planted
    repeats of the max), through the draft vocabulary, into the drafts' column i and the
    next step's token, and the next step's KV length and slot; nothing staged on the last
    step, nothing touched past the batch or in other columns."""
    g = torch.Generator().manual_seed(bs * width)
    k = 4
    logits = torch.randn(bs, width, generator=g).to(torch.float16).to(DEVICE)
    logits[:, width // 2] = 9.0  # the max twice: the first index wins
    logits[:, width - 1] = 9.0
    if bs > 1:
        logits[1, 5] = 10.0
    vocab = (torch.randperm(50_000, generator=g)[:width] + 7).to(DEVICE) if mapped else None
    seq = torch.randint(5, 90, (bs,), generator=g).to(DEVICE)
    reserved = torch.randint(0, 10_000, (bs, k + 1), generator=g).to(DEVICE)
    want = logits.float().argmax(-1)
    want = vocab[want] if mapped else want
    assert int(want[0]) == (int(vocab[width // 2]) if mapped else width // 2)
    for i, stage in ((0, True), (2, True), (3, False)):
        a, b = _steps(bs, k, -5), _steps(bs, k, -5)
        got = T.draft_take_triton(logits, vocab, i, seq, reserved, a, stage)
        T.draft_take_ref(logits, vocab, i, seq, reserved, b, stage)
        for x, y in zip((a.ids, a.seq_lens, a.loc, a.drafts), (b.ids, b.seq_lens, b.loc,
                                                              b.drafts), strict=True):
            assert torch.equal(x, y)
        assert torch.equal(got, want) and torch.equal(a.drafts[:bs, i], want)
        assert torch.equal(a.ids[:bs], want)
        assert (a.drafts[:, [j for j in range(k) if j != i]] == -5).all()
        assert (a.ids[bs:] == -5).all() and (a.drafts[bs:] == -5).all()
        if stage:
            assert torch.equal(a.seq_lens[:bs], seq + i + 1)
            assert torch.equal(a.loc[:bs], reserved[:, i + 1])
        else:
            assert (a.seq_lens == -5).all() and (a.loc == -5).all()
