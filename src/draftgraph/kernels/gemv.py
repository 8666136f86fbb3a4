"""Decode-size (small M) projections with their neighbours fused in: one launch each.

    gemv(x, W, bias, residual)                      y = x @ W^T (+ bias) (+ residual)
    rmsnorm_gemv(x, norm_w, eps, W, bias, residual) h = x (+ residual); y = rmsnorm(h) @ W^T
    silu_mul_gemv(gate_up, W, residual)             y = (silu(gate) * up) @ W^T (+ residual)
    rmsnorm_qkv_rope_triton(x, ..., k_cache, v_cache, out_cache_loc, Hq, Hkv)
        qkv = rmsnorm_gemv(...); RoPE on the q and k heads; k, v stored into their KV slots

Twins: `gemv_ref`, `rmsnorm_gemv_ref`, `silu_mul_gemv_ref`, `rmsnorm_qkv_rope_ref`. The first
three public functions dispatch: the Triton kernel when `pays(M, weight)` (CUDA, M <=
GEMV_MAX_M, or M <= the weight's exact-rows bound: `mark_exact_rows`), else the unfused chain
(`ops.rms_norm` / `ops.silu_and_mul`, whose twins run on CPU, + F.linear); tests call the
`*_triton` launchers directly (real launches on CUDA, the
interpreter on CPU). `gemv` and `silu_mul_gemv` take out_dtype=torch.float32 for an unrounded
result (the partial sums a row-parallel layer all-reduces).

One kernel serves the first three (`MODE` constexpr picks the activation prologue). Each
program owns BLOCK_N output columns and streams its [BLOCK_N, K] weight slice once, in
[BLOCK_N, BLOCK_K] tiles; math in fp32, one rounding at the end. With the single-row configs the
dispatch uses (block_m 1) a program carries up to 8 rows (`rows_per_program`), each in its own
lane-wise accumulator tile reduced once after the loop, exactly as a lone row: a row's result
does not depend on M. (block_m > 1, FMA or tensor cores, is reachable by explicit config.)
The qkv kernel shares the norm prologue and owns column pairs (d, d + head_dim / 2) of one head,
so the rotation stays inside a program; it saves the separate RoPE + KV-store launch (on an
H200, 3.8 us per SmolLM2 layer against 3.0 + 1.6).
The activation a row feeds the matmul is rounded to the model dtype first (normed, silu * up), so
the fused result equals the unfused chain up to summation order.

NOTE: block sizes come from a fixed table keyed by shape (`TUNED`, then `default_config`), never
from run-time autotuning: the kernels are captured in CUDA graphs. A row's result depends on the
config (summation order), and every M takes the shape's M = 1 config, so a row computed at
M = 1 and at M = 5 is the same to the bit (tested on the H200).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftgraph.kernels import matmul
from draftgraph.kernels._triton import (
    cdiv,
    next_pow2,
    pdl_kwargs,
    pdl_wait,
    tl,
    triton,
    triton_usable,
)
from draftgraph.kernels.elementwise import rotate

# Rows up to which the fused kernels run. Measured on the H200 (benchmarks/results/gemv_h200.json):
# at M = 1 the fused chain of a SmolLM2-135M step takes 458 us against 680 us unfused; at M = 8
# the fused kernels lose on every shape, so only single-row steps take them. At M = 1 they beat
# norm/activation + cuBLAS on every shape swept (gemv_tune2_h200.json), up to Llama-3.1-8B's
# gate_up (57.3 vs 64.1 us) and LM head (237.7 vs 253.1 us).
GEMV_MAX_M = 1

_PLAIN, _NORM, _SILU = 0, 1, 2
_MODE_NAMES = {_PLAIN: "plain", _NORM: "norm", _SILU: "silu"}


class GemvConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    use_dot: bool = False  # tensor-core tl.dot with rows padded to 16; else FMA + reduce


# (mode, N, K, M bucket) -> config, from `python benchmarks/bench_gemv.py --tune` on an H200
# (benchmarks/results/gemv_tune_h200.json and gemv_tune2_h200.json; us = the tuned time,
# default config's in brackets). Only shapes the engine runs fused and where the sweep beat
# `default_config`; "qkv_rope" keys the one-token norm + qkv + RoPE kernel.
TUNED: dict[tuple[str, int, int, int], GemvConfig] = {
    # SmolLM2-135M
    ("qkv_rope", 960, 576, 1): GemvConfig(1, 2, 512, 4, 1),  # 3.61 us (3.72)
    ("plain", 576, 576, 1): GemvConfig(1, 2, 1024, 4, 3),  # o: 2.00 us (2.17)
    ("norm", 3072, 576, 1): GemvConfig(1, 8, 512, 8, 3),  # gate_up: 3.95 us (4.78)
    ("silu", 576, 1536, 1): GemvConfig(1, 1, 512, 4, 3),  # down: 3.19 us (3.87)
    ("norm", 49152, 576, 1): GemvConfig(1, 32, 64, 2, 1),  # final norm + LM head: 16.47 (36.86)
    # Llama-3.1-8B
    ("plain", 4096, 4096, 1): GemvConfig(1, 2, 2048, 2, 3),  # o: 10.05 us (10.55)
    ("norm", 28672, 4096, 1): GemvConfig(1, 16, 256, 4, 3),  # gate_up: 57.31 us (58.99)
    ("silu", 4096, 14336, 1): GemvConfig(1, 4, 2048, 4, 3),  # down: 31.25 us (32.70)
    ("norm", 128256, 4096, 1): GemvConfig(1, 16, 256, 4, 1),  # norm + LM head: 237.69 (243.67)
}


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


def _config(mode: int, n: int, k: int, dtype: torch.dtype) -> GemvConfig:
    """The single-row config of a shape: every M the dispatch fuses runs it, `ROWS` rows per
    program, so a row's arithmetic is the same at every M."""
    name = _MODE_NAMES[mode]
    return TUNED.get((name, n, k, 1)) or default_config(name, 1, n, k, dtype)


def pays(m: int, weight: torch.Tensor) -> bool:
    """Whether rows [m, K] times `weight` take the fused kernels: on CUDA, m <= GEMV_MAX_M
    (measured to beat norm/activation + cuBLAS for every weight), or m <= the weight's
    exact-rows bound (`mark_exact_rows`); never for a batch-invariant weight."""
    return (weight.is_cuda and not getattr(weight, INVARIANT_ATTR, False)
            and 0 < m <= max(GEMV_MAX_M, getattr(weight, EXACT_ROWS_ATTR, 0)))


# Exact rows (`--exact-rows on`): multi-row steps of up to EXACT_ROWS_MAX_M rows (verify rows,
# small decode batches) go through the fused kernels too, each row computed exactly as a lone
# row, so a verify row is bitwise the decode row at its position. It costs time: the per-row
# FMA accumulators are issue-bound beyond a row or two (smollm2-135m on the H200: n-gram k = 4
# step 1.574 vs 1.392 ms at batch 1, decode at batch 8 1.646 vs 0.982 ms), hence off by
# default; "auto" turns it on for models of at most EXACT_ROWS_MAX_BYTES of weights.
EXACT_ROWS_ATTR = "_draftgraph_exact_rows"
EXACT_ROWS_MAX_M = 16
EXACT_ROWS_MAX_BYTES = 1 << 30


def mark_exact_rows(module: torch.nn.Module, max_m: int = EXACT_ROWS_MAX_M) -> None:
    """Every weight of `module` takes the fused kernels for up to max_m rows (0: back to
    GEMV_MAX_M): a verify row is then bitwise the decode row at its position (with the
    decode-kernel attention of verify rows)."""
    for p in module.parameters():
        setattr(p, EXACT_ROWS_ATTR, max_m)


# Exact rows on the CPU without the cost: where a weight's product of up to M rows is measured
# bitwise equal to its lone rows' on this machine (`probe_rows`: oneDNN picks its kernels by
# shape, dtype and ISA, and e.g. bf16 on AMX computes each row alike), `linear` runs such rows
# batched, still exactly as decode rows. Elsewhere (fp32 MKL / oneDNN round a row by M) the
# rows go one at a time as before.
ROWS_INVARIANT_ATTR = "_draftgraph_rows_invariant"
PROBE_MAX_M = 32  # rows probed: a 4x5:16 tree's verify at batch 1 (17), a chain's up to 6


def probe_rows(weight: torch.Tensor, max_m: int = PROBE_MAX_M, seed: int = 0) -> int:
    """The largest M <= max_m such that for every m in 2 .. M the product (F.linear, or the
    weight's packed form) of m random rows equals each row's lone product to the bit (1: not
    even two rows)."""
    mm = getattr(weight, PACKED_ATTR, None) or F.linear
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max_m, weight.shape[1], generator=g).to(weight.dtype)
    alone = [mm(x[:1], weight, None)]
    for m in range(2, max_m + 1):  # (a lone row more per m: a failing weight costs 3 calls)
        alone.append(mm(x[m - 1 : m], weight, None))
        if not torch.equal(mm(x[:m], weight, None), torch.cat(alone)):
            return m - 1
    return max_m


_PROBED: dict = {}  # (shape, dtype, packed form, max_m) -> bound: once per process


def mark_rows_invariant(module: torch.nn.Module, max_m: int = PROBE_MAX_M) -> dict:
    """`probe_rows` once per distinct (shape, dtype, packed form) of the module's 2-D CPU
    weights that take exact rows (and once per process); marks each with its bound.
    Returns {shape: bound}."""
    bounds: dict = {}
    for p in module.parameters():
        if p.dim() != 2 or p.is_cuda or not getattr(p, EXACT_ROWS_ATTR, 0):
            continue
        packed = getattr(p, PACKED_ATTR, None)
        key = (tuple(p.shape), p.dtype, type(packed).__name__)
        if key not in bounds:
            if key + (max_m,) not in _PROBED:
                with torch.no_grad():
                    _PROBED[key + (max_m,)] = probe_rows(p, max_m)
            bounds[key] = _PROBED[key + (max_m,)]
        setattr(p, ROWS_INVARIANT_ATTR, bounds[key])
    return {f"{k[0][0]}x{k[0][1]} {str(k[1]).removeprefix('torch.')}": v
            for k, v in bounds.items()}


# Batch invariance (`--deterministic`): on CUDA every product with a marked weight, at every M,
# runs the batch-invariant matmul (kernels/matmul.py) after the plain norm / activation
# kernels, which are row-wise already: a row's bits then depend on nothing but the row, so a
# verify row is the decode row at its position and a request's tokens do not depend on its
# batch-mates. On the CPU the mark does nothing (exact rows cover verify = decode there).
INVARIANT_ATTR = "_draftgraph_invariant"


def mark_invariant(module: torch.nn.Module, on: bool = True) -> None:
    for p in module.parameters():
        setattr(p, INVARIANT_ATTR, on)


# Tensor-core rows (`--tensor-core-rows`; the executor marks its model): on CUDA a product of
# min .. max rows (a tree's verify rows, a batched decode step) runs the batch-invariant matmul
# (kernels/matmul.py: one tuned config per shape, 64-row tiles, programmatic dependent launch,
# SwiGLU and the next norm in its epilogues) instead of cuBLAS, which cannot overlap its launch
# with the kernel before it. Single rows keep the fused kernels. Measured on an H100 with
# SmolLM2-135M, one process an arm (benchmarks/NOTES.md, `results/dot/`,
# `results/epilogues/`): rows 9 .. 64 cut the 4x5:16 tree round at batch 1 by 12 % (stop
# 44); with the epilogues (stop 46) decode at batch 2 / 4 / 8 by 4 / 3 / 7 %, the chain's 5
# verify rows at batch 1 by 2 %, 66 rows (an 8x5:32 tree at batch 2) by 5 %, 80 (the chain at
# batch 16) by 6 %, 132 (the tree at batch 4) by 1 %, while 160 (the chain at batch 32) lost
# 3 % and 8 (a tree's beam at batch 1) moved nothing.
# The engine's range is DOT_ROWS: 2 rows to two 64-row tiles. "auto" takes it for models of at
# most DOT_ROWS_MAX_BYTES of weights (launch-bound; Llama-3.2-1B measured even: stop 46).
DOT_ROWS_ATTR = "_draftgraph_dot_rows"
DOT_ROWS = (2, 128)
DOT_ROWS_MAX_BYTES = 1 << 30


def mark_dot_rows(module: torch.nn.Module, rows: tuple[int, int] | None = DOT_ROWS) -> None:
    """Products of rows[0] .. rows[1] rows with the module's weights take the tensor-core
    matmul on CUDA (None: cuBLAS again)."""
    for p in module.parameters():
        setattr(p, DOT_ROWS_ATTR, rows)


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def wants_dot_rows(module: torch.nn.Module) -> bool:
    """"auto": tensor-core rows for a model whose weights are at most DOT_ROWS_MAX_BYTES."""
    return weight_bytes(module) <= DOT_ROWS_MAX_BYTES


def _dot(x: torch.Tensor, weight: torch.Tensor, m: int) -> bool:
    """Whether `m` rows times `weight` take the batch-invariant matmul (CUDA only): every M
    under `--deterministic`, the weight's tensor-core rows."""
    if not x.is_cuda:
        return False
    rows = getattr(weight, DOT_ROWS_ATTR, None)
    return getattr(weight, INVARIANT_ATTR, False) or (rows is not None
                                                      and max(2, rows[0]) <= m <= rows[1])


# The tensor-core matmul's epilogues (kernels/matmul.py): SwiGLU in gate_up's, the next
# layer's input norm in down's K-chunk combine; each bitwise the kernel it replaces, one launch
# fewer a layer each. False: the unfused chain (benchmarks' A/B arms).
DOT_EPILOGUES = True


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up [M, I] for rows x [M, K] and weight [gate | up] ([2I, K]), in the
    tensor-core matmul's epilogue where these rows take it with a one-chunk config; None
    elsewhere (the caller multiplies and leaves SwiGLU to the down projection)."""
    m = x.numel() // max(x.shape[-1], 1)
    if DOT_EPILOGUES and _dot(x, weight, m) and matmul.num_chunks(weight) == 1:
        return matmul.dot_linear(x, weight, silu_mul=True)
    return None


def linear_rmsnorm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                   norm_weight: torch.Tensor, eps: float, *,
                   silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rmsnorm(y + residual) * norm_weight, y + residual) for y = x @ weight^T (silu_mul: x
    is [gate | up], SwiGLU first), the norm in the tensor-core matmul's K-chunk combine where
    these rows take it in several chunks; None elsewhere, nothing computed (the caller
    projects and normalizes apart)."""
    m = x.numel() // max(x.shape[-1], 1)
    if DOT_EPILOGUES and _dot(x, weight, m) and matmul.num_chunks(weight) > 1:
        if silu_mul:
            from draftgraph.kernels import ops

            x = ops.silu_and_mul(x)
        return matmul.dot_linear_rmsnorm(x, weight, residual, norm_weight, eps)
    return None


# RoPE and the KV store in qkv's epilogue too (`matmul.dot_qkv_rope_store`; bitwise the
# product followed by `rope_and_store_kv`, a launch fewer a layer). On an H100 (random
# SmolLM2 weights, bf16, batch 1, 512-token context) it took the chain's k = 4 round from 1.078
# to 1.003 ms, the 8x5:32 tree's from 1.214 to 1.200, 8x5:27+g5's from 1.246 to 1.227
# (benchmarks/NOTES.md, stop 47; `bench_block.py --dot-epilogues on|rope`).
DOT_ROPE = True


def linear_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out_cache_loc: torch.Tensor, num_q_heads: int,
                      num_kv_heads: int) -> torch.Tensor | None:
    """Rotated q [M, Hq, D] for rows x [M, K] and the qkv weight, k rotated and v stored into
    their KV slots, all in the tensor-core matmul's epilogue where these rows take it and its
    tiles are half a head (`matmul.rope_fits`); None elsewhere."""
    m = x.numel() // max(x.shape[-1], 1)
    head_dim = weight.shape[0] // (num_q_heads + 2 * num_kv_heads)
    if (DOT_EPILOGUES and DOT_ROPE and _dot(x, weight, m)
            and matmul.rope_fits(weight, head_dim, cos_sin_cache.shape[-1])):
        return matmul.dot_qkv_rope_store(x, weight, bias, positions, cos_sin_cache, k_cache,
                                         v_cache, out_cache_loc, num_q_heads, num_kv_heads)
    return None


def wants_exact_rows(module: torch.nn.Module) -> bool:
    """"auto": exact rows for a model whose weights are at most EXACT_ROWS_MAX_BYTES."""
    return weight_bytes(module) <= EXACT_ROWS_MAX_BYTES


# ---- kernel ------------------------------------------------------------------------------


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


@triton.jit
def _gemv_kernel(
    x, res_in, norm_w, w, bias, res_add, y, res_out,
    M, N, K, eps,
    stride_xm, stride_rim, stride_wn, stride_ram, stride_ym, stride_rom,
    MODE: tl.constexpr, HAS_RES_IN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RES_ADD: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
):
    # MODE 0: a = x. MODE 1: h = x (+ res_in), a = rmsnorm(h) * norm_w, program 0 of each row
    # block writes h to res_out. MODE 2: x = [gate | up] of width 2K, a = silu(gate) * up.
    # BLOCK_M == 1: the program owns ROWS rows, each accumulated lane-wise in its own
    # [BLOCK_N, BLOCK_K] tile and reduced once after the loop: exactly the arithmetic of a
    # lone row, so a row's result does not depend on M or on the other rows.
    # Row blocks are the fastest grid axis: the programs that share a weight tile run
    # together, and all but the first read it from L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # NOTE: tail columns re-read row N - 1 (stores are masked), so weight loads need no N mask
    rn_w = tl.minimum(rn, N - 1).to(tl.int64)
    w_rows = w + rn_w[:, None] * stride_wn
    act_dtype = w.dtype.element_ty
    mask_n = rn < N
    pdl_wait(PDL)  # every program, before its first load
    if BLOCK_M == 1:
        rms = ()
        rstds = ()
        accs = ()
        for i in tl.static_range(ROWS):
            # rows past M read row M - 1 again (their stores are masked)
            rm = tl.minimum(pid_m * ROWS + i, M - 1) + tl.zeros([1], dtype=tl.int32)
            rstd = tl.zeros([1], dtype=tl.float32)
            if MODE == 1:
                live = (pid_m * ROWS + i + tl.zeros([1], dtype=tl.int32)) < M
                rstd = _rms_prologue(x + rm.to(tl.int64)[:, None] * stride_xm, res_in, res_out,
                                     rm, live, pid_n, K, eps, stride_rim, stride_rom,
                                     HAS_RES_IN, 1, NORM_BLOCK)
            rms = rms + (rm,)
            rstds = rstds + (rstd,)
            accs = accs + (tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32),)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mask_k = rk < K
            # NOTE: the activations before the weight tile: the other order cost 14 % of
            # SmolLM2's gate_up and 18 % of its LM head at M = 1, up to 40 % at M = 4 (the
            # norm prologue's L2 loads queued behind the weight stream; bench_gemv.py, H200)
            acts = ()
            for i in tl.static_range(ROWS):
                acts = acts + (_act_tile(x, res_in, res_out, norm_w, rms[i], rms[i] >= 0, rk,
                                         mask_k, rstds[i], K, stride_xm, stride_rim, act_dtype,
                                         MODE, HAS_RES_IN),)
            # weight tile [BLOCK_N, BLOCK_K]: streamed once, used by every row
            if EVEN_K:
                wt = tl.load(w_rows + rk[None, :], eviction_policy="evict_first")
            else:
                wt = tl.load(w_rows + rk[None, :], mask=mask_k[None, :], other=0.0,
                             eviction_policy="evict_first")
            new = ()
            for i in tl.static_range(ROWS):
                new = new + (accs[i] + acts[i].to(tl.float32) * wt.to(tl.float32),)
            accs = new
        for i in tl.static_range(ROWS):
            acc = tl.sum(accs[i], axis=1)  # [BLOCK_N]
            row = pid_m * ROWS + i
            mask_y = mask_n & ((row + tl.zeros([BLOCK_N], dtype=tl.int32)) < M)
            if HAS_BIAS:
                acc += tl.load(bias + rn, mask=mask_n, other=0.0).to(tl.float32)
            if HAS_RES_ADD:
                acc += tl.load(res_add + row.to(tl.int64) * stride_ram + rn, mask=mask_y,
                               other=0.0).to(tl.float32)
            tl.store(y + row.to(tl.int64) * stride_ym + rn, acc.to(y.dtype.element_ty),
                     mask=mask_y)
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rm < M
        x_rows = x + rm.to(tl.int64)[:, None] * stride_xm
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if MODE == 1:
            rstd = _rms_prologue(x_rows, res_in, res_out, rm, mask_m, pid_n, K, eps,
                                 stride_rim, stride_rom, HAS_RES_IN, BLOCK_M, NORM_BLOCK)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mask_k = rk < K
            a = _act_tile(x, res_in, res_out, norm_w, rm, mask_m, rk, mask_k, rstd, K,
                          stride_xm, stride_rim, act_dtype, MODE, HAS_RES_IN)
            if EVEN_K:
                wt = tl.load(w_rows + rk[None, :], eviction_policy="evict_first")
            else:
                wt = tl.load(w_rows + rk[None, :], mask=mask_k[None, :], other=0.0,
                             eviction_policy="evict_first")
            if USE_DOT:
                acc += tl.dot(a.to(act_dtype), tl.trans(wt))
            else:
                prod = a.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :]
                acc += tl.sum(prod, axis=2)
        mask_y = mask_m[:, None] & mask_n[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if HAS_RES_ADD:
            acc += tl.load(res_add + rm.to(tl.int64)[:, None] * stride_ram + rn[None, :],
                           mask=mask_y, other=0.0).to(tl.float32)
        tl.store(y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
                 acc.to(y.dtype.element_ty), mask=mask_y)


@triton.jit
def _qkv_rope_kernel(
    x, res_in, norm_w, w, bias, y, res_out, k_cache, v_cache, positions, out_cache_loc,
    cos_sin, M, N, K, eps,
    stride_xm, stride_rim, stride_wn, stride_ym, stride_rom, stride_kcs, stride_kch,
    stride_vcs, stride_vch, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_RES_IN: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    # qkv = rmsnorm(x (+ res_in)) @ W^T (+ bias), then neox RoPE on the q and k heads, k and v
    # stored into each token's KV slot. A program owns BLOCK_P column pairs (d, d + HEAD_DIM /
    # 2) of the same head, so the rotation stays inside the program, for ROWS tokens, each
    # accumulated and reduced exactly as a lone token (as in _gemv_kernel).
    HALF = HEAD_DIM // 2
    pid_m = tl.program_id(0)
    pid = tl.program_id(1)
    p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    num_pairs = N // 2
    mask_p = p < num_pairs
    pc = tl.minimum(p, num_pairs - 1)  # tail pairs re-read the last one (stores masked)
    head = pc // HALF
    d = pc % HALF
    c1 = (head * HEAD_DIM + d).to(tl.int64)
    c2 = c1 + HALF
    act_dtype = w.dtype.element_ty
    pdl_wait(PDL)
    rms = ()
    rstds = ()
    accs1 = ()
    accs2 = ()
    for i in tl.static_range(ROWS):
        rm = tl.minimum(pid_m * ROWS + i, M - 1) + tl.zeros([1], dtype=tl.int32)
        live = (pid_m * ROWS + i + tl.zeros([1], dtype=tl.int32)) < M
        rstd = _rms_prologue(x + rm.to(tl.int64)[:, None] * stride_xm, res_in, res_out, rm,
                             live, pid, K, eps, stride_rim, stride_rom, HAS_RES_IN, 1,
                             NORM_BLOCK)
        rms = rms + (rm,)
        rstds = rstds + (rstd,)
        accs1 = accs1 + (tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32),)
        accs2 = accs2 + (tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32),)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < K
        if EVEN_K:
            w1 = tl.load(w + c1[:, None] * stride_wn + rk[None, :], eviction_policy="evict_first")
            w2 = tl.load(w + c2[:, None] * stride_wn + rk[None, :], eviction_policy="evict_first")
        else:
            w1 = tl.load(w + c1[:, None] * stride_wn + rk[None, :], mask=mask_k[None, :],
                         other=0.0, eviction_policy="evict_first")
            w2 = tl.load(w + c2[:, None] * stride_wn + rk[None, :], mask=mask_k[None, :],
                         other=0.0, eviction_policy="evict_first")
        new1 = ()
        new2 = ()
        for i in tl.static_range(ROWS):
            a = _act_tile(x, res_in, res_out, norm_w, rms[i], rms[i] >= 0, rk, mask_k,
                          rstds[i], K, stride_xm, stride_rim, act_dtype, 1,
                          HAS_RES_IN).to(tl.float32)
            new1 = new1 + (accs1[i] + a * w1.to(tl.float32),)
            new2 = new2 + (accs2[i] + a * w2.to(tl.float32),)
        accs1 = new1
        accs2 = new2
    rot = head < NUM_Q_HEADS + NUM_KV_HEADS  # v heads pass through
    kh = head - NUM_Q_HEADS
    vh = head - NUM_Q_HEADS - NUM_KV_HEADS
    for i in tl.static_range(ROWS):
        row = pid_m * ROWS + i
        live = mask_p & ((row + tl.zeros([BLOCK_P], dtype=tl.int32)) < M)
        rowc = tl.minimum(row, M - 1).to(tl.int64)
        y1 = tl.sum(accs1[i], axis=1)
        y2 = tl.sum(accs2[i], axis=1)
        if HAS_BIAS:
            y1 += tl.load(bias + c1).to(tl.float32)
            y2 += tl.load(bias + c2).to(tl.float32)
        # rounded like the unfused projection's output before RoPE reads it
        y1 = y1.to(y.dtype.element_ty).to(tl.float32)
        y2 = y2.to(y.dtype.element_ty).to(tl.float32)
        pos = tl.load(positions + rowc).to(tl.int64)
        cos = tl.load(cos_sin + pos * stride_cs + d)
        sin = tl.load(cos_sin + pos * stride_cs + HALF + d)
        o1, o2 = rotate(y1, y2, cos, sin)
        r1 = tl.where(rot, o1, y1).to(y.dtype.element_ty)
        r2 = tl.where(rot, o2, y2).to(y.dtype.element_ty)
        tl.store(y + rowc * stride_ym + c1, r1, mask=live)
        tl.store(y + rowc * stride_ym + c2, r2, mask=live)
        slot = tl.load(out_cache_loc + rowc).to(tl.int64)
        is_k = live & (kh >= 0) & (kh < NUM_KV_HEADS)
        kc = k_cache + slot * stride_kcs + kh * stride_kch + d
        tl.store(kc, r1.to(k_cache.dtype.element_ty), mask=is_k)
        tl.store(kc + HALF, r2.to(k_cache.dtype.element_ty), mask=is_k)
        is_v = live & (vh >= 0)
        vc = v_cache + slot * stride_vcs + vh * stride_vch + d
        tl.store(vc, r1.to(v_cache.dtype.element_ty), mask=is_v)
        tl.store(vc + HALF, r2.to(v_cache.dtype.element_ty), mask=is_v)


# fp32 accumulator registers per thread that the rows of one program may take: more rows per
# program read each weight tile once for more rows, fewer leave more programs in flight.
# Measured on the H200 (benchmarks/results/exact_rows_smollm2_h200.json, smollm2-135m): 16
# is the fastest of 16 / 32 / 64 / 128 at every batch size (n-gram k = 4 step at batch 1:
# 1.574 ms against 1.709 at 128; decode at batch 16: 2.78 against 3.67).
ROWS_REG_BUDGET = 16


def rows_per_program(cfg: GemvConfig, m: int, budget: int | None = None) -> int:
    """Rows one program of a single-row config (block_m 1) carries, each in its own
    accumulator tile: as many as fit `budget` (default ROWS_REG_BUDGET) fp32 registers per
    thread, at most 8 and at most m (1 for a multi-row config). It never changes a row's
    arithmetic, only how rows share programs."""
    if cfg.block_m != 1:
        return 1
    per_row = max(1, cfg.block_n * cfg.block_k // (32 * cfg.num_warps))
    return max(1, min(8, m, (budget or ROWS_REG_BUDGET) // per_row))


def norm_block(k: int, block_m: int, block_k: int) -> int:
    """Width of the RMS prologue's loads: the whole row up to 4096 fp32 values per program."""
    return min(max(16, next_pow2(k)), max(block_k, 4096 // block_m))


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
    cfg = config or _config(mode, n, k, weight.dtype)
    dummy = y
    rows = rows_per_program(cfg, m)
    grid = (cdiv(m, rows if cfg.block_m == 1 else cfg.block_m), cdiv(n, cfg.block_n))
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
        NORM_BLOCK=norm_block(k, cfg.block_m, cfg.block_k), ROWS=rows,
        **pdl_kwargs(x2), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
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


def rmsnorm_qkv_rope_triton(x, norm_weight, eps, weight, bias, residual, positions,
                            cos_sin_cache, k_cache, v_cache, out_cache_loc, num_q_heads,
                            num_kv_heads, *, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel launch of `rmsnorm_qkv_rope`: tokens x [T, K], full-width rotary; each token is
    computed as it would be alone."""
    n, k = weight.shape
    head_dim = k_cache.shape[-1]
    x2 = _rows(x, k)
    m = x2.shape[0]
    if n != (num_q_heads + 2 * num_kv_heads) * head_dim or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError("rmsnorm_qkv_rope needs weight rows (Hq + 2 Hkv) * head_dim and a "
                         "full-width rotary cos/sin cache")
    if x2.dtype != weight.dtype:
        raise ValueError(f"rmsnorm_qkv_rope: activations are {x2.dtype} but the weight is "
                         f"{weight.dtype}; cast one so both match (the model dtype)")
    res = _rows(residual, k) if residual is not None else None
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    res_out = torch.empty(m, k, dtype=x2.dtype, device=x2.device) if res is not None else None
    if m == 0:
        return y.view(*x.shape[:-1], n), res_out.view(x.shape) if res_out is not None else x
    cfg = config or TUNED.get(("qkv_rope", n, k, 1)) or _config(_NORM, n, k, weight.dtype)
    block_p = max(1, cfg.block_n // 2)  # block_n weight rows per program, as in the gemv
    # two accumulator tiles per row
    rows = rows_per_program(cfg._replace(block_n=2 * block_p), m)
    dummy = y
    _qkv_rope_kernel[(cdiv(m, rows), cdiv(n // 2, block_p))](
        x2, res if res is not None else dummy, norm_weight, weight,
        bias if bias is not None else dummy, y, res_out if res_out is not None else dummy,
        k_cache, v_cache, positions, out_cache_loc, cos_sin_cache, m, n, k, eps,
        x2.stride(0), res.stride(0) if res is not None else 0, weight.stride(0), y.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HAS_RES_IN=res is not None, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        BLOCK_P=block_p, BLOCK_K=cfg.block_k, NORM_BLOCK=norm_block(k, 1, cfg.block_k),
        ROWS=rows, **pdl_kwargs(x2), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    new_residual = res_out.view(x.shape) if res_out is not None else x
    return y.view(*x.shape[:-1], n), new_residual


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


def rmsnorm_qkv_rope_ref(x, norm_weight, eps, weight, bias, residual, positions, cos_sin_cache,
                         k_cache, v_cache, out_cache_loc, num_q_heads,
                         num_kv_heads) -> tuple[torch.Tensor, torch.Tensor]:
    """`rmsnorm_gemv_ref`, then `rope_ref` on the q and k heads and `store_kv_ref` of k and v.
    Returns (qkv with q and k rotated [T, N], new residual)."""
    from draftgraph.kernels.kv_store import store_kv_ref
    from draftgraph.kernels.ops import rope_ref

    qkv, new_residual = rmsnorm_gemv_ref(x, norm_weight, eps, weight, bias, residual)
    head_dim = k_cache.shape[-1]
    q, k, v = qkv.view(-1, num_q_heads + 2 * num_kv_heads, head_dim).split(
        [num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    q, k = rope_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, out_cache_loc)
    return torch.cat((q, k, v), dim=1).view(qkv.shape), new_residual


# ---- dispatch: fused kernel for small M, else the unfused chain ----------------------------


def _fused(x: torch.Tensor, weight: torch.Tensor, k: int) -> bool:
    """Kernel only on CUDA (like `ops`): on CPU, even in the interpreter, the chain runs."""
    return x.is_cuda and triton_usable(x) and pays(x.numel() // max(k, 1), weight)


# A weight with a packed form (`--quantization int4`, models/quant.py; `--row-pack`,
# models/row_pack.py) carries it here: a callable taking F.linear's arguments, which `linear`
# calls instead of F.linear.
PACKED_ATTR = "_draftgraph_packed"


def dense_form(weight: torch.Tensor) -> bool:
    """Whether F.linear over the weight's own values is its product: no packed form, or one
    that keeps the dense values authoritative (`keeps_dense`: row packing, not int4)."""
    packed = getattr(weight, PACKED_ATTR, None)
    return packed is None or getattr(packed, "keeps_dense", False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear (or the weight's packed form). On the CPU, rows [M, K] with 1 < M <= the
    weight's exact-rows bound go one at a time: a multi-row matmul may round a row differently
    from the lone row (MKL/oneDNN pick other kernels by M, and which ones depends on the CPU),
    so a verify row equals the decode row at its position only this way. It costs a weight
    read per row, hence opt-in; unless this machine's product of M rows was measured to be
    its lone rows' (`mark_rows_invariant`, probed without a bias, so a biased product keeps
    the rows apart): then the rows go together."""
    m = x.numel() // max(x.shape[-1], 1)
    if _dot(x, weight, m):
        return matmul.dot_linear(x, weight, bias)
    mm = getattr(weight, PACKED_ATTR, None) or F.linear
    if (x.is_cuda or not 1 < m <= getattr(weight, EXACT_ROWS_ATTR, 0)
            or (bias is None and m <= getattr(weight, ROWS_INVARIANT_ATTR, 0))):
        return mm(x, weight, bias)
    rows = x.reshape(m, x.shape[-1])
    y = torch.cat([mm(rows[i : i + 1], weight, bias) for i in range(m)])
    return y.view(*x.shape[:-1], weight.shape[0])


def _linear(x, weight, bias, out_dtype) -> torch.Tensor:
    """`linear`, or with out_dtype fp32 the accumulator unrounded (cuBLAS out_dtype on CUDA)."""
    if out_dtype is None or out_dtype == x.dtype:
        return linear(x, weight, bias)
    if not x.is_cuda:
        return F.linear(x.to(out_dtype), weight.to(out_dtype),
                        bias.to(out_dtype) if bias is not None else None)
    if _dot(x, weight, x.numel() // max(x.shape[-1], 1)):
        return matmul.dot_linear(x, weight, bias, out_dtype=out_dtype)
    y = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=out_dtype)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y


def _out(x: torch.Tensor, n: int, out_dtype) -> torch.Tensor | None:
    if out_dtype is None or out_dtype == x.dtype:
        return None
    return torch.empty(x.numel() // x.shape[-1], n, dtype=out_dtype, device=x.device)


def gemv(x, weight, bias=None, residual=None, *, out_dtype=None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight[N, K]^T (+ bias [N]) (+ residual [M, N]), in out_dtype
    (default x.dtype; fp32: the accumulator unrounded, e.g. a row-parallel partial sum)."""
    if _fused(x, weight, weight.shape[1]):
        return gemv_triton(x, weight, bias, residual, out=_out(x, weight.shape[0], out_dtype))
    y = _linear(x, weight, bias, out_dtype)
    return y + residual if residual is not None else y


def rmsnorm_gemv(x, norm_weight, eps, weight, bias=None,
                 residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, N], new_residual [M, K]): h = x (+ residual); y = (rmsnorm(h) * norm_weight) @ W^T
    (+ bias). new_residual is h (x itself when residual is None)."""
    if _fused(x, weight, weight.shape[1]):
        return rmsnorm_gemv_triton(x, norm_weight, eps, weight, bias, residual)
    from draftgraph.kernels import ops

    normed, new_residual = ops.rms_norm(x, norm_weight, eps, residual)
    return linear(normed, weight, bias), new_residual if new_residual is not None else x


def silu_mul_gemv(gate_up, weight, residual=None, *, out_dtype=None) -> torch.Tensor:
    """y [M, N] = (silu(gate) * up) @ W^T (+ residual [M, N]); gate_up [M, 2I], W [N, I]; in
    out_dtype as `gemv`."""
    if _fused(gate_up, weight, 2 * weight.shape[1]):
        return silu_mul_gemv_triton(gate_up, weight, residual,
                                    out=_out(gate_up, weight.shape[0], out_dtype))
    from draftgraph.kernels import ops

    return gemv(ops.silu_and_mul(gate_up), weight, residual=residual, out_dtype=out_dtype)
