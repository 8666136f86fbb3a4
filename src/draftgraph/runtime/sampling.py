"""Device-side, graph-safe sampling: the processed distribution, seeded draws, and the
random streams.

Randomness is a pure function of (seed, position, stream, vocabulary index): a counter-based
hash, not a stateful generator. So a seeded request draws the same tokens alone or batched,
eagerly or inside a CUDA graph, and speculative rejection sampling can draw its uniforms with
the same mechanism (another `stream`).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF

# streams of random numbers drawn at one position
STREAM_SAMPLE = 0  # token choice of plain decoding / bonus token
STREAM_ACCEPT = 1  # speculative acceptance uniform
STREAM_RESIDUAL = 2  # resampling from the residual after a rejection
STREAM_DRAFT = 3  # drafter's own sampling


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 lanes holding values in [0, 2^32)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    x = x ^ (x >> 16)
    return x


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, stream: int,
                  width: int) -> torch.Tensor:
    """[n, width] fp32 uniforms in (0, 1), a pure function of (seed, position, stream, column).

    seeds, positions: [n] int64.
    """
    col = torch.arange(width, device=seeds.device, dtype=torch.int64)
    row = _hash32(seeds * 0x9E3779B1 + _hash32(positions * 4 + stream))
    h = _hash32(row[:, None] ^ _hash32(col[None, :] + 0x632BE5AB))
    h = _hash32(h + row[:, None])
    return (h.to(torch.float32) + 0.5) * (1.0 / 4294967296.0)


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                    top_k: torch.Tensor) -> torch.Tensor:
    """The distribution a request samples from: softmax(logits / T) cut to top-k and top-p,
    renormalised. logits [n, V] fp32; temperature/top_p [n] fp32; top_k [n] int64 (<= 0: off).
    Rows with temperature 0 get a point mass on the argmax. Graph-safe (no host sync)."""
    n, vocab = logits.shape
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / t[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp_max(vocab))
    keep = ranks < k[:, None]
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep &= mass_before < top_p[:, None]
    sorted_p = sorted_p * keep
    probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    point = torch.nn.functional.one_hot(logits.argmax(dim=-1), vocab).to(probs.dtype)
    return torch.where(greedy[:, None], point, probs)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                      stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) from the hashed uniforms."""
    u = uniform_noise(seeds, positions, stream, probs.shape[-1])
    return (probs / -torch.log(u)).argmax(dim=-1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           top_k: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
           greedy_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row [n] int64: argmax for temperature 0, else a seeded draw.
    greedy_tokens: logits' argmax [n] when the caller has it already (`kernels.argmax`)."""
    greedy_tok = logits.argmax(dim=-1) if greedy_tokens is None else greedy_tokens
    probs = processed_probs(logits, temperature, top_p, top_k)
    drawn = sample_from_probs(probs, seeds, positions)
    return torch.where(temperature <= 0, greedy_tok, drawn)
