"""CPU, bf16: with exact rows every verify row attends as the decode row at its position would
(TorchBackend: one row at a time over the keys that row owns; projections, LM head and
logsumexp one row at a time too: `gemv.linear`, `argmax.ROWS_ALONE`), so n-gram speculation
gives plain decoding's tokens and logprobs bit for bit at batch 1. (On a Xeon the multi-row
matmuls and logsumexp already gave each row its lone value at these shapes; on an AMD EPYC they
do not: a row by row matmul and logsumexp are each needed there, each shown by removing it.)"""

from __future__ import annotations

import torch

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams

NGRAM = SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False)


def _run(spec: SpecConfig, exact: str, prompts, max_tokens: int = 24):
    engine = LLMEngine(EngineConfig(
        model="random:smollm2-135m", device="cpu", dtype="bfloat16", seed=0, exact_rows=exact,
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
    return outs, engine


def _prompts(vocab: int = 49152):
    g = torch.Generator().manual_seed(0)  # a repeated motif: n-gram drafts on every step
    return [torch.randint(0, vocab, (6,), generator=g).repeat(12).tolist() for _ in range(2)]


def test_bf16_ngram_with_exact_rows_equals_plain_tokens_and_logprobs():
    plain, _ = _run(SpecConfig(), "on", _prompts())
    spec, spec_engine = _run(NGRAM, "on", _prompts())
    assert spec_engine.target.backend.exact_rows
    # accepted drafts: tokens whose logprobs came from verify rows past the first
    assert spec_engine.stats["num_accepted_tokens"] > 0
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert [lp for _, lp in spec] == [lp for _, lp in plain]  # bitwise: the same rows


def test_without_exact_rows_the_verify_rows_round_differently():
    # the control: the same runs without exact rows give other logprobs (at SmolLM2's shapes
    # the chunk's causal attention rounds differently from lone rows; a tiny model's does not)
    plain, _ = _run(SpecConfig(), "off", _prompts())
    spec, _ = _run(NGRAM, "off", _prompts())
    assert [lp for _, lp in spec] != [lp for _, lp in plain]
