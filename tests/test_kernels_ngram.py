"""The n-gram kernel (kernels/ngram.py) against the python twin, over token-table rows."""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the kernel in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from draftgraph.kernels._triton import compiled_for_cpu_missing  # noqa: E402
from draftgraph.kernels.ngram import _ngram_kernel, ngram_propose_triton  # noqa: E402
from draftgraph.spec.ngram import propose_ref  # noqa: E402

if compiled_for_cpu_missing(_ngram_kernel):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _drafts(seqs, min_n, max_n, k, block, garbage):
    """Each sequence in a token-table row of its own (rows in reverse order, the table wider
    than any sequence and filled past each length with `garbage`)."""
    width = max(len(s) for s in seqs) + 7
    table = torch.full((len(seqs) + 2, width), garbage, dtype=torch.int64)
    rows = list(range(len(seqs) + 1, 1, -1))
    for r, s in zip(rows, seqs, strict=True):
        table[r, : len(s)] = torch.tensor(s, dtype=torch.int64)
    drafts, num = ngram_propose_triton(
        table.to(DEVICE), torch.tensor(rows, device=DEVICE),
        torch.tensor([len(s) for s in seqs], device=DEVICE), min_n, max_n, k, block=block)
    out = []
    for i in range(len(seqs)):
        n = int(num[i])
        assert (drafts[i, n:] == 0).all()  # 0-padded
        out.append(drafts[i, :n].tolist())
    return out


def test_ngram_drafts_go_into_the_columns_they_are_given():
    """`out`: the drafts written into a view of a wider buffer (a tree proposal's last
    columns), the other columns untouched."""
    seqs = [[1, 2, 3, 9, 1, 2, 3], [5, 6, 1, 5, 6, 2, 5, 6], [4]]
    table = torch.zeros(4, 16, dtype=torch.int64)
    for r, seq in enumerate(seqs, 1):
        table[r, : len(seq)] = torch.tensor(seq)
    wide = torch.full((3, 7), -7, dtype=torch.int64, device=DEVICE)
    rows = torch.tensor([1, 2, 3], device=DEVICE)
    lens = torch.tensor([len(x) for x in seqs], device=DEVICE)
    drafts, num = ngram_propose_triton(table.to(DEVICE), rows, lens, 1, 3, 4, out=wide[:, 3:])
    assert drafts.data_ptr() == wide[:, 3:].data_ptr()
    for i, seq in enumerate(seqs):
        want = propose_ref(seq, 1, 3, 4)
        assert wide[i, 3:].tolist() == want + [0] * (4 - len(want)) and int(num[i]) == len(want)
    assert (wide[:, :3] == -7).all()


def test_ngram_kernel_edge_cases():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 9, 1, 2, 3], [5, 6, 1, 5, 6, 2, 5, 6],
            [7, 5, 6, 1, 8, 5, 6, 2, 7, 5, 6], [4, 4, 4], [4], [], [9] * 12]
    want = [propose_ref(s, 1, 3, 4) for s in seqs]
    assert want[1] == [9, 1, 2, 3] and want[3] == [1, 8, 5, 6] and want[0] == []
    for garbage in (0, 9, 4):  # tokens past a row's length never extend a match
        assert _drafts(seqs, 1, 3, 4, 4, garbage) == want


@pytest.mark.parametrize("min_n,max_n,k,block", [(1, 1, 3, 8), (1, 3, 5, 4), (2, 4, 2, 16),
                                                 (3, 3, 8, 32)])
def test_ngram_kernel_matches_the_ref_on_random_sequences(min_n, max_n, k, block):
    rng = random.Random(min_n * 100 + max_n * 10 + k)
    seqs = []
    for _ in range(24):
        vocab = rng.choice([3, 8, 50])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        for _ in range(rng.randrange(0, 3)):  # plant repeats of earlier spans
            if len(seq) > 2:
                start = rng.randrange(len(seq) - 1)
                span = seq[start : start + rng.randrange(1, 8)]
                seq += [rng.randrange(vocab) for _ in range(rng.randrange(0, 3))] + span
        seqs.append(seq)
    want = [propose_ref(s, min_n, max_n, k) for s in seqs]
    assert sum(1 for w in want if w) >= 6  # the cases exercise matches
    assert _drafts(seqs, min_n, max_n, k, block, rng.randrange(3)) == want
