"""Batch-invariant matmul for `--deterministic`: y = x @ W^T (+ bias) (+ residual) in which a
row's result depends only on that row and the weight: not on M, not on where the row sits in
the batch, not on its batch-mates.

    dot_linear(x, W, bias, residual, out_dtype)     x [M, K], W [N, K] -> y [M, N]

It is also `--tensor-core-rows`' matmul (kernels/gemv.py: DOT_ROWS), and its epilogues take a
layer's small kernels in, each bitwise the kernel it replaces (the same roundings, the same
arithmetic): SwiGLU (`dot_linear(silu_mul=True)`: gate and up rows in two accumulators over
one activation tile), the next layer's input norm in the K-chunk combine
(`dot_linear_rmsnorm`), and RoPE with the KV store (`dot_qkv_rope_store`: a head's two halves
in two accumulators). The loads stay pure: a fusion into them (the norm formed while loading
the activation) cost 47 % of a tree round (benchmarks/NOTES.md, stop 45).

How: ONE config per weight shape (N, K), never chosen by M (`dot_config`). A program owns a
[BLOCK_M, BLOCK_N] tile of the output and walks K with tensor cores (tl.dot accumulating into
its fp32 tile), rows past M masked to zero, so every row takes the same instructions in the
same order whatever M is. Long K splits into `split_k` chunks of a fixed length (more
programs streaming the weight at small M); each chunk's fp32 partial goes to scratch and a
second kernel adds the chunks in order 0, 1, ..., then bias and residual, and rounds once.
cuBLAS is what this replaces on that path: it picks kernels (and split-K) by M, so a row of
a 5-row verify step and the same row decoded alone differ in their last bits.

Every M takes this kernel, prefill included (a prompt's KV then does not depend on what was
prefilled with it). Its price against cuBLAS and the fused single-row kernels is measured in
benchmarks/NOTES.md ("`--deterministic`: batch invariance on the GPU").

NOTE: block sizes come from `DOT_TUNED` / `dot_config`, never from run-time autotuning: the
kernel is captured in CUDA graphs, and a row's bits depend on the config.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftgraph.kernels._triton import cdiv, next_pow2, pdl_kwargs, pdl_wait, tl, triton
from draftgraph.kernels.elementwise import rotate, row_warps  # epilogues round as they do


class DotConfig(NamedTuple):
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1  # K chunks of fixed length, each a program; added in a fixed order
    num_warps: int = 4
    num_stages: int = 3


# (N, K) -> config: the fastest of 64-row configs at M = 1 and 5 in a sweep on an H200
# (`python benchmarks/bench_deterministic.py kernels`, benchmarks/results/dot_sweep_h200.json;
# us per call at M = 1 / 5 in CUDA graphs, cuBLAS's and the fused single-row kernel's in
# brackets). 16-row tiles were as fast at M <= 5 but 2-6x slower at M = 512 (prefill), which
# takes the same config. Shapes not listed take `dot_config`'s heuristic.
DOT_TUNED: dict[tuple[int, int], DotConfig] = {
    # SmolLM2-135M
    (960, 576): DotConfig(64, 32, 64, 1, 4, 4),  # qkv: 3.0 / 3.0 (3.6 / 3.5, 2.3)
    (576, 576): DotConfig(64, 32, 64, 1, 4, 4),  # o: 3.1 / 3.1 (3.4 / 3.4, 2.1)
    (3072, 576): DotConfig(64, 32, 64, 1, 4, 4),  # gate_up: 3.2 / 3.2 (3.5 / 3.4, 2.9)
    (576, 1536): DotConfig(64, 32, 64, 4, 4, 4),  # down: 4.0 / 4.0 (4.9 / 4.7, 2.5)
    (49152, 576): DotConfig(64, 64, 64, 1, 4, 4),  # LM head: 17.5 / 18.1 (16.6 / 16.8, 25.0)
    # Llama-3.2-1B
    (3072, 2048): DotConfig(64, 32, 64, 1, 4, 4),  # qkv: 6.2 / 6.3 (5.5 / 5.4, 3.9)
    (2048, 2048): DotConfig(64, 64, 64, 4, 4, 4),  # o: 5.0 / 5.1 (5.2 / 5.2, 3.3)
    (16384, 2048): DotConfig(64, 64, 128, 1, 4, 3),  # gate_up: 19.0 / 19.0 (18.3 / 18.4, 18.7)
    (2048, 8192): DotConfig(64, 64, 128, 4, 4, 3),  # down: 9.3 / 9.3 (11.1 / 9.8, 12.6)
    (128256, 2048): DotConfig(64, 64, 128, 1, 4, 3),  # LM head: 127 / 129 (128 / 128, 121)
    # Llama-3.1-8B
    (6144, 4096): DotConfig(64, 64, 64, 4, 4, 4),  # qkv: 13.9 / 14.3 (14.6 / 13.4, 14.1)
    (4096, 4096): DotConfig(64, 64, 128, 4, 4, 3),  # o: 8.8 / 8.8 (10.3 / 9.6, 7.9)
    (28672, 4096): DotConfig(64, 64, 128, 1, 4, 3),  # gate_up: 59.7 / 60.5 (56.7 / 57.5, 56.0)
    (4096, 14336): DotConfig(64, 64, 128, 4, 4, 3),  # down: 31.8 / 32.2 (32.5 / 32.7, 31.4)
    (128256, 4096): DotConfig(64, 64, 64, 1, 4, 3),  # LM head: 244 / 246 (247 / 248, 240)
}

# programs the heuristic aims for at M <= block_m: about two per SM of an H200 (132 SMs); a
# constant, not the device's SM count, so a shape's config (and its bits) is the same anywhere
TARGET_PROGRAMS = 264


def dot_config(n: int, k: int) -> DotConfig:
    """A shape's config: the tuned entry, else what the sweep favoured: 64 x 64 output tiles
    (32 columns for a narrow weight), 128-wide K steps for long rows, and K chunks of at
    least 1024 up to about TARGET_PROGRAMS programs at M <= 64."""
    if (n, k) in DOT_TUNED:
        return DOT_TUNED[(n, k)]
    bn = 64 if n >= 2048 else 32
    split = max(1, min(cdiv(TARGET_PROGRAMS, cdiv(n, bn)), k // 1024, 4))
    return DotConfig(64, bn, 128 if k >= 2048 else 64, split, 4, 3 if k >= 2048 else 4)


def _k_split(k: int, cfg: DotConfig) -> int:
    """Length of one K chunk: a multiple of block_k (every chunk starts on a tile)."""
    return cdiv(cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k


@triton.jit
def _k_walk(x_rows, w_rows, w2_rows, mask_m, k_lo, k_hi, PAIR: tl.constexpr,
            EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # the product of rows x_rows with weight rows w_rows over K [k_lo, k_hi) in fp32 tiles;
    # PAIR: also with w2_rows (a second accumulator over the same activation tiles)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(x_rows + rk[None, :], mask=mask_m[:, None], other=0.0)
            b = tl.load(w_rows + rk[None, :], eviction_policy="evict_first")
            if PAIR:
                b2 = tl.load(w2_rows + rk[None, :], eviction_policy="evict_first")
        else:
            mask_k = rk < k_hi
            a = tl.load(x_rows + rk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(w_rows + rk[None, :], mask=mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            if PAIR:
                b2 = tl.load(w2_rows + rk[None, :], mask=mask_k[None, :], other=0.0,
                             eviction_policy="evict_first")
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        if PAIR:
            acc2 = tl.dot(a, tl.trans(b2), acc2, input_precision=PRECISION)
    return acc, acc2


@triton.jit(do_not_specialize=["M"])  # M varies step to step: one compiled kernel for all
def _dot_kernel(
    x, w, y, part, bias, res, M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_ym, stride_rm,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    SILU_MUL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)  # every program, before its first load
    # Row blocks are the fastest grid axis: the programs that share a weight tile run
    # together, and all but the first read it from L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < N
    # tail columns re-read row N - 1 (their stores are masked): no N mask on weight loads
    w_rows = w + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    x_rows = x + rm.to(tl.int64)[:, None] * stride_xm
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    up_rows = w_rows
    if SILU_MUL:  # w is [gate | up] ([2N, K]): this program also walks the up rows N + rn
        up_rows = w + (tl.minimum(rn, N - 1) + N).to(tl.int64)[:, None] * stride_wn
    acc, acc_up = _k_walk(x_rows, w_rows, up_rows, mask_m, k_lo, k_hi, SILU_MUL, EVEN_K,
                          PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = mask_m[:, None] & mask_n[None, :]
    if SILU_MUL:
        # gate and up rounded to y's dtype first, then `_silu_and_mul_kernel`'s arithmetic:
        # bitwise the product [M, 2N] followed by that kernel
        g = acc.to(y.dtype.element_ty).to(tl.float32)
        u = acc_up.to(y.dtype.element_ty).to(tl.float32)
        acc = g / (1.0 + tl.exp(-g)) * u
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            acc += tl.load(res + rm.to(tl.int64)[:, None] * stride_rm + rn[None, :],
                           mask=mask, other=0.0).to(tl.float32)
        tl.store(y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
                 acc.to(y.dtype.element_ty), mask=mask)
    else:  # this chunk's partial: part [SPLIT, M, N] fp32
        tl.store(part + (pid_k * M + rm.to(tl.int64))[:, None] * N + rn[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _combine_kernel(part, y, bias, res, M, N, stride_ym, stride_rm, HAS_BIAS: tl.constexpr,
                    HAS_RES: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    # y = part[0] + part[1] + ... + part[SPLIT - 1] (+ bias) (+ residual), in that order
    pdl_wait(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    size = M.to(tl.int64) * N
    mask = offs < size
    row = offs // N
    col = offs % N
    acc = tl.load(part + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part + s * size + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(res + row * stride_rm + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + row * stride_ym + col, acc.to(y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _combine_rmsnorm_kernel(part, res, res_out, out, norm_weight, M, N, eps, stride_rm,
                            stride_rom, stride_om, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):
    # one row a program: y = part[0] + ... + part[SPLIT - 1] rounded to out's dtype (as
    # `_combine_kernel` rounds it), then `_rms_norm_kernel`'s arithmetic on (y, res): the new
    # residual y + res and its norm
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    size = M.to(tl.int64) * N
    acc = tl.load(part + row * N + cols, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part + s * size + row * N + cols, mask=mask, other=0.0)
    xv = acc.to(out.dtype.element_ty).to(tl.float32)
    rv = tl.load(res + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (xv + rv).to(res_out.dtype.element_ty)
    tl.store(res_out + row * stride_rom + cols, summed, mask=mask)
    xv = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / N + eps)
    w = tl.load(norm_weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_om + cols, (xv * rstd * w).to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _dot_rope_kernel(
    x, w, bias, q_out, k_cache, v_cache, out_cache_loc, positions, cos_sin_cache, M, K,
    stride_xm, stride_wn, stride_qot, stride_qoh, stride_kcs, stride_kch, stride_vcs,
    stride_vch, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    # qkv = x @ w^T (+ bias) for one head a program (its two halves, BLOCK_N = head_dim / 2
    # columns each, in two accumulators), rounded to the model's dtype as the product stores
    # it, then `_rope_store_kv_kernel`'s arithmetic: q heads rotated into q_out, k heads
    # rotated into their KV slots, v heads copied there
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rm < M
    i = tl.arange(0, BLOCK_N)
    rn = head * 2 * BLOCK_N + i  # the head's first half; its second half is rn + BLOCK_N
    x_rows = x + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w + rn.to(tl.int64)[:, None] * stride_wn
    acc, acc2 = _k_walk(x_rows, w_rows, w_rows + BLOCK_N * stride_wn, mask_m, 0, K, True,
                        EVEN_K, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias + rn).to(tl.float32)[None, :]
        acc2 += tl.load(bias + rn + BLOCK_N).to(tl.float32)[None, :]
    x1 = acc.to(q_out.dtype.element_ty).to(tl.float32)
    x2 = acc2.to(q_out.dtype.element_ty).to(tl.float32)
    mask = mask_m[:, None]
    rows = rm.to(tl.int64)[:, None]
    if head < NUM_Q_HEADS + NUM_KV_HEADS:  # q or k: rotated by each row's position
        pos = tl.load(positions + rm, mask=mask_m, other=0).to(tl.int64)
        cs = cos_sin_cache + pos[:, None] * stride_cs + i[None, :]
        cos = tl.load(cs, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(cs + BLOCK_N, mask=mask, other=0.0).to(tl.float32)
        o1, o2 = rotate(x1, x2, cos, sin)
        if head < NUM_Q_HEADS:
            d = q_out + rows * stride_qot + head * stride_qoh + i[None, :]
            tl.store(d, o1.to(q_out.dtype.element_ty), mask=mask)
            tl.store(d + BLOCK_N, o2.to(q_out.dtype.element_ty), mask=mask)
        else:
            slot = tl.load(out_cache_loc + rm, mask=mask_m, other=0).to(tl.int64)
            d = k_cache + slot[:, None] * stride_kcs + (head - NUM_Q_HEADS) * stride_kch \
                + i[None, :]
            tl.store(d, o1.to(k_cache.dtype.element_ty), mask=mask)
            tl.store(d + BLOCK_N, o2.to(k_cache.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(out_cache_loc + rm, mask=mask_m, other=0).to(tl.int64)
        d = v_cache + slot[:, None] * stride_vcs \
            + (head - NUM_Q_HEADS - NUM_KV_HEADS) * stride_vch + i[None, :]
        tl.store(d, x1.to(v_cache.dtype.element_ty), mask=mask)
        tl.store(d + BLOCK_N, x2.to(v_cache.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def num_chunks(weight: torch.Tensor, config: DotConfig | None = None) -> int:
    """K chunks a product with `weight` [N, K] is summed in (its shape's config): 1 means no
    combine kernel (SwiGLU can go in the matmul's epilogue), more means a combine (the next
    norm can go there)."""
    n, k = weight.shape
    return cdiv(k, _k_split(k, config or dot_config(n, k)))


def _launch_dot(x2, weight, y, part, bias, res, n, cfg, silu_mul) -> None:
    """Launch `_dot_kernel` for rows x2 [M, K]: into y, or with K chunks into part."""
    m, k = x2.shape
    k_split = _k_split(k, cfg)
    split = cdiv(k, k_split)
    _dot_kernel[(cdiv(m, cfg.block_m), cdiv(n, cfg.block_n), split)](
        x2, weight, y, part, bias if bias is not None else y, res if res is not None else y,
        m, n, k, k_split, x2.stride(0), weight.stride(0), y.stride(0),
        res.stride(0) if res is not None else 0,
        HAS_BIAS=bias is not None, HAS_RES=res is not None, SPLIT=split,
        EVEN_K=k_split * split == k, SILU_MUL=silu_mul,
        PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **pdl_kwargs(x2),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _check(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dtype != weight.dtype:
        raise ValueError(f"dot_linear: activations are {x.dtype} but the weight is "
                         f"{weight.dtype}; cast one so both match (the model dtype)")
    return weight if weight.stride(-1) == 1 else weight.contiguous()


def dot_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None,
               config: DotConfig | None = None, silu_mul: bool = False) -> torch.Tensor:
    """y [..., N] = x [..., K] @ weight [N, K]^T (+ bias [N]) (+ residual [..., N]), summed in
    fp32 and rounded once to out_dtype (default x.dtype); each row as it would be alone.

    silu_mul: weight is [gate | up] ([2I, K]) and y [..., I] = silu(gate) * up, each product
    rounded to out_dtype first: bitwise the [..., 2I] product followed by `silu_and_mul`, in
    the matmul's epilogue (one launch fewer). The config stays the [2I, K] weight's, which
    must sum K in one chunk (`num_chunks`)."""
    weight = _check(x, weight)
    n, k = weight.shape
    cfg = config or dot_config(n, k)
    if silu_mul:
        if num_chunks(weight, cfg) != 1 or bias is not None or residual is not None:
            raise ValueError("dot_linear(silu_mul=True) needs a one-chunk config and no bias "
                             "or residual")
        n //= 2
    x2 = _rows(x, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    res = _rows(residual, n) if residual is not None else None
    split = num_chunks(weight, cfg)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    _launch_dot(x2, weight, y, part, bias, res, n, cfg, silu_mul)
    if split > 1:
        block = 1024
        _combine_kernel[(cdiv(m * n, block),)](
            part, y, bias if bias is not None else y, res if res is not None else y,
            m, n, y.stride(0), res.stride(0) if res is not None else 0,
            HAS_BIAS=bias is not None, HAS_RES=res is not None, SPLIT=split, BLOCK=block,
            **pdl_kwargs(x2), num_warps=4,
        )
    return y.view(*x.shape[:-1], n)


def dot_linear_rmsnorm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float, *,
                       config: DotConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed [..., N], new_residual [..., N]) with y = `dot_linear(x, weight)`:
    new_residual = y + residual and normed = rmsnorm(new_residual) * norm_weight, bitwise
    `rms_norm(y, norm_weight, eps, residual)` (kernels/elementwise.py), done in the combine of
    the K chunks (one launch fewer: the next layer's input norm in this layer's down
    projection). The weight's config must sum K in several chunks (`num_chunks`)."""
    weight = _check(x, weight)
    n, k = weight.shape
    cfg = config or dot_config(n, k)
    split = num_chunks(weight, cfg)
    if split == 1:
        raise ValueError("dot_linear_rmsnorm needs a config that sums K in several chunks")
    x2 = _rows(x, k)
    m = x2.shape[0]
    res = _rows(residual, n)
    normed = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    new_residual = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        _launch_dot(x2, weight, normed, part, None, None, n, cfg, False)
        block = next_pow2(n)
        _combine_rmsnorm_kernel[(m,)](
            part, res, new_residual, normed, norm_weight, m, n, eps, res.stride(0),
            new_residual.stride(0), normed.stride(0), SPLIT=split, BLOCK=block,
            **pdl_kwargs(x2), num_warps=row_warps(block),
        )
    shape = (*x.shape[:-1], n)
    return normed.view(shape), new_residual.view(shape)


def rope_fits(weight: torch.Tensor, head_dim: int, rot_dim: int,
              config: DotConfig | None = None) -> bool:
    """Whether the qkv product [N, K] can rotate and store its heads in its epilogue: K in one
    chunk, column tiles of half a head (the rotation pairs column i with i + head_dim / 2),
    whole heads rotated."""
    n, k = weight.shape
    cfg = config or dot_config(n, k)
    return (num_chunks(weight, cfg) == 1 and 2 * cfg.block_n == head_dim == rot_dim
            and n % head_dim == 0)


def dot_qkv_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor,
                       out_cache_loc: torch.Tensor, num_q_heads: int, num_kv_heads: int, *,
                       config: DotConfig | None = None) -> torch.Tensor:
    """q [T, Hq, D] rotated, with k rotated and v stored into k_cache / v_cache at
    out_cache_loc: bitwise `dot_linear(x, weight, bias)` followed by
    `elementwise.rope_and_store_kv`, in one launch (the projection's epilogue). Needs
    `rope_fits`."""
    weight = _check(x, weight)
    n, k = weight.shape
    cfg = config or dot_config(n, k)
    head_dim = n // (num_q_heads + 2 * num_kv_heads)
    if not rope_fits(weight, head_dim, cos_sin_cache.shape[-1], cfg):
        raise ValueError("dot_qkv_rope_store needs a one-chunk config whose column tiles "
                         "are half a head, and a rotary part of the whole head")
    x2 = _rows(x, k)
    m = x2.shape[0]
    q_out = torch.empty(m, num_q_heads, head_dim, dtype=x.dtype, device=x.device)  # [T, Hq, D]
    assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    if m:
        _dot_rope_kernel[(cdiv(m, cfg.block_m), num_q_heads + 2 * num_kv_heads)](
            x2, weight, bias if bias is not None else x2, q_out, k_cache, v_cache,
            out_cache_loc, positions, cos_sin_cache, m, k, x2.stride(0), weight.stride(0),
            q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HAS_BIAS=bias is not None,
            EVEN_K=k % cfg.block_k == 0,
            PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **pdl_kwargs(x2),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return q_out.view(*x.shape[:-1], num_q_heads, head_dim)


def dot_linear_ref(x, weight, bias=None, residual=None, *, out_dtype=None,
                   silu_mul=False) -> torch.Tensor:
    """The twin: the same sum in fp32, rounded once (silu_mul: then silu(gate) * up in fp32,
    rounded again)."""
    y = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
    if residual is not None:
        y = y + residual.float()
    y = y.to(out_dtype or x.dtype)
    if silu_mul:
        gate, up = y.float().chunk(2, dim=-1)
        y = (F.silu(gate) * up).to(y.dtype)
    return y


def dot_linear_rmsnorm_ref(x, weight, residual, norm_weight, eps):
    """The twin: the product rounded to x's dtype, added to residual (rounded), normalized."""
    h = (F.linear(x.float(), weight.float()).to(x.dtype).float() + residual.float()).to(x.dtype)
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return normed.to(x.dtype), h
