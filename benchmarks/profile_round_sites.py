"""Where a speculative round's launches come from: every torch op that launches work (views
and metadata ops excluded) and every Triton kernel of a few eager rounds, counted per round
by the draftgraph function that issued it (the innermost frame under src/draftgraph), so the
small glue ops a round's graph replays (each a node of ~2 us on a GPU) can be found and fused.

    python benchmarks/profile_round_sites.py --target random:smollm2-135m \
        --arm 'chain|src/draftgraph/heads/smollm2-135m-chain|4x5:16' --out sites.json

Eager rounds (`use_graphs=False`) run the step body that the graph captures, op for op. On the
CPU the Triton kernels' torch twins run instead, so count on the device the numbers are for;
`--glue kernels` (with TRITON_INTERPRET=1 on a CPU) runs a step's packing, acceptance and
catch-up staging as their kernels there too, `--glue twins` as their torch twins on a GPU
(`bench_block.glue`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import traceback

import torch
from _meta import run_header
from bench_block import glue
from torch.utils._python_dispatch import TorchDispatchMode

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig, TreeShape
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.loader import load_model
from draftgraph.spec import make_drafter

# ops that launch no kernel (views, shape queries, aliasing)
_FREE = {"view", "_unsafe_view", "slice", "select", "as_strided", "unsqueeze", "squeeze",
         "expand", "t", "transpose", "permute", "alias", "detach", "split", "split_with_sizes",
         "unbind", "narrow", "reshape", "_reshape_alias", "lift_fresh", "empty", "empty_like",
         "empty_strided", "new_empty", "new_empty_strided", "chunk", "view_as", "sym_size",
         "sym_stride", "is_same_size", "_to_copy_noop", "unfold", "diagonal", "movedim"}


def _site() -> str:
    """The innermost draftgraph frame of the current Python stack, as module:function."""
    for fr in reversed(traceback.extract_stack()):
        f = fr.filename.replace("\\", "/")
        if "/draftgraph/" in f and "/benchmarks/" not in f:
            mod = f.split("/draftgraph/", 1)[1].removesuffix(".py").replace("/", ".")
            return f"{mod}:{fr.name}"
    return "?"


class Sites(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.in_kernel = 0  # inside a Triton launch (the interpreter's own torch ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _FREE and not self.in_kernel:
            self.counts[(_site(), f"aten.{name}")] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_triton(sites: Sites):
    """Count every Triton launch (compiled: JITFunction.run; interpreted:
    InterpretedFunction.run) under its site, and none of the ops it runs inside."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield
        return
    saved = [(cls, cls.run) for cls in (JITFunction, InterpretedFunction)]

    def wrap(orig):
        def run(self, *args, **kwargs):
            if not sites.in_kernel:
                sites.counts[(_site(), f"triton.{self.fn.__name__}")] += 1
            sites.in_kernel += 1
            try:
                return orig(self, *args, **kwargs)
            finally:
                sites.in_kernel -= 1
        return run

    for cls, orig in saved:
        cls.run = wrap(orig)
    try:
        yield
    finally:
        for cls, orig in saved:
            cls.run = orig


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="random:smollm2-135m")
    ap.add_argument("--arm", required=True, help="method|head|mode as in bench_block.py, "
                    "or 'plain'")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--glue", choices=["default", "twins", "kernels"], default="default")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dtype_name = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    target = load_model(a.target, device=a.device, dtype=dtype)
    d = None
    spec = SpecConfig()
    if a.arm != "plain":
        method, head, mode = a.arm.split("|")
        tree = TreeShape.parse(mode) if ":" in mode else None
        spec = SpecConfig(method=method, draft_head=head, tree=tree,
                          num_draft_tokens=int(mode) if mode.isdigit() else 4)
        d = make_drafter(spec, a.device, dtype, target.config)
    n = a.context + 40 * a.rounds + 256
    e = LLMEngine(EngineConfig(
        model=a.target, device=a.device, dtype=dtype_name, use_graphs=False,
        async_scheduling=False, prefill_graph_tokens=0,
        cache=CacheConfig(kv_cache_tokens=a.batch_size * (n + 256)),
        scheduler=SchedulerConfig(max_num_seqs=a.batch_size, max_num_batched_tokens=4096,
                                  max_model_len=n),
        spec=spec), loaded=target, drafter=d)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=40 * a.rounds + 64, temperature=a.temperature,
                        seed=0 if a.temperature > 0 else None, ignore_eos=True)
    vocab = target.config.vocab_size
    for _ in range(a.batch_size):
        e.add_request(torch.randint(0, vocab, (a.context,), generator=g).tolist(), sp)
    for _ in range(3):  # prefill, then rounds
        e.step()
    sites = Sites()
    with glue(a.glue), count_triton(sites), sites:  # eager rounds: the glue is read per step
        for _ in range(a.rounds):
            e.step()
    per_round = {f"{s} {op}": c / a.rounds for (s, op), c in sites.counts.most_common()}
    by_site: collections.Counter = collections.Counter()
    for (s, _), c in sites.counts.items():
        by_site[s] += c / a.rounds
    out = {"benchmark": "round_sites", **run_header(), "target": a.target, "arm": a.arm,
           "device": a.device, "dtype": dtype_name, "glue": a.glue, "batch_size": a.batch_size,
           "rounds": a.rounds, "launches_per_round": sum(per_round.values()),
           "by_site": dict(by_site.most_common()), "by_site_op": per_round}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"launches per round: {out['launches_per_round']:.1f}")
    for s, c in by_site.most_common():
        print(f"{c:7.1f}  {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
