"""Prompt-lookup n-gram proposer: the device version against its plain-python twin."""

import random

import pytest
import torch

from draftgraph.spec.ngram import NgramProposer, propose_ref


def _propose_batch(proposer: NgramProposer, seqs: list[list[int]],
                   pad_token: int = 0) -> list[list[int]]:
    """Run the device proposer on right-padded rows and return each row's active drafts."""
    width = max(len(s) for s in seqs) + 3
    token_buffer = torch.full((len(seqs), width), pad_token, dtype=torch.int64)
    for row, seq in enumerate(seqs):
        token_buffer[row, :len(seq)] = torch.tensor(seq, dtype=torch.int64)
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    draft_tokens, num_draft_tokens = proposer.propose(token_buffer, lens)
    assert draft_tokens.shape == (len(seqs), proposer.k) and draft_tokens.dtype == torch.int64
    drafts = []
    for row in range(len(seqs)):
        n = int(num_draft_tokens[row])
        assert bool((draft_tokens[row, n:] == 0).all())  # padding is 0
        drafts.append(draft_tokens[row, :n].tolist())
    return drafts


def test_ngram_ref_cases() -> None:
    # no earlier occurrence of any suffix
    assert propose_ref([1, 2, 3, 4, 5], 1, 3, 4) == []
    # the suffix [3, 4] occurred before: propose what followed it
    assert propose_ref([3, 4, 10, 11, 12, 13, 14, 3, 4], 1, 3, 3) == [10, 11, 12]
    # a match near the end has fewer than k followers
    assert propose_ref([1, 2, 3, 9, 1, 2, 3], 2, 3, 5) == [9, 1, 2, 3]
    # multiple matches: the most recent wins
    assert propose_ref([5, 6, 1, 5, 6, 2, 5, 6], 2, 2, 1) == [2]
    # the longest n wins over a more recent shorter match
    assert propose_ref([7, 5, 6, 1, 8, 5, 6, 2, 7, 5, 6], 1, 3, 2) == [1, 8]
    # an occurrence may overlap the suffix but must end before it
    assert propose_ref([4, 4, 4], 2, 2, 3) == [4]
    assert propose_ref([4, 4], 2, 2, 3) == []
    # n below min_n does not count
    assert propose_ref([1, 2, 9, 2], 2, 3, 3) == []
    assert propose_ref([], 1, 3, 3) == [] and propose_ref([1], 1, 3, 3) == []


def test_ngram_device_matches_ref_on_edge_cases() -> None:
    proposer = NgramProposer(min_n=1, max_n=3, k=4)
    seqs = [
        [1, 2, 3, 4, 5],  # no match
        [1, 2, 3, 9, 1, 2, 3],  # fewer than k followers
        [5, 6, 1, 5, 6, 2, 5, 6],  # most recent of several
        [7, 5, 6, 1, 8, 5, 6, 2, 7, 5, 6],  # longest n wins
        [4, 4, 4],
        [4],
        [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9],
    ]
    want = [propose_ref(s, 1, 3, 4) for s in seqs]
    assert want[0] == [] and want[1] == [9, 1, 2, 3] and want[3] == [1, 8, 5, 6]
    # padding that would extend matches must be ignored: pad with a token that occurs
    for pad_token in (0, 9, 4):
        assert _propose_batch(proposer, seqs, pad_token) == want


@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 3), (1, 3, 5), (2, 4, 2), (3, 3, 8)])
def test_ngram_device_matches_ref_on_random_sequences(min_n, max_n, k) -> None:
    rng = random.Random(min_n * 100 + max_n * 10 + k)
    proposer = NgramProposer(min_n, max_n, k)
    for _ in range(10):
        seqs = []
        for _ in range(16):
            vocab = rng.choice([3, 8, 50])
            seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
            # plant repeats: copy an earlier span to the end, sometimes a few times
            for _ in range(rng.randrange(0, 3)):
                if len(seq) > 2:
                    start = rng.randrange(len(seq) - 1)
                    span = seq[start:start + rng.randrange(1, 8)]
                    seq += [rng.randrange(vocab) for _ in range(rng.randrange(0, 3))] + span
            seqs.append(seq or [rng.randrange(vocab)])
        want = [propose_ref(s, min_n, max_n, k) for s in seqs]
        assert _propose_batch(proposer, seqs, pad_token=rng.randrange(3)) == want


def test_ngram_propose_is_static_shape() -> None:
    proposer = NgramProposer(1, 3, 4)
    token_buffer = torch.zeros(2, 32, dtype=torch.int64, device="meta")
    draft_tokens, num_draft_tokens = proposer.propose(token_buffer,
                                                      torch.zeros(2, dtype=torch.int64,
                                                                  device="meta"))
    assert draft_tokens.shape == (2, 4) and num_draft_tokens.shape == (2,)


def test_ngram_proposer_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(0, 3, 4)
    with pytest.raises(ValueError, match="max_n"):
        NgramProposer(3, 2, 4)
    with pytest.raises(ValueError, match="k"):
        NgramProposer(1, 3, 0)
