"""Batch-invariant matmuls for `--deterministic`, with the default step's epilogue fusions: a
row's result depends only on that row and the weights, not on M, not on where the row sits in
the batch, not on its batch-mates.

    dot_linear(x, W, bias, residual, out_dtype)     y = x @ W^T (+ bias) (+ residual)
    dot_swiglu(x, W_gate_up)                        y = silu(x @ W_gate^T) * (x @ W_up^T)
    dot_qkv_rope(x, W, bias, positions, cos_sin, k_cache, v_cache, out_cache_loc, Hq, Hkv)
        qkv = x @ W^T (+ bias); neox RoPE on the q and k heads; k and v stored into their slots

Twins: `*_ref`.

How: ONE kernel (`_dot_kernel`) and ONE config per weight shape (N, K), never chosen by M
(`dot_config`). A program owns a [BLOCK_M, BLOCK_N] tile of the output and walks K with
tensor cores (tl.dot accumulating into its fp32 tile), rows past M masked to zero, so every
row takes the same instructions in the same order whatever M is. Long K splits into
`split_k` chunks of a fixed length (more programs streaming the weight at small M); each
chunk's fp32 partial goes to scratch and a second kernel over the same tiles adds the chunks
in order 0, 1, ... and finishes them. The paired epilogues keep SwiGLU and RoPE inside a
program: it owns column pairs (c, c + GROUP), GROUP = I for gate / up and head_dim / 2 for
the rotate-half pairs, each with its own accumulator, so they need no launch of their own.

cuBLAS is what this replaces on that path: it picks kernels (and split-K) by M, so a row of a
5-row verify step and the same row decoded alone differ in their last bits. Measured on the
H200 and not taken (benchmarks/NOTES.md, "`--deterministic`"): the norm folded into the K
loop (h * norm_w formed and h^2 summed per tile) made these kernels 2.6-4.3x slower, so the
norm stays a row-wise kernel of its own (ops.rms_norm); split-K's partials added by the last
program of a tile to arrive cost 64-row tiles more than the second launch; 16-row tiles,
where it was free, cost batch 32 decode 16 % more than 64-row ones.

NOTE: block sizes come from `DOT_TUNED` / `dot_config`, never from run-time autotuning: the
kernel is captured in CUDA graphs, and a row's bits depend on the config.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftgraph.kernels._triton import cdiv, tl, triton


class DotConfig(NamedTuple):
    block_m: int = 64
    block_n: int = 64  # output columns of a program (paired kernels: half as many pairs)
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


# what a program does with its finished tile (EPILOGUE)
_STORE, _SWIGLU, _ROPE = 0, 1, 2


@triton.jit(do_not_specialize=["M"])  # M varies step to step: one compiled kernel for all
def _dot_kernel(
    x, w, y, part, bias, res_add, positions, cos_sin, k_cache, v_cache,
    out_cache_loc, M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_ym, stride_ram, stride_cs, stride_kcs, stride_kch,
    stride_vcs, stride_vch,
    HAS_BIAS: tl.constexpr, HAS_RES_ADD: tl.constexpr, EPILOGUE: tl.constexpr,
    GROUP: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # EPILOGUE 0: y = acc1 (+ bias) (+ res_add), columns c = p. Paired (1: SwiGLU, 2: RoPE):
    # output p owns weight rows c1 = (p // GROUP) * 2 GROUP + p % GROUP and c2 = c1 + GROUP,
    # accumulated side by side (acc1, acc2).
    pid_k = tl.program_id(2)
    rm, mask_m, pc, mask_p, c1 = _tile(M, N, EPILOGUE, GROUP, BLOCK_M, BLOCK_N)
    rm64 = rm.to(tl.int64)
    w1 = w + c1[:, None] * stride_wn
    w2 = w + (c1 + GROUP)[:, None] * stride_wn
    x_rows = x + rm64[:, None] * stride_xm
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < k_hi
        if EVEN_K:
            mask_a = mask_m[:, None]
        else:
            mask_a = mask_m[:, None] & mask_k[None, :]
        a = tl.load(x_rows + rk[None, :], mask=mask_a, other=0.0)
        if EVEN_K:
            b1 = tl.load(w1 + rk[None, :], eviction_policy="evict_first")
        else:
            b1 = tl.load(w1 + rk[None, :], mask=mask_k[None, :], other=0.0,
                         eviction_policy="evict_first")
        acc1 = tl.dot(a, tl.trans(b1), acc1, input_precision=PRECISION)
        if EPILOGUE != 0:
            if EVEN_K:
                b2 = tl.load(w2 + rk[None, :], eviction_policy="evict_first")
            else:
                b2 = tl.load(w2 + rk[None, :], mask=mask_k[None, :], other=0.0,
                             eviction_policy="evict_first")
            acc2 = tl.dot(a, tl.trans(b2), acc2, input_precision=PRECISION)
    mask = mask_m[:, None] & mask_p[None, :]
    if SPLIT > 1:  # this chunk's partials at their own columns of part [SPLIT, M, N] fp32
        offs = pid_k * M.to(tl.int64) * N + rm64[:, None] * N + c1[None, :]
        tl.store(part + offs, acc1, mask=mask)
        if EPILOGUE != 0:
            tl.store(part + offs + GROUP, acc2, mask=mask)
    else:
        _finish(acc1, acc2, y, bias, res_add, positions, cos_sin, k_cache, v_cache,
                out_cache_loc, rm, mask_m, pc, mask, c1, stride_ym, stride_ram, stride_cs,
                stride_kcs, stride_kch, stride_vcs, stride_vch, HAS_BIAS, HAS_RES_ADD,
                EPILOGUE, GROUP, NUM_Q_HEADS, NUM_KV_HEADS)


@triton.jit(do_not_specialize=["M"])
def _combine_kernel(
    part, y, bias, res_add, positions, cos_sin, k_cache, v_cache, out_cache_loc, M, N,
    stride_ym, stride_ram, stride_cs, stride_kcs, stride_kch, stride_vcs, stride_vch,
    HAS_BIAS: tl.constexpr, HAS_RES_ADD: tl.constexpr, EPILOGUE: tl.constexpr,
    GROUP: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # split-K's second launch, over _dot_kernel's output tiles: the chunks' partials added in
    # order 0, 1, ..., then the same epilogue
    rm, mask_m, pc, mask_p, c1 = _tile(M, N, EPILOGUE, GROUP, BLOCK_M, BLOCK_N)
    mask = mask_m[:, None] & mask_p[None, :]
    offs = rm.to(tl.int64)[:, None] * N + c1[None, :]
    chunk = M.to(tl.int64) * N
    acc1 = tl.load(part + offs, mask=mask, other=0.0)
    acc2 = acc1
    if EPILOGUE != 0:
        acc2 = tl.load(part + offs + GROUP, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc1 += tl.load(part + s * chunk + offs, mask=mask, other=0.0)
        if EPILOGUE != 0:
            acc2 += tl.load(part + s * chunk + offs + GROUP, mask=mask, other=0.0)
    _finish(acc1, acc2, y, bias, res_add, positions, cos_sin, k_cache, v_cache, out_cache_loc,
            rm, mask_m, pc, mask, c1, stride_ym, stride_ram, stride_cs, stride_kcs,
            stride_kch, stride_vcs, stride_vch, HAS_BIAS, HAS_RES_ADD, EPILOGUE, GROUP,
            NUM_Q_HEADS, NUM_KV_HEADS)


@triton.jit
def _tile(M, N, EPILOGUE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr):
    # program (pid_m, pid_n)'s rows and output columns p, and the weight rows c1 of acc1
    # (c1 + GROUP of acc2 when paired). Row blocks are the fastest grid axis: the programs
    # that share a weight tile run together, and all but the first read it from L2.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    num_out = N if EPILOGUE == 0 else N // 2
    p = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # NOTE: tail columns re-read the last one (their stores are masked): no N mask on loads
    pc = tl.minimum(p, num_out - 1)
    if EPILOGUE == 0:
        c1 = pc.to(tl.int64)
    else:
        c1 = ((pc // GROUP) * (2 * GROUP) + pc % GROUP).to(tl.int64)
    return rm, rm < M, pc, p < num_out, c1


@triton.jit
def _finish(acc1, acc2, y, bias, res_add, positions, cos_sin, k_cache, v_cache,
            out_cache_loc, rm, mask_m, pc, mask, c1, stride_ym, stride_ram, stride_cs,
            stride_kcs, stride_kch, stride_vcs, stride_vch, HAS_BIAS: tl.constexpr,
            HAS_RES_ADD: tl.constexpr, EPILOGUE: tl.constexpr, GROUP: tl.constexpr,
            NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    # the tile's epilogue: bias, then store (+ residual), SwiGLU, or RoPE + KV store
    out_dtype = y.dtype.element_ty
    rm64 = rm.to(tl.int64)
    if HAS_BIAS:
        acc1 += tl.load(bias + c1).to(tl.float32)[None, :]
        if EPILOGUE != 0:
            acc2 += tl.load(bias + c1 + GROUP).to(tl.float32)[None, :]
    if EPILOGUE == 0:
        if HAS_RES_ADD:
            acc1 += tl.load(res_add + rm64[:, None] * stride_ram + c1[None, :], mask=mask,
                            other=0.0).to(tl.float32)
        tl.store(y + rm64[:, None] * stride_ym + c1[None, :], acc1.to(out_dtype), mask=mask)
    elif EPILOGUE == 1:
        # gate and up rounded like the unfused projection's output, silu(gate) * up in fp32
        g = acc1.to(out_dtype).to(tl.float32)
        u = acc2.to(out_dtype).to(tl.float32)
        tl.store(y + rm64[:, None] * stride_ym + pc[None, :],
                 (g / (1.0 + tl.exp(-g)) * u).to(out_dtype), mask=mask)
    else:
        # neox RoPE on q and k heads (pairs (d, d + GROUP) of head p // GROUP), v passes
        y1 = acc1.to(out_dtype).to(tl.float32)
        y2 = acc2.to(out_dtype).to(tl.float32)
        head = pc // GROUP
        d = pc % GROUP
        pos = tl.load(positions + rm, mask=mask_m, other=0).to(tl.int64)
        cos = tl.load(cos_sin + pos[:, None] * stride_cs + d[None, :])
        sin = tl.load(cos_sin + pos[:, None] * stride_cs + GROUP + d[None, :])
        rot = (head < NUM_Q_HEADS + NUM_KV_HEADS)[None, :]
        r1 = tl.where(rot, y1 * cos - y2 * sin, y1).to(out_dtype)
        r2 = tl.where(rot, y2 * cos + y1 * sin, y2).to(out_dtype)
        out = y + rm64[:, None] * stride_ym + c1[None, :]
        tl.store(out, r1, mask=mask)
        tl.store(out + GROUP, r2, mask=mask)
        slot = tl.load(out_cache_loc + rm, mask=mask_m, other=0).to(tl.int64)
        kh = head - NUM_Q_HEADS
        is_k = mask & ((kh >= 0) & (kh < NUM_KV_HEADS))[None, :]
        kc = k_cache + slot[:, None] * stride_kcs + kh[None, :] * stride_kch + d[None, :]
        tl.store(kc, r1.to(k_cache.dtype.element_ty), mask=is_k)
        tl.store(kc + GROUP, r2.to(k_cache.dtype.element_ty), mask=is_k)
        vh = head - NUM_Q_HEADS - NUM_KV_HEADS
        is_v = mask & (vh >= 0)[None, :]
        vc = v_cache + slot[:, None] * stride_vcs + vh[None, :] * stride_vch + d[None, :]
        tl.store(vc, r1.to(v_cache.dtype.element_ty), mask=is_v)
        tl.store(vc + GROUP, r2.to(v_cache.dtype.element_ty), mask=is_v)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x2, weight, *, bias=None, res_add=None, epilogue=_STORE, group=0, rope=None,
            out_dtype=None, config=None) -> torch.Tensor:
    """y of `_dot_kernel` on rows x2 [M, K]: [M, N], or [M, N / 2] for SwiGLU."""
    n, k = weight.shape
    if x2.dtype != weight.dtype:
        raise ValueError(f"dot_linear: activations are {x2.dtype} but the weight is "
                         f"{weight.dtype}; cast one so both match (the model dtype)")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    num_out = n if epilogue == _STORE else n // 2
    y = torch.empty(m, n if epilogue == _ROPE else num_out, dtype=out_dtype or x2.dtype,
                    device=x2.device)
    if m == 0:
        return y
    cfg = config or dot_config(n, k)
    block_n = cfg.block_n if epilogue == _STORE else max(16, cfg.block_n // 2)
    k_split = _k_split(k, cfg)
    split = cdiv(k, k_split)  # chunks that hold keys (a tiny K may need fewer than split_k)
    grid = (cdiv(m, cfg.block_m), cdiv(num_out, block_n))
    part = torch.empty(split * m * n, dtype=torch.float32, device=x2.device) if split > 1 \
        else y
    positions, cos_sin, k_cache, v_cache, loc, nq, nkv = rope or (y, y, y, y, y, 0, 0)
    tail = (y, bias if bias is not None else y, res_add if res_add is not None else y,
            positions, cos_sin, k_cache, v_cache, loc)
    strides = (y.stride(0), res_add.stride(0) if res_add is not None else 0,
               cos_sin.stride(0) if rope else 0, k_cache.stride(0) if rope else 0,
               k_cache.stride(1) if rope else 0, v_cache.stride(0) if rope else 0,
               v_cache.stride(1) if rope else 0)
    flags = dict(HAS_BIAS=bias is not None, HAS_RES_ADD=res_add is not None, EPILOGUE=epilogue,
                 GROUP=group, NUM_Q_HEADS=nq, NUM_KV_HEADS=nkv, SPLIT=split,
                 BLOCK_M=cfg.block_m, BLOCK_N=block_n)
    _dot_kernel[(*grid, split)](
        x2, weight, tail[0], part, *tail[1:], m, n, k, k_split, x2.stride(0),
        weight.stride(0), *strides, EVEN_K=k_split * split == k,
        PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )
    if split > 1:
        _combine_kernel[grid](part, *tail, m, n, *strides, num_warps=4, **flags)
    return y


def dot_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None,
               config: DotConfig | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ weight [N, K]^T (+ bias [N]) (+ residual [..., N]), summed in
    fp32 and rounded once to out_dtype (default x.dtype); each row as it would be alone."""
    n, k = weight.shape
    res = _rows(residual, n) if residual is not None else None
    y = _launch(_rows(x, k), weight, bias=bias, res_add=res, out_dtype=out_dtype,
                config=config)
    return y.view(*x.shape[:-1], n)


def dot_swiglu(x: torch.Tensor, weight: torch.Tensor, *,
               config: DotConfig | None = None) -> torch.Tensor:
    """silu(gate) * up [..., I] of gate, up = x @ weight [2I, K]^T's halves, each rounded to
    the model dtype as the projection's output is, the product in fp32."""
    y = _launch(_rows(x, weight.shape[1]), weight, epilogue=_SWIGLU,
                group=weight.shape[0] // 2, config=config)
    return y.view(*x.shape[:-1], weight.shape[0] // 2)


def dot_qkv_rope(x, weight, bias, positions, cos_sin_cache, k_cache, v_cache, out_cache_loc,
                 num_q_heads: int, num_kv_heads: int, *, config: DotConfig | None = None):
    """qkv [T, N] = x [T, K] @ weight^T (+ bias), then neox RoPE (full-width rotary) on the q
    and k heads, and k, v stored into each token's KV slot; qkv holds rotated q and k, and v."""
    head_dim = k_cache.shape[-1]
    if weight.shape[0] != (num_q_heads + 2 * num_kv_heads) * head_dim or \
            cos_sin_cache.shape[-1] != head_dim:
        raise ValueError("dot_qkv_rope needs weight rows (Hq + 2 Hkv) * head_dim and a "
                         "full-width rotary cache")
    return _launch(_rows(x, weight.shape[1]), weight, bias=bias, epilogue=_ROPE,
                   group=head_dim // 2, config=config,
                   rope=(positions, cos_sin_cache, k_cache, v_cache, out_cache_loc,
                         num_q_heads, num_kv_heads))


# ---- twins: the same sums in fp32, the same roundings --------------------------------------


def dot_linear_ref(x, weight, bias=None, residual=None, *, out_dtype=None) -> torch.Tensor:
    y = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
    if residual is not None:
        y = y + residual.float()
    return y.to(out_dtype or x.dtype)


def dot_swiglu_ref(x, weight) -> torch.Tensor:
    g, u = dot_linear_ref(x, weight).float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(x.dtype)


def dot_qkv_rope_ref(x, weight, bias, positions, cos_sin_cache, k_cache, v_cache,
                     out_cache_loc, num_q_heads, num_kv_heads) -> torch.Tensor:
    from draftgraph.kernels.kv_store import store_kv_ref
    from draftgraph.kernels.ops import rope_ref

    qkv = dot_linear_ref(x, weight, bias)
    head_dim = k_cache.shape[-1]
    q, k, v = qkv.view(-1, num_q_heads + 2 * num_kv_heads, head_dim).split(
        [num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    q, k = rope_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, out_cache_loc)
    return torch.cat((q, k, v), dim=1).view(qkv.shape)
