"""The raw-input schema: named lanes of one int64 buffer, and the eager step's batch.

A step body (spec/step.py) declares its raw inputs and its results as `Lanes`: per-request
fields (`[max_bs]`), per-request grids (`[max_bs, width]`) and float32 fields (packed two per
int64 lane). One schema serves the three places that used to lay the buffer out by hand:
the pinned staging buffer on the host (numpy views), its persistent twin on the device (torch
views) and the tensor-parallel control message (its size). The host writes the staging
buffer with a few slice assignments and copies it with ONE H2D transfer.

`StepBatch` is the host-side description of one eager forward (what the scheduler decided);
`to_lanes` / `from_lanes` are its tensor-parallel wire format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftgraph.attention.backend import Phase


@dataclass(frozen=True)
class Field:
    name: str
    width: int = 0  # 0: one value per request ([max_bs]); w: a [max_bs, w] grid
    dtype: torch.dtype = torch.int64  # int64 or float32
    rows: int = 0  # 0: max_bs rows; more: a field with rows past the requests' (spare rows)


class Lanes:
    """A layout of named fields for up to `max_bs` requests in one flat int64 buffer."""

    def __init__(self, max_bs: int, fields: list[Field]) -> None:
        self.max_bs = max_bs
        self.fields = fields
        self._offsets: dict[str, tuple[int, Field]] = {}
        off = 0
        for f in (f for f in fields if f.dtype == torch.int64):
            self._offsets[f.name] = (off, f)
            off += self.rows(f) * max(f.width, 1)
        self._float_base = off
        foff = 0  # float32 elements after the int64 lanes
        for f in (f for f in fields if f.dtype == torch.float32):
            self._offsets[f.name] = (foff, f)
            foff += self.rows(f) * max(f.width, 1)
        self.size = off + (foff + 1) // 2  # int64 lanes in all

    def rows(self, f: Field) -> int:
        return f.rows or self.max_bs

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of every field into `buf` ([size] int64, host or device)."""
        assert buf.dtype == torch.int64 and buf.numel() == self.size, (buf.shape, self.size)
        floats = buf[self._float_base :].view(torch.float32)
        out = {}
        for name, (off, f) in self._offsets.items():
            src = floats if f.dtype == torch.float32 else buf
            m = self.rows(f)
            n = m * max(f.width, 1)
            v = src[off : off + n]
            out[name] = v.view(m, f.width) if f.width else v
        return out

    def host_views(self, buf: torch.Tensor) -> dict:
        """numpy views of a host buffer: staging a step is a few slice assignments."""
        return {k: v.numpy() for k, v in self.views(buf).items()}


def resolve_refs(ids: torch.Tensor, ref_tokens: torch.Tensor | None) -> torch.Tensor:
    """ids [n] int64 on the device with every -(i + 1) replaced by ref_tokens[i], in place,
    with no host sync (StepBatch.ref_tokens; nothing to do without them)."""
    if ref_tokens is not None:
        ids.copy_(torch.where(ids < 0, ref_tokens[(-1 - ids).clamp_(min=0)], ids))
    return ids


@dataclass
class StepBatch:
    """Host-side description of one eager forward. Request r contributes `extend_lens[r]`
    tokens (a prefill chunk, the single decode token, or 1 + drafts in a verify step) and
    `logit_indices` names the tokens whose next-token logits are needed."""

    phase: Phase
    input_ids: list[int]  # [num_tokens]
    req_pool_indices: list[int]  # [bs]
    seq_lens: list[int]  # [bs] KV length after this forward
    extend_lens: list[int]  # [bs]
    out_cache_loc: list[int]  # [num_tokens] KV slot of each new token
    logit_indices: list[int]
    # where input ids -(i + 1) are read: row i of a graph set's output tokens on the device
    # (a decode row riding a prefill behind the step that samples its token; rank 0 only)
    ref_tokens: torch.Tensor | None = None

    def to_lanes(self) -> tuple[list[int], torch.Tensor]:
        """(header [phase, num_tokens, bs, num_logits], payload int64) for the TP message."""
        head = [list(Phase).index(self.phase), len(self.input_ids), len(self.req_pool_indices),
                len(self.logit_indices)]
        body = (self.input_ids + self.out_cache_loc + self.logit_indices
                + self.req_pool_indices + self.seq_lens + self.extend_lens)
        return head, torch.tensor(body, dtype=torch.int64)

    @staticmethod
    def from_lanes(head: list[int], payload: torch.Tensor) -> StepBatch:
        phase, n, bs, n_logits = head
        body = payload[: 2 * n + n_logits + 3 * bs].tolist()
        rows = body[2 * n + n_logits :]
        return StepBatch(list(Phase)[phase], body[:n], rows[:bs], rows[bs : 2 * bs],
                         rows[2 * bs :], body[n : 2 * n], body[2 * n : 2 * n + n_logits])
