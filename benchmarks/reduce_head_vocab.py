"""A trained chain or block head over the target's whole vocabulary, re-drafting over the N
tokens most frequent in its training responses, or over another head's draft vocabulary
(`models.heads.reduce_vocab`: same weights, its LM head the target's rows of those tokens, so
each draft reads N rows instead of the vocabulary).

    python benchmarks/reduce_head_vocab.py HEAD_DIR --sequences RUN/sequences.json \
        --vocab 16384 --out DIR [--eval-sequences RUN/eval_sequences.json]
    python benchmarks/reduce_head_vocab.py RUN/best \
        --vocab-from src/draftgraph/heads/smollm2-135m-chain --out DIR

Prints the share of the training (and held-out) response tokens the reduced vocabulary covers,
and the sequences' sha256 (record both next to the head). HEAD_DIR is a whole-vocabulary head,
or a reduced chain head (its weights do not depend on its vocabulary; the shipped one over
`--vocab 32768` measured what its 16,384 tokens cost, 2026-12-07); a reduced block head is
refused. The second command is how the default model's block head got the chain head's
16,384 tokens (2026-12-07, on train-drafter's best/ of that run; the shipped files' bytes).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from draftgraph.models.heads import load_head, reduce_vocab, save_head
from draftgraph.models.loader import load_model
from draftgraph.train.loop import Sequence, frequent_response_tokens


def _read(path: str) -> tuple[list[Sequence], str]:
    with open(path) as f:
        saved = json.load(f)
    return [Sequence(s["ids"], s["prompt_len"]) for s in saved["sequences"]], saved["sha256"]


def coverage(seqs: list[Sequence], d2t: torch.Tensor, vocab_size: int) -> float:
    """The share of the sequences' response tokens that are in d2t."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[d2t] = True
    toks = torch.tensor([t for s in seqs for t in s.ids[s.prompt_len:]], dtype=torch.int64)
    return inside[toks].float().mean().item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("head")
    ap.add_argument("--model", default="default")
    ap.add_argument("--sequences", default=None, help="train-drafter's sequences.json (with "
                    "--vocab-from: only to report its coverage)")
    ap.add_argument("--eval-sequences", default=None, help="held-out sequences (coverage)")
    ap.add_argument("--vocab", type=int, default=0, help="with --sequences: N")
    ap.add_argument("--vocab-from", default=None, help="instead: a head directory whose d2t "
                    "to take")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if bool(a.vocab_from) == bool(a.vocab) or (a.vocab and not a.sequences):
        ap.error("give --vocab with --sequences, or --vocab-from")
    target = load_model(a.model).config
    seqs, sha = _read(a.sequences) if a.sequences else (None, None)
    if a.vocab_from:
        d2t = load_head(a.vocab_from, target).d2t
    else:
        d2t = frequent_response_tokens(seqs, a.vocab, target.vocab_size)
    head = reduce_vocab(load_head(a.head, target), d2t, target)
    save_head(head.to(torch.bfloat16), a.out)
    report = {"head": a.head, "out": a.out, "draft_vocab": d2t.numel()}
    if seqs is not None:
        report.update(sequences_sha256=sha, train_coverage=coverage(seqs, d2t,
                                                                     target.vocab_size))
    if a.eval_sequences:
        held, held_sha = _read(a.eval_sequences)
        report.update(held_out_sha256=held_sha,
                      held_out_coverage=coverage(held, d2t, target.vocab_size))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
