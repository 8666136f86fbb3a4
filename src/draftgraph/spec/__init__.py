"""Proposers and the verifier: device-side, sync-free."""

from draftgraph.spec.ngram import NgramProposer, propose_ref
from draftgraph.spec.verify import first_stop_index, greedy_accept, rejection_sample

__all__ = [
    "NgramProposer",
    "first_stop_index",
    "greedy_accept",
    "propose_ref",
    "rejection_sample",
]
