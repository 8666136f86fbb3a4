"""Elementwise ops of the decoder, dispatched to a Triton kernel on CUDA and to the plain
torch reference elsewhere. The references are the twins the kernel tests compare against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


# Up to this many tokens a forward's RoPE goes through tables built once for all its layers
# (`rope_tables`): at one token on a 2-core CPU, 48 us a layer against 149 for the two-half
# form, bitwise the same; over long prefill chunks the roll costs more than it saves.
ROPE_TABLE_MAX_T = 64


def rope_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [T, 1, rot_dim] fp32 at `positions`: cat(cos, cos) and cat(-sin,
    sin), with which x * cos + roll(x, rot_dim / 2) * sin is `rope_ref`'s rotation bit for
    bit (x1 cos + x2 (-sin) is x1 cos - x2 sin exactly). `memo` (one forward's dict: its
    positions do not change between layers) keeps them per cache."""
    key = ("rope", id(cos_sin_cache))
    if memo is not None and key in memo:
        return memo[key]
    cos_sin = cos_sin_cache[positions]
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    tables = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    if memo is not None:
        memo[key] = tables
    return tables


def rope_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    memo: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) RoPE. q: [T, Hq, D], k: [T, Hkv, D];
    cos_sin_cache: [max_pos, rot_dim] fp32 holding cos in the first half, sin in the second.
    A short batch with full-width rotary rotates through `rope_tables` (kept in `memo`)."""
    if cos_sin_cache.shape[-1] == q.shape[-1] and q.shape[0] <= ROPE_TABLE_MAX_T:
        cos, sin = rope_tables(positions, cos_sin_cache, memo)
        half = cos.shape[-1] // 2

        def turn(x: torch.Tensor) -> torch.Tensor:
            xf = x.float()
            return (xf * cos + xf.roll(half, -1) * sin).to(x.dtype)

        return turn(q), turn(k)
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
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    *, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out: where the normed rows go (a view of a wider buffer, say: no concatenation after)."""
    kernels = _triton_kernels(x)
    if kernels is not None:
        return kernels.rms_norm_triton(x, weight, eps, residual, out=out)
    if x.dtype == weight.dtype == torch.float32:
        # torch's own: the reference's arithmetic in one call (bitwise equal in fp32; 30
        # against 44 us a decode row on a 2-core CPU)
        if residual is not None:
            x = residual = x + residual
        normed = F.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        normed, residual = rms_norm_ref(x, weight, eps, residual)
    return (normed if out is None else out.copy_(normed)), residual


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    memo: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    kernels = _triton_kernels(q)
    if kernels is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
        return kernels.rope_triton(q, k, positions, cos_sin_cache)
    return rope_ref(q, k, positions, cos_sin_cache, memo)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernels = _triton_kernels(gate_up)
    if kernels is not None:
        return kernels.silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)
