"""CPU, bf16: with exact rows every verify row is computed as the decode row at its position
(projections one row at a time, attention over the keys the decode row owns), so n-gram
speculation gives plain decoding's tokens and its logprobs bit for bit at batch 1."""

from __future__ import annotations

import torch

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.kernels import gemv

NGRAM = SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False)


def _run(spec: SpecConfig, exact: str, prompts, max_tokens: int = 40):
    engine = LLMEngine(EngineConfig(
        model="random:tiny", device="cpu", dtype="bfloat16", seed=0, exact_rows=exact,
        cache=CacheConfig(kv_cache_tokens=4096),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512,
                                  max_model_len=512), spec=spec))
    outs = []
    for p in prompts:  # batch 1 throughout
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0,
                                             ignore_eos=True, logprobs=True), request_id="r")
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs.append((out.token_ids, out.logprobs))
    accepted = engine.stats.get("spec_accepted_tokens", None)
    return outs, engine, accepted


def _prompts(vocab: int):
    g = torch.Generator().manual_seed(0)  # a repeated motif: n-gram drafts on every step
    return [torch.randint(0, vocab, (6,), generator=g).repeat(12).tolist() for _ in range(4)]


def test_bf16_ngram_with_exact_rows_equals_plain_tokens_and_logprobs():
    plain, engine, _ = _run(SpecConfig(), "on", _prompts(256))
    spec, spec_engine, _ = _run(NGRAM, "on", _prompts(256))
    assert getattr(spec_engine.target.model.lm_head_weight, gemv.EXACT_ROWS_ATTR) > 1
    assert spec_engine.target.backend.exact_rows
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert [lp for _, lp in spec] == [lp for _, lp in plain]  # bitwise: the same rows


def test_without_exact_rows_the_verify_rows_round_differently():
    # the control: the same runs without exact rows give other logprobs (multi-row matmuls
    # and a causal mask over the whole chunk round differently from lone rows)
    plain, _, _ = _run(SpecConfig(), "off", _prompts(256))
    spec, _, _ = _run(NGRAM, "off", _prompts(256))
    assert [lp for _, lp in spec] != [lp for _, lp in plain]
