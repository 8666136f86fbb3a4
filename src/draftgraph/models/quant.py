"""CPU int4 weights (`--quantization int4`): a memory-bound CPU decode reads 4-bit weights.

A decode step on the CPU streams every weight once: fp32 SmolLM2-135M is 540 MB per token, at
the ~8 GB/s a 2-core VM sustains about 70 ms. With `int4` each projection (qkv, o, gate_up, down)
keeps 4-bit codes in groups of GROUP along the input dimension, one bf16 scale and offset per
group (w = (q - 8) * scale + zero: the layout of torch's CPU int4 matmul,
`_weight_int4pack_mm_for_cpu`): 5 bits a weight, 6.4x fewer bytes. Its activations enter in
bf16 (that kernel's fast path: 25x faster than fp32 inputs) and the result returns in the
model's dtype. A GGUF Q4_1 weight (groups of 32, w = d * q + m) comes back as its own codes;
only d and m are rounded from fp16 to bf16. The LM head gets an fp16 copy instead: the default
model's is Q8_0, and at 4 bits (or bf16) greedy decoding leaves fp32's top-1 far more often
(`benchmarks/eval_int4_cpu.py`). Approximate, hence opt-in: no longer fp32-exact.

The dense projection weights are dropped (a zero-stride stand-in keeps their shape); the LM
head keeps its dense form too (tied, the embedding lookups read it; untied, a chain head
gathers its rows for a reduced vocabulary). Every CPU projection goes through
`kernels.gemv.linear`, which calls the packed form when a weight carries one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftgraph.kernels.gemv import PACKED_ATTR, dense_form

GROUP = 32


class Int4Linear:
    """The packed form of one weight [N, K]; called as F.linear(x, weight, bias) would be."""

    def __init__(self, weight: torch.Tensor, group: int = GROUP) -> None:
        n, k = weight.shape
        if k % group:
            raise ValueError(f"int4: input dimension {k} is not a multiple of the group {group}")
        w = weight.detach().float().view(n, k // group, group)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        codes = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
        zero = lo + 8 * scale
        self.shape = (n, k)
        self.group = group
        # [K / group, N, 2]: scale then offset of each group, as the CPU kernel reads them
        self.scales_zeros = torch.stack((scale.view(n, -1), zero.view(n, -1)), dim=-1) \
            .transpose(0, 1).contiguous().to(torch.bfloat16)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, k).to(torch.bfloat16), self.packed, self.group, self.scales_zeros)
        y = y.to(x.dtype).view(*x.shape[:-1], n)
        return y + bias if bias is not None else y

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] fp32 this form multiplies by (tests)."""
        n, k = self.shape  # fp32 in, fp32 out: (q - 8) * scale + zero unrounded (slow path)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            torch.eye(k), self.packed, self.group, self.scales_zeros.float()).t().contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + \
            self.scales_zeros.numel() * self.scales_zeros.element_size()


class HalfLinear:
    """An fp16 copy of a weight [N, K] (the LM head under int4: an 8-bit GGUF table loses too
    much at 4 bits, and fp16 keeps fp32's top-1 where bf16 does not)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().to(torch.float16)
        self.shape = tuple(weight.shape)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x.to(torch.float16), self.weight).to(x.dtype)
        return y + bias if bias is not None else y

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def _pack(param: nn.Parameter, form, drop_dense: bool) -> int:
    """Attach the packed form to `param` (once: a shared model is packed already); drop its
    dense values unless something else reads them. Returns the bytes a step reads."""
    if dense_form(param):  # none yet, or a row-packed copy (int4 replaces it)
        setattr(param, PACKED_ATTR, form(param.data))
        if drop_dense:  # a stride-0 stand-in keeps the shape the dispatch reads
            param.data = torch.zeros(1, dtype=param.dtype).expand(param.shape)
    return getattr(param, PACKED_ATTR).nbytes


def quantize_int4_(model: nn.Module) -> dict:
    """Pack the projections (int4) and the LM head (fp16) of a Llama-family model in place, on
    the CPU. Returns {"packed": weights, "bytes_before" / "bytes_after": what a step reads}."""
    if any(p.is_cuda for p in model.parameters()):
        raise ValueError("--quantization int4 is a CPU path (torch's CPU int4 matmul); "
                         "on a GPU run --dtype bfloat16")
    if model.tp.size > 1:
        raise ValueError("--quantization int4 does not run under --tensor-parallel-size > 1")
    weights = []
    for layer in model.layers:
        weights += [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
                    layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    head = model.lm_head_weight
    before = sum(w.numel() * w.element_size() for w in [*weights, head])
    after = sum(_pack(w, Int4Linear, drop_dense=True) for w in weights)
    after += _pack(head, HalfLinear, drop_dense=False)
    return {"packed": len(weights) + 1, "bytes_before": before, "bytes_after": after}
