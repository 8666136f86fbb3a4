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
    assert graph.runner.graphs is not None and graph.runner.graphs.metadata_in_graph
    vocab = eager.model_config.vocab_size
    a = _growing_shrinking_workload(eager, vocab)
    b = _growing_shrinking_workload(graph, vocab)
    assert a == b
    assert graph.num_free_kv_slots() == graph.runner.allocator.usable_slots


def test_replay_equals_its_eager_twin_and_buffers_keep_their_addresses():
    engine = _engine(use_graphs=True)
    runner, graphs = engine.runner, engine.runner.graphs
    watched = [graphs.raw, graphs.out_tokens, runner.req_pool.req_to_token,
               *runner.meta.all_tensors(), *runner.kv_pool.k_buffers[:2]]
    ptrs = [t.data_ptr() for t in watched]
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(1)
    for bs in (1, 3, 8, 13, 16, 2):
        rows = [runner.req_pool.alloc() for _ in range(bs)]
        seq_lens = torch.randint(2, 200, (bs,), generator=g).tolist()
        loc = []
        for row, n in zip(rows, seq_lens, strict=True):
            slots = torch.randint(1, runner.allocator.num_slots, (n,), generator=g)
            runner.req_pool.req_to_token[row, :n] = slots.cuda()
            loc.append(int(slots[-1]))
        ids = torch.randint(0, vocab, (bs,), generator=g).tolist()
        temps = [0.0] * bs
        bucket = graphs.replay(ids, rows, seq_lens, loc, temps, [1.0] * bs, [-1] * bs,
                               list(range(bs)))
        replay_tokens, replay_lp = graphs.result(bs)
        graphs.run_eager(bucket, greedy=True)
        torch.cuda.synchronize()
        eager_tokens = graphs.out_tokens[:bs].tolist()
        eager_lp = graphs.out_logprobs[:bs].tolist()
        assert replay_tokens == eager_tokens
        assert max(abs(x - y) for x, y in zip(replay_lp, eager_lp, strict=True)) < 1e-3
        for row in rows:
            runner.req_pool.free(row)
    assert [t.data_ptr() for t in watched] == ptrs


def test_eager_metadata_fallback_gives_the_same_tokens():
    from draftgraph.runtime.graph_runner import DecodeGraphRunner

    ref = _engine(use_graphs=True)
    fallback = _engine(use_graphs=False)
    fallback.runner.graphs = DecodeGraphRunner(fallback.runner, 16, metadata_in_graph=False)
    fallback.runner.graphs.capture()
    vocab = ref.model_config.vocab_size
    assert _growing_shrinking_workload(ref, vocab) == \
        _growing_shrinking_workload(fallback, vocab)


def test_ngram_speculation_on_gpu_matches_plain_greedy():
    plain = _engine(use_graphs=True)
    spec = _engine(use_graphs=True, spec=SpecConfig(method="ngram", num_draft_tokens=4))
    vocab = plain.model_config.vocab_size
    a = _growing_shrinking_workload(plain, vocab)
    b = _growing_shrinking_workload(spec, vocab)
    same = sum(a[k] == b[k] for k in a)
    # fp32 on GPU: verify (extend kernel) and decode (split-KV) may differ in the last bits
    assert same >= len(a) - 2, (same, len(a))
