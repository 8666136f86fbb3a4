"""Engine behaviour on a tiny random model: exact greedy decoding, batching invariance under
chunked prefill, KV accounting, preemption, stops and errors."""

from __future__ import annotations

import random

import pytest
import torch
from _tiny import tiny_engine, tiny_hf_model

from draftgraph.config import EngineConfig, SchedulerConfig
from draftgraph.engine.engine import EngineError
from draftgraph.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(seed=0)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    lens = (5, 30, 12, 40, 7, 22, 3, 17)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]


def _teacher_forced_argmax(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0]


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_greedy_tokens_are_the_reference_argmax_at_every_position(sliding_window, prompts):
    hf = tiny_hf_model(seed=3, sliding_window=sliding_window)
    engine = tiny_engine(hf, budget=16)
    outs = engine.generate(prompts[:4], GREEDY)
    for p, out in zip(prompts[:4], outs, strict=True):
        seq = p + out.token_ids
        logits = _teacher_forced_argmax(hf, seq)
        for i in range(len(p) - 1, len(seq) - 1):
            top2 = logits[i].topk(2).values
            if (top2[0] - top2[1]) < 1e-4:
                break  # a near-tie: the rest of the sequence may legitimately differ
            assert seq[i + 1] == int(logits[i].argmax()), f"position {i}"


def test_batch_of_8_with_chunked_prefill_equals_each_prompt_alone(hf, prompts):
    alone = []
    for p in prompts:
        engine = tiny_engine(hf, budget=512)
        alone.append(engine.generate([p], GREEDY)[0].token_ids)
    engine = tiny_engine(hf, budget=16)  # 16-token budget splits the long prompts
    batched = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == alone
    assert all(len(t) == 24 for t in alone)


def test_page_size_4_gives_the_same_tokens_from_whole_pages(hf, prompts):
    ref = tiny_engine(hf).generate(prompts[:4], GREEDY)
    engine = tiny_engine(hf, page_size=4)
    seen_rows = []
    real_forward = engine.model.forward  # every step: eager forwards and step bodies

    def forward(*args, **kwargs):  # every request's slots: 4 consecutive positions, one page
        for req in engine.scheduler.running:
            n = req.num_computed_tokens + 1
            seen_rows.append(engine.slots.req_pool.req_to_token[req.req_pool_idx, :n].clone())
        return real_forward(*args, **kwargs)

    engine.model.forward = forward
    paged = engine.generate(prompts[:4], GREEDY)
    assert [o.token_ids for o in paged] == [o.token_ids for o in ref]
    checked = 0
    for row in seen_rows:
        n = (row.numel() - 1) // 4 * 4  # whole pages already written
        if n:
            pages = row[:n].view(-1, 4)
            assert (pages // 4 == pages[:, :1] // 4).all()
            assert (pages % 4 == torch.arange(4)).all()
            checked += 1
    assert checked > 10


def test_preemption_when_kv_runs_out_keeps_outputs_identical(hf, prompts):
    ref = tiny_engine(hf).generate(prompts, GREEDY)
    small = tiny_engine(hf, kv_tokens=120, budget=32)  # far less than 8 requests need
    outs = small.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert small.num_free_kv_slots() == small.slots.allocator.usable_slots


def test_every_kv_slot_is_free_after_adds_finishes_and_aborts(hf):
    rng = random.Random(0)
    engine = tiny_engine(hf, max_num_seqs=4, budget=24, kv_tokens=400, page_size=2)
    usable = engine.slots.allocator.usable_slots
    live: list[str] = []
    finished = aborted = 0
    for _step in range(300):
        if rng.random() < 0.3:
            p = [rng.randrange(128) for _ in range(rng.randint(1, 40))]
            sp = SamplingParams(max_tokens=rng.randint(1, 20), temperature=rng.choice([0, 1.0]),
                                ignore_eos=True)
            live.append(engine.add_request(p, sp))
        if live and rng.random() < 0.1:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished:
                finished += out.finish_reason == "length"
                aborted += out.finish_reason == "abort"
                if out.request_id in live:
                    live.remove(out.request_id)
    for rid in live:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert finished > 5 and aborted > 0
    assert engine.num_free_kv_slots() == usable
    assert engine.slots.req_pool.num_free == engine.slots.req_pool.max_reqs


def test_seeded_sampling_is_the_same_alone_and_batched(hf, prompts):
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=20, seed=1234,
                        ignore_eos=True)
    alone = tiny_engine(hf).generate([prompts[1]], sp)[0].token_ids
    batch = tiny_engine(hf, budget=16).generate(prompts, [GREEDY] + [sp] + [GREEDY] * 6)
    assert batch[1].token_ids == alone
    other = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=20, seed=99,
                           ignore_eos=True)
    assert tiny_engine(hf).generate([prompts[1]], other)[0].token_ids != alone


def test_stop_token_ids_and_max_tokens_finish_requests(hf, prompts):
    ref = tiny_engine(hf).generate([prompts[0]], GREEDY)[0].token_ids
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    sp = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_tok])
    out = tiny_engine(hf).generate([prompts[0]], sp)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[: first + 1]
    out = tiny_engine(hf).generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.finish_reason == "length" and out.token_ids == ref[:3]


def test_bad_requests_raise_actionable_errors(hf):
    engine = tiny_engine(hf)
    with pytest.raises(EngineError, match="--max-model-len"):
        engine.add_request([1] * 600, GREEDY)
    with pytest.raises(EngineError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(EngineError, match=r"\[0, 128\)"):
        engine.add_request([5, 500], GREEDY)
    with pytest.raises(EngineError, match="token ids"):
        engine.add_request("text needs a tokenizer", GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    assert not engine.has_unfinished()


def test_a_request_that_makes_the_step_raise_fails_alone(hf, prompts, monkeypatch):
    """Fault injection: the forward raises whenever one poisoned token is in the batch. The
    engine re-runs the step in halves: only the request holding the token fails; its
    batch-mates finish with the tokens they get alone, and every KV slot comes back."""
    solo = [tiny_engine(hf).generate([p], GREEDY)[0].token_ids for p in prompts[:3]]
    engine = tiny_engine(hf)
    used = {t for seq in prompts[:3] + solo for t in seq}
    poison = next(t for t in range(127, -1, -1) if t not in used)
    real_forward = engine.model.forward  # prefill (eager forward) and decode (step body)

    def forward(input_ids, *args, **kwargs):
        if bool((input_ids == poison).any()):
            raise RuntimeError("boom")
        return real_forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", forward)
    bad = prompts[3][:-1] + [poison]
    outs = engine.generate([prompts[0], bad, prompts[1], prompts[2]], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert "boom" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids, outs[3].token_ids] == solo
    assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots
    ok = engine.generate([prompts[0]], GREEDY)[0]  # the engine keeps serving
    assert ok.finish_reason == "length" and ok.token_ids == solo[0]


def test_graph_staging_writes_slot_rows_zero_padded():
    import numpy as np

    from draftgraph.runtime.graph_set import stage_slot_rows

    dst = np.full((4, 3), 99, dtype=np.int64)
    stage_slot_rows(dst, [[5, 6, 7, 8], [9, 10, 11]])  # uniform after the cut: one assignment
    assert dst[:2].tolist() == [[5, 6, 7], [9, 10, 11]] and dst[2:].tolist() == [[99] * 3] * 2
    stage_slot_rows(dst, [[1], [2, 3, 4], [5, 6]])  # ragged: zero-padded row by row
    assert dst[:3].tolist() == [[1, 0, 0], [2, 3, 4], [5, 6, 0]]
    dst[:] = 99
    stage_slot_rows(dst, [[1, 2], [3, 4]])  # uniform, shorter than the grid: zero-padded
    assert dst[:2].tolist() == [[1, 2, 0], [3, 4, 0]] and dst[2:].tolist() == [[99] * 3] * 2


def test_only_the_final_output_carries_the_whole_token_and_logprob_lists(hf, prompts):
    """Streams read new_token_ids / new_logprobs; no step copies a request's history."""
    engine = tiny_engine(hf)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    rid = engine.add_request(prompts[1], sp)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    *partial, final = outs
    assert final.finished and len(final.token_ids) == 12 and len(final.logprobs) == 12
    assert all(o.token_ids == [] and o.logprobs == [] for o in partial if not o.finished)
    assert sum((o.new_token_ids for o in outs), []) == final.token_ids
    assert sum((o.new_logprobs for o in outs), []) == final.logprobs


def test_step_budget_and_batch_default_to_the_device(monkeypatch):
    from draftgraph.config import EngineConfig, SchedulerConfig
    from draftgraph.runtime.graph_set import batch_buckets

    cpu = EngineConfig(device="cpu").scheduler
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == SchedulerConfig.CPU_DEFAULTS \
        == (32, 256)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = EngineConfig(device="cuda").scheduler
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (256, 8192)
    given = EngineConfig(device="cuda", scheduler=SchedulerConfig(max_num_seqs=8)).scheduler
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (8, 8192)  # flags win
    b = batch_buckets(256)
    assert b[:11] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64] and b[-1] == 256 and len(b) == 19
    # no batch pads by more than a quarter
    assert all(next(x for x in b if x >= n) <= max(n * 5 / 4, n + 7) for n in range(1, 257))
    assert batch_buckets(100)[-1] == 100 and batch_buckets(3) == [1, 2, 3]


def test_graph_capture_runs_with_the_cycle_collector_paused_after_one_collection():
    """A collection during a capture could free a dead engine's CUDA objects and invalidate
    it: `gc_paused` collects once before and none during, and restores the collector."""
    import gc

    from draftgraph.runtime.graph_set import gc_paused

    freed = []

    class Node:
        def __del__(self):
            freed.append(True)

    a, b = Node(), Node()
    a.other, b.other = b, a  # a dead cycle: only the collector frees it
    del a, b
    assert gc.isenabled() and not freed
    with gc_paused():
        assert len(freed) == 2  # collected before the capture begins
        assert not gc.isenabled()
        c, d = Node(), Node()
        c.other, d.other = d, c
        del c, d
        for _ in range(5000):  # allocations that would trigger generation-0 collections
            [object()]
        assert len(freed) == 2
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failed capture")
    assert gc.isenabled()  # restored on the way out of a failure too
    gc.collect()
    assert len(freed) == 4


def test_prefill_chunks_are_cut_by_time_while_streams_decode(hf, prompts, monkeypatch):
    """max_step_seconds: with a stream decoding, the next prompt's chunks take what fits in
    the step time by the last measured costs; with none decoding, the whole token budget."""
    from draftgraph.engine.scheduler import MIN_CHUNK

    eng = tiny_engine(hf, budget=64)
    eng.config.scheduler.max_step_seconds = 0.1
    sched = eng.scheduler
    eng.add_request(prompts[0][:8], SamplingParams(max_tokens=50, temperature=0))  # a stream
    eng.step()  # its prefill: nobody decodes, nothing is cut
    monkeypatch.setattr(sched, "observe", lambda *a: None)  # the costs below, not the clock's
    sched.decode_step_seconds, sched.prefill_token_seconds = 0.02, 0.004
    long = eng.add_request([3 + i % 100 for i in range(200)],
                           SamplingParams(max_tokens=1, temperature=0))
    eng._drain_inbox([])
    chunks = []
    while len(chunks) < 3:
        picked = sched.schedule(0)
        chunks.append([sr.num_new_tokens for sr in picked])
        for sr in picked:  # as if the step ran: the chunk's tokens are in the KV now
            if sr.req.request_id == long:
                sr.req.num_computed_tokens += sr.num_new_tokens
    # (0.1 - 0.02) s / 0.004 s a token = 20 tokens beside the stream's one, every step
    assert chunks == [[1, 20]] * 3
    sched.decode_step_seconds, sched.prefill_token_seconds = 0.099, 0.004
    assert sched._time_budget(64) == MIN_CHUNK  # a prefill always moves
    eng.config.scheduler.max_step_seconds = 0.0
    assert sched._time_budget(64) == 64  # off: the token budget alone


def test_the_cli_cuts_prefill_by_time_on_a_cpu_only():
    from draftgraph.cli import build_parser
    from draftgraph.flags import engine_config_from_args

    parser = build_parser()
    cpu = engine_config_from_args(parser.parse_args(["generate", "hi", "--device", "cpu"]))
    assert cpu.scheduler.max_step_seconds == SchedulerConfig.CPU_STEP_SECONDS == 0.35
    off = engine_config_from_args(parser.parse_args(["generate", "hi", "--device", "cpu",
                                                     "--max-step-seconds", "0"]))
    assert off.scheduler.max_step_seconds == 0.0
    assert EngineConfig(device="cpu").scheduler.max_step_seconds == 0.0  # library: off


def test_scheduler_observe_takes_the_decode_base_out_of_a_mixed_step():
    from draftgraph.engine.scheduler import Scheduler

    s = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_step_seconds=0.5), None, None)
    s.observe(0, 1, 0.05)
    s.observe(100, 1, 0.45)
    assert s.decode_step_seconds == 0.05 and abs(s.prefill_token_seconds - 0.004) < 1e-12
    assert s._time_budget(256) == 112  # (0.5 - 0.05) / 0.004
    s.observe(100, 0, 0.8)  # no stream in that step: no base to take out
    assert abs(s.prefill_token_seconds - 0.008) < 1e-12


def test_a_streams_outputs_carry_its_tokens_once_and_timing_where_it_is_read(hf, prompts):
    """A running stream's outputs (the engine builds them on a fast path: no text, no
    logprobs asked) hold only the step's new tokens; the first with tokens carries the
    request's timing (TTFT), the ones between none, the final one every token and the
    timing; the new tokens add up to the final ones."""
    engine = tiny_engine(hf)
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=6, temperature=0,
                                                        ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    with_tokens = [o for o in outs if o.new_token_ids]
    first, *middle, final = with_tokens
    assert final.finished and len(final.token_ids) == 6
    assert sum((o.new_token_ids for o in with_tokens), []) == final.token_ids
    assert first.metrics["ttft"] is not None and first.metrics["completion_tokens"] == 1
    assert middle and all(o.metrics == {} and o.token_ids == [] and not o.finished
                          for o in middle)
    assert all(o.text == "" == o.delta_text and o.logprobs is None for o in outs)
    assert final.metrics["completion_tokens"] == 6
