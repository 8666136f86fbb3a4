"""The activation prologue the small-M projections share (kernels/gemv.py, the single-row
fused kernels; kernels/matmul.py, the batch-invariant matmul): the tile of rows that feeds a
weight, computed row by row from the layer's input.

    MODE 0 (_PLAIN): a = x
    MODE 1 (_NORM):  h = x (+ res_in); a = rmsnorm(h) * norm_w   (1 / rms from `_rms_prologue`)
    MODE 2 (_SILU):  x = [gate | up] of width 2K; a = silu(gate) * up

Rounded to the weight's dtype, as the unfused chain rounds what it hands the matmul.
"""

from __future__ import annotations

from draftgraph.kernels._triton import next_pow2, tl, triton

_PLAIN, _NORM, _SILU = 0, 1, 2


@triton.jit
def _rms_prologue(x_rows, res_in, res_out, rm, mask_m, pid_n, K, eps, stride_rim, stride_rom,
                  HAS_RES_IN: tl.constexpr, BLOCK_M: tl.constexpr, NORM_BLOCK: tl.constexpr):
    # 1 / rms of each row of h = x (+ res_in); every program recomputes it (x is tiny and
    # L2-resident), program 0 of each row block writes h to res_out. NORM_BLOCK is wide (the
    # whole row where registers allow): each step of this loop is an L2 round trip that the
    # weight stream waits behind.
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    writes_res = mask_m & ((tl.zeros([BLOCK_M], dtype=tl.int32) + pid_n) == 0)
    for k0 in range(0, K, NORM_BLOCK):
        rk = k0 + tl.arange(0, NORM_BLOCK)
        mask_x = mask_m[:, None] & (rk[None, :] < K)
        h = tl.load(x_rows + rk[None, :], mask=mask_x, other=0.0).to(tl.float32)
        if HAS_RES_IN:
            r = tl.load(res_in + rm.to(tl.int64)[:, None] * stride_rim + rk[None, :],
                        mask=mask_x, other=0.0).to(tl.float32)
            h = (h + r).to(res_out.dtype.element_ty)  # rounded like x + residual
            tl.store(res_out + rm.to(tl.int64)[:, None] * stride_rom + rk[None, :], h,
                     mask=writes_res[:, None] & (rk[None, :] < K))
            h = h.to(tl.float32)
        sumsq += tl.sum(h * h, axis=1)
    return 1.0 / tl.sqrt(sumsq / K + eps)


@triton.jit
def _normed_tile(x_rows, res_in, res_out, norm_w, rm, rk, mask_x, mask_k, rstd, stride_rim,
                 act_dtype: tl.constexpr, HAS_RES_IN: tl.constexpr):
    # activation tile [BLOCK_M, BLOCK_K] = rmsnorm(x (+ res_in)) * norm_w, rounded to act_dtype
    a = tl.load(x_rows + rk[None, :], mask=mask_x, other=0.0).to(tl.float32)
    if HAS_RES_IN:
        r = tl.load(res_in + rm.to(tl.int64)[:, None] * stride_rim + rk[None, :],
                    mask=mask_x, other=0.0).to(tl.float32)
        a = (a + r).to(res_out.dtype.element_ty).to(tl.float32)
    nw = tl.load(norm_w + rk, mask=mask_k, other=0.0).to(tl.float32)
    return (a * rstd[:, None] * nw[None, :]).to(act_dtype)


@triton.jit
def _act_tile(x, res_in, res_out, norm_w, rm, mask_m, rk, mask_k, rstd, K, stride_xm,
              stride_rim, act_dtype: tl.constexpr, MODE: tl.constexpr,
              HAS_RES_IN: tl.constexpr):
    # the activation tile [rows, BLOCK_K] of rows rm (mask_m: the live ones) that feeds the
    # matmul, rounded to the model dtype
    x_rows = x + rm.to(tl.int64)[:, None] * stride_xm
    mask_x = mask_m[:, None] & mask_k[None, :]
    if MODE == 2:
        g = tl.load(x_rows + rk[None, :], mask=mask_x, other=0.0).to(tl.float32)
        u = tl.load(x_rows + K + rk[None, :], mask=mask_x, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * u).to(act_dtype)
    elif MODE == 1:
        a = _normed_tile(x_rows, res_in, res_out, norm_w, rm, rk, mask_x, mask_k, rstd,
                         stride_rim, act_dtype, HAS_RES_IN)
    else:
        a = tl.load(x_rows + rk[None, :], mask=mask_x, other=0.0)
    return a


def norm_block(k: int, block_m: int, block_k: int) -> int:
    """Width of the RMS prologue's loads: the whole row up to 4096 fp32 values per program."""
    return min(max(16, next_pow2(k)), max(block_k, 4096 // block_m))
