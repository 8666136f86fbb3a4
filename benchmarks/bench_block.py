"""Block-drafter rounds on the GPU next to chain rounds with the same number of drafts, in one
run over one target: the plain decode step, then per arm the speculative round (draft + verify
+ accept) and the draft alone (the drafter's `propose` captured as one graph). An arm is

    block|<head>|in_graph     the block head, its metadata built inside the replay
    block|<head>|eager        the fallback: block metadata rebuilt eagerly before each replay
    chain|<head>|<k>          a chain head drafting k tokens (fused chain)
    chain|<head>|<W>x<D>:<N>  the chain head drafting trees (spec/tree.py: width W, depth D, N
                              verified nodes)
    <method>|<head>|batchplan the in-graph arm (k = 4) with verify attention planned by the
                              requests, not the rows (the A arm of that plan)
    <arm>/dot, <arm>/cublas   the arm with `--tensor-core-rows` on / off: the target's and the
                              head's products of 2 .. 128 rows (a tree's verify rows, batched
                              decode) on the tensor-core matmul with programmatic dependent
                              launch, or on cuBLAS (the A/B of that path)
    <arm>/fma                 the arm with the target's o and (SwiGLU +) down projections of 2 ..
                              8 rows on the fused single-row kernels (programmatic dependent
                              launch, SwiGLU folded into down) instead of cuBLAS: `fma_rows`
    <arm>/chain<N>            steps without a tree verifying N drafts: a block head's first N
                              (`BlockHeadDrafter.chain`), a chain head's tree drafter's chain
                              of N (`TreeHeadDrafter.chain`); batches above tree_max_bs
    <arm>/twins               the arm with a step's packing, acceptance and catch-up staging as
                              the torch ops they were before their kernels (`glue_twins`: the A
                              arm of kernels/tree.py's pack / accept, kernels/tokens.py's
                              pack_chain / stage_catch_up, kernels/argmax.py's greedy_emit:
                              `glue`)

with <head> a head directory or `random:...` (models/heads.py: random_head). Per arm: ms per
round, tokens per round per request, host-launched kernels and graph launches per round
(torch.profiler), round / decode step, and with `--draft-alone` ms of the draft alone (timed
after the arm's rounds: its side-stream graph slows every later round of the process, so
arms after the first are not comparable with it on).

    python benchmarks/bench_block.py --target random:llama-3.1-8b --out r.json \
        --arms 'block|random:block_size=5|in_graph;block|random:block_size=5|eager'

Random heads accept almost nothing, so rounds are priced at accept length ~1. Batch 1,
512-token context, bf16, greedy by default (`--temperature`: sampled rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys

import torch
from _meta import model_shape, run_header
from bench_chain import run

from draftgraph.attention.triton_backend import TritonBackend
from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig, TreeShape
from draftgraph.engine.engine import LLMEngine
from draftgraph.kernels import gemv
from draftgraph.models.loader import load_model
from draftgraph.spec import make_drafter
from draftgraph.spec.block import BlockHeadDrafter


@contextlib.contextmanager
def glue(variant: str):
    """A step's glue (packing, acceptance, a chain step's take, the chain head's catch-up
    staging) for the graphs captured inside: "twins", the torch ops it was before its kernels
    (the A arm); "kernels", the Triton launchers even on a CPU (under TRITON_INTERPRET=1: to
    count launches); anything else, the engine's own dispatch. (The metadata builders have
    no capturable twin: both arms build a forward's in one launch.)"""
    import draftgraph.spec.chain as chain
    import draftgraph.spec.chain_head as chain_head
    import draftgraph.spec.step as step
    import draftgraph.spec.verify as verify
    from draftgraph.kernels import tokens, tree

    which = {"twins": 0, "kernels": 1}.get(variant)
    patches = [] if which is None else [
        (step, "tree_pack", (tree.tree_pack_ref, tree.tree_pack_triton)[which]),
        (step, "tree_accept", (tree.tree_accept_ref, tree.tree_accept_triton)[which]),
        (step, "pack_chain", (tokens.pack_chain_ref, tokens.pack_chain_triton)[which]),
        (chain_head, "stage_catch_up",
         (tokens.stage_catch_up_ref, tokens.stage_catch_up_triton)[which]),
        (chain, "draft_take", (tokens.draft_take_ref, tokens.draft_take_triton)[which]),
        (verify, "_greedy_emit_fused", lambda logits: bool(which))]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, fn in patches:
        setattr(mod, name, fn)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@contextlib.contextmanager
def fma_rows(model, on: bool, max_m: int = 8):
    """With `on`: the model's o and down projections of 2 .. max_m rows take the fused
    single-row kernels (kernels/gemv.py `pays`, patched for the graphs captured inside; the
    fused kernels measured 0.9x cuBLAS's time for those shapes at 5 rows, and launch with
    PDL), the other projections stay on cuBLAS."""

    if not on:
        yield
        return
    picked = {id(w) for layer in model.layers
              for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)}
    pays = gemv.pays
    gemv.pays = lambda m, w: pays(m, w) or (id(w) in picked and 1 < m <= max_m)
    try:
        yield
    finally:
        gemv.pays = pays


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--arms", required=True, help="';'-separated method|head|mode arms")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernels", action="store_true",
                    help="add GPU time per kernel name over 10 rounds (torch.profiler)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sampled rounds (seed 0 per request; plain decode sampled too)")
    ap.add_argument("--tensor-core-rows", default="auto", choices=["auto", "on", "off"],
                    help="the whole run's setting (plain decode too); '/dot' and '/cublas' "
                         "arms set on / off")
    ap.add_argument("--dot-epilogues", default="rope", choices=["rope", "on", "off"],
                    help="the whole run's: SwiGLU, the next layer's norm and RoPE + the KV "
                         "store in the tensor-core matmul's epilogues (the default: "
                         "gemv.DOT_EPILOGUES, gemv.DOT_ROPE), all but RoPE's, or the unfused "
                         "chain")
    ap.add_argument("--dot-rows", default=None, metavar="LO,HI",
                    help="products of LO .. HI rows on the tensor-core matmul (gemv.DOT_ROWS: "
                         f"{gemv.DOT_ROWS[0]},{gemv.DOT_ROWS[1]})")
    ap.add_argument("--draft-alone", action="store_true",
                    help="also time each arm's draft alone (a graph of its propose on a side "
                         "stream); after it every round of the process, other arms' too, ran "
                         "0.15 ms slower (the chain's 1.09 -> 1.25 ms: probe_instance.py)")
    ap.add_argument("--free-engines", action="store_true",
                    help="free each arm's engine (gc, empty_cache) before the next is built")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    gemv.DOT_EPILOGUES = a.dot_epilogues != "off"
    gemv.DOT_ROPE = a.dot_epilogues == "rope"
    if a.dot_rows:
        gemv.DOT_ROWS = tuple(map(int, a.dot_rows.split(",")))
    target = load_model(a.target, device="cuda", dtype=dtype)

    def engine(d=None, tensor_core_rows=a.tensor_core_rows):  # d None: plain decoding
        # the drafter is passed in; the config only keeps its draft length fixed
        spec = SpecConfig(method="ngram", adaptive=False) if d is not None else SpecConfig()
        return LLMEngine(EngineConfig(
            model=a.target, device="cuda", dtype=a.dtype,
            cache=CacheConfig(kv_cache_tokens=a.batch_size * (a.context + 20 * a.steps + 512)),
            scheduler=SchedulerConfig(max_num_seqs=a.batch_size, max_num_batched_tokens=4096,
                                      max_model_len=a.context + 20 * a.steps + 256),
            tensor_core_rows=tensor_core_rows, spec=spec), loaded=target, drafter=d)

    out = {"benchmark": "block_round", **run_header(), "target": a.target,
           "batch_size": a.batch_size, "context": a.context, "dtype": a.dtype,
           "temperature": a.temperature, "tensor_core_rows": a.tensor_core_rows,
           "dot_epilogues": a.dot_epilogues, "dot_rows": list(gemv.DOT_ROWS),
           "target_shape": model_shape(target.config), "arms": {}}
    e = engine()
    out["plain_decode"] = run(e, a.context, a.steps, a.batch_size, False, a.kernels,
                              a.temperature)
    del e
    for arm in a.arms.split(";"):
        method, head, mode = arm.split("|")
        mode, _, variant = mode.partition("/")
        tree = TreeShape.parse(mode) if ":" in mode else None
        spec = SpecConfig(method=method, draft_head=head, tree=tree,
                          num_draft_tokens=int(mode) if mode.isdigit() else 4)
        d = make_drafter(spec, "cuda", dtype, target.config)
        if variant.startswith("chain"):  # chain steps verify N drafts (a block's first N, a
            assert hasattr(d, "chain"), f"{arm}: {type(d).__name__} has no chain steps"
            d.chain = int(variant[len("chain"):])  # tree drafter's chain of N)
        patched = method == "block" and mode == "eager"
        if patched:  # what a backend without in-graph block metadata gets
            saved = BlockHeadDrafter.in_graph
            BlockHeadDrafter.in_graph = property(lambda self: False)
        # batchplan: verify attention planned by the requests, as before rows planned it
        TritonBackend.verify_plan_by_rows = mode != "batchplan"
        try:
            with glue(variant), fma_rows(target.model, variant == "fma"):
                e = engine(d, {"dot": "on", "cublas": "off"}.get(variant, a.tensor_core_rows))
                assert e.spec_graphs.body.fused_draft == (not patched)
                r = run(e, a.context, a.steps, a.batch_size, a.draft_alone, a.kernels,
                      a.temperature)
                if a.free_engines:
                    e = None
                    gc.collect()
                    torch.cuda.empty_cache()
        finally:
            TritonBackend.verify_plan_by_rows = True
            if patched:
                BlockHeadDrafter.in_graph = saved
        r.update(method=method, head=head, mode=mode, variant=variant or "kernels",
                 num_drafts=d.k,
                 head_shape=model_shape(d.head.config),
                 head_config=dict(vars(d.head.head_config)),
                 round_over_decode_step=r["ms_per_round"] / out["plain_decode"]["ms_per_round"])
        out["arms"][arm] = r
        print(json.dumps({"arm": arm, **{k: v for k, v in r.items()
                                          if not k.startswith("head_")}}), flush=True)
        del e, d
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
