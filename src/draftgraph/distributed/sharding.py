"""How a model splits across tensor-parallel ranks: pure arithmetic, no process groups.

Attention heads are split by KV group, so every rank's query heads use only the KV heads it
holds: with K KV heads and G = H / K query heads per KV head,
  K >= tp: rank r takes K // tp KV heads (one more for r < K % tp) and their G query heads
           each. The split may be uneven: SmolLM2 (9 q / 3 kv heads) at tp = 2 gives rank 0
           kv heads 0-1 (q heads 0-5) and rank 1 kv head 2 (q heads 6-8).
  K <  tp: KV heads are replicated; tp must be a multiple of K and each group of G query
           heads is split evenly over the tp / K ranks sharing its KV head.
The MLP intermediate dimension is split as evenly as possible (sizes may differ by one row);
the vocabulary in equal padded shards of ceil(V / tp) rows, so the LM head's all-gather is
uniform (padding rows are zero and sliced off the gathered logits).
"""

from __future__ import annotations

from dataclasses import dataclass

TP_FLAG = "--tensor-parallel-size"


@dataclass(frozen=True)
class AttentionShard:
    q_start: int  # first global query head of this rank
    num_q_heads: int
    kv_start: int  # first global KV head of this rank
    num_kv_heads: int


def split_evenly(n: int, size: int, rank: int) -> tuple[int, int]:
    """(start, count) of part `rank` when n items are split into `size` near-equal parts."""
    base, rem = divmod(n, size)
    return rank * base + min(rank, rem), base + (rank < rem)


def attention_shard(num_heads: int, num_kv_heads: int, size: int, rank: int) -> AttentionShard:
    """The query and KV heads rank `rank` of `size` holds; ValueError naming the flag when the
    heads cannot be split so that each rank's query heads map to whole KV heads."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= size:
        kv_start, kv_count = split_evenly(num_kv_heads, size, rank)
        return AttentionShard(kv_start * group, kv_count * group, kv_start, kv_count)
    ranks_per_kv = size // num_kv_heads
    if size % num_kv_heads or group % ranks_per_kv:
        raise ValueError(
            f"{TP_FLAG} {size} cannot split {num_heads} query heads over {num_kv_heads} KV "
            f"heads: with fewer KV heads than ranks, the size must be a multiple of the KV "
            f"heads and divide each KV head's {group} query heads (try a size <= "
            f"{num_kv_heads}, or a divisor of {num_heads} that is a multiple of "
            f"{num_kv_heads})")
    q_per_rank = group // ranks_per_kv
    return AttentionShard(rank * q_per_rank, q_per_rank, rank // ranks_per_kv, 1)


def vocab_shard(vocab_size: int, size: int, rank: int) -> tuple[int, int, int]:
    """(start, count, padded) of this rank's vocabulary rows: shards are `padded` =
    ceil(V / size) rows each, the last one holding fewer real rows."""
    padded = -(-vocab_size // size)
    start = min(rank * padded, vocab_size)
    return start, min(padded, vocab_size - start), padded
