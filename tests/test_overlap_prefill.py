"""`--overlap-prefill` on CPU: with async scheduling, prompts that arrive while every running
request decodes are prefilled by a prefill-only forward run behind the step N in flight
(`LLMEngine._prefill_behind`), which leaves their first tokens in the spare result rows of
its graph set; the launch of N + 1 refers to those rows as to step N's rows
(engine/first_tokens.py), and the host appends the tokens after that launch. With plain
decode the running requests' next decode rows ride in that prefill (`_riders`): their inputs
refer to step N's rows on the device, their tokens go to the spare rows too, and the launch
after refers to them (two tokens each appended at once).
On CPU the graph sets run eagerly with the captured graphs' contract. Outputs must equal
the synchronous engine's token for token (greedy with logprobs, seeded sampling, a drafter
with its own KV), whatever arrives or is aborted mid-run; every KV slot comes back; and the
steps really ran behind."""

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
    """graphs.spare: rows staged as references to a spare row (a first token that a prefill
    behind the previous replay left on the device); graphs.literal: replays whose rows mix
    references with literal last tokens (fresh requests whose first token was read)."""
    graphs.spare = graphs.literal = 0
    replay = graphs.replay

    def counting(bs, greedy, fields):
        ids = fields["input_ids"]
        graphs.spare += sum(t < -graphs.max_bs for t in ids)
        graphs.literal += any(t < 0 for t in ids) and any(t >= 0 for t in ids)
        return replay(bs, greedy, fields)

    graphs.replay = counting


def engine_for(hf, mode: str, drafter=None, kv_tokens: int = 2048, ride: bool = True,
               padded: bool = False):
    """mode: sync, async (the launches stop for arrivals), overlap (ride: decode rows ride
    in its prefills). padded: extend forwards take the captured prefill's padded body (run
    eagerly here: runtime/extend_graphs.py)."""
    spec = SpecConfig(method="ngram", num_draft_tokens=3, adaptive=False) if drafter else None
    engine = tiny_engine(hf, max_num_seqs=8, budget=64, kv_tokens=kv_tokens, spec=spec,
                         drafter=drafter)
    if padded:
        engine.target.init_extend_graphs(64, use_graphs=False)
    engine.async_scheduling = mode != "sync"  # on CPU off by default
    engine.config.overlap_prefill = mode == "overlap"
    engine.config.decode_rides_prefill = ride
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
    whole = drive(engine_for(hf, "sync"), arrivals)
    ref = drive(engine_for(hf, "sync"), arrivals, abort={13: "r0"})
    alone = engine_for(hf, "overlap", ride=False)
    assert drive(alone, arrivals, abort={13: "r0"}) == ref
    engine = engine_for(hf, "overlap")
    got = drive(engine, arrivals, abort={13: "r0"})
    assert got.keys() == ref.keys() and ref["r0"][2] == got["r0"][2] == "abort"
    for rid in ref:
        want = whole[rid] if rid == "r0" else ref[rid]
        n = len(got[rid][0])  # r0: the tokens it had when aborted (more with riding rows)
        assert got[rid][0] == want[0][:n] and (rid == "r0" or n == len(want[0])), rid
        assert n >= len(ref[rid][0]), rid  # riding only ever brings tokens sooner
        assert rid == "r0" or got[rid][2] == want[2], rid
        if want[1] is not None:  # asked for logprobs
            torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(want[1][:n]))
    # the arrivals after the start ran behind the step in flight, the running requests' rows
    # rode in them, and the launches after them referred to the tokens on the device (none
    # was read first)
    assert engine.stats["steps_behind"] >= 3 and alone.stats["steps_behind"] >= 3
    assert engine.stats["rows_riding"] >= 5 and alone.stats["rows_riding"] == 0
    assert engine.decode_graphs.literal == alone.decode_graphs.literal == 0
    assert engine.decode_graphs.spare >= 4 + 5 and alone.decode_graphs.spare >= 4
    # the same through the captured prefill's body, which reads the riding rows' inputs in
    # its staged buffer
    padded = engine_for(hf, "overlap", padded=True)
    assert drive(padded, arrivals, abort={13: "r0"}) == got
    assert padded.stats["rows_riding"] == engine.stats["rows_riding"]
    assert padded.target.extend_graphs.replays >= padded.stats["steps_behind"]
    # the server's /metrics count them, as `bench serve` reads them back
    prometheus_client = pytest.importorskip("prometheus_client")
    from draftgraph.bench.serve import parse_metrics
    from draftgraph.server.metrics import ServerMetrics

    text = prometheus_client.generate_latest(ServerMetrics(engine, "m").registry).decode()
    assert parse_metrics(text)["rows_riding"] == engine.stats["rows_riding"]
    # without the flag the launches stop for each arrival: a mixed extend step instead
    plain_async = engine_for(hf, "async")
    assert drive(plain_async, arrivals, abort={13: "r0"}) == ref
    assert plain_async.stats["steps_behind"] == 0 and plain_async.decode_graphs.spare == 0
    assert plain_async.stats["steps_extend"] > engine.stats["steps_extend"]


def test_first_tokens_left_on_the_device_end_stop_abort_and_give_way(hf):
    """Arrivals whose first token ends them (max_tokens 1, a stop token) ride in no later
    step; one prefilled behind the step in flight has its first token out of that very
    engine step (an abort right after it finds one token, and its slots come back); one
    that asks for top-N logprobs makes its prefill's tokens be read at once (the extras
    tail), and everything still equals the synchronous engine."""
    arrivals = arrivals_of([SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 7)
    first = {rid: toks[0] for rid, (toks, _, _) in drive(engine_for(hf, "sync"),
                                                         arrivals).items()}
    sp = {rid: sp for rid, _, sp in sum(arrivals.values(), [])}
    sp["r2"] = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    sp["r3"] = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first["r3"]])
    sp["r5"] = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True,
                              top_logprobs=2)
    arrivals = {s: [(rid, prompt, sp[rid]) for rid, prompt, _ in a]
                for s, a in arrivals.items()}
    abort = {7: "r4"}  # r4 arrives after step 6; step 7 prefills it behind the step in flight
    ref = drive(engine_for(hf, "sync"), arrivals, abort)
    engine = engine_for(hf, "overlap")
    taken = []
    take = engine._take_first_tokens

    def counting_take(first):
        taken.append([r.request_id for r in first.reqs])
        return take(first)

    engine._take_first_tokens = counting_take
    got = drive(engine, arrivals, abort)
    assert got["r4"] == ([first["r4"]], None, "abort") and ref["r4"][2] == "abort"
    assert {k: v for k, v in got.items() if k != "r4"} == \
        {k: v for k, v in ref.items() if k != "r4"}
    assert got["r2"][0] == [first["r2"]] and got["r3"] == ([first["r3"]], None, "stop")
    pending = sum(taken, [])
    assert {"r2", "r3", "r4"} <= set(pending) and "r5" not in pending


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
    assert engines["overlap"].spec_graphs.spare >= 4


@pytest.mark.parametrize("ride", [False, True])
def test_overlapped_prefill_waits_for_room_while_the_launches_go_on(hf, ride):
    """A pool too small for every arrival: a prefill behind admits what fits beside the
    decoding requests' headroom (and the riding rows' slots), the rest wait while launches
    ahead go on, and outputs still equal the sync run."""
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 7
    arrivals = arrivals_of(params)
    engine = engine_for(hf, "overlap", kv_tokens=140, ride=ride)
    waited = []  # steps launched ahead with requests still waiting

    def launch(reqs, graphs, first=None, launch=engine._launch_ahead):
        ahead = launch(reqs, graphs, first)
        waited.append(ahead and bool(engine.scheduler.waiting))
        return ahead

    engine._launch_ahead = launch
    ref = drive(engine_for(hf, "sync", kv_tokens=140), arrivals)
    got = drive(engine, arrivals)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in ref.items()}
    assert engine.stats["steps_behind"] >= 2 and sum(waited) >= 4
    assert (engine.stats["rows_riding"] > 0) == ride


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


def test_a_row_rides_only_beside_a_prefill_whose_keys_it_does_not_far_outnumber(hf,
                                                                                 monkeypatch):
    """The extend kernel's time is its longest key loop: a row rides in a prefill only when
    its keys are at most RIDE_EXTRA_KEYS more than the prefill's longest list (0 here: a
    40-token context never rides beside a 7-token prompt), and the outputs stay the
    synchronous engine's."""
    import draftgraph.engine.engine as engine_module

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
              for n in (24, 16, 12, 20, 3, 9, 14)]
    arrivals = arrivals_of(params)
    ref = drive(engine_for(hf, "sync"), arrivals)
    rode = {}
    for extra in (512, 0):
        monkeypatch.setattr(engine_module, "RIDE_EXTRA_KEYS", extra)
        engine = engine_for(hf, "overlap")
        seen = []  # (riding rows' longest context, the prefill's longest list) per prefill
        run = engine._run

        def spying(scheduled, riders=(), run=run, seen=seen):
            if riders:
                seen.append((max(r.num_tokens + 1 for r, _, _ in riders),
                             max(sr.req.num_computed_tokens + sr.num_new_tokens
                                 for sr in scheduled)))
            return run(scheduled, riders)

        engine._run = spying
        assert drive(engine, arrivals) == ref
        rode[extra] = engine.stats["rows_riding"]
        assert seen and all(ctx <= longest + extra for ctx, longest in seen)
        if extra:  # some row outnumbered its prefill's keys and rode all the same
            assert any(ctx > longest for ctx, longest in seen)
    assert 0 < rode[0] < rode[512]


def test_held_arrivals_share_one_prefill_behind(hf):
    """--prefill-coalesce-ms: an arrival filling less than half the step's token budget waits
    (the launches ahead go on) until another joins it, and both prefill in one step behind;
    outputs stay the synchronous engine's. One that has waited past the hold since its
    arrival goes at once."""
    import time

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (m,), generator=g).tolist() for m in (9, 11, 20, 20)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
              for n in (24, 22, 8, 8)]
    reqs = [(f"r{i}", prompts[i], params[i]) for i in range(4)]
    arrivals = {0: reqs[:2], 3: [reqs[2]], 5: [reqs[3]]}  # 20 + 20 tokens, a budget of 64
    ref = drive(engine_for(hf, "sync"), arrivals)
    runs = {}
    for hold in (0.0, 1000.0):
        runs[hold] = engine = engine_for(hf, "overlap")
        engine.config.prefill_coalesce_ms = hold
        assert drive(engine, arrivals) == ref
    assert runs[0.0].stats["steps_behind"] == 2 and runs[0.0].stats["prefills_held"] == 0
    # r2 held at steps 4 and 5; r3 joins it: 40 tokens, past half the budget
    assert runs[1000.0].stats["steps_behind"] == 1 and runs[1000.0].stats["prefills_held"] == 2
    engine = engine_for(hf, "overlap")
    engine.config.prefill_coalesce_ms = 1000.0
    for rid, prompt, sp in reqs[:2]:
        engine.add_request(prompt, sp, request_id=rid)
    for _ in range(3):
        engine.step()
    engine.add_request(prompts[2], params[2], request_id="late",
                       arrival_time=time.perf_counter() - 2.0)
    engine.step()
    assert engine.step_kind == "behind" and engine.stats["prefills_held"] == 0


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_a_request_whose_tokens_fail_to_record_fails_alone(hf, mode, monkeypatch, caplog):
    """Fault injection in the host's bookkeeping of a step (`_append`: here its stop check
    raises for r3's sixth token, in the step launched ahead or in the synchronous one): r3
    ends "error", its batch-mates and later arrivals get their tokens (the synchronous
    engine's), every KV slot comes back and the engine keeps stepping."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
              for n in (24, 16, 12, 20, 3, 9, 14)]
    arrivals = arrivals_of(params)
    ref = drive(engine_for(hf, "sync"), arrivals)
    engine = engine_for(hf, mode)
    check = engine._check_stop

    def failing(req, tok):
        if req.request_id == "r3" and len(req.output_token_ids) == 6:
            raise RuntimeError("boom")
        return check(req, tok)

    monkeypatch.setattr(engine, "_check_stop", failing)
    got = drive(engine, arrivals)
    assert got["r3"][2] == "error" and got["r3"][0] == ref["r3"][0][:6]
    assert "recording the tokens of request r3 failed" in caplog.text
    assert {k: v for k, v in got.items() if k != "r3"} == \
        {k: v for k, v in ref.items() if k != "r3"}
    assert mode == "sync" or engine.stats["steps_ahead"] > 0


def test_a_step_in_flight_that_fails_ends_its_requests_and_the_engine_goes_on(hf,
                                                                            monkeypatch):
    """Fault injection in reading the step in flight (`_step_ahead`): every running request
    ends "error" once, with the tokens it had; requests that arrive later get the synchronous
    engine's tokens, and every KV slot comes back."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
              for n in (24, 16, 12, 20, 3, 9, 14)]
    arrivals = arrivals_of(params)
    ref = drive(engine_for(hf, "sync"), arrivals)
    engine = engine_for(hf, "overlap")
    read, calls, running = engine._read, [], set()

    def failing(*args, **kwargs):
        calls.append(engine.step_kind)
        if len(calls) == 5:
            assert engine.step_kind in ("ahead", "behind")
            running.update(r.request_id for r in engine.scheduler.running)
            raise RuntimeError("boom")
        return read(*args, **kwargs)

    monkeypatch.setattr(engine, "_read", failing)
    got = drive(engine, arrivals)
    failed = {rid for rid, (_, _, reason) in got.items() if reason == "error"}
    assert failed == running and len(failed) >= 2 and len(got) == 7
    for rid in failed:
        assert got[rid][0] == ref[rid][0][: len(got[rid][0])]
    assert {k: v for k, v in got.items() if k not in failed} == \
        {k: v for k, v in ref.items() if k not in failed}
