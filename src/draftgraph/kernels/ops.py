"""Elementwise ops of the decoder, dispatched to a Triton kernel on CUDA and to the plain
torch reference elsewhere. The references are the twins the kernel tests compare against."""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm in fp32. With `residual`, first x = x + residual; returns (normed, new residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype), residual


def rope_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) RoPE. q: [T, Hq, D], k: [T, Hkv, D];
    cos_sin_cache: [max_pos, rot_dim] fp32 holding cos in the first half, sin in the second."""
    cos_sin = cos_sin_cache[positions]
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        rot_dim = 2 * half
        xr, xp = x[..., :rot_dim].float(), x[..., rot_dim:]
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((out, xp), dim=-1) if xp.shape[-1] else out

    return rot(q), rot(k)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ---- dispatch: Triton on CUDA, the reference elsewhere ----------------------------------

_kernels = None  # the elementwise kernel module, imported on first CUDA call


def _triton_kernels(t: torch.Tensor):
    """The Triton kernel module when `t` is on CUDA and Triton imports, else None."""
    global _kernels
    if not t.is_cuda:
        return None
    if _kernels is None:
        from draftgraph.kernels._triton import HAS_TRITON

        if HAS_TRITON:
            from draftgraph.kernels import elementwise as _kernels_module

            _kernels = _kernels_module
        else:
            _kernels = False
    return _kernels or None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    kernels = _triton_kernels(x)
    if kernels is not None:
        return kernels.rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    kernels = _triton_kernels(q)
    if kernels is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
        return kernels.rope_triton(q, k, positions, cos_sin_cache)
    return rope_ref(q, k, positions, cos_sin_cache)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernels = _triton_kernels(gate_up)
    if kernels is not None:
        return kernels.silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)
