"""The batch-invariant kernels' tiles and epilogues (issue 16), on a GPU: us per call at M = 1,
5 and 512 of `matmul.dot_linear` with the shape's config (64-row tiles) and with 16-row tiles,
and of the SwiGLU epilogue, next to cuBLAS (+ the row-wise SwiGLU kernel) and the default
step's fused single-row kernel; 20 calls per CUDA graph, best of 5 replays
(`bench_deterministic.graph_us`). Earlier versions timed the norm folded into the K loop
(`results/fused_dot_norm_h200.json`: 2.6-4.3x slower) and a decode side of 16-row tiles with
a last-program split-K combine (`results/fused_dot_sides_h200.json`); both dropped.

    OUT=out python benchmarks/bench_fused_dot.py [models]   # -> fused_dot_h200.json
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from _meta import run_header
from bench_deterministic import MODELS, graph_us, shapes

from draftgraph.kernels import gemv as G
from draftgraph.kernels import matmul as MM
from draftgraph.kernels import ops

OUT = os.environ.get("OUT", ".")


def time_shape(n: int, k: int, m: int, gate_up: bool) -> dict[str, float]:
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cfg = MM.dot_config(n, k)
    rows16 = cfg._replace(block_m=16)
    t = {
        "cublas": graph_us(lambda: F.linear(x, w)),
        "dot": graph_us(lambda: MM.dot_linear(x, w, config=cfg)),
        "dot_16rows": graph_us(lambda: MM.dot_linear(x, w, config=rows16)),
    }
    if m == 1:
        t["gemv_fused"] = graph_us(lambda: G.gemv_triton(x, w))
    if gate_up:
        t["cublas_silu_and_mul"] = graph_us(lambda: ops.silu_and_mul(F.linear(x, w)))
        t["swiglu"] = graph_us(lambda: MM.dot_swiglu(x, w, config=cfg))
    return t


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for model in sys.argv[1:] or list(MODELS):
        for name in ("qkv", "gate_up", "down", "lm_head"):
            n, k = shapes(MODELS[model])[name]
            for m in (1, 5, 512):
                t = time_shape(n, k, m, name == "gate_up")
                rows.append({"model": model, "proj": name, "n": n, "k": k, "m": m, "us": t})
                print(model, name, m, " ".join(f"{a} {b:.1f}" for a, b in t.items()), flush=True)
    with open(os.path.join(OUT, "fused_dot_h200.json"), "w") as f:
        json.dump({"benchmark": "fused_dot", **run_header(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
