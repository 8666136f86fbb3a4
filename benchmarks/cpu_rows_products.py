"""What a forward's products cost on this CPU by row count: every projection of the default
model's shape plus its LM head (fp32, random weights, ~540 MB: the weights stream from memory
as in a real step), one pass per row count, best of several, in one process. Rows 2 .. 64 go
through oneDNN's blocked copies as `--row-pack` runs them (models/row_pack.py), one row
through the dense weight; `--variants` also times other ways of running 5 rows (oneDNN's
reorder told another row count, MKL's packed GEMM, plain MKL GEMM).

    python benchmarks/cpu_rows_products.py --rows 1,5,9,17,28,33 --variants --out r.json

A verify of 1 + k rows against a decode step's one row, a tree's 17 or 28: the ratio is what a
speculative round pays in products on the CPU before attention and the rest.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from _meta import run_header

from draftgraph.models.presets import PRESETS


def shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of every projection of the model, layer by layer, then the LM head."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    per_layer = [(qkv, h), (cfg.num_attention_heads * cfg.head_dim, h), (2 * i, h), (h, i)]
    return per_layer * cfg.num_hidden_layers + [(cfg.vocab_size, h)]


def best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--rows", default="1,5,9,17,28,33")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = PRESETS[a.preset]
    weights = [torch.randn(s) * 0.02 for s in shapes(cfg)]
    blocked = {8: [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]}
    ins = sorted({k for _, k in shapes(cfg)})

    def run(m: int, hint: int = 8):
        xs = {k: torch.randn(m, k) for k in ins}
        if m == 1:
            return lambda: [F.linear(xs[w.shape[1]], w) for w in weights]
        if hint not in blocked:
            blocked[hint] = [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in weights]
        return lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], b, None, "none", [],
                                                           "")
                        for w, b in zip(weights, blocked[hint], strict=True)]

    out = {**run_header("cpu"), "preset": a.preset, "weights_mb": round(
        sum(w.numel() for w in weights) * 4 / 2**20), "rows": {}, "variants_5_rows": {}}
    rows = [int(r) for r in a.rows.split(",")]
    for m in rows:
        out["rows"][m] = best_ms(run(m), a.reps)
        print(f"{m} rows: {out['rows'][m]:.1f} ms", flush=True)
    if a.variants:
        x5 = {k: torch.randn(5, k) for k in ins}
        arms = {f"onednn_hint_{h}": run(5, h) for h in (1, 5, 16)}
        arms["mkl_gemm"] = lambda: [F.linear(x5[w.shape[1]], w) for w in weights]
        if hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
            packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, 5) for w in weights]
            arms["mkl_packed_5"] = lambda: [
                torch.ops.mkl._mkl_linear(x5[w.shape[1]], p, w, None, 5)
                for w, p in zip(weights, packed, strict=True)]
        for name, fn in arms.items():
            out["variants_5_rows"][name] = best_ms(fn, a.reps)
            print(f"5 rows, {name}: {out['variants_5_rows'][name]:.1f} ms", flush=True)
    out["rows_again"] = {1: best_ms(run(1), a.reps), 5: best_ms(run(5), a.reps)}  # drift check
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
