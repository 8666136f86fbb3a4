"""Tensor-parallel layers. With a TP group of one they are exactly nn.Linear / nn.Embedding.

Column-parallel projections (qkv, gate_up) need no layer of their own: each rank's nn.Linear
simply holds its rows. The row-parallel ones (o, down) hold the matching input columns and sum
the partial outputs with ONE all-reduce; the embedding holds a vocabulary shard and sums the
rows of the ranks owning each id; the LM head computes its vocabulary slice and all-gathers
the full logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftgraph.distributed.parallel import (
    TPInfo,
    all_gather_last_dim,
    all_gather_rows,
    all_reduce,
)
from draftgraph.distributed.sharding import vocab_shard
from draftgraph.kernels import gemv


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_r @ W_r^T: input features sharded, output replicated.

    `forward(x, silu_mul=True)` takes [gate | up] and multiplies silu(gate) * up first (the
    down projection). One row on CUDA runs the fused GEMV (kernels/gemv.py), SwiGLU folded in."""

    def __init__(self, in_features: int, out_features: int, tp: TPInfo) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        project = gemv.silu_mul_gemv if silu_mul else gemv.gemv
        if self.tp.size == 1:
            return project(x, self.weight)
        # the partial sums travel in fp32 and the total is rounded once, as one rank's matmul
        # rounds its own fp32 accumulator once: bf16 partials would add a rounding per rank
        return all_reduce(project(x, self.weight, out_dtype=torch.float32), self.tp).to(x.dtype)


class VocabParallelEmbedding(nn.Embedding):
    """Holds rows [vocab_start, vocab_start + padded) of the table (zero past the vocabulary)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo) -> None:
        self.vocab_start, self.num_real_rows, padded = vocab_shard(vocab_size, tp.size, tp.rank)
        super().__init__(padded, hidden)
        self.vocab_size = vocab_size
        self.tp = tp

    def reset_parameters(self) -> None:
        # nothing to draw on the meta device (`loader.empty_model`: weights are loaded next),
        # where torch's normal_ imports torch._dynamo: 1.6-3 s of every start on a CPU
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_real_rows)  # [num_tokens] bool
        x = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce(x * mine[:, None].to(x.dtype), self.tp)


def gather_vocab_rows(weight: torch.Tensor, vocab_size: int, tp: TPInfo) -> torch.Tensor:
    """The whole [vocab_size, hidden] table on every rank from each rank's padded row shard
    (a collective: every rank calls it at the same point); the weight itself without TP."""
    if tp.size == 1:
        return weight
    with torch.no_grad():
        return all_gather_rows(weight.detach(), tp)[:vocab_size]


def parallel_lm_head(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                     tp: TPInfo) -> torch.Tensor:
    """[n, hidden] -> [n, vocab] fp32 on every rank: local vocabulary slice, then all-gather."""
    logits = all_gather_last_dim(gemv.linear(hidden, weight), tp)
    if logits.shape[1] != vocab_size:
        logits = logits[:, :vocab_size]
    return logits.float()
