"""CPU products of a few rows through oneDNN's blocked weights (`--row-pack`, fp32).

On the CPU a projection of 2 .. 64 rows (a speculative step's verify rows, a batched decode
step) runs MKL's GEMM well below its rate for one row: on a 2-core Xeon, SmolLM2's LM head
takes 3.5 ms for one row, 6.2 ms for 5 and 9.1 ms for 8; oneDNN's linear over a weight
reordered once into its blocked layout takes 4.2 and 4.7 ms (gate_up 331 against 472 us at
5 rows, a whole layer 645 against 799; `benchmarks/results/row_pack_products_cpu.json`). A
lone row stays fastest on the dense weight (MKL's GEMV: down 112 against 159 us) and long
prefill chunks gain little (0.9-1.3x at 128-256 rows). So each projection and the LM head
keep their dense values and carry a blocked copy for
2 .. ROWS_MAX rows, through the hook int4 uses (`kernels.gemv.PACKED_ATTR`, which
`kernels.gemv.linear` calls): twice the weight memory, hence "auto" only for models of at most
MAX_BYTES of weights. The blocked product rounds differently from MKL's (as MKL's own GEMM
rounds differently from its GEMV), so a verify row is not bitwise its decode row either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftgraph.kernels.gemv import PACKED_ATTR

ROWS_MAX = 64  # above it the blocked product stops paying (128 rows: 0.88-1.07x a shape)
ROWS_HINT = 8  # the row count oneDNN's reorder is told to expect
MAX_BYTES = 1 << 30  # "auto": models of at most this many bytes of weights


def available() -> bool:
    """Whether this torch has oneDNN's blocked linear (its CPU builds do)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class RowsLinear:
    """A weight [N, K]'s blocked copy; called as F.linear(x, weight, bias) would be: rows
    2 .. ROWS_MAX through the copy, any other count through the dense weight."""

    keeps_dense = True  # the dense weight stays authoritative (kernels.gemv.dense_form)

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = tuple(weight.shape)
        self.blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        m = x.numel() // max(x.shape[-1], 1)
        if not 1 < m <= ROWS_MAX:
            return F.linear(x, weight, bias)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(m, x.shape[-1]).contiguous(),
                                               self.blocked, bias, "none", [], "")
        return y.view(*x.shape[:-1], self.shape[0])

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 4


def wants(model: nn.Module) -> bool:
    """"auto": an fp32 CPU model of at most MAX_BYTES of weights, on a torch with oneDNN."""
    params = list(model.parameters())
    return (available() and all(p.device.type == "cpu" and p.dtype == torch.float32
                                for p in params)
            and sum(p.numel() * p.element_size() for p in params) <= MAX_BYTES)


def pack_rows_(model: nn.Module) -> int:
    """Attach a blocked copy to every projection and the LM head of a Llama-family model on
    the CPU in fp32 (weights that carry a packed form already, int4's, keep it). Returns the
    bytes the copies take."""
    if not available():
        raise ValueError("--row-pack on needs a torch with oneDNN (torch.backends.mkldnn)")
    weights = [model.lm_head_weight]
    for layer in model.layers:
        weights += [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
                    layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    total = 0
    for w in weights:
        if w.device.type != "cpu" or w.dtype != torch.float32:
            raise ValueError("--row-pack on is for fp32 weights on the CPU (--dtype float32)")
        if getattr(w, PACKED_ATTR, None) is None:
            setattr(w, PACKED_ATTR, RowsLinear(w.data))
            total += getattr(w, PACKED_ATTR).nbytes
    return total
