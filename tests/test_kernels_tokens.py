"""record_last_tokens: device-resolved last tokens (async scheduling) and the token table."""

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
    # the previous step's tokens as a strided column, as the runner's [max_bs, 1 + k] view
    prev = torch.randint(0, 1000, (48, 3), generator=g).to(DEVICE)[:, 0]
    # every other row refers to a previous step's row, the rest carry their token
    given = torch.randint(0, 1000, (bs,), generator=g)
    refs = -(torch.randperm(48, generator=g)[:bs] + 1)
    ids = torch.where(torch.arange(bs) % 2 == 1, refs, given).to(DEVICE)
    rows = (torch.randperm(50, generator=g)[:bs] + 1).to(DEVICE)
    seq = torch.randint(1, 30, (bs,), generator=g).to(DEVICE)
    table = torch.full((51, 32), -7, dtype=torch.int64, device=DEVICE)
    ids_ref, table_ref = ids.clone(), table.clone()
    T.record_last_tokens_triton(ids, prev, table, rows, seq)
    T.record_last_tokens_ref(ids_ref, prev, table_ref, rows, seq)
    assert torch.equal(ids, ids_ref)
    assert torch.equal(table, table_ref)
    # the values themselves: references resolved, tokens kept, one table entry per row
    odd = torch.arange(bs) % 2 == 1
    assert torch.equal(ids[odd.to(DEVICE)], prev[(-refs[odd] - 1).to(DEVICE)])
    assert torch.equal(ids[~odd.to(DEVICE)], given[~odd].to(DEVICE))
    assert torch.equal(table[rows, seq - 1], ids)
    assert int((table != -7).sum()) == bs
