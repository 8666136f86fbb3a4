"""Fused elementwise kernels of the decoder: RMSNorm (+ residual add), neox RoPE, SiLU * mul.

Twins: `rms_norm_ref`, `rope_ref`, `silu_and_mul_ref` in `draftgraph.kernels.ops`. Each kernel is
one launch with one program per token (silu_and_mul: per token and column block); math in fp32,
one rounding to the output dtype. Each waits for the kernel before under programmatic dependent
launch (`_triton.pdl_kwargs`).
"""

import torch

from draftgraph.kernels._triton import cdiv, next_pow2, pdl_kwargs, pdl_wait, tl, triton


def row_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


@triton.jit
def _rms_norm_kernel(
    x, weight, residual, out, residual_out, n_cols, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    xv = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        rv = tl.load(residual + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (xv + rv).to(residual_out.dtype.element_ty)  # rounded like x + residual
        tl.store(residual_out + row * stride_ro + cols, summed, mask=mask)
        xv = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / n_cols + eps)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + cols, (xv * rstd * w).to(out.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    *, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same semantics as `rms_norm_ref`: returns (normed, x + residual or None); the normed
    rows written into `out` ([..., hidden], unit stride over hidden) when given."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, n_cols = x2.shape
    given = out
    if out is None:
        out = torch.empty(rows, n_cols, dtype=x.dtype, device=x.device)  # [rows, hidden]
    else:
        assert out.shape == shape and out.stride(-1) == 1 and out.dtype == x.dtype
        out = out if out.dim() == 2 else out.view(rows, n_cols)  # a view, or it raises
    if residual is not None:
        r2 = residual.reshape(-1, n_cols)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        residual_out = torch.empty(rows, n_cols, dtype=x.dtype, device=x.device)
    else:
        r2, residual_out = x2, out  # unused
    if rows:
        block = next_pow2(n_cols)
        _rms_norm_kernel[(rows,)](
            x2, weight, r2, out, residual_out, n_cols, eps,
            x2.stride(0), r2.stride(0), out.stride(0), residual_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=row_warps(block),
            **pdl_kwargs(x2),
        )
    new_residual = residual_out.view(shape) if residual is not None else None
    return (out.view(shape) if given is None else given), new_residual


@triton.jit
def rotate(x1, x2, cos, sin):
    # RoPE's rotation of a pair of halves in fp32, each output one explicit fma over one
    # product, so every kernel that rotates (these, the gemv's and the matmul's qkv epilogues)
    # rounds alike: left to itself the compiler contracts x1 * cos - x2 * sin into either
    # fma, and the H100 gave the matmul's epilogue and this kernel different fp32 bits
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@triton.jit
def _cos_sin(cos_sin_cache, pos, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # [1, BLOCK_HALF] fp32 cos and sin of position pos (cache rows: cos | sin)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cs = cos_sin_cache + pos * stride_cs
    cos = tl.load(cs + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rope_heads(
    src, dst, t, stride_st, stride_sh, stride_dt, stride_dh, cos, sin, num_heads,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, COPY_TAIL: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (i < HALF)
    s = src + t * stride_st + h * stride_sh
    d = dst + t * stride_dt + h * stride_dh
    x1 = tl.load(s + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(s + HALF + i, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate(x1, x2, cos, sin)
    tl.store(d + i, o1.to(dst.dtype.element_ty), mask=mask)
    tl.store(d + HALF + i, o2.to(dst.dtype.element_ty), mask=mask)
    if COPY_TAIL:  # partial rotary, out of place: dims past the rotary part pass through
        j = tl.arange(0, BLOCK_D)[None, :]
        tail = (h < num_heads) & (j >= 2 * HALF) & (j < HEAD_DIM)
        tl.store(d + j, tl.load(s + j, mask=tail), mask=tail)


@triton.jit
def _rope_kernel(
    q, k, q_out, k_out, positions, cos_sin_cache,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, COPY_TAIL: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_cache, pos, stride_cs, HALF, BLOCK_HALF)
    _rope_heads(q, q_out, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                NUM_Q_HEADS, HALF, HEAD_DIM, COPY_TAIL, BLOCK_HQ, BLOCK_HALF, BLOCK_D)
    _rope_heads(k, k_out, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                NUM_KV_HEADS, HALF, HEAD_DIM, COPY_TAIL, BLOCK_HK, BLOCK_HALF, BLOCK_D)


def rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same semantics as `rope_ref`. q [T, Hq, D], k [T, Hkv, D] (head_dim contiguous);
    cos_sin_cache [max_pos, rot_dim]. `inplace=True` rotates q and k where they are."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1, "rope needs a contiguous head_dim"
    half = cos_sin_cache.shape[-1] // 2
    if inplace:
        q_out, k_out = q, k
    else:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # [T, Hkv, D]
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, HEAD_DIM=head_dim,
            COPY_TAIL=(not inplace) and 2 * half < head_dim,
            BLOCK_HQ=next_pow2(num_q_heads), BLOCK_HK=next_pow2(num_kv_heads),
            BLOCK_HALF=next_pow2(half), BLOCK_D=next_pow2(head_dim),
            num_warps=row_warps(num_q_heads * head_dim), **pdl_kwargs(q),
        )
    return q_out, k_out


@triton.jit
def _rope_store_kv_kernel(
    q, k, v, q_out, k_cache, v_cache, out_cache_loc, positions, cos_sin_cache,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, COPY_TAIL: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    # RoPE on q (into q_out) and on k straight into its KV slot; v copied to its slot.
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    slot = tl.load(out_cache_loc + t).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_cache, pos, stride_cs, HALF, BLOCK_HALF)
    _rope_heads(q, q_out, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                NUM_Q_HEADS, HALF, HEAD_DIM, COPY_TAIL, BLOCK_HQ, BLOCK_HALF, BLOCK_D)
    _rope_heads(k, k_cache + slot * stride_kcs, t, stride_kt, stride_kh, 0, stride_kch, cos,
                sin, NUM_KV_HEADS, HALF, HEAD_DIM, 2 * HALF < HEAD_DIM, BLOCK_HK, BLOCK_HALF,
                BLOCK_D)
    h = tl.arange(0, BLOCK_HK)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    vt = tl.load(v + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache + slot * stride_vcs + h * stride_vch + d,
             vt.to(v_cache.dtype.element_ty), mask=mask)


def rope_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> torch.Tensor:
    """One launch for `rope_ref` + `store_kv_ref`: returns rotated q [T, Hq, D]; the rotated k
    and v go straight into k_cache / v_cache at out_cache_loc (k itself is not modified)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    half = cos_sin_cache.shape[-1] // 2
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    if num_tokens:
        _rope_store_kv_kernel[(num_tokens,)](
            q, k, v, q_out, k_cache, v_cache, out_cache_loc, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, HEAD_DIM=head_dim,
            COPY_TAIL=2 * half < head_dim,
            BLOCK_HQ=next_pow2(num_q_heads), BLOCK_HK=next_pow2(num_kv_heads),
            BLOCK_HALF=next_pow2(half), BLOCK_D=next_pow2(head_dim),
            num_warps=row_warps(num_q_heads * head_dim), **pdl_kwargs(q),
        )
    return q_out


@triton.jit
def _silu_and_mul_kernel(gate_up, out, n_cols, stride_in, stride_out, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_up + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out + row * stride_out + cols, y.to(out.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: silu(gate) * up."""
    shape = gate_up.shape
    x = gate_up.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, n_cols = x.shape[0], shape[-1] // 2
    out = torch.empty(rows, n_cols, dtype=x.dtype, device=x.device)  # [rows, I]
    if rows:
        block = min(1024, next_pow2(n_cols))
        _silu_and_mul_kernel[(rows, cdiv(n_cols, block))](
            x, out, n_cols, x.stride(0), out.stride(0), BLOCK=block, num_warps=row_warps(block),
            **pdl_kwargs(x),
        )
    return out.view(*shape[:-1], n_cols)
