"""Does a row's result from the batch-invariant matmul depend on the tile's row count? (issue 16)

If 16-, 32- and 64-row tiles of the same column tile, K step and split gave every row the same
bits, `--deterministic` could pick the row tile by M (16 rows at decode sizes, where they run
at cuBLAS's speed, 64 at prefill sizes) and stay batch-invariant. On a GPU, bf16, the
engine's shapes: bitwise comparison of M = 1 / 5 / 64 rows under each row tile against the
64-row tile, and us per call at M = 1 / 32 / 512 (`bench_deterministic.graph_us`).

    OUT=out python benchmarks/probe_tile_rows.py   # -> probe_tile_rows_h200.json
"""

from __future__ import annotations

import json
import os

import torch
from _meta import run_header
from bench_deterministic import MODELS, graph_us, shapes

from draftgraph.kernels import matmul as MM

OUT = os.environ.get("OUT", ".")


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for model, c in MODELS.items():
        for name, (n, k) in shapes(c).items():
            w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
            x = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)
            base = MM.dot_config(n, k)
            ref = MM.dot_linear(x[:64], w, config=base)
            row = {"model": model, "proj": name, "n": n, "k": k, "config": list(base),
                   "tiles": {}}
            for bm in (16, 32, 64):
                cfg = base._replace(block_m=bm)
                same = {m: bool(torch.equal(MM.dot_linear(x[:m], w, config=cfg), ref[:m]))
                        for m in (1, 5, 64)}
                us = {m: graph_us(lambda c=cfg, m=m, x=x, w=w: MM.dot_linear(x[:m], w, config=c))
                      for m in (1, 32, 512)}
                row["tiles"][bm] = {"bitwise_equal_to_64": same, "us": us}
            rows.append(row)
            print(model, name, {bm: (all(t["bitwise_equal_to_64"].values()),
                                     [round(v, 1) for v in t["us"].values()])
                                for bm, t in row["tiles"].items()}, flush=True)
    with open(os.path.join(OUT, "probe_tile_rows_h200.json"), "w") as f:
        json.dump({"benchmark": "probe_tile_rows", **run_header(), "shapes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
