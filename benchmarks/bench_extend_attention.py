"""Extend attention (prefill, chunked prefill, a mixed step's rows) sweep: GPU us per layer of
`extend_attention` per split count (split-KV: `num_splits`, and what `extend_num_splits`
would pick at EXTEND_MAX_SPLITS 8) at the engine's plan of tiles, and per (block_m, block_n,
num_warps, num_stages) unsplit with masks on the diagonal key tiles only (`unmasked_first`),
and the engine's plan ("plan": kernels/attention.py's defaults), against the plan before
stop 56 ("default" in the output: unsplit, 64 / 64, 4 warps, 2 stages, every tile masked).

    python benchmarks/bench_extend_attention.py --out extend_sweep.json

Cases: one prompt of 512 and of 4096 tokens, and a served step's shape (two 512-token prompts
beside 64 decode rows of 600-token contexts), for the heads of SmolLM2-135M (9 / 3 x 64),
Llama-3.2-1B (32 / 8 x 64) and Llama-3.1-8B (32 / 8 x 128). Each timing is a CUDA graph of
20 calls (one per layer's own KV pool), median of 5 replays. Each config's output is checked
against the default config's (max abs difference printed; bf16).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch
from _meta import run_header

from draftgraph.kernels import attention as A

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.2-1b": (32, 8, 64), "llama-3.1-8b": (32, 8, 128)}
LAYERS = 20
DEV = "cuda"  # --dry-run: the CPU through Triton's interpreter, tiny cases, no timing


class Case:
    """Requests of `prompt` new tokens each (their whole list new) and `decode` rows of one
    new token over `ctx` keys."""

    def __init__(self, hq: int, hkv: int, d: int, prompts: list[int], decode: int, ctx: int):
        g = torch.Generator(device=DEV).manual_seed(0)
        dt = torch.bfloat16 if DEV == "cuda" else torch.float32
        lens = prompts + [1] * decode
        kv = prompts + [ctx] * decode
        self.bs = len(lens)
        self.t = sum(lens)
        slots = sum(kv) + 1
        self.k = [torch.randn(slots, hkv, d, device=DEV, generator=g, dtype=dt)
                  for _ in range(LAYERS)]
        self.v = [torch.randn(slots, hkv, d, device=DEV, generator=g, dtype=dt)
                  for _ in range(LAYERS)]
        self.q = torch.randn(self.t, hq, d, device=DEV, generator=g, dtype=dt)
        self.out = torch.empty_like(self.q)
        cum = lambda xs: torch.tensor([0] + list(itertools.accumulate(xs)), device=DEV)  # noqa: E731
        self.qo_indptr, self.kv_indptr = cum(lens), cum(kv)
        self.kv_indices = torch.arange(1, slots, device=DEV)
        self.kv_start = torch.zeros(self.bs, dtype=torch.int64, device=DEV)
        self.positions = torch.cat([torch.arange(n, device=DEV) for n in prompts]
                                   + [torch.full((decode,), ctx - 1, device=DEV)])
        self.d = d
        self.hq, self.hkv = hq, hkv
        # room for any split plan of the sweep (the engine's scratch is EXTEND_TARGET_PROGRAMS)
        self.scratch = A.extend_scratch(d, DEV, block_m=128, target=8192)

    def call(self, layer: int, cfg: dict) -> None:
        A.extend_attention(self.q, self.k[layer], self.v[layer], self.qo_indptr,
                           self.kv_indptr, self.kv_indices, self.kv_start, self.positions,
                           None, self.d ** -0.5, self.out, self.bs,
                           **{k: v for k, v in cfg.items() if k != "plan"},
                           **(self.scratch if cfg.get("num_splits", 1) > 1 else {}))

    def time_us(self, cfg: dict) -> tuple[float, torch.Tensor]:
        self.call(0, cfg)  # compile
        if DEV != "cuda":
            return 0.0, self.out.clone()
        torch.cuda.synchronize()
        first = self.out.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for layer in range(LAYERS):
                self.call(layer, cfg)
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / LAYERS)
        return statistics.median(times), first


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU (TRITON_INTERPRET=1), tiny cases: the script runs")
    args = ap.parse_args()
    cases = {"1x512": ([512], 0, 0), "1x4096": ([4096], 0, 0),
             "2x512+64dec@600": ([512, 512], 64, 600)}
    if args.dry_run:
        global DEV, LAYERS
        DEV, LAYERS = "cpu", 1
        cases = {"1x40": ([40], 0, 0), "2x20+3dec@30": ([20, 20], 3, 30)}
    # the tile configs with masks only on the diagonal key tiles (`unmasked_first`); the
    # default config with them is the first, the A/B of that switch alone
    tiles = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s, unmasked_first=True)
             for m, n, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3))]
    # the base: the plan before stop 56 (every key tile masked, 64 keys, 2 stages); "plan":
    # the engine's plan now (kernels/attention.py extend_block_n, EXTEND_NUM_STAGES,
    # EXTEND_UNMASKED_FIRST)
    default = dict(block_m=64, block_n=64, num_warps=4, num_stages=2, unmasked_first=False)
    # split-KV (off in the engine: EXTEND_MAX_SPLITS) on the plan's tiles, as it would run
    splits = [{"plan": True}] + [{"plan": True, "num_splits": n} for n in (2, 4, 8)]
    results = []
    for model in args.models.split(","):
        hq, hkv, d = SHAPES[model]
        for name, (prompts, decode, ctx) in cases.items():
            case = Case(hq, hkv, d, prompts, decode, ctx)
            base_us, ref = case.time_us(default)
            auto = A.extend_num_splits(case.t, case.bs, hq, hkv, max_splits=8)
            rows = []
            for cfg in splits + tiles:
                try:
                    us, out = case.time_us(cfg)
                except Exception as e:  # out of shared memory / registers: skipped
                    rows.append({**cfg, "error": str(e)[:120]})
                    continue
                rows.append({**cfg, "us": us, "max_abs_diff": (out.float() - ref.float())
                             .abs().max().item()})
            ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
            best = ok[0]
            print(f"{model} {name}: default {base_us:.1f} us, best {best['us']:.1f} us "
                  f"{ {k: best[k] for k in best if k not in ('us', 'max_abs_diff')} } "
                  f"(diff {best['max_abs_diff']:.2e}); next: "
                  f"{[{k: r[k] for k in r if k != 'max_abs_diff'} for r in ok[1:4]]}",
                  flush=True)
            by_split = {r["num_splits"]: round(r["us"], 1) for r in rows
                        if "num_splits" in r and "us" in r}
            print(f"    splits (us): {by_split}; extend_num_splits at 8 picks {auto}",
                  flush=True)
            results.append({"model": model, "heads": [hq, hkv, d], "case": name,
                            "default_us": base_us, "auto_splits": auto, "configs": rows})
            del case
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"benchmark": "extend_attention_sweep", **run_header(),
                   "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
