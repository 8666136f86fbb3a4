"""`--row-pack` on the CPU, A/B in one process: the default model in fp32 with its weights'
blocked copies attached and detached in turn (models/row_pack.py), plain decoding and the
shipped chain head at batch 1 and 8 and its 4x5:16 trees at batch 1, arms interleaved over
`--repeats` rounds; tokens/s and whether each arm's outputs equal plain decoding's (and the
other mode's).

    python benchmarks/ab_row_pack_cpu.py --out benchmarks/results/row_pack_ab_cpu.json
    python benchmarks/ab_row_pack_cpu.py --products --out r.json   # the products alone

`--products`: us per product of M rows with each of the model's weight shapes (a fresh
weight per call from a pool, so the weights stream from memory as in a step), MKL's F.linear
against the blocked copy, the best of 3 interleaved runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _meta import ab_arm, ab_prompts, model_shape, run_header, timed_generate

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.kernels.gemv import PACKED_ATTR
from draftgraph.models import row_pack
from draftgraph.models.loader import load_model


def products(model_name: str) -> dict:
    model = load_model(model_name, device="cpu", dtype=torch.float32).model
    layer = model.layers[0]
    shapes = {"qkv": layer.self_attn.qkv_proj.weight.shape,
              "o": layer.self_attn.o_proj.weight.shape,
              "gate_up": layer.mlp.gate_up_proj.weight.shape,
              "down": layer.mlp.down_proj.weight.shape, "lm_head": model.lm_head_weight.shape}
    out = {"benchmark": "row_pack_products", **run_header("cpu"), "model": model_name,
           "rows_hint": row_pack.ROWS_HINT, "us": {}}
    for name, (n, k) in shapes.items():
        pool = [torch.randn(n, k) for _ in range(1 if name == "lm_head" else 24)]
        forms = [row_pack.RowsLinear(w) for w in pool]
        blocked = [f.blocked for f in forms]
        calls = 6 if name == "lm_head" else 48
        for m in (1, 2, 5, 8, 17, 32, 64, 128, 256):
            x = torch.randn(m, k)

            def mkl(i, x=x, pool=pool):
                return torch.nn.functional.linear(x, pool[i % len(pool)])

            def onednn(i, x=x, blocked=blocked):
                return torch.ops.mkldnn._linear_pointwise(x, blocked[i % len(blocked)], None,
                                                          "none", [], "")
            best = {}
            for _ in range(3):
                for label, fn in (("mkl", mkl), ("blocked", onednn)):
                    fn(0)
                    t0 = time.perf_counter()
                    for i in range(calls):
                        fn(i)
                    us = (time.perf_counter() - t0) / calls * 1e6
                    best[label] = min(best.get(label, us), us)
            out["us"][f"{name} m={m}"] = best
            print(name, m, {k: round(v, 1) for k, v in best.items()}, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--products", action="store_true", help="time the products alone")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.products:
        Path(a.out).write_text(json.dumps(products(a.model), indent=1))
        return 0
    prompts = ab_prompts(20, 10)  # 8 code prompts, 8 chat prompts
    loaded = load_model(a.model, device="cpu", dtype=torch.float32)
    model = loaded.model
    t0 = time.perf_counter()
    packed_bytes = row_pack.pack_rows_(model)
    pack_s = time.perf_counter() - t0
    forms = {p: getattr(p, PACKED_ATTR) for p in model.parameters()
             if isinstance(getattr(p, PACKED_ATTR, None), row_pack.RowsLinear)}

    def mode(on: bool) -> None:
        for p, form in forms.items():
            if on:
                setattr(p, PACKED_ATTR, form)
            else:
                delattr(p, PACKED_ATTR)

    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    out = {"benchmark": "row_pack_ab", **run_header("cpu"), "model": a.model,
           "model_shape": model_shape(loaded.config), "dtype": "float32",
           "max_tokens": a.max_tokens, "prompts": len(prompts), "pack_seconds": pack_s,
           "packed_mb": packed_bytes / 1e6, "rows_max": row_pack.ROWS_MAX, "runs": []}
    for rep in range(a.repeats):
        for on in (False, True):
            mode(on)
            for arm, bs in (("plain", 1), ("chain", 1), ("tree", 1), ("plain", 8),
                            ("chain", 8)):
                spec, d = ab_arm(arm, loaded, torch.float32, a.model)
                e = LLMEngine(EngineConfig(
                    model=a.model, device="cpu", dtype="float32", row_pack="off",
                    cache=CacheConfig(kv_cache_tokens=16384),
                    scheduler=SchedulerConfig(max_num_seqs=bs, max_num_batched_tokens=2048,
                                              max_model_len=2048), spec=spec),
                    loaded=loaded, drafter=d)
                ps = prompts if bs > 1 else prompts[::4]  # batch 1: 4 of them
                run = {"repeat": rep, "row_pack": on, "arm": arm, "batch": bs,
                       **timed_generate(e, ps, params)}
                out["runs"].append(run)
                print(json.dumps(run), flush=True)
                del e, d
    mode(False)
    digests = {}
    for r in out["runs"]:
        digests.setdefault(r["batch"], set()).add(r["outputs_md5"])
    out["outputs_equal_across_arms_and_modes"] = {bs: len(v) == 1 for bs, v in digests.items()}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["outputs_equal_across_arms_and_modes"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
