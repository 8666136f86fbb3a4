"""GPU: decode graph replays equal the eager path, and captured buffers never move."""

from __future__ import annotations

import pytest
import torch

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _engine(use_graphs: bool, dtype: str = "float32", spec: SpecConfig | None = None,
            model: str = "random:smollm2-135m") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model, device="cuda", dtype=dtype, use_graphs=use_graphs, seed=0,
        cache=CacheConfig(kv_cache_tokens=16384),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024,
                                  max_model_len=1024),
        spec=spec or SpecConfig()))


def _growing_shrinking_workload(engine: LLMEngine, vocab: int) -> dict[str, list[int]]:
    """Requests join and leave so the batch crosses buckets up and down."""
    g = torch.Generator().manual_seed(0)
    outs: dict[str, list[int]] = {}
    lens = [17, 130, 5, 64, 300, 9, 41, 77, 3, 200, 33, 12]
    max_tokens = [40, 8, 25, 60, 12, 30, 5, 50, 20, 45, 10, 35]
    pending = list(zip(lens, max_tokens, strict=True))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            n, m = pending.pop(0)
            engine.add_request(torch.randint(0, vocab, (n,), generator=g).tolist(),
                               SamplingParams(max_tokens=m, temperature=0, ignore_eos=True),
                               request_id=f"r{n}")
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
        step += 1
    return outs


def test_graph_replay_equals_eager_on_growing_and_shrinking_batches():
    eager = _engine(use_graphs=False)
    graph = _engine(use_graphs=True)
    assert graph.decode_graphs.use_graphs and graph.decode_graphs.body.metadata_in_graph
    vocab = eager.model_config.vocab_size
    a = _growing_shrinking_workload(eager, vocab)
    b = _growing_shrinking_workload(graph, vocab)
    assert a == b
    assert graph.num_free_kv_slots() == graph.slots.allocator.usable_slots


def _replay_vs_eager(engine: LLMEngine, graphs, k: int, seed: int) -> None:
    """Stage random batches straight into a step graph; replay must equal the eager twin."""
    slots = engine.slots
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    for bs in (1, 3, 8, 13, 16, 2):
        rows = [slots.req_pool.alloc() for _ in range(bs)]
        seq_lens = torch.randint(2, 200, (bs,), generator=g).tolist()
        locs = []
        for row, n in zip(rows, seq_lens, strict=True):
            kv = torch.randint(1, slots.allocator.num_slots, (n + k,), generator=g)
            slots.req_pool.req_to_token[row, : n - 1] = kv[: n - 1].cuda()
            # token history with repeats, so the n-gram proposer finds drafts
            motif = torch.randint(0, vocab, (7,), generator=g)
            slots.token_table[row, :n] = motif.repeat(n // 7 + 1)[:n].cuda()
            locs.append(kv[n - 1 :].tolist())
        ids = slots.token_table[rows, torch.tensor(seq_lens) - 1].tolist()
        max_draft = torch.randint(0, k + 1, (bs,), generator=g).tolist()
        bucket = graphs.replay(bs, True, dict(
            input_ids=ids, req_pool_indices=rows, seq_lens=seq_lens, reserved_slots=locs,
            temperature=[0.0] * bs, top_p=[1.0] * bs, top_k=[-1] * bs, seeds=list(range(bs)),
            max_draft=max_draft))
        replayed = graphs.result()
        graphs.run_eager(bucket, greedy=True)
        torch.cuda.synchronize()
        graphs.host_out[(graphs._launched - 1) % 2].copy_(graphs.out)  # the latest result
        eager = graphs.result()
        assert [r[0] for r in replayed] == [e[0] for e in eager]
        assert [r[2] for r in replayed] == [e[2] for e in eager]
        assert all(r[2] <= m for r, m in zip(replayed, max_draft, strict=True))
        for r, e in zip(replayed, eager, strict=True):
            assert max(abs(x - y) for x, y in zip(r[1], e[1], strict=True)) < 1e-3
        for row in rows:
            slots.req_pool.free(row)
    if k:
        assert any(r[2] > 0 for r in replayed)  # drafts were really proposed in the graph


def test_replay_equals_its_eager_twin_and_buffers_keep_their_addresses():
    engine = _engine(use_graphs=True, spec=SpecConfig(method="ngram", num_draft_tokens=4))
    target, slots = engine.target, engine.slots
    watched = [engine.decode_graphs.raw, engine.decode_graphs.out, engine.spec_graphs.raw,
               engine.spec_graphs.body.packed_ids, slots.req_pool.req_to_token,
               slots.token_table, *target.meta.all_tensors(), *target.kv_pool.k_buffers[:2]]
    ptrs = [t.data_ptr() for t in watched]
    _replay_vs_eager(engine, engine.decode_graphs, 0, seed=1)
    _replay_vs_eager(engine, engine.spec_graphs, 4, seed=2)
    assert [t.data_ptr() for t in watched] == ptrs


@pytest.mark.parametrize("spec", [None, SpecConfig(method="ngram", num_draft_tokens=4)])
def test_eager_metadata_fallback_gives_the_same_tokens_and_says_so(caplog, spec):
    from draftgraph.runtime.graph_set import GraphSet
    from draftgraph.spec.step import StepBody

    ref = _engine(use_graphs=True, spec=spec)
    fallback = _engine(use_graphs=True, spec=spec)
    target = fallback.target
    with caplog.at_level("WARNING", logger="draftgraph.spec.step"):
        bodies = {name: StepBody(target, gs.body.drafter, metadata_in_graph=False)
                  for name, gs in target.graph_sets.items()}
    lines = [r.getMessage() for r in caplog.records if "rebuilt eagerly" in r.getMessage()]
    assert len(lines) == len(bodies) and all("'triton'" in x for x in lines)
    for i, (name, body) in enumerate(bodies.items()):
        gs = GraphSet(target, body, i)
        gs.capture()
        # the metadata builder runs between two captured parts, not inside a graph
        assert [type(p).__name__ for p in gs.graphs[(1, True)]] == \
            ["CUDAGraph", "function", "CUDAGraph"]
        target.graph_sets[name] = gs
    fallback.decode_graphs = target.graph_sets["decode"]
    fallback.spec_graphs = target.graph_sets.get("spec")
    vocab = ref.model_config.vocab_size
    assert _growing_shrinking_workload(ref, vocab) == \
        _growing_shrinking_workload(fallback, vocab)


def test_speculative_graphs_match_eager_verify_and_plain_greedy():
    ngram = SpecConfig(method="ngram", num_draft_tokens=4)
    plain = _engine(use_graphs=True)
    graph_spec = _engine(use_graphs=True, spec=ngram)
    eager_spec = _engine(use_graphs=False, spec=ngram)
    vocab = plain.model_config.vocab_size
    a = _growing_shrinking_workload(plain, vocab)
    b = _growing_shrinking_workload(graph_spec, vocab)
    c = _growing_shrinking_workload(eager_spec, vocab)
    assert graph_spec.stats["num_drafts"] > 0 and graph_spec.stats["num_accepted_tokens"] > 0
    # fp32 on GPU: verify (extend kernel) and decode (split-KV kernel) may differ in the last
    # bits, which can flip a near-tie on a random-weight model
    assert sum(b[r] == c[r] for r in b) >= len(b) - 1
    assert sum(a[r] == b[r] for r in a) >= len(a) - 2
    assert graph_spec.num_free_kv_slots() == graph_spec.slots.allocator.usable_slots


@pytest.mark.parametrize("model", ["random:smollm2-135m", "random:tiny"])
def test_fused_single_token_kernels_match_the_unfused_chain(monkeypatch, model):
    """At batch 1 the layers run the fused kernels (norm + qkv + RoPE + KV store in one launch,
    o, norm + gate_up, SwiGLU + down); with them off (weight limit 0) the unfused chain runs.
    fp32: the same greedy tokens and logprobs."""
    from draftgraph.kernels import gemv

    def run():
        engine = _engine(use_graphs=False, model=model)
        g = torch.Generator().manual_seed(3)
        prompt = torch.randint(0, engine.model_config.vocab_size, (37,), generator=g).tolist()
        out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                       ignore_eos=True, logprobs=True))[0]
        return out.token_ids, torch.tensor(out.logprobs)

    calls = []
    fused_qkv = gemv.rmsnorm_qkv_rope_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return fused_qkv(*args, **kwargs)

    monkeypatch.setattr(gemv, "rmsnorm_qkv_rope_triton", counted)
    fused_tokens, fused_lp = run()
    assert calls, "the fused single-token path did not run"
    monkeypatch.setattr(gemv, "GEMV_MAX_M", 0)  # every projection unfused
    calls.clear()
    plain_tokens, plain_lp = run()
    assert not calls
    assert fused_tokens == plain_tokens
    assert (fused_lp - plain_lp).abs().max().item() < 1e-3


def test_async_scheduling_gives_the_synchronous_tokens_and_logprobs():
    g = torch.Generator().manual_seed(5)
    outs, launched_ahead = {}, {}
    for async_on in (False, True):
        engine = _engine(use_graphs=True)
        engine.async_scheduling = async_on
        graphs, seen = engine.decode_graphs, []
        replay = graphs.replay

        def counted(bs, greedy, fields, replay=replay, seen=seen):
            seen.append(any(t < 0 for t in fields["input_ids"]))
            return replay(bs, greedy, fields)

        graphs.replay = counted
        vocab = engine.model_config.vocab_size
        g.manual_seed(5)
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist()
                   for n in (7, 90, 33, 12, 51, 4)]
        # greedy and seeded sampling, different lengths
        params = [SamplingParams(max_tokens=m, temperature=t, top_p=0.9, ignore_eos=True,
                                 logprobs=True)
                  for m, t in zip((30, 9, 22, 1, 17, 26), (0, 0.8, 0, 0.8, 0, 1.0),
                                  strict=True)]
        res = engine.generate(prompts, params)
        outs[async_on] = [(o.token_ids, torch.tensor(o.logprobs)) for o in res]
        launched_ahead[async_on] = sum(seen)
        assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots
    assert launched_ahead[False] == 0 and launched_ahead[True] > 10
    for (ta, la), (tb, lb) in zip(outs[False], outs[True], strict=True):
        assert ta == tb
        assert (la - lb).abs().max().item() < 1e-4


@pytest.mark.parametrize("drafter", ["ngram", "chain"])
def test_async_speculative_steps_give_the_synchronous_tokens_and_logprobs(drafter):
    """Speculative step N + 1 launched before step N is read (its inputs shifted on the
    device by step N's accept lengths): the same tokens and logprobs as synchronous steps,
    greedy and seeded sampling (fixed draft lengths), with drafts really accepted."""
    spec = (SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False) if drafter == "ngram"
            else SpecConfig(method="chain", draft_head="random", num_draft_tokens=3,
                            adaptive=False))
    outs, launched_ahead, accepted = {}, {}, {}
    for async_on in (False, True):
        engine = _engine(use_graphs=True, spec=spec)
        engine.async_scheduling = async_on
        graphs, seen = engine.spec_graphs, []
        replay = graphs.replay

        def counted(bs, greedy, fields, replay=replay, seen=seen):
            seen.append(sum(t < 0 for t in fields["input_ids"]))
            return replay(bs, greedy, fields)

        graphs.replay = counted
        vocab = engine.model_config.vocab_size
        g = torch.Generator().manual_seed(5)
        prompts = []
        for n in (7, 90, 33, 12, 51, 4):  # repeats: the n-gram drafter finds matches
            motif = torch.randint(0, vocab, (n,), generator=g).tolist()
            prompts.append(motif * 3)
        params = [SamplingParams(max_tokens=m, temperature=t, top_p=0.9, seed=m,
                                 ignore_eos=True, logprobs=True)
                  for m, t in zip((60, 19, 42, 7, 37, 56), (0, 0.8, 0, 0.8, 0, 1.0),
                                  strict=True)]
        res = engine.generate(prompts, params)
        outs[async_on] = [(o.token_ids, torch.tensor(o.logprobs)) for o in res]
        launched_ahead[async_on] = sum(seen)
        accepted[async_on] = engine.stats["num_accepted_tokens"]
        assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots
        assert engine._inflight is None
    assert launched_ahead[False] == 0 and launched_ahead[True] > 20
    if drafter == "ngram":
        assert accepted[True] == accepted[False] > 20
    for (ta, la), (tb, lb) in zip(outs[False], outs[True], strict=True):
        assert ta == tb
        assert (la - lb).abs().max().item() < 1e-4


def test_prefill_graphs_equal_the_eager_prefill_and_keep_their_buffers():
    """Extend steps (whole prompts, chunks of long ones, steps mixing them with decode rows)
    replayed as graphs of bucketed token counts give the eager forward's tokens and logprobs;
    a step past the largest bucket runs eagerly; the captured buffers never move (fp32)."""
    from draftgraph.models.heads import random_head
    from draftgraph.models.loader import load_model
    from draftgraph.spec.chain_head import ChainHeadDrafter

    loaded = load_model("random:smollm2-135m", device="cuda", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=g).tolist()
               for n in (17, 130, 5, 300, 700, 64)]
    sp = SamplingParams(max_tokens=24, temperature=0, logprobs=True, ignore_eos=True)
    runs = {}
    for tokens, head in ((0, False), (256, False), (256, True)):
        drafter = ChainHeadDrafter(random_head(loaded.config, "", seed=3, device="cuda"),
                                   4) if head else None
        engine = LLMEngine(EngineConfig(
            model="random:smollm2-135m", device="cuda", dtype="float32", seed=0,
            prefill_graph_tokens=tokens, cache=CacheConfig(kv_cache_tokens=16384),
            scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512,
                                      max_model_len=1024),
            spec=SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False) if head
            else SpecConfig()), loaded=loaded, drafter=drafter)
        graphs, eager = engine.target.extend_graphs, engine.target._hidden
        counts = {"eager": 0}

        def counted(sb, eager=eager, counts=counts):
            counts["eager"] += 1
            return eager(sb)

        engine.target._hidden = counted
        if tokens:
            addresses = (graphs.raw.data_ptr(), graphs.hidden_out.data_ptr())
        outs = engine.generate(prompts, sp)
        runs[tokens, head] = ([o.token_ids for o in outs], [o.logprobs for o in outs])
        if tokens:
            assert graphs.max_tokens == 256 and len(graphs.graphs) == len(graphs.buckets)
            # two requests at a time: steps of 147 and 252 tokens replay, 305 and 512 do not
            assert graphs.replays >= 2 and counts["eager"] >= 2
            assert (graphs.raw.data_ptr(), graphs.hidden_out.data_ptr()) == addresses
        else:
            assert graphs is None
    eager_tokens, eager_lps = runs[0, False]
    for tokens, lps in runs.values():
        assert tokens == eager_tokens
        for a, b in zip(lps, eager_lps, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


def run_arrivals(engine: LLMEngine, sampled: bool = True) -> dict:
    """Six requests arriving at steps 0 .. 20 while others decode (two sampled ones, seeded,
    unless `sampled` is off), run to the end: {request id: (tokens, logprobs)}; every KV slot
    must be back (also benchmarks/overlap_diag.py's workload)."""
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(3)
    arrivals = {s: (torch.randint(0, vocab, (n,), generator=g).tolist(),
                    SamplingParams(max_tokens=m, temperature=t, seed=m, ignore_eos=True,
                                   logprobs=True))
                for s, n, m, t in ((0, 40, 50, 0), (1, 300, 30, 0.8), (5, 17, 40, 0),
                                   (9, 120, 25, 1.0), (10, 64, 35, 0), (20, 8, 12, 0))
                if sampled or t == 0}
    got, step = {}, 0
    while engine.has_unfinished() or step <= max(arrivals):
        if step in arrivals:
            engine.add_request(*arrivals[step], request_id=f"r{step}")
        for out in engine.step():
            if out.finished:
                got[out.request_id] = (out.token_ids, torch.tensor(out.logprobs))
        step += 1
    assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots
    assert engine._inflight is None
    return got


@pytest.mark.parametrize("drafter", ["none", "chain"])
def test_overlapped_prefill_gives_the_synchronous_tokens(drafter):
    """`--overlap-prefill` on the GPU: arrivals while requests decode are prefilled behind
    the launched replay (in the same stream, its graph still running), their first tokens
    left in that replay's spare result rows, which the next launch refers to (captured
    graphs reading rows a prefill wrote between replays; without a drafter the running
    rows ride in that prefill, their inputs read from the replay's rows inside the captured
    prefill, their tokens left in the spare rows too); outputs equal the synchronous
    engine's, greedy and seeded (decode). The chain head runs greedy only: arrivals split
    a request's tokens into speculative steps and plain rows differently in the two modes
    (a synchronous engine takes an arrival one step earlier), and a sampled chain's drafts,
    drawn from the head's distribution at each step's start, then differ, so its seeded
    tokens do too (valid samples both; asynchronous steps without the overlap differ from
    synchronous ones so, benchmarks/overlap_diag.py)."""
    spec = (SpecConfig(method="chain", draft_head="random", num_draft_tokens=3,
                       adaptive=False) if drafter == "chain" else None)
    from test_overlap_prefill import count_rows

    outs, behind, spare, riding = {}, {}, {}, {}
    for mode in ("sync", "overlap"):
        engine = _engine(use_graphs=True, spec=spec)
        engine.async_scheduling = mode == "overlap"
        engine.config.overlap_prefill = mode == "overlap"
        sets = [g for g in (engine.decode_graphs, engine.spec_graphs) if g is not None]
        for g in sets:
            count_rows(g)
        outs[mode] = run_arrivals(engine, sampled=spec is None)
        behind[mode] = engine.stats["steps_behind"]
        spare[mode] = sum(g.spare for g in sets)
        riding[mode] = engine.stats["rows_riding"]
    assert behind["sync"] == 0 and behind["overlap"] >= 2
    assert spare["sync"] == 0 and spare["overlap"] >= 2
    assert riding["sync"] == 0 and (riding["overlap"] >= 2) == (spec is None)
    assert outs["sync"].keys() == outs["overlap"].keys()
    for rid, (ta, la) in outs["sync"].items():
        tb, lb = outs["overlap"][rid]
        assert ta == tb, rid
        assert (la - lb).abs().max().item() < 1e-4
