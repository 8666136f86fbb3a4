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
