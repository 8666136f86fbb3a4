"""Decode-size (small M) projections with their neighbours fused in: one launch each.

    gemv(x, W, bias, residual)                      y = x @ W^T (+ bias) (+ residual)
    rmsnorm_gemv(x, norm_w, eps, W, bias, residual) h = x (+ residual); y = rmsnorm(h) @ W^T
    silu_mul_gemv(gate_up, W, residual)             y = (silu(gate) * up) @ W^T (+ residual)

Twins: `gemv_ref`, `rmsnorm_gemv_ref`, `silu_mul_gemv_ref`. The public functions dispatch: the
Triton kernel when `use_gemv(M, device)` (CUDA, M <= GEMV_MAX_M), else the unfused path
(`ops.rms_norm` / `ops.silu_and_mul` + cuBLAS) on CUDA, or the twin on CPU; tests call the
`*_triton` launchers directly (real launches on CUDA, the interpreter on CPU).

One kernel serves all three (`MODE` constexpr picks the activation prologue). Each program owns
BLOCK_N output columns for BLOCK_M rows and streams its [BLOCK_N, K] weight slice once, in
[BLOCK_N, BLOCK_K] tiles, reusing every tile for all rows; math in fp32, one rounding at the end.
The activation a row feeds the matmul is rounded to the model dtype first (normed, silu * up), so
the fused result equals the unfused chain up to summation order.

NOTE: block sizes come from a fixed table keyed by shape (`TUNED`, then `default_config`), never
from run-time autotuning: the kernels are captured in CUDA graphs. A row's result depends on the
config (summation order), and the config on the M bucket, so a row computed at M = 1 and at
M = 4 may differ in the last bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftgraph.kernels._triton import cdiv, next_pow2, tl, triton, triton_usable

# Rows up to which the fused kernels run. Measured on the H200 (benchmarks/results/gemv_h200.json):
# at M = 1 the fused chain of a SmolLM2-135M step takes 458 us against 680 us unfused; at M = 8
# the fused kernels lose on every shape, so only single-row steps take them.
GEMV_MAX_M = 1
# Weights above this many elements stream faster through cuBLAS at M = 1 (8B qkv, gate_up,
# down, LM heads); below it the fused kernel wins by saving launches (o_proj 10.6 vs 12.6 us).
FUSED_MAX_WEIGHT_ELEMS = 20_000_000

_PLAIN, _NORM, _SILU = 0, 1, 2
_MODE_NAMES = {_PLAIN: "plain", _NORM: "norm", _SILU: "silu"}


class GemvConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    use_dot: bool = False  # tensor-core tl.dot with rows padded to 16; else FMA + reduce


# (mode, N, K, M bucket) -> config, from `python benchmarks/bench_gemv.py --tune` on an H200.
# Shapes missing here use `default_config`.
TUNED: dict[tuple[str, int, int, int], GemvConfig] = {}


def m_bucket(m: int) -> int:
    return min(next_pow2(max(m, 1)), 16)


def default_config(mode: str, m: int, n: int, k: int, dtype: torch.dtype) -> GemvConfig:
    """Heuristic block sizes: enough programs to keep every SM streaming (about 4 per SM on an
    H200's 132), 16-byte weight loads, and a per-thread register budget that leaves room for
    several programs per SM."""
    bm = m_bucket(m)
    kp = max(16, next_pow2(k))
    if bm >= 4 and dtype in (torch.float16, torch.bfloat16):
        # tensor cores, rows padded to 16: wide column tiles keep the activation re-reads
        # (one per program, from L2) small next to the weight stream
        bn = 32 if cdiv(n, 32) >= 264 else 16
        return GemvConfig(16, bn, min(256, kp), 4, 3, True)
    if bm > 8:
        return GemvConfig(8, 2, min(256, kp), 4, 1, False)
    # one row or two: a K up to 1024 in a single masked step (all loads in flight at once)
    bk = (kp if kp <= 1024 else 512) if bm <= 2 else min(256, kp)
    bn = 16
    while bn > 1 and cdiv(n, bn) < 512:  # prefer more programs over wider tiles
        bn //= 2
    while bn > 1 and bm * bn * bk > 4096:  # fp32 products per program: about 32 per thread
        bn //= 2
    warps = 4 if bn * bk >= 1024 else 2
    return GemvConfig(bm, bn, bk, warps, 1, False)


def _config(mode: int, m: int, n: int, k: int, dtype: torch.dtype) -> GemvConfig:
    name = _MODE_NAMES[mode]
    return TUNED.get((name, n, k, m_bucket(m))) or default_config(name, m, n, k, dtype)


def pays(m: int, weight: torch.Tensor) -> bool:
    """Whether the fused kernel beats norm/activation + cuBLAS for this shape (measured)."""
    return use_gemv(m, weight.device) and weight.numel() <= FUSED_MAX_WEIGHT_ELEMS


def use_gemv(m: int, device: torch.device | str) -> bool:
    """Whether rows [m, K] should take the fused small-M kernels: on CUDA, m <= GEMV_MAX_M."""
    return torch.device(device).type == "cuda" and 0 < m <= GEMV_MAX_M


# ---- kernel ------------------------------------------------------------------------------


@triton.jit
def _gemv_kernel(
    x, res_in, norm_w, w, bias, res_add, y, res_out,
    M, N, K, eps,
    stride_xm, stride_rim, stride_wn, stride_ram, stride_ym, stride_rom,
    MODE: tl.constexpr, HAS_RES_IN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RES_ADD: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # MODE 0: a = x. MODE 1: h = x (+ res_in), a = rmsnorm(h) * norm_w, program 0 of each row
    # block writes h to res_out. MODE 2: x = [gate | up] of width 2K, a = silu(gate) * up.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    # NOTE: tail columns re-read row N - 1 (stores are masked), so weight loads need no N mask
    rn_w = tl.minimum(rn, N - 1).to(tl.int64)
    x_rows = x + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w + rn_w[:, None] * stride_wn
    act_dtype = w.dtype.element_ty

    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if MODE == 1:  # pass 1: every program recomputes its rows' rms (x is tiny, L2-resident)
        sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
        writes_res = mask_m & ((tl.zeros([BLOCK_M], dtype=tl.int32) + pid_n) == 0)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
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
        rstd = 1.0 / tl.sqrt(sumsq / K + eps)

    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif BLOCK_M == 1:  # one row: accumulate lane-wise, reduce once after the loop
        acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < K
        mask_x = mask_m[:, None] & mask_k[None, :]
        # activation tile [BLOCK_M, BLOCK_K], rounded to the model dtype
        if MODE == 2:
            g = tl.load(x_rows + rk[None, :], mask=mask_x, other=0.0).to(tl.float32)
            u = tl.load(x_rows + K + rk[None, :], mask=mask_x, other=0.0).to(tl.float32)
            a = (g / (1.0 + tl.exp(-g)) * u).to(act_dtype)
        else:
            a = tl.load(x_rows + rk[None, :], mask=mask_x, other=0.0)
            if MODE == 1:
                a = a.to(tl.float32)
                if HAS_RES_IN:
                    r = tl.load(res_in + rm.to(tl.int64)[:, None] * stride_rim + rk[None, :],
                                mask=mask_x, other=0.0).to(tl.float32)
                    a = (a + r).to(res_out.dtype.element_ty).to(tl.float32)
                nw = tl.load(norm_w + rk, mask=mask_k, other=0.0).to(tl.float32)
                a = (a * rstd[:, None] * nw[None, :]).to(act_dtype)
        # weight tile [BLOCK_N, BLOCK_K]: streamed once, never reused by this program
        if EVEN_K:
            wt = tl.load(w_rows + rk[None, :], eviction_policy="evict_first")
        else:
            wt = tl.load(w_rows + rk[None, :], mask=mask_k[None, :], other=0.0,
                         eviction_policy="evict_first")
        if USE_DOT:
            acc += tl.dot(a.to(act_dtype), tl.trans(wt))
        elif BLOCK_M == 1:
            acc3 += a.to(tl.float32) * wt.to(tl.float32)  # [1, BK] * [BN, BK]
        else:
            prod = a.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=2)
    if not USE_DOT:
        if BLOCK_M == 1:
            acc = tl.sum(acc3, axis=1)[None, :]

    mask_n = rn < N
    mask_y = mask_m[:, None] & mask_n[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_RES_ADD:
        acc += tl.load(res_add + rm.to(tl.int64)[:, None] * stride_ram + rn[None, :],
                       mask=mask_y, other=0.0).to(tl.float32)
    tl.store(y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
             acc.to(y.dtype.element_ty), mask=mask_y)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(mode: int, x2, weight, k: int, *, norm_w=None, eps=0.0, res_in=None, bias=None,
            res_add=None, out=None, config: GemvConfig | None = None):
    m, n = x2.shape[0], weight.shape[0]
    if x2.dtype != weight.dtype:
        raise ValueError(f"gemv: activations are {x2.dtype} but the weight is {weight.dtype}; "
                         "cast one so both match (the model dtype)")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = out if out is not None else torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    res_out = None
    if mode == _NORM and res_in is not None:
        res_out = torch.empty(m, k, dtype=x2.dtype, device=x2.device)  # [M, K] new residual
    if m == 0:
        return y, res_out
    cfg = config or _config(mode, m, n, k, weight.dtype)
    dummy = y
    grid = (cdiv(n, cfg.block_n), cdiv(m, cfg.block_m))
    _gemv_kernel[grid](
        x2, res_in if res_in is not None else dummy, norm_w if norm_w is not None else dummy,
        weight, bias if bias is not None else dummy, res_add if res_add is not None else dummy,
        y, res_out if res_out is not None else dummy,
        m, n, k, eps,
        x2.stride(0), res_in.stride(0) if res_in is not None else 0, weight.stride(0),
        res_add.stride(0) if res_add is not None else 0, y.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        MODE=mode, HAS_RES_IN=res_in is not None, HAS_BIAS=bias is not None,
        HAS_RES_ADD=res_add is not None, EVEN_K=k % cfg.block_k == 0, USE_DOT=cfg.use_dot,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y, res_out


def gemv_triton(x, weight, bias=None, residual=None, *, out=None, config=None) -> torch.Tensor:
    """Kernel launch of `gemv`; x [M, K], weight [N, K], bias [N], residual [M, N]."""
    k = weight.shape[1]
    x2 = _rows(x, k)
    res = _rows(residual, weight.shape[0]) if residual is not None else None
    y, _ = _launch(_PLAIN, x2, weight, k, bias=bias, res_add=res, out=out, config=config)
    return y.view(*x.shape[:-1], weight.shape[0])


def rmsnorm_gemv_triton(x, norm_weight, eps, weight, bias=None, residual=None, *, out=None,
                        config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel launch of `rmsnorm_gemv`."""
    k = weight.shape[1]
    x2 = _rows(x, k)
    res = _rows(residual, k) if residual is not None else None
    y, res_out = _launch(_NORM, x2, weight, k, norm_w=norm_weight, eps=eps, res_in=res,
                         bias=bias, out=out, config=config)
    new_residual = res_out.view(x.shape) if res_out is not None else x
    return y.view(*x.shape[:-1], weight.shape[0]), new_residual


def silu_mul_gemv_triton(gate_up, weight, residual=None, *, out=None,
                         config=None) -> torch.Tensor:
    """Kernel launch of `silu_mul_gemv`; gate_up [M, 2I], weight [N, I]."""
    k = weight.shape[1]
    x2 = _rows(gate_up, 2 * k)
    res = _rows(residual, weight.shape[0]) if residual is not None else None
    y, _ = _launch(_SILU, x2, weight, k, res_add=res, out=out, config=config)
    return y.view(*gate_up.shape[:-1], weight.shape[0])


# ---- references (fp32 math, same roundings as the kernel) ----------------------------------


def gemv_ref(x, weight, bias=None, residual=None) -> torch.Tensor:
    """y = x @ W^T (+ bias) (+ residual), accumulated in fp32, rounded once to x.dtype."""
    y = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def rmsnorm_gemv_ref(x, norm_weight, eps, weight, bias=None,
                     residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.rms_norm_ref(x, norm_weight, eps, residual)` then a linear. Returns (y, new
    residual): x + residual, or x itself when residual is None (the first layer's residual)."""
    from draftgraph.kernels.ops import rms_norm_ref

    normed, new_residual = rms_norm_ref(x, norm_weight, eps, residual)
    y = gemv_ref(normed, weight, bias)
    return y, new_residual if new_residual is not None else x


def silu_mul_gemv_ref(gate_up, weight, residual=None) -> torch.Tensor:
    """(silu(gate) * up, computed in fp32 and rounded) @ W^T (+ residual)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(gate_up.dtype)
    return gemv_ref(act, weight, residual=residual)


# ---- dispatch: fused kernel for small M, else the unfused chain ----------------------------


def _fused(x: torch.Tensor, k: int) -> bool:
    """Kernel only on CUDA (like `ops`): on CPU, even in the interpreter, the twin runs."""
    return x.is_cuda and triton_usable(x) and use_gemv(x.numel() // max(k, 1), x.device)


def gemv(x, weight, bias=None, residual=None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight[N, K]^T (+ bias [N]) (+ residual [M, N]), x.dtype."""
    if _fused(x, weight.shape[1]):
        return gemv_triton(x, weight, bias, residual)
    if x.is_cuda:
        y = F.linear(x, weight, bias)
        return y + residual if residual is not None else y
    return gemv_ref(x, weight, bias, residual)


def rmsnorm_gemv(x, norm_weight, eps, weight, bias=None,
                 residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, N], new_residual [M, K]): h = x (+ residual); y = (rmsnorm(h) * norm_weight) @ W^T
    (+ bias). new_residual is h (x itself when residual is None)."""
    if _fused(x, weight.shape[1]):
        return rmsnorm_gemv_triton(x, norm_weight, eps, weight, bias, residual)
    if x.is_cuda:
        from draftgraph.kernels import ops

        normed, new_residual = ops.rms_norm(x, norm_weight, eps, residual)
        return F.linear(normed, weight, bias), new_residual if new_residual is not None else x
    return rmsnorm_gemv_ref(x, norm_weight, eps, weight, bias, residual)


def silu_mul_gemv(gate_up, weight, residual=None) -> torch.Tensor:
    """y [M, N] = (silu(gate) * up) @ W^T (+ residual [M, N]); gate_up [M, 2I], W [N, I]."""
    if _fused(gate_up, 2 * weight.shape[1]):
        return silu_mul_gemv_triton(gate_up, weight, residual)
    if gate_up.is_cuda:
        from draftgraph.kernels import ops

        y = F.linear(ops.silu_and_mul(gate_up), weight)
        return y + residual if residual is not None else y
    return silu_mul_gemv_ref(gate_up, weight, residual)
