"""GPU: the chain head in captured step graphs. The fused chain (metadata advanced inside one
graph), the per-step fallback (the backend declared without draft_step_update) and the eager
body propose the same drafts step after step and give plain decoding's output; with drafts
that get accepted, the head's KV after every replayed step equals a from-scratch computation
(the catch-up inside the graph); captured buffers keep their addresses over growing and
shrinking batches (fp32)."""

from __future__ import annotations

import pytest
import torch

from draftgraph.attention.triton_backend import TritonBackend
from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.heads import random_head
from draftgraph.models.loader import load_model
from draftgraph.spec.chain_head import ChainHeadDrafter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

K = 4
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model("random:smollm2-135m", device="cuda", dtype=torch.float32)


def _engine(loaded, drafter=None, use_graphs: bool = True, k: int = K) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model="random:smollm2-135m", device="cuda", dtype="float32", use_graphs=use_graphs,
        cache=CacheConfig(kv_cache_tokens=16384),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                  max_model_len=1024),
        spec=SpecConfig(method="ngram", num_draft_tokens=k, adaptive=False)),
        loaded=loaded, drafter=drafter)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 120, 33, 64, 5)]


def _drafts_and_outputs(engine, prompts) -> tuple[list, list]:
    """Requests join one per step and finish at different lengths (the batch grows, then
    shrinks); the drafts every speculative replay recorded for its live rows (0 past a
    request's budget), then every request's tokens."""
    rids, drafts, done = [], [], {}
    pending, gs = list(prompts), engine.spec_graphs
    # NOTE: replay by replay against the eager engine (which never launches ahead): each
    # replay's drafts are read after the step that ran it (async steps: tests/test_async_spec.py,
    # test_gpu_graphs.py)
    engine.async_scheduling = False
    while pending or engine.has_unfinished():
        if pending:
            sp = SamplingParams(max_tokens=20 + 7 * len(pending), temperature=0,
                                ignore_eos=True)
            rids.append(engine.add_request(pending.pop(0), sp))
        launched = gs._launched
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        if gs._launched > launched:  # a speculative step ran: its batch's recorded drafts
            drafts.append(gs.body.draft_tokens[: gs._bs[(gs._launched - 1) % 2]].clone())
    return drafts, [done[r] for r in rids]


@pytest.mark.parametrize("spec", ["draft_vocab=8192", "draft_vocab=8192,share_lm_head=1"])
def test_fused_fallback_and_eager_chains_draft_the_same_and_are_lossless(loaded, monkeypatch,
                                                                        spec):
    prompts = _prompts(loaded.config.vocab_size)
    head = random_head(loaded.config, spec, "cuda", torch.float32, seed=2)
    runs = {}
    for arm in ("fused", "fallback", "eager"):
        if arm == "fallback":
            monkeypatch.setattr(TritonBackend, "draft_step_update", False)
        drafter = ChainHeadDrafter(head, K)
        engine = _engine(loaded, drafter, use_graphs=arm != "eager")
        body = engine.spec_graphs.body
        assert body.fused_draft == (arm != "fallback")
        ptrs = [t.data_ptr() for t in (drafter.last_feat, drafter.step_ids, drafter.drafts,
                                       drafter.capture.out)]
        runs[arm] = _drafts_and_outputs(engine, prompts)
        assert ptrs == [t.data_ptr() for t in (drafter.last_feat, drafter.step_ids,
                                                drafter.drafts, drafter.capture.out)]
        assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots
        monkeypatch.undo()
    assert_arms_agree(runs, _engine(loaded), prompts)


def assert_arms_agree(runs: dict, plain_engine, prompts) -> None:
    """runs[arm] = `_drafts_and_outputs`: the fallback and eager arms drafted what the fused
    one did, replay by replay, and emitted its tokens, which are plain decoding's (fp32 rows
    of another batch shape may flip one near-tie)."""
    for arm in ("fallback", "eager"):
        assert len(runs[arm][0]) == len(runs["fused"][0]) > 10, arm
        assert all(torch.equal(a, b) for a, b in zip(runs["fused"][0], runs[arm][0],
                                                     strict=True)), arm
        assert runs[arm][1] == runs["fused"][1], arm
    ref = [o.token_ids for o in plain_engine.generate(
        prompts, [SamplingParams(max_tokens=20 + 7 * (len(prompts) - i), temperature=0,
                                 ignore_eos=True) for i in range(len(prompts))])]
    assert sum(a == b for a, b in zip(runs["fused"][1], ref, strict=True)) >= len(ref) - 1


def test_the_head_kv_in_graphs_equals_a_from_scratch_computation(loaded):
    """Drafts that are accepted (the plain continuation, fed with the head's own features):
    the catch-up inside the replayed graph makes every final entry exact."""
    from test_spec_chain_head import KV_PROMPT, LONG, _Accepting, _max_kv_error

    (out,) = _engine(loaded).generate([KV_PROMPT], LONG)
    head = random_head(loaded.config, "", "cuda", torch.float32, seed=2)
    drafter = _Accepting(head, K, future=KV_PROMPT + out.token_ids)
    drafter.future = drafter.future.cuda()
    engine = _engine(loaded, drafter)
    assert engine.spec_graphs.use_graphs and engine.spec_graphs.body.fused_draft
    assert _max_kv_error(engine, drafter) < 1e-3
    s = engine.stats
    assert s["num_accepted_tokens"] >= 0.9 * s["num_draft_tokens"] > 30
