"""Small-M projection benchmark: cuBLAS (`F.linear`, plus the separate RMSNorm / SiLU*mul
kernels) vs draftgraph's fused GEMV kernels, per projection shape and as a whole decode chain.

    python benchmarks/bench_gemv.py --out gemv.json
    python benchmarks/bench_gemv.py --tune --models smollm2-135m --ms 1   # best block sizes

Every timing is a CUDA graph replay (kernel launch cost inside a graph included) that cycles
through enough copies of the weights to defeat the L2 cache, so TB/s is HBM bandwidth. The
chain compares one decode step's projections (30 or 32 layers + LM head; attention and RoPE
left out) built from the unfused ops vs the fused kernels. Writes JSON with the device, date,
command and shapes; prints a table last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from _meta import run_header

from draftgraph.kernels import gemv as G
from draftgraph.kernels import ops
from draftgraph.models.presets import preset_config

EPS = 1e-5
L2_DEFEAT_BYTES = 256 << 20  # cycle through at least this many weight bytes per replay


def model_shapes(name: str) -> dict[str, tuple[str, int, int]]:
    """projection -> (fused mode, N, K) of one layer (and the LM head) of a preset."""
    c = preset_config(name)
    return {
        "qkv": ("norm", c.q_size + 2 * c.kv_size, c.hidden_size),
        "o": ("plain", c.hidden_size, c.q_size),
        "gate_up": ("norm", 2 * c.intermediate_size, c.hidden_size),
        "down": ("silu", c.hidden_size, c.intermediate_size),
        "lm_head": ("norm", c.vocab_size, c.hidden_size),
    }


def default_config(mode: str, m: int, n: int, k: int, dtype) -> G.GemvConfig:
    """The config the dispatch runs for this shape (since the exact-rows change the single-row
    one at every M; before it, one per M bucket: kept so older trees can be timed too)."""
    code = {"plain": 0, "norm": 1, "silu": 2}[mode]
    if G._config.__code__.co_argcount == 4:
        return G._config(code, n, k, dtype)
    return G._config(code, m, n, k, dtype)


def graph_us(calls: list, replays: int = 20) -> float:
    """GPU µs per call of `calls` (closures) captured back to back in one CUDA graph."""
    for fn in calls[:2]:
        fn()  # compile / pick cuBLAS algorithms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(3):  # best of 3 batches of replays
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * len(calls)))
    del graph
    return best


class Operands:
    """Copies of one projection's weights (enough to defeat L2) and its activations."""

    def __init__(self, mode: str, n: int, k: int, m: int, dtype: torch.dtype, seed: int = 0,
                 device: str = "cuda"):
        g = torch.Generator(device=device).manual_seed(seed)
        self.mode, self.n, self.k, self.m = mode, n, k, m
        self.weight_bytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(2, min(256, -(-L2_DEFEAT_BYTES // self.weight_bytes)))
        if device != "cuda":
            copies = 1
        self.weights = [torch.empty(n, k, dtype=dtype, device=device).normal_(0, k ** -0.5,
                                                                               generator=g)
                        for _ in range(copies)]
        width = 2 * k if mode == "silu" else k
        self.x = torch.randn(m, width, device=device, generator=g).to(dtype)  # [M, K or 2I]
        self.x_k = self.x[:, :k].contiguous()  # [M, K]: what cuBLAS alone multiplies
        self.residual = torch.randn(m, k, device=device, generator=g).to(dtype)  # [M, K]
        self.norm_w = (1 + 0.1 * torch.randn(k, device=device, generator=g)).to(dtype)

    def unfused(self, w):
        if self.mode == "norm":
            h, _ = ops.rms_norm(self.x, self.norm_w, EPS, self.residual)
            return F.linear(h, w)
        if self.mode == "silu":
            return F.linear(ops.silu_and_mul(self.x), w)
        return F.linear(self.x, w)

    def fused(self, w, config=None):
        if self.mode == "norm":
            return G.rmsnorm_gemv_triton(self.x, self.norm_w, EPS, w, residual=self.residual,
                                         config=config)[0]
        if self.mode == "silu":
            return G.silu_mul_gemv_triton(self.x, w, config=config)
        return G.gemv_triton(self.x, w, config=config)

    def reference(self, w):  # fp32 math
        if self.mode == "norm":
            return G.rmsnorm_gemv_ref(self.x, self.norm_w, EPS, w, residual=self.residual)[0]
        if self.mode == "silu":
            return G.silu_mul_gemv_ref(self.x, w)
        return G.gemv_ref(self.x, w)

    def time(self, fn) -> float:
        return graph_us([lambda w=w: fn(w) for w in self.weights])


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def bench_shapes(models, ms, dtype) -> list[dict]:
    rows = []
    for model in models:
        for proj, (mode, n, k) in model_shapes(model).items():
            for m in ms:
                op = Operands(mode, n, k, m, dtype)
                w = op.weights[0]
                ref = op.reference(w)
                row = {"model": model, "proj": proj, "mode": mode, "M": m, "N": n, "K": k,
                       "weight_MB": op.weight_bytes / 2**20,
                       "config": default_config(mode, m, n, k, dtype)._asdict()}
                arms = {
                    "cublas_linear": lambda w, op=op: F.linear(op.x_k, w),
                    "unfused_chain": op.unfused,
                    "fused_gemv": op.fused,
                }
                for arm, fn in arms.items():
                    us = op.time(fn)
                    row[arm] = {"us": us, "TBps": op.weight_bytes / us / 1e6}
                row["cublas_linear"]["note"] = "matmul alone (input prepared outside the timing)"
                row["rel_err_unfused"] = rel_err(op.unfused(w), ref)
                row["rel_err_fused"] = rel_err(op.fused(w), ref)
                rows.append(row)
                print(f"{model:14s} {proj:8s} M={m:<2d} N={n:<6d} K={k:<6d} "
                      f"cublas {row['cublas_linear']['us']:8.2f} us  "
                      f"unfused {row['unfused_chain']['us']:8.2f} us  "
                      f"fused {row['fused_gemv']['us']:8.2f} us "
                      f"({row['fused_gemv']['TBps']:.2f} TB/s)  err {row['rel_err_fused']:.1e}",
                      flush=True)
                op = None  # free the weight copies before the next shape
                torch.cuda.empty_cache()
    return rows


def candidate_configs(m: int, n: int, k: int, dtype) -> list[G.GemvConfig]:
    bm = G.m_bucket(m)
    kmax = max(16, 1 << (k - 1).bit_length())
    out = []
    for bn, bk, warps, stages in itertools.product((1, 2, 4, 8, 16, 32),
                                                   (64, 128, 256, 512, 1024, 2048),
                                                   (1, 2, 4, 8), (1, 3)):
        if bk > kmax or bn > max(1, n // 8):
            continue
        per_thread = bn * bk / (32 * warps)  # weight elements per thread per K step
        if not 4 <= per_thread <= 64 or bm * per_thread > 256:
            continue
        out.append(G.GemvConfig(bm, bn, bk, warps, stages, False))
    if m > 1 and dtype in (torch.float16, torch.bfloat16):
        for bn, bk, warps, stages in itertools.product((16, 32, 64), (64, 128, 256, 512),
                                                       (4, 8), (2, 3, 4)):
            if bk <= kmax and bn * bk <= 16384:
                out.append(G.GemvConfig(16, bn, bk, warps, stages, True))
    d = G.default_config("plain", m, n, k, dtype)
    # nearest to the default first: a time budget cuts the sweep short
    out.sort(key=lambda c: (c != d, c.use_dot != d.use_dot,
                            abs(math.log2(c.block_n * c.block_k / (d.block_n * d.block_k))),
                            abs(math.log2(c.num_warps / d.num_warps))))
    return out


def tune(models, ms, dtype, budget_s: float) -> list[dict]:
    """Sweep block sizes per (projection, M); print a `TUNED` line per shape to paste into
    src/draftgraph/kernels/gemv.py."""
    rows, lines = [], []
    for model in models:
        for proj, (mode, n, k) in model_shapes(model).items():
            for m in ms:
                op = Operands(mode, n, k, m, dtype)
                ref = op.reference(op.weights[0])
                cublas = op.time(op.unfused)
                default = default_config(mode, m, n, k, dtype)
                results = []
                t0 = time.time()
                for cfg in [default] + candidate_configs(m, n, k, dtype):
                    if time.time() - t0 > budget_s:
                        break
                    try:
                        if rel_err(op.fused(op.weights[0], cfg), ref) > 2e-2:
                            continue
                        results.append((op.time(lambda w, c=cfg, op=op: op.fused(w, c)), cfg))
                    except Exception as e:  # a config the compiler rejects
                        print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                if not results:
                    print(f"{model} {proj} M={m}: no config ran", flush=True)
                    continue
                results.sort(key=lambda r: r[0])
                best_us, best = results[0]
                default_us = next((us for us, c in results if c == default), None)
                key = (mode, n, k, G.m_bucket(m))
                lines.append(f"    {key!r}: {best!r},  # {best_us:.2f} us, {model} {proj}")
                rows.append({"model": model, "proj": proj, "M": m, "key": list(key),
                             "best": best._asdict(), "best_us": best_us,
                             "default_us": default_us, "unfused_us": cublas,
                             "tried": len(results),
                             "top5": [{"us": us, **c._asdict()} for us, c in results[:5]]})
                print(f"{model:14s} {proj:8s} M={m:<2d} best {best_us:8.2f} us "
                      f"(default {default_us or float('nan'):8.2f}, unfused {cublas:8.2f}, "
                      f"{len(results)} tried) {best}", flush=True)
                op = None  # free the weight copies before the next shape
                torch.cuda.empty_cache()
    print("\n# paste into src/draftgraph/kernels/gemv.py: TUNED = {")
    print("\n".join(lines))
    print("# }")
    return rows


def shape_operands(mode: str, n: int, k: int, ms, dtype):
    """Operands at each M of `ms`, the largest of them, and a lone row: row 0 of the largest
    (its x, residual and norm weight) as its own M = 1 operands, for the bitwise checks."""
    ops_m = {m: Operands(mode, n, k, m, dtype) for m in ms}
    big = ops_m[max(ms)]
    lone = Operands(mode, n, k, 1, dtype)
    lone.x, lone.residual = big.x[:1].contiguous(), big.residual[:1].contiguous()
    lone.norm_w = big.norm_w
    return ops_m, big, lone


def rows_sweep(models, ms, dtype, budget_s: float) -> list[dict]:
    """Multi-row (exact rows) fused projections: single-row configs (block_m 1, every M runs
    the M = 1 config, so a row's bits never depend on M) at several rows-per-program register
    budgets, timed at each M of `ms` next to norm / activation + cuBLAS. Per shape: the tuned
    config first, then its neighbours, until `budget_s`; each checked bitwise: row 0 at the
    largest M equals the lone row."""
    rows = []
    budgets = (16, 32, 64, 128)
    for model in models:
        for proj, (mode, n, k) in model_shapes(model).items():
            ops_m, big, lone = shape_operands(mode, n, k, ms, dtype)
            cublas = {m: op.time(op.unfused) for m, op in ops_m.items()}
            tuned = default_config(mode, 1, n, k, dtype)
            cands = [tuned] + [c for c in candidate_configs(1, n, k, dtype)
                               if c.block_m == 1 and c != tuned]
            results, t0 = [], time.time()
            for cfg in cands:
                if time.time() - t0 > budget_s:
                    break
                for b in budgets:
                    saved = G.ROWS_REG_BUDGET
                    G.ROWS_REG_BUDGET = b
                    try:
                        r = G.rows_per_program(cfg, max(ms))
                        if b > budgets[0] and r == G.rows_per_program(cfg, max(ms), budgets[0]):
                            continue  # the same launch as a smaller budget's
                        exact = torch.equal(big.fused(big.weights[0], cfg)[:1],
                                            lone.fused(big.weights[0], cfg))
                        us = {m: op.time(lambda w, c=cfg, op=op: op.fused(w, c))
                              for m, op in ops_m.items()}
                    except Exception as e:  # a config the compiler rejects
                        print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                        continue
                    finally:
                        G.ROWS_REG_BUDGET = saved
                    results.append({"config": cfg._asdict(), "budget": b, "rows": r,
                                    "exact": exact, "us": us})
            base = results[0]["us"] if results else {}
            row = {"model": model, "proj": proj, "mode": mode, "N": n, "K": k,
                   "cublas_chain_us": cublas, "tuned": tuned._asdict(), "results": results}
            rows.append(row)
            m2 = max(ms)
            best = sorted((r for r in results if r["exact"]), key=lambda r: r["us"][m2])[:3]
            print(f"{model:14s} {proj:8s} cuBLAS {cublas}  tuned {base}", flush=True)
            for r in best:
                print(f"    {r['us']}  budget {r['budget']} rows {r['rows']} {r['config']}",
                      flush=True)
            ops_m = big = lone = None
            torch.cuda.empty_cache()
    return rows


def dot_configs(n: int, k: int) -> list[G.GemvConfig]:
    """Tensor-core configs (rows padded to 16) for a shape, the likeliest first (a time budget
    cuts the sweep short: each config compiles once)."""
    kmax = max(16, 1 << (k - 1).bit_length())
    out = []
    for bn, bk, warps, stages in itertools.product((16, 32, 64), (64, 128, 256, 512),
                                                   (2, 4, 8), (1, 2, 3, 4)):
        if bk <= kmax and bn * bk <= 16384 and bn <= max(16, n // 8):
            out.append(G.GemvConfig(16, bn, bk, warps, stages, True))
    out.sort(key=lambda c: (abs(math.log2(c.block_k / 128)) + abs(math.log2(c.block_n / 16))
                            + (c.num_warps != 4) + (c.num_stages not in (2, 3)), c))
    return out


def dot_sweep(models, ms, dtype, budget_s: float) -> list[dict]:
    """Tensor-core rows (issue 16): per shape, every dot config (one per shape serves every M up
    to 16: its rows are padded to 16, so a row's bits do not depend on M) timed at each M of
    `ms`, next to norm / activation + cuBLAS and the single-row FMA config the dispatch runs
    at M = 1. Each config is checked bitwise (row 0 at the largest M equals the lone row) and
    against fp32 math. Prints a `TUNED_DOT` line per shape: the config fastest at the middle
    M, with the largest M up to which it beats the cuBLAS chain."""
    rows, lines = [], []
    for model in models:
        for proj, (mode, n, k) in model_shapes(model).items():
            ops_m, big, lone = shape_operands(mode, n, k, sorted(set(ms) | {1}), dtype)
            cublas = {m: op.time(op.unfused) for m, op in ops_m.items()}
            fma = default_config(mode, 1, n, k, dtype)
            fma_us = {1: lone.time(lambda w, op=lone, c=fma: op.fused(w, c))}
            ref = big.reference(big.weights[0])
            results, t0 = [], time.time()
            for cfg in dot_configs(n, k):
                if time.time() - t0 > budget_s:
                    break
                try:
                    y = big.fused(big.weights[0], cfg)
                    if rel_err(y, ref) > 2e-2:
                        continue
                    exact = torch.equal(y[:1], lone.fused(big.weights[0], cfg))
                    us = {m: op.time(lambda w, c=cfg, op=op: op.fused(w, c))
                          for m, op in ops_m.items()}
                except Exception as e:  # a config the compiler rejects
                    print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                    continue
                results.append({"config": cfg._asdict(), "exact": exact, "us": us})
            mid = sorted(ms)[len(ms) // 2]
            ranked = sorted((r for r in results if r["exact"]), key=lambda r: r["us"][mid])
            row = {"model": model, "proj": proj, "mode": mode, "N": n, "K": k,
                   "cublas_chain_us": cublas, "fma_m1": {"config": fma._asdict(), "us": fma_us},
                   "tried": len(results), "top": ranked[:8]}
            rows.append(row)
            if ranked:
                best = ranked[0]
                max_m = 0  # the largest M up to which it beats cuBLAS at every M swept
                for m in sorted(m for m in ms if m > 1):
                    if best["us"][m] >= cublas[m]:
                        break
                    max_m = m
                row["best"] = best
                row["max_m"] = max_m
                cfg = G.GemvConfig(**best["config"])
                lines.append(f"    ({mode!r}, {n}, {k}): ({cfg!r}, {max_m}),  # {model} {proj}: "
                             + ", ".join(f"M={m} {best['us'][m]:.2f}/{cublas[m]:.2f}"
                                         for m in sorted(ms)) + " us (dot/cuBLAS)")
            print(f"{model:14s} {proj:8s} cuBLAS {({m: round(v, 2) for m, v in cublas.items()})}"
                  f"  FMA M=1 {fma_us[1]:.2f}", flush=True)
            for r in ranked[:3]:
                print(f"    {({m: round(v, 2) for m, v in r['us'].items()})}  {r['config']}",
                      flush=True)
            ops_m = big = lone = None
            torch.cuda.empty_cache()
    print("\n# TUNED_DOT = {")
    print("\n".join(lines))
    print("# }")
    return rows


def tune_qkv_rope(models, dtype, budget_s: float) -> list[dict]:
    """Sweep block sizes of the one-token norm + qkv + RoPE + KV-store kernel; print `TUNED`
    lines keyed ("qkv_rope", N, K, 1) (block_n weight rows, i.e. block_n / 2 column pairs)."""
    from draftgraph.models.llama import rope_cos_sin_cache

    rows, lines = [], []
    for model in models:
        c = preset_config(model)
        _, n, k = model_shapes(model)["qkv"]
        op = Operands("norm", n, k, 1, dtype)
        caches = [torch.zeros(16, c.num_key_value_heads, c.head_dim, dtype=dtype, device="cuda")
                  for _ in range(2)]
        pos = torch.tensor([5], device="cuda")
        loc = torch.tensor([3], device="cuda")
        cos_sin = rope_cos_sin_cache(c, 64).cuda()

        def run(w, cfg=None, op=op, c=c, pos=pos, cos_sin=cos_sin, caches=caches, loc=loc):
            return G.rmsnorm_qkv_rope_triton(
                op.x, op.norm_w, EPS, w, None, op.residual, pos, cos_sin, *caches, loc,
                c.num_attention_heads, c.num_key_value_heads, config=cfg)[0]

        ref = G.rmsnorm_qkv_rope_ref(op.x, op.norm_w, EPS, op.weights[0], None, op.residual,
                                     pos, cos_sin, *[t.clone() for t in caches], loc,
                                     c.num_attention_heads, c.num_key_value_heads)[0]
        default = G.TUNED.get(("qkv_rope", n, k, 1)) or default_config("norm", 1, n, k, dtype)
        results, t0 = [], time.time()
        for cfg in [default] + [c2 for c2 in candidate_configs(1, n, k, dtype)
                                if c2.block_n >= 2]:
            if time.time() - t0 > budget_s:
                break
            try:
                if rel_err(run(op.weights[0], cfg), ref) > 2e-2:
                    continue
                results.append((op.time(lambda w, cfg=cfg: run(w, cfg)), cfg))
            except Exception as e:  # a config the compiler rejects
                print(f"  skip {cfg}: {type(e).__name__}", flush=True)
        results.sort(key=lambda r: r[0])
        best_us, best = results[0]
        default_us = next((us for us, c2 in results if c2 == default), None)
        key = ("qkv_rope", n, k, 1)
        lines.append(f"    {key!r}: {best!r},  # {best_us:.2f} us, {model} qkv+rope")
        rows.append({"model": model, "proj": "qkv_rope", "M": 1, "key": list(key),
                     "best": best._asdict(), "best_us": best_us, "default_us": default_us,
                     "tried": len(results),
                     "top5": [{"us": us, **c2._asdict()} for us, c2 in results[:5]]})
        print(f"{model:14s} qkv_rope M=1  best {best_us:8.2f} us (default "
              f"{default_us or float('nan'):8.2f}, {len(results)} tried) {best}", flush=True)
        op = None
        torch.cuda.empty_cache()
    print("\n".join(lines))
    return rows


def build_chain(model: str, dtype, device: str = "cuda"):
    """(step(fused, x0) -> logits, weight bytes) for one decode step's projections of every layer
    + final norm + LM head; the attention output is stood in for by q's slice of qkv."""
    c = preset_config(model)
    g = torch.Generator(device=device).manual_seed(0)

    def w(n, k):
        return torch.empty(n, k, dtype=dtype, device=device).normal_(0, k ** -0.5, generator=g)

    def ones(k):
        return torch.ones(k, dtype=dtype, device=device)

    hid, q = c.hidden_size, c.q_size
    layers = [dict(ln1=ones(hid), qkv=w(q + 2 * c.kv_size, hid), o=w(hid, q), ln2=ones(hid),
                   gate_up=w(2 * c.intermediate_size, hid), down=w(hid, c.intermediate_size))
                   for _ in range(c.num_hidden_layers)]
    norm, lm_head = ones(hid), w(c.vocab_size, hid)

    def unfused(x):  # 7 kernels per layer: norm, qkv, o, norm, gate_up, silu*mul, down
        residual = None
        for p in layers:
            h, residual = ops.rms_norm(x, p["ln1"], EPS, residual)
            residual = x if residual is None else residual
            attn = F.linear(h, p["qkv"])[:, :q]
            h, residual = ops.rms_norm(F.linear(attn, p["o"]), p["ln2"], EPS, residual)
            x = F.linear(ops.silu_and_mul(F.linear(h, p["gate_up"])), p["down"])
        h, _ = ops.rms_norm(x, norm, EPS, residual)
        return F.linear(h, lm_head)

    def fused(x):  # 4 kernels per layer
        residual = None
        for p in layers:
            qkv, residual = G.rmsnorm_gemv_triton(x, p["ln1"], EPS, p["qkv"], residual=residual)
            o = G.gemv_triton(qkv[:, :q], p["o"])
            gate_up, residual = G.rmsnorm_gemv_triton(o, p["ln2"], EPS, p["gate_up"],
                                                      residual=residual)
            x = G.silu_mul_gemv_triton(gate_up, p["down"])
        return G.rmsnorm_gemv_triton(x, norm, EPS, lm_head, residual=residual)[0]

    weight_bytes = sum(t.numel() * t.element_size() for p in layers for t in p.values())
    weight_bytes += lm_head.numel() * lm_head.element_size()
    return (lambda use_fused, x: (fused if use_fused else unfused)(x)), weight_bytes


def chain(model: str, ms: list[int], dtype) -> list[dict]:
    """Unfused vs fused decode-step projections, each step captured in one CUDA graph."""
    step, weight_bytes = build_chain(model, dtype)
    c = preset_config(model)
    rows = []
    for m in ms:
        x0 = torch.randn(m, c.hidden_size, device="cuda").to(dtype)  # [M, hidden]
        out = {"model": model, "M": m, "layers": c.num_hidden_layers,
               "weight_GB": weight_bytes / 1e9, "floor_us_at_4.1TBps": weight_bytes / 4.1e6,
               "kernels_per_layer": {"unfused": 7, "fused": 4},
               "note": "projections + norms + SiLU*mul only; attention and RoPE not included"}
        for arm, use_fused in (("unfused", False), ("fused", True)):
            us = graph_us([lambda f=use_fused, x0=x0: step(f, x0)], replays=10)
            out[arm] = {"us_per_step": us, "TBps": weight_bytes / us / 1e6}
        out["rel_err_fused_vs_unfused_logits"] = rel_err(step(True, x0), step(False, x0))
        print(f"chain {model:14s} M={m:<2d} unfused {out['unfused']['us_per_step']:9.1f} us  "
              f"fused {out['fused']['us_per_step']:9.1f} us  "
              f"(floor {out['floor_us_at_4.1TBps']:.1f})", flush=True)
        rows.append(out)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="JSON file to write")
    ap.add_argument("--models", default="smollm2-135m,llama-3.1-8b")
    ap.add_argument("--ms", default="1,8", help="row counts M")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-chain", action="store_true", help="skip the whole-step chains")
    ap.add_argument("--tune", action="store_true", help="sweep block sizes instead")
    ap.add_argument("--tune-budget-s", type=float, default=25.0, help="seconds per shape")
    ap.add_argument("--dot-sweep", action="store_true",
                    help="tensor-core configs (rows padded to 16) per shape at every M")
    ap.add_argument("--rows-sweep", action="store_true",
                    help="multi-row single-row configs at several register budgets")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gemv needs a CUDA GPU", file=sys.stderr)
        return 2
    models = args.models.split(",")
    ms = [int(v) for v in args.ms.split(",")]
    dtype = getattr(torch, args.dtype)
    out = {
        "benchmark": "gemv_tune" if args.tune else "gemv",
        **run_header(),
        "triton": __import__("triton").__version__,
        "dtype": args.dtype,
        "shapes": {mdl: {p: {"mode": s[0], "N": s[1], "K": s[2]}
                         for p, s in model_shapes(mdl).items()} for mdl in models},
    }
    with torch.no_grad():
        if args.dot_sweep:
            out["benchmark"] = "gemv_dot_sweep"
            out["dot_sweep"] = dot_sweep(models, ms, dtype, args.tune_budget_s)
        elif args.rows_sweep:
            out["benchmark"] = "gemv_rows_sweep"
            out["rows_sweep"] = rows_sweep(models, ms, dtype, args.tune_budget_s)
        elif args.tune:
            out["tune"] = tune(models, ms, dtype, args.tune_budget_s)
            if 1 in ms:
                out["tune"] += tune_qkv_rope(models, dtype, args.tune_budget_s)
        else:
            out["results"] = bench_shapes(models, ms, dtype)
            if not args.no_chain:
                out["chain"] = [r for mdl in models for r in chain(mdl, ms, dtype)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if not (args.tune or args.rows_sweep or args.dot_sweep):
        print(f"\n{'model':14s} {'proj':8s} {'M':>2s} {'cuBLAS us':>10s} {'unfused us':>10s} "
              f"{'fused us':>9s} {'fused TB/s':>10s} {'rel err':>8s}")
        for r in out["results"]:
            print(f"{r['model']:14s} {r['proj']:8s} {r['M']:2d} {r['cublas_linear']['us']:10.2f} "
                  f"{r['unfused_chain']['us']:10.2f} {r['fused_gemv']['us']:9.2f} "
                  f"{r['fused_gemv']['TBps']:10.2f} {r['rel_err_fused']:8.1e}")
        for r in out.get("chain", []):
            print(f"step {r['model']:14s} M={r['M']:<2d} unfused {r['unfused']['us_per_step']:8.1f}"
                  f" us  fused {r['fused']['us_per_step']:8.1f} us  "
                  f"floor {r['floor_us_at_4.1TBps']:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
