"""Device-side, graph-safe sampling: the processed distribution, seeded draws, and the
random streams.

Randomness is a pure function of (seed, position, stream, vocabulary index): a counter-based
hash, not a stateful generator. So a seeded request draws the same tokens alone or batched,
eagerly or inside a CUDA graph, and speculative rejection sampling can draw its uniforms with
the same mechanism (another `stream`).
"""

from __future__ import annotations

import torch

from draftgraph.kernels.sampling import cut_probs, race_draw, uniform_noise

__all__ = ["STREAM_ACCEPT", "STREAM_DRAFT", "STREAM_RESIDUAL", "STREAM_SAMPLE",
           "processed_probs", "sample", "sample_from_probs", "uniform_noise"]

# streams of random numbers drawn at one position
STREAM_SAMPLE = 0  # token choice of plain decoding / bonus token
STREAM_ACCEPT = 1  # speculative acceptance uniform
STREAM_RESIDUAL = 2  # resampling from the residual after a rejection
STREAM_DRAFT = 3  # drafter's own sampling


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                    top_k: torch.Tensor, argmax: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution a request samples from: softmax(logits / T) cut to top-k and top-p,
    renormalised. logits [n, V] fp32; temperature/top_p [n] fp32; top_k [n] int64 (<= 0: off);
    argmax [n] int64, the logits' argmax when the caller has it. Rows with temperature 0 get
    a point mass on the argmax. Graph-safe (no host sync).

    The cut keeps the shortest prefix of the tokens in descending order whose mass reaches
    top_p, at most top_k long, and every token tied with its last (`kernels.sampling.cut_probs`:
    on CUDA a search that sorts nothing, and a row that cuts nothing costs nothing)."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / t[:, None], dim=-1)
    if argmax is None:
        argmax = logits.argmax(dim=-1)
    return cut_probs(probs, temperature, top_p, top_k, argmax)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                      stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) from the hashed uniforms
    (`kernels.sampling`: two launches on CUDA, the torch twin elsewhere). p needs no
    normalising: a row is drawn in proportion to its weights."""
    return race_draw(probs, seeds, positions, stream)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           top_k: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
           greedy_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row [n] int64: argmax for temperature 0, else a seeded draw.
    greedy_tokens: logits' argmax [n] when the caller has it already (`kernels.argmax`)."""
    greedy_tok = logits.argmax(dim=-1) if greedy_tokens is None else greedy_tokens
    probs = processed_probs(logits, temperature, top_p, top_k, greedy_tok)
    drawn = sample_from_probs(probs, seeds, positions)
    return torch.where(temperature <= 0, greedy_tok, drawn)
