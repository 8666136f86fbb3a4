"""GPU: the draft-model chain (k draft steps, metadata advanced inside the graph) in captured
step graphs equals the same body run eagerly, and the target as its own draft accepts every
draft (fp32)."""

from __future__ import annotations

import pytest
import torch

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.loader import load_model
from draftgraph.spec.draft_model import DraftModelDrafter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _engine(use_graphs: bool, loaded, drafter=None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model="random:smollm2-135m", device="cuda", dtype="float32", use_graphs=use_graphs,
        cache=CacheConfig(kv_cache_tokens=16384),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                  max_model_len=1024),
        spec=SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False)),
        loaded=loaded, drafter=drafter)


def test_draft_model_chain_in_graphs_equals_eager_and_self_draft_accepts_all():
    loaded = load_model("random:smollm2-135m", device="cuda", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 120, 33, 64, 5)]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in _engine(True, loaded).generate(prompts, sp)]
    outs, stats = {}, {}
    for use_graphs in (True, False):
        engine = _engine(use_graphs, loaded, DraftModelDrafter(loaded.model, 4))
        assert engine.spec_graphs.use_graphs == use_graphs
        outs[use_graphs] = [o.token_ids for o in engine.generate(prompts, sp)]
        stats[use_graphs] = dict(engine.stats)
        assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots
    assert outs[True] == outs[False]
    assert sum(a == b for a, b in zip(outs[True], plain, strict=True)) >= len(plain) - 1
    for s in stats.values():
        assert s["num_draft_tokens"] > 100
        assert s["num_accepted_tokens"] >= 0.97 * s["num_draft_tokens"], s
    assert stats[True]["accepted_per_pos"] == stats[False]["accepted_per_pos"]
