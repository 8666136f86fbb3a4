"""Probe (issue 16): the small-M kernels' tensor-core path (tl.dot, rows padded to 16) as the
way to exact rows that cost nothing. For SmolLM2-135M and Llama-3.1-8B shapes and a few dot
configs: whether the rows of M = 1 / 5 / 16 are bitwise equal, and us per call at M = 1 and 5,
next to the single-row FMA config and cuBLAS.

    OUT=out python benchmarks/probe_dot_rows.py

NOTE: times are per eager call, back to back: for the small shapes they are the host's launch
rate (about 35 us), not the kernel; only the large shapes' ratios mean something.
"""

from __future__ import annotations

import itertools
import json
import os

import torch
import torch.nn.functional as F

from draftgraph.kernels import gemv as G

SHAPES = [("smol_qkv", "norm", 960, 576), ("smol_o", "plain", 576, 576),
          ("smol_gu", "norm", 3072, 576), ("smol_down", "silu", 576, 1536),
          ("smol_lm", "norm", 49152, 576), ("8b_qkv", "norm", 6144, 4096),
          ("8b_gu", "norm", 28672, 4096), ("8b_down", "silu", 4096, 14336),
          ("8b_o", "plain", 4096, 4096)]
MODES = {"plain": G._PLAIN, "norm": G._NORM, "silu": G._SILU}


def us_per_call(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps * 1000)
    return best


def main() -> None:
    torch.manual_seed(0)
    out = []
    for name, mode, n, k in SHAPES:
        w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
        x = torch.randn(16, 2 * k if mode == "silu" else k, device="cuda", dtype=torch.bfloat16)
        norm_w = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5

        def f(m, cfg, mode=mode, w=w, x=x, norm_w=norm_w):
            if mode == "plain":
                return G.gemv_triton(x[:m], w, config=cfg)
            if mode == "silu":
                return G.silu_mul_gemv_triton(x[:m], w, config=cfg)
            return G.rmsnorm_gemv_triton(x[:m], norm_w, 1e-5, w, config=cfg)[0]

        fma = G._config(MODES[mode], n, k, torch.bfloat16)
        row = {"shape": name, "fma_m1": us_per_call(lambda c=fma: f(1, c)),
               "fma_m5": us_per_call(lambda c=fma: f(5, c)),
               "cublas_m5": us_per_call(lambda x=x, k=k, w=w: F.linear(x[:5, :k], w)),
               "dot": []}
        for bn, bk in itertools.product([16, 32], [64, 128, 256]):
            cfg = G.GemvConfig(16, bn, bk, 4, 3, True)
            y16 = f(16, cfg)
            exact = bool(torch.equal(y16[:1], f(1, cfg)) and torch.equal(y16[:5], f(5, cfg)))
            row["dot"].append({"cfg": [bn, bk, 4, 3], "exact": exact,
                               "m1": us_per_call(lambda c=cfg: f(1, c)),
                               "m5": us_per_call(lambda c=cfg: f(5, c))})
        best = min(row["dot"], key=lambda d: d["m1"])
        print(f"{name:10s} fma m1 {row['fma_m1']:7.2f} m5 {row['fma_m5']:7.2f} cublas m5 "
              f"{row['cublas_m5']:7.2f} | best dot {best['cfg']} m1 {best['m1']:7.2f} m5 "
              f"{best['m5']:7.2f} | all exact {all(d['exact'] for d in row['dot'])}", flush=True)
        out.append(row)
    with open(os.path.join(os.environ.get("OUT", "."), "dot_probe_h200.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
