"""Speculative decoding in the engine: lossless greedy output, self-drafting acceptance,
stops inside accepted runs, and KV accounting of rejected drafts."""

from __future__ import annotations

import pytest
import torch
from _tiny import OracleDrafter, tiny_engine, tiny_hf_model

from draftgraph.config import SpecConfig
from draftgraph.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
NGRAM = SpecConfig(method="ngram", num_draft_tokens=4, ngram_min=1, ngram_max=3)


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(seed=5)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    out = []
    for n in (6, 25, 14, 33):
        base = torch.randint(0, 128, (n,), generator=g).tolist()
        out.append(base + base[: n // 2] + base)  # repeats give the n-gram proposer matches
    return out


def test_ngram_speculation_is_lossless_alone_and_batched(hf, prompts):
    plain = tiny_engine(hf).generate(prompts, GREEDY)
    for p, ref in zip(prompts, plain, strict=True):
        alone = tiny_engine(hf, spec=NGRAM).generate([p], GREEDY)[0]
        assert alone.token_ids == ref.token_ids
    engine = tiny_engine(hf, spec=NGRAM, budget=32)
    batched = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == [o.token_ids for o in plain]
    assert engine.stats["num_drafts"] > 0  # drafts were really verified
    assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots


def _oracle_engine(hf, future):
    return tiny_engine(hf, spec=SpecConfig(method="ngram", num_draft_tokens=4),
                       drafter=OracleDrafter(future))


def test_self_drafting_accepts_every_draft(hf, prompts):
    """A drafter that returns the target's own future greedy tokens reaches k + 1."""
    ref = tiny_engine(hf).generate([prompts[1]], GREEDY)[0]
    future = prompts[1] + ref.token_ids
    engine = _oracle_engine(hf, future)
    out = engine.generate([prompts[1]], GREEDY)[0]
    assert out.token_ids == ref.token_ids
    m = out.metrics
    assert m["accepted_tokens"] == m["draft_tokens"]  # every proposed draft accepted
    # 1 token from prefill, then k + 1 = 5 per verify step (the last one capped by max_tokens)
    assert m["verify_steps"] == -(-(GREEDY.max_tokens - 1) // 5)
    assert m["accept_len_mean"] > 4.5


def test_stop_token_inside_an_accepted_run_discards_the_rest(hf, prompts):
    ref = tiny_engine(hf).generate([prompts[1]], GREEDY)[0].token_ids
    future = prompts[1] + ref
    stop_at = 6
    sp = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ref[stop_at]])
    first = ref.index(ref[stop_at])
    engine = _oracle_engine(hf, future)
    out = engine.generate([prompts[1]], sp)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[: first + 1]
    assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots


@pytest.mark.parametrize("top", [{}, {"top_p": 0.9, "top_k": 20}])
def test_point_mass_drafts_with_seeded_sampling_emit_plain_decodings_tokens(hf, prompts, top):
    """Point-mass drafts are verified against the very draw plain decoding makes at each
    position, so seeded sampling with speculation emits plain seeded sampling's tokens: an
    oracle drafting that output, wrong at every third position (drafts accepted and
    rejected), and n-gram drafts, alone and batched."""
    params = [SamplingParams(max_tokens=32, temperature=0.8, seed=40 + i, ignore_eos=True,
                             **top) for i in range(len(prompts))]
    plain = tiny_engine(hf).generate(prompts, params)
    ref = plain[1].token_ids
    future = prompts[1] + [(t + 1) % 128 if i % 3 == 2 else t for i, t in enumerate(ref)]
    engine = _oracle_engine(hf, future)
    assert engine.generate([prompts[1]], params[1])[0].token_ids == ref
    m = engine.stats
    assert m["num_accepted_tokens"] > 5  # drafts accepted ...
    assert m["num_draft_tokens"] - m["num_accepted_tokens"] > 5  # ... and rejected
    batched = tiny_engine(hf, spec=NGRAM, budget=32).generate(prompts, params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in plain]


def test_seeded_sampling_with_speculation_reproduces_itself(hf, prompts):
    sp = SamplingParams(max_tokens=24, temperature=0.7, seed=11, ignore_eos=True)
    a = tiny_engine(hf, spec=NGRAM).generate([prompts[2]], sp)[0].token_ids
    b = tiny_engine(hf, spec=NGRAM, budget=16).generate(prompts, sp)[2].token_ids
    assert a == b and len(a) == 24


def test_a_request_at_draft_length_0_probes_every_interval_of_launched_steps():
    """The adaptive policy's idle count moves only with launched steps: asking `max_draft`
    (as a launch ahead does before it may decline) counts nothing."""
    from draftgraph.engine.request import Request
    from draftgraph.engine.speculation import SpecPolicy

    k = 4
    policy = SpecPolicy(SpecConfig(method="ngram", num_draft_tokens=k), k)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=1000), 0, set())
    for _ in range(3):  # rejected at 4, 2, 1 drafts: length 0
        policy.record(req, policy.max_draft(req), 0)
    assert policy.max_draft(req) == 0
    drafts = []
    for _ in range(2 * SpecPolicy.PROBE_INTERVAL):
        d = [policy.max_draft(req) for _ in range(3)]  # asked three times, launched once
        assert d[0] == d[1] == d[2]
        policy.launched([req])
        drafts.append(d[0])
    probes = [i for i, d in enumerate(drafts) if d]
    assert probes == [SpecPolicy.PROBE_INTERVAL - 1, 2 * SpecPolicy.PROBE_INTERVAL - 1]
    assert set(drafts) == {0, 1}
