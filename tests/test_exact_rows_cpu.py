"""CPU, bf16: with exact rows every verify row attends as the decode row at its position would
(TorchBackend: one row at a time over the keys that row owns; projections, LM head and
logsumexp one row at a time too: `gemv.linear`, `argmax.ROWS_ALONE`), so n-gram speculation
gives plain decoding's tokens and logprobs bit for bit at batch 1. (On a Xeon the multi-row
matmuls and logsumexp already gave each row its lone value at these shapes; on an AMD EPYC they
do not: a row by row matmul and logsumexp are each needed there, each shown by removing it.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.kernels import gemv

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


def _weight(n: int = 24, k: int = 40, packed=None) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    if packed is not None:
        setattr(w, gemv.PACKED_ATTR, packed)
    return w


def _exact(x, w, b=None):
    """A product of whole numbers: every summation order gives the same bits."""
    return F.linear(x.round(), w.round(), b)


def _rounds_by_m(from_m: int):
    """A product whose rows round differently once it has from_m rows or more (as MKL's
    blocked kernels may), counted."""
    calls = []

    def mm(x, w, b):
        calls.append(x.shape[0])
        y = _exact(x, w, b)
        return y + 0.5 if x.shape[0] >= from_m else y
    return mm, calls


def test_the_probe_finds_where_rows_stop_being_their_lone_rows():
    assert gemv.probe_rows(_weight(packed=_rounds_by_m(5)[0]), max_m=12) == 4
    assert gemv.probe_rows(_weight(packed=_rounds_by_m(2)[0]), max_m=12) == 1
    assert gemv.probe_rows(_weight(packed=_exact), max_m=12) == 12


def test_exact_rows_go_batched_only_within_the_probed_bound():
    mm, calls = _rounds_by_m(5)
    w = _weight(packed=mm)
    setattr(w, gemv.EXACT_ROWS_ATTR, 16)
    x = torch.randn(7, 40)
    setattr(w, gemv.ROWS_INVARIANT_ATTR, gemv.probe_rows(w, max_m=12))  # 4
    calls.clear()
    gemv.linear(x[:4], w)
    assert calls == [4]  # within the bound: one product
    calls.clear()
    y = gemv.linear(x, w)
    assert calls == [1] * 7  # past it: row by row, each its lone value
    assert torch.equal(y, torch.cat([_exact(x[i : i + 1], w) for i in range(7)]))
    calls.clear()
    gemv.linear(x[:4], w, torch.zeros(24))  # a bias: the probe did not measure that product
    assert calls == [1] * 4
    setattr(w, gemv.EXACT_ROWS_ATTR, 0)  # exact rows off: batched whatever the probe said
    calls.clear()
    gemv.linear(x, w)
    assert calls == [7]


def test_an_exact_engine_on_the_cpu_marks_its_weights_with_their_probed_bound():
    _, engine = _run(SpecConfig(), "on", _prompts()[:1], max_tokens=2)
    model = engine.target.model
    ws = [p for p in model.parameters() if p.dim() == 2]
    assert ws and all(getattr(p, gemv.ROWS_INVARIANT_ATTR, None) == gemv.probe_rows(p)
                      for p in ws[:3])
    _, off = _run(SpecConfig(), "off", _prompts()[:1], max_tokens=2)
    assert not any(getattr(p, gemv.EXACT_ROWS_ATTR, 0) for p in off.target.model.parameters())
