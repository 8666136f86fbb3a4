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
        # one tensor [2, layers, slots, Hkv, D]: a layer's K or V is a contiguous view of it,
        # and a slot copy across every layer (`copy_slots`) is one gather and one scatter
        try:
            self.kv = torch.zeros(2, num_layers, num_slots, num_kv_heads, head_dim, dtype=dtype,
                                  device=device)
        except (MemoryError, RuntimeError) as e:  # the CPU allocator's or CUDA's out of memory
            if isinstance(e, RuntimeError) and "alloc" not in str(e) and \
                    "out of memory" not in str(e):
                raise
            size = 2 * num_layers * num_slots * num_kv_heads * head_dim * dtype.itemsize
            raise ValueError(f"no memory for a KV pool of {num_slots} slots ({size / 2**30:.1f} "
                             f"GiB on {device}): lower --kv-cache-tokens ({e.__class__.__name__})"
                             ) from None
        self.k_buffers = [self.kv[0, i] for i in range(num_layers)]
        self.v_buffers = [self.kv[1, i] for i in range(num_layers)]

    def bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K and V of slots `src` into slots `dst` ([n] int64 each; every source
        is read before any destination is written, so they may overlap)."""
        self.kv[:, :, dst] = self.kv[:, :, src]
