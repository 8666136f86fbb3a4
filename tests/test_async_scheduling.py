"""Async scheduling on CPU: decode step N + 1 is launched before step N's tokens are read.

On CPU the decode graph set runs its step body eagerly, with the same contract as the
captured graphs: last tokens staged as -(j + 1) are resolved from the previous step's sampled
row j on the device (kernels/tokens.py). Outputs must equal the engine without async
scheduling token for token, whatever finishes, aborts or arrives mid-run, and every KV slot
must come back."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_engine, tiny_hf_model

from draftgraph.engine.sampling import SamplingParams
from draftgraph.engine.stats import step_accounts


def count_refs(graphs) -> None:
    """graphs.refs: rows staged as references to the previous replay (launched ahead)."""
    graphs.refs = 0
    replay = graphs.replay

    def counting_replay(bs, greedy, fields):
        graphs.refs += sum(t < 0 for t in fields["input_ids"])
        return replay(bs, greedy, fields)

    graphs.replay = counting_replay


def _engine(hf, async_on: bool, kv_tokens: int = 2048):
    engine = tiny_engine(hf, max_num_seqs=8, budget=64, kv_tokens=kv_tokens)
    engine.async_scheduling = async_on  # on CPU off by default: eagerly nothing overlaps
    count_refs(engine.decode_graphs)
    return engine


def run_steps(engine, prompts, params, abort_at=None, late=None, before_step=None):
    """Drive step() by hand: abort request `abort_at[1]` after step abort_at[0]; add `late`
    (prompt, params) after step 3; call before_step(engine) before each step. Returns
    {request id: (tokens, logprobs, reason)}; every KV slot must be back at the end."""
    ids = [engine.add_request(p, sp, request_id=f"r{i}")
           for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    done, step = {}, 0
    while engine.has_unfinished():
        if before_step is not None:
            before_step(engine)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.logprobs, out.finish_reason)
        step += 1
        if abort_at and step == abort_at[0]:
            engine.abort(ids[abort_at[1]])
        if late and step == 3:
            engine.add_request(late[0], late[1], request_id="late")
    assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots
    assert engine._inflight is None
    return done


_run = run_steps


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(seed=0)


def _prompts(n=5):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (m,), generator=g).tolist() for m in (5, 30, 12, 9, 21)[:n]]


def test_async_steps_equal_sync_steps_with_requests_ending_at_different_steps(hf):
    prompts = _prompts()
    # different lengths, and one stop token the random model emits at some point
    sync = _engine(hf, False)
    probe = sync.generate(prompts[:1], SamplingParams(max_tokens=30, temperature=0,
                                                      ignore_eos=True))[0].token_ids
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=True)
              for n in (3, 17, 9, 25, 1)]
    params[0] = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=True,
                               stop_token_ids=[probe[6]])
    ref = _run(_engine(hf, False), prompts, params)
    engine = _engine(hf, True)
    got = _run(engine, prompts, params)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in ref.items()}
    assert {k: v[2] for k, v in got.items()} == {k: v[2] for k, v in ref.items()}
    assert ref["r0"][2] == "stop" and len(ref["r0"][0]) <= 7
    for k in ref:
        torch.testing.assert_close(torch.tensor(got[k][1]), torch.tensor(ref[k][1]))
    assert engine.decode_graphs.refs > 20  # the steps really were launched ahead
    assert engine._inflight is None


def test_async_steps_survive_an_abort_and_a_late_arrival(hf):
    prompts = _prompts(4)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 4
    late = (_prompts(5)[4], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    ref = _run(_engine(hf, False), prompts, params, abort_at=(5, 2), late=late)
    engine = _engine(hf, True)
    got = _run(engine, prompts, params, abort_at=(5, 2), late=late)
    assert got["r2"][2] == ref["r2"][2] == "abort"
    for k in ("r0", "r1", "r3", "late"):
        assert got[k] == ref[k], k
    assert engine.decode_graphs.refs > 0


def test_without_async_scheduling_no_step_is_launched_ahead(hf):
    engine = _engine(hf, False)
    _run(engine, _prompts(3), [SamplingParams(max_tokens=8, temperature=0,
                                              ignore_eos=True)] * 3)
    assert engine.decode_graphs.refs == 0


def test_async_scheduling_falls_back_when_kv_runs_short(hf):
    # a pool too small for every request's next slot: the launch ahead is skipped (the normal
    # path preempts) and the outputs still equal the synchronous engine's
    prompts = _prompts(4)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 4
    ref = _run(_engine(hf, False, kv_tokens=90), prompts, params)
    got = _run(_engine(hf, True, kv_tokens=90), prompts, params)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in ref.items()}


@pytest.mark.parametrize("overlap", [True, False])
def test_each_step_says_what_it_ran(hf, overlap):
    """engine.step_kind (counted in engine.stats by kind): the prefill step "extend", the
    first decode step "decode", the steps read while the next runs "ahead", a late arrival's
    prefill "behind" (run behind the step in flight: --overlap-prefill, the default) or
    "extend" again (mixed with the decode row), a step with nothing to run ""."""
    engine = _engine(hf, True)
    engine.config.overlap_prefill = overlap
    late = "behind" if overlap else "extend"
    engine.add_request(_prompts(1)[0], SamplingParams(max_tokens=8, temperature=0,
                                                     ignore_eos=True))
    kinds = []
    while engine.has_unfinished():
        engine.step()
        kinds.append(engine.step_kind)
        if len(kinds) == 4:
            engine.add_request(_prompts(2)[1], SamplingParams(max_tokens=2, temperature=0,
                                                             ignore_eos=True))
    assert kinds[:4] == ["extend", "decode", "ahead", "ahead"]
    assert late in kinds[4:] and kinds.count(late) == 1 + (late == "extend")
    assert kinds.count("behind") == overlap
    engine.step()
    assert engine.step_kind == ""
    # engine.stats counts them (the server's /metrics, bench serve, serve_offline.py)
    got = step_accounts(engine.stats)
    assert {k: v["steps"] for k, v in got.items()} == {k: kinds.count(k) for k in set(kinds)}
    assert all(v["ms_each"] > 0 for v in got.values())
    # with the part of each spent waiting for the device's results: every kind reads some
    # (on the CPU the eager step is done by then: microseconds)
    assert all(0 < v["wait_ms_each"] < v["ms_each"] for v in got.values()), got
