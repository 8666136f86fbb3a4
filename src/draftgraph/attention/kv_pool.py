"""Per-layer K and V buffers of one model, indexed by KV slot (the slot space is shared by
every model of an engine: `runtime.slot_space`)."""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K and V buffers: [num_slots, num_kv_heads, head_dim] each."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(num_layers)]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_buffers + self.v_buffers)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K and V of slots `src` into slots `dst` ([n] int64 each; every source
        is read before any destination is written, so they may overlap)."""
        for buf in self.k_buffers + self.v_buffers:
            buf[dst] = buf[src]
