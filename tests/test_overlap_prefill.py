"""`--overlap-prefill` on CPU: with async scheduling, prompts that arrive while every running
request decodes are prefilled by a prefill-only forward run behind the launched step N + 1
(`LLMEngine._prefill_behind`), and the step after takes their first tokens as literal inputs
beside the other rows' references (`_launch_ahead`'s fresh rows). On CPU the graph sets run
eagerly with the captured graphs' contract. Outputs must equal the synchronous engine's token
for token (greedy with logprobs, seeded sampling, a drafter with its own KV), whatever arrives
or is aborted mid-run; every KV slot comes back; and the steps really ran behind."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_engine, tiny_hf_model, tiny_loaded
from test_async_scheduling import _prompts

from draftgraph.config import SpecConfig
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.heads import random_head
from draftgraph.spec.chain_head import ChainHeadDrafter


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(seed=0)


def count_rows(graphs) -> None:
    """graphs.mixed: replays whose rows mix references to the previous replay with literal
    last tokens (a launch ahead that took fresh requests)."""
    graphs.mixed = 0
    replay = graphs.replay

    def counting(bs, greedy, fields):
        ids = fields["input_ids"]
        graphs.mixed += any(t < 0 for t in ids) and any(t >= 0 for t in ids)
        return replay(bs, greedy, fields)

    graphs.replay = counting


def engine_for(hf, mode: str, drafter=None, kv_tokens: int = 2048):
    """mode: sync, async (the launches stop for arrivals), overlap."""
    spec = SpecConfig(method="ngram", num_draft_tokens=3, adaptive=False) if drafter else None
    engine = tiny_engine(hf, max_num_seqs=8, budget=64, kv_tokens=kv_tokens, spec=spec,
                         drafter=drafter)
    engine.async_scheduling = mode != "sync"  # on CPU off by default
    engine.config.overlap_prefill = mode == "overlap"
    for graphs in (engine.decode_graphs, engine.spec_graphs):
        if graphs is not None:
            count_rows(graphs)
    return engine


def drive(engine, arrivals: dict[int, list], abort: dict[int, str] | None = None) -> dict:
    """Add arrivals[s] (request id, prompt, params) after step s (0: before the first) and
    abort abort[s] after step s; run until everything ended. Returns {request id: (tokens,
    logprobs, reason)}; every KV slot must be back."""
    abort = abort or {}
    done, step, last = {}, 0, max(arrivals)
    for rid, prompt, sp in arrivals.get(0, []):
        engine.add_request(prompt, sp, request_id=rid)
    while engine.has_unfinished() or step < last:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.logprobs, out.finish_reason)
        step += 1
        for rid, prompt, sp in arrivals.get(step, []):
            engine.add_request(prompt, sp, request_id=rid)
        if step in abort:
            engine.abort(abort[step])
    assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots
    assert engine._inflight is None
    return done


def arrivals_of(params) -> dict[int, list]:
    """Two requests at the start, the others one or two at a time while they decode."""
    g = torch.Generator().manual_seed(11)
    prompts = _prompts() + [torch.randint(0, 128, (m,), generator=g).tolist() for m in (7, 40)]
    at = {0: [0, 1], 4: [2], 6: [3, 4], 11: [5], 12: [6]}
    return {s: [(f"r{i}", prompts[i], params[i]) for i in ids] for s, ids in at.items()}


def test_overlapped_prefill_equals_sync_greedy_and_seeded_sampling(hf):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=True)
              for n in (24, 16, 12, 20, 3, 9, 14)]
    params[1] = SamplingParams(max_tokens=16, temperature=0.8, top_k=40, seed=5,
                               ignore_eos=True, logprobs=True)
    params[3] = SamplingParams(max_tokens=20, temperature=1.0, seed=9, ignore_eos=True)
    arrivals = arrivals_of(params)
    ref = drive(engine_for(hf, "sync"), arrivals, abort={13: "r0"})
    engine = engine_for(hf, "overlap")
    got = drive(engine, arrivals, abort={13: "r0"})
    assert got.keys() == ref.keys() and ref["r0"][2] == "abort"
    for rid in ref:
        assert got[rid][0] == ref[rid][0] and got[rid][2] == ref[rid][2], rid
        if ref[rid][1] is not None:  # asked for logprobs
            torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(ref[rid][1]))
    # the arrivals after the start ran behind a launched step, and the launches after them
    # took their first tokens literally beside the others' references
    assert engine.stats["steps_behind"] >= 3
    assert engine.decode_graphs.mixed >= 3
    # without the flag the launches stop for each arrival: a mixed extend step instead
    plain_async = engine_for(hf, "async")
    assert drive(plain_async, arrivals, abort={13: "r0"}) == got
    assert plain_async.stats["steps_behind"] == 0 and plain_async.decode_graphs.mixed == 0
    assert plain_async.stats["steps_extend"] > engine.stats["steps_extend"]


def test_overlapped_prefill_with_a_chain_head_keeps_its_kv(hf):
    """A drafter with its own KV: the prefill run behind writes the new requests' head KV
    (its `observe`), and their first speculative step comes from a launch ahead."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
              for n in (22, 14, 18, 10, 5, 12, 16)]
    arrivals = arrivals_of(params)
    outs, engines = {}, {}
    for mode in ("sync", "overlap"):
        head = random_head(tiny_loaded(hf).config, "", seed=3)
        engines[mode] = engine_for(hf, mode, drafter=ChainHeadDrafter(head, 3))
        outs[mode] = drive(engines[mode], arrivals)
    plain = drive(engine_for(hf, "sync"), arrivals)
    assert outs["overlap"] == outs["sync"]
    assert {k: v[0] for k, v in outs["overlap"].items()} == {k: v[0] for k, v in plain.items()}
    assert engines["overlap"].stats["steps_behind"] >= 3
    assert engines["overlap"].spec_graphs.mixed >= 3


def test_overlapped_prefill_waits_for_room_while_the_launches_go_on(hf):
    """A pool too small for every arrival: a prefill behind admits what fits beside the
    decoding requests' headroom, the rest wait while launches ahead go on, and outputs still
    equal the sync run."""
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 7
    arrivals = arrivals_of(params)
    engine = engine_for(hf, "overlap", kv_tokens=140)
    waited = []  # steps launched ahead with requests still waiting

    def launch(reqs, graphs, launch=engine._launch_ahead):
        ahead = launch(reqs, graphs)
        waited.append(ahead and bool(engine.scheduler.waiting))
        return ahead

    engine._launch_ahead = launch
    ref = drive(engine_for(hf, "sync", kv_tokens=140), arrivals)
    got = drive(engine, arrivals)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in ref.items()}
    assert engine.stats["steps_behind"] >= 2 and sum(waited) >= 5


def test_a_prefill_only_schedule_preempts_nobody():
    """schedule(decode=False) runs beside a step in flight: a chunk that finds no KV slots is
    left for later instead of preempting a running request (whose slots that step writes)."""
    from draftgraph.config import SchedulerConfig
    from draftgraph.engine.request import Request, Status
    from draftgraph.engine.scheduler import Scheduler
    from draftgraph.runtime.kv_cache import PagedAllocator, ReqToTokenPool

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                      PagedAllocator(21), ReqToTokenPool(4, 64, "cpu"))
    sp = SamplingParams(max_tokens=8)
    a = Request("a", list(range(12)), sp, 0, set())
    sched.add(a)
    sched.schedule()  # a takes 12 of the 20 slots, then decodes
    a.num_computed_tokens = 12
    a.output_token_ids.append(5)
    b = Request("b", list(range(15)), sp, 0, set())  # admitted, its prompt not yet fed
    b.req_pool_idx, b.status = sched.req_pool.alloc(), Status.RUNNING
    sched.running.append(b)
    assert sched.schedule(decode=False) == []
    assert a.status is Status.RUNNING and len(a.pages) == 12 and a in sched.running
