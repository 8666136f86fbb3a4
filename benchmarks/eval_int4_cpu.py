"""How far `--quantization int4` moves the default model from its fp32 self, on real prompts.

    python benchmarks/eval_int4_cpu.py --num-prompts 8 --max-tokens 128 \
        --out benchmarks/results/eval_int4_cpu.json

Per prompt set (chat-templated MT-Bench, HumanEval, held-out ShareGPT): the fp32 engine decodes
each prompt greedily; both engines then score prompt + that continuation (prompt_logprobs=1), and
over the continuation's positions we report
- top1_agreement: how often int4's most likely next token is fp32's (teacher forced);
- mean_abs_dlogprob: the mean |int4 - fp32| logprob of the token fp32 chose;
- fp32_nll / int4_nll: the mean negative log-likelihood of that token under each;
and, decoding freely, how many int4 greedy outputs equal fp32's and the mean length of the
common prefix (a first disagreement makes the rest diverge, so the teacher-forced rate is the
measure of the weights, this one of what a user sees).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from _meta import model_shape, run_header

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams


def _engine(model: str, quantization: str, max_len: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model, device="cpu", quantization=quantization,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                  max_model_len=max_len),
        cache=CacheConfig(kv_cache_tokens=8 * max_len + 64)))


def _score(engine: LLMEngine, seqs: list[list[int]]) -> list[tuple[list, list]]:
    """Per sequence: (logprob of each token given the ones before, top-1 id at each position)."""
    outs = engine.generate(seqs, SamplingParams(max_tokens=1, temperature=0.0,
                                                prompt_logprobs=1))
    res = []
    for o in outs:
        tops = [t[1][0] if t is not None else None for t in o.prompt_top_logprobs]
        res.append((o.prompt_logprobs, tops))
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--sets", default="benchmarks/data/accept_sets_smollm2_ids.json")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/eval_int4_cpu.json")
    args = ap.parse_args()
    with open(args.sets) as f:
        sets = {k: v[: args.num_prompts] for k, v in json.load(f).items()}
    max_len = max(len(p) for v in sets.values() for p in v) + args.max_tokens + 8
    ref, q = _engine(args.model, "none", max_len), _engine(args.model, "int4", max_len)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    report = {"benchmark": "eval_int4", **run_header("cpu"), "model": args.model,
              "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
              "model_shape": model_shape(ref.model_config), "sets": {}}
    for name, prompts in sets.items():
        gen_ref = [o.token_ids for o in ref.generate(prompts, greedy)]
        gen_q = [o.token_ids for o in q.generate(prompts, greedy)]
        seqs = [p + g for p, g in zip(prompts, gen_ref, strict=True)]
        s_ref, s_q = _score(ref, seqs), _score(q, seqs)
        agree, dlp, nll_ref, nll_q = [], [], [], []
        for p, seq, (lp_r, top_r), (lp_q, top_q) in zip(prompts, seqs, s_ref, s_q, strict=True):
            for i in range(len(p), len(seq)):  # the continuation's tokens
                agree.append(top_r[i] == top_q[i])
                dlp.append(abs(lp_q[i] - lp_r[i]))
                nll_ref.append(-lp_r[i])
                nll_q.append(-lp_q[i])
        prefix = []
        for a, b in zip(gen_ref, gen_q, strict=True):
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
            prefix.append(n)
        report["sets"][name] = {
            "prompts": len(prompts), "positions": len(agree),
            "top1_agreement": sum(agree) / len(agree),
            "mean_abs_dlogprob": statistics.fmean(dlp),
            "fp32_nll": statistics.fmean(nll_ref), "int4_nll": statistics.fmean(nll_q),
            "greedy_identical": sum(n == args.max_tokens for n in prefix),
            "mean_common_prefix": statistics.fmean(prefix),
        }
        print(name, json.dumps(report["sets"][name]), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
