"""What sampling costs on the GPU, and the sampled round against the greedy one (issue 14's
temperature-0.7 speed), A/B in one run.

    python benchmarks/bench_sampling.py --models smollm2-135m --out r.json

Part 1 (`micro`): the sampling functions alone, each captured as one CUDA graph and replayed,
us per call, at the vocabularies of the models and n rows (1 = a draft step or a decode row,
k + 1 = a verify): the temperature softmax, `processed_probs` (with its sort), the sort alone,
`sample_from_probs` on the torch twin (`ref`) and on `kernels/sampling.py` (`kernel`), and
`rejection_sample` with the drafter's distributions three ways (its kernels; its torch ops
with the draw kernels; torch throughout).

Part 2 (`rounds`): per model, plain decoding, the chain head (k = 4) and the block head
(its block size) at batch 1 with a 512-token random prompt, greedy and at temperature 0.7
(top_p 1 and 0.9): ms per round (`bench_chain.run`), the draft alone, tokens per round.
smollm2-135m takes the shipped heads (random target weights of their shape); other models
random heads. For an A/B against an older tree run part 2 alone under each tree's `src`
(`--skip-micro --tag old`, `PYTHONPATH=.old/src:benchmarks`) and merge the JSONs
(`benchmarks/sampling_gpu.sh` does).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _meta import run_header
from bench_chain import run

import draftgraph.runtime.sampling as sampling
import draftgraph.spec.verify as verify
from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.models.loader import load_model
from draftgraph.spec import make_drafter

# the cut's (search fan, search block, search warps, chunk) swept at top_p 0.9
CUT_CONFIGS = [(8, 1024, 8, 1024), (8, 512, 4, 1024), (8, 2048, 16, 1024), (4, 1024, 8, 1024),
               (16, 1024, 8, 1024), (8, 1024, 8, 2048), (8, 1024, 8, 512)]
VOCABS = {"smollm2-135m": 49152, "llama-3.2-1b": 128256, "llama-3.1-8b": 128256}
HEADS = {"smollm2-135m": ("src/draftgraph/heads/smollm2-135m-chain",
                          "src/draftgraph/heads/smollm2-135m-block")}
RANDOM_HEADS = ("random:layers=1,draft_vocab=32000", "random:block_size=8,draft_vocab=32000")


def graph_us(fn, reps: int = 200) -> float:
    """us per replay of fn captured as one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(10):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def micro(vocab: int, n: int) -> dict:
    from draftgraph.kernels.sampling import (
        cut_probs,
        cut_probs_ref,
        cut_probs_triton,
        race_draw,
        race_draw_ref,
        uniform_noise_ref,
    )

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(n, vocab, device="cuda", generator=g) * 4
    t = torch.full((n,), 0.7, device="cuda")
    top_p, top_k = torch.ones(n, device="cuda"), torch.zeros(n, dtype=torch.int64, device="cuda")
    seeds = torch.arange(n, device="cuda")
    pos = torch.arange(n, device="cuda") + 512
    probs = torch.softmax(logits / 0.7, dim=-1)
    am = probs.argmax(dim=-1)
    r = {"softmax": graph_us(lambda: torch.softmax(logits / t[:, None], dim=-1)),
         "sort": graph_us(lambda: probs.sort(dim=-1, descending=True)),
         "processed_probs_top_p_1": graph_us(
             lambda: sampling.processed_probs(logits, t, top_p, top_k)),
         "processed_probs_top_p_0.9": graph_us(
             lambda: sampling.processed_probs(logits, t, top_p * 0.9, top_k)),
         "cut_ref_top_p_0.9": graph_us(lambda: cut_probs_ref(probs, t, top_p * 0.9, top_k,
                                                             am)),
         "cut_kernel_top_p_1": graph_us(lambda: cut_probs(probs.clone(), t, top_p, top_k,
                                                          am)),
         "cut_kernel_top_p_0.9": graph_us(lambda: cut_probs(probs.clone(), t, top_p * 0.9,
                                                            top_k, am)),
         "cut_kernel_top_k_50": graph_us(lambda: cut_probs(probs.clone(), t, top_p,
                                                           top_k + 50, am)),
         **{f"cut_kernel_top_p_0.9_bins{nb}_width{w}": graph_us(
             lambda nb=nb, w=w: cut_probs_triton(probs.clone(), t, top_p * 0.9, top_k, am,
                                                 bins=nb, width=w))
            for nb, w in ((64, 1), (32, 1), (16, 2), (8, 4))},
         "clone": graph_us(lambda: probs.clone()),
         **{f"cut_kernel_top_p_0.9_fan{f}_block{b}_warps{w}_chunk{c}": graph_us(
             lambda f=f, b=b, w=w, c=c: cut_probs_triton(
                 probs.clone(), t, top_p * 0.9, top_k, am, block=b, fan=f, num_warps=w,
                 chunk=c))
            for f, b, w, c in CUT_CONFIGS},
         "draw_ref": graph_us(lambda: race_draw_ref(probs, seeds, pos, 0)),
         "draw_kernel": graph_us(lambda: race_draw(probs, seeds, pos, 0))}
    agree = (race_draw_ref(probs, seeds, pos, 0) == race_draw(probs, seeds, pos, 0)).float()
    r["draws_equal_share"] = agree.mean().item()
    if n > 1:  # a verify of n rows against n - 1 sampled drafts
        k = n - 1
        q = torch.softmax(torch.randn(1, k, vocab, device="cuda", generator=g), dim=-1)
        drafts = q[0].argmax(-1)[None]
        nd = torch.full((1,), k, device="cuda")
        tp = probs.view(1, n, vocab)
        greedy = torch.zeros(1, dtype=torch.bool, device="cuda")

        def rs():
            return verify.rejection_sample(drafts, nd, q, tp, seeds[:1], pos[:1], greedy)
        # three arms: the rejection kernels (3 launches); verify's torch ops with the draw
        # kernels (stop 36's path, ~40 launches); torch throughout (before stop 36)
        r["rejection_sample_kernel"] = graph_us(rs)
        kernel_out = rs()
        saved = verify.uniform_noise, verify.triton_usable
        verify.triton_usable = lambda t: False
        try:
            r["rejection_sample_torch_ops"] = graph_us(rs)
            r["rejection_equal_torch_ops"] = bool(torch.equal(rs()[0], kernel_out[0]))
            sampling.race_draw, verify.uniform_noise = race_draw_ref, uniform_noise_ref
            r["rejection_sample_ref"] = graph_us(rs)
        finally:
            sampling.race_draw = race_draw
            verify.uniform_noise, verify.triton_usable = saved
    return r


def rounds(model: str, steps: int, tag: str = "") -> dict:
    target = load_model(f"random:{model}", device="cuda", dtype=torch.bfloat16)
    chain_head, block_head = HEADS.get(model, RANDOM_HEADS)
    out = {}

    def engine(spec: SpecConfig | None):
        d = make_drafter(spec, "cuda", torch.bfloat16, target.config) if spec else None
        cfg = SpecConfig(method="ngram", num_draft_tokens=d.k, adaptive=False) if d \
            else SpecConfig()
        return LLMEngine(EngineConfig(
            model=f"random:{model}", device="cuda", dtype="bfloat16",
            cache=CacheConfig(kv_cache_tokens=512 + 20 * steps + 512),
            scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=4096,
                                      max_model_len=512 + 20 * steps + 256),
            spec=cfg), loaded=target, drafter=d)

    methods = {"plain": None,
               "chain": SpecConfig(method="chain", draft_head=chain_head, num_draft_tokens=4,
                                   adaptive=False),
               "block": SpecConfig(method="block", draft_head=block_head)}
    modes = [("greedy", 0.0, 1.0), ("t0.7", 0.7, 1.0), ("t0.7_p0.9", 0.7, 0.9)]
    for name, spec in methods.items():
        for mode, temp, top_p in modes:
            e = engine(spec)
            r = run(e, 512, steps, 1, spec is not None, False, temp, top_p)
            r = {k: r[k] for k in ("ms_per_round", "tokens_per_round_per_request",
                                   "tokens_per_s", "draft_ms") if k in r}
            out[f"{tag}{name}/{mode}"] = r
            print(json.dumps({"model": model, "arm": f"{tag}{name}/{mode}", **r}), flush=True)
            del e
            torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,llama-3.1-8b")
    ap.add_argument("--rows", default="1,5,8,64")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--skip-rounds", action="store_true")
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--tag", default="", help="prefix of the rounds' arm names")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = {"benchmark": "sampling", **run_header(), "micro": {}, "rounds": {}}
    models = a.models.split(",")
    for vocab in sorted({VOCABS[m] for m in models}) if not a.skip_micro else ():
        for n in map(int, a.rows.split(",")):
            r = micro(vocab, n)
            out["micro"][f"V{vocab}_n{n}"] = r
            print(json.dumps({"vocab": vocab, "rows": n, **r}), flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    if not a.skip_rounds:
        for m in models:
            out["rounds"][m] = rounds(m, a.steps, a.tag + "/" if a.tag else "")
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
