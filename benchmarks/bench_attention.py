"""Decode attention benchmark and tuner: GPU µs per layer of `decode_attention` at given batch
sizes and contexts, per (num_splits, DecodeConfig).

    python benchmarks/bench_attention.py --tune --out attn_tune.json

Every timing is a CUDA graph replay of one call per layer (up to 32 layers' KV pools, at
least 256 MB of keys and values, so they come from HBM as in a decode step, not from L2).
The tuner searches in two stages: the split layout (num_splits, keys per tile, fewest tiles
per split) at 4 warps / 2 stages, then warps and stages around the best three layouts. The
pick is the fastest at the short context among configs within 1.25x of the best at the long
one, so long contexts are not given up for a short benchmark. Prints `DECODE_TUNED` lines
for src/draftgraph/kernels/attention.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

import torch
from _meta import run_header

from draftgraph.kernels import attention as A
from draftgraph.models.presets import preset_config

L2_DEFEAT_BYTES = 256 << 20  # KV bytes cycled through per replay, at most 32 layers


class Case:
    """One layer stack's KV pools and a decode batch of `bs` rows with `ctx` keys each."""

    def __init__(self, hq: int, hkv: int, d: int, bs: int, ctx: int, dtype: torch.dtype):
        g = torch.Generator(device="cuda").manual_seed(0)
        slots = bs * ctx + 1
        self.hq, self.hkv, self.d, self.bs, self.ctx = hq, hkv, d, bs, ctx
        layer_bytes = 2 * slots * hkv * d * torch.finfo(dtype).bits // 8
        self.layers = max(2, min(32, -(-L2_DEFEAT_BYTES // layer_bytes)))
        self.k = [torch.randn(slots, hkv, d, device="cuda", generator=g, dtype=dtype)
                  for _ in range(self.layers)]
        self.v = [torch.randn(slots, hkv, d, device="cuda", generator=g, dtype=dtype)
                  for _ in range(self.layers)]
        self.q = torch.randn(bs, hq, d, device="cuda", generator=g, dtype=dtype)
        self.out = torch.empty_like(self.q)
        self.kv_indptr = torch.arange(bs + 1, device="cuda") * ctx
        self.kv_indices = torch.arange(1, slots, device="cuda")  # slot 0: the dummy
        self.kv_start = torch.zeros(bs, dtype=torch.int64, device="cuda")
        self.positions = torch.full((bs,), ctx - 1, device="cuda")
        self.mid_o = torch.empty(bs, hq, 32, d, device="cuda")
        self.mid_lse = torch.empty(bs, hq, 32, device="cuda")
        self.counters = torch.zeros(bs * hkv, dtype=torch.int32, device="cuda")

    def call(self, layer: int, splits: int, cfg: A.DecodeConfig) -> None:
        A.decode_attention(self.q, self.k[layer], self.v[layer], self.kv_indptr,
                           self.kv_indices, self.kv_start, self.positions, None,
                           self.d ** -0.5, self.out, mid_o=self.mid_o, mid_lse=self.mid_lse,
                           kv_counters=self.counters, num_splits=splits, config=cfg)

    def reference(self) -> torch.Tensor:
        qo = torch.arange(self.bs + 1, device="cuda")
        return A.attention_ref(self.q, self.k[0], self.v[0], qo, self.kv_indptr,
                               self.kv_indices, self.kv_start, self.positions, None,
                               self.d ** -0.5)

    def time_us(self, splits: int, cfg: A.DecodeConfig, replays: int = 20) -> float:
        """GPU µs per layer, or inf when the result is wrong or the config does not compile."""
        try:
            self.call(0, splits, cfg)
            err = (self.out.float() - self.reference().float()).abs().max().item()
            if not err < 2e-2:
                return math.inf
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for layer in range(self.layers):
                    self.call(layer, splits, cfg)
        except Exception as e:  # a config the compiler rejects
            print(f"  skip {splits} {cfg}: {type(e).__name__}", flush=True)
            return math.inf
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = math.inf
        for _ in range(3):
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / (replays * self.layers))
        return best


def layouts():
    for splits, bn, mt in itertools.product((1, 2, 4, 8, 16, 32), (32, 64, 128), (1, 2, 4)):
        if splits == 1 and mt > 1:
            continue
        yield splits, A.DecodeConfig(bn, mt, 4, 2)


def tune_one(model: str, bs: int, short: int, long: int, dtype, budget_s: float) -> dict:
    c = preset_config(model)
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    cases = {short: Case(hq, hkv, d, bs, short, dtype), long: Case(hq, hkv, d, bs, long, dtype)}
    default = (A.decode_num_splits(bs, hkv, 16), A.DecodeConfig())
    timed: dict = {}
    t0 = time.time()

    def measure(plan):
        if plan not in timed and time.time() - t0 < budget_s:
            timed[plan] = {ctx: case.time_us(*plan) for ctx, case in cases.items()}
        return timed.get(plan)

    measure(default)
    for plan in layouts():
        measure(plan)
    best3 = sorted(timed, key=lambda p: timed[p][short])[:3]
    for (splits, cfg), warps, stages in itertools.product(best3, (2, 4, 8), (1, 2, 3)):
        measure((splits, cfg._replace(num_warps=warps, num_stages=stages)))
    best_long = min(t[long] for t in timed.values())
    ok = [p for p, t in timed.items() if t[long] <= 1.25 * best_long]
    pick = min(ok, key=lambda p: timed[p][short])
    key = (hq // hkv, d, min(1 << (bs - 1).bit_length(), 64))
    row = {"model": model, "bs": bs, "key": list(key), "short_ctx": short, "long_ctx": long,
           "pick": {"num_splits": pick[0], **pick[1]._asdict()}, "pick_us": timed[pick],
           "default": {"num_splits": default[0], **default[1]._asdict()},
           "default_us": timed[default], "tried": len(timed),
           "top5_short": [{"num_splits": p[0], **p[1]._asdict(), "us": timed[p]}
                          for p in sorted(timed, key=lambda p: timed[p][short])[:5]]}
    print(f"{model:14s} bs={bs:<3d} pick {pick[0]:2d} {pick[1]}: {timed[pick][short]:.2f} us "
          f"@{short}, {timed[pick][long]:.2f} @{long}; default {timed[default][short]:.2f} / "
          f"{timed[default][long]:.2f} ({len(timed)} tried)", flush=True)
    row["line"] = f"    {key!r}: ({pick[0]}, A.DecodeConfig{tuple(pick[1])!r}),  # {model} bs {bs}"
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="smollm2-135m:1,llama-3.1-8b:1,llama-3.2-1b:8,"
                                       "llama-3.2-1b:32,llama-3.2-1b:64",
                    help="model:batch pairs")
    ap.add_argument("--short", type=int, default=512)
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget-s", type=float, default=40.0, help="seconds per case")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    rows = []
    for case in args.cases.split(","):
        model, bs = case.split(":")
        rows.append(tune_one(model, int(bs), args.short, args.long, dtype, args.budget_s))
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"benchmark": "decode_attention_tune", **run_header(), "dtype": args.dtype,
                   "results": rows}, f, indent=1)
    print("\n# paste into src/draftgraph/kernels/attention.py: DECODE_TUNED = {")
    print("\n".join(r["line"] for r in rows))
    print("# }")
    return 0


if __name__ == "__main__":
    sys.exit(main())
