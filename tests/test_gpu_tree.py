"""GPU: draft trees (spec/tree.py) in captured step graphs, fp32. An oracle tree (the plain
continuation, greedy or seeded sampling's, ranked first at every row) is accepted to full
depth round after round and gives plain decoding's tokens, from the fused graphs, the
per-step fallback and the eager body alike; a random head over a batch that grows and
shrinks drafts the same trees in all three (replay by replay) and gives plain decoding's
output; captured buffers keep their addresses."""

from __future__ import annotations

import pytest
import torch
from test_gpu_chain_head import _drafts_and_outputs, _prompts, assert_arms_agree
from test_gpu_chain_head import _engine as chain_engine

from draftgraph.attention.triton_backend import TritonBackend
from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig, TreeShape
from draftgraph.engine.engine import LLMEngine
from draftgraph.models.heads import random_head
from draftgraph.models.loader import load_model
from draftgraph.spec.tree import TreeHeadDrafter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TREE = TreeShape(4, 5, 16)
ARMS = ("fused", "fallback", "eager")


@pytest.fixture(scope="module")
def loaded():
    return load_model("random:smollm2-135m", device="cuda", dtype=torch.float32)


def _engine(loaded, drafter=None, use_graphs: bool = True, tree: TreeShape = TREE) -> LLMEngine:
    if tree.verified <= 16:
        return chain_engine(loaded, drafter, use_graphs, k=tree.verified)
    return LLMEngine(EngineConfig(  # more drafts than --num-draft-tokens allows
        model="random:smollm2-135m", device="cuda", dtype="float32", use_graphs=use_graphs,
        cache=CacheConfig(kv_cache_tokens=16384),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                  max_model_len=1024),
        spec=SpecConfig(method="chain", tree=tree, adaptive=False)), loaded=loaded,
        drafter=drafter)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("arm", ARMS)
def test_an_oracle_tree_is_accepted_to_full_depth_and_lossless(loaded, monkeypatch, arm,
                                                               sampled):
    """Greedy, and sampled (the oracle ranks plain seeded sampling's continuation first)."""
    from test_spec_tree import GREEDY, HOT, oracle_run

    if arm == "fallback":
        monkeypatch.setattr(TritonBackend, "draft_step_update", False)

    def engine_for(make):
        drafter = make(random_head(loaded.config, "", "cuda", torch.float32, seed=2))
        drafter_engine = _engine(loaded, drafter, use_graphs=arm != "eager")
        body = drafter_engine.spec_graphs.body
        assert body.fused_draft == (arm != "fallback")
        return drafter_engine, drafter

    prompt = _prompts(loaded.config.vocab_size)[1]
    tokens, ref, s = oracle_run(engine_for, lambda p, params: _engine(loaded).generate(
        [p], params)[0].token_ids, prompt, params=HOT if sampled else GREEDY)
    assert tokens == ref
    assert s["num_accepted_tokens"] >= 0.9 * TREE.depth * s["num_drafts"]


@pytest.mark.parametrize("tree", [TREE, TreeShape(8, 5, 32), TreeShape(12, 5, 63),
                                  TreeShape(8, 5, 27, 5),  # with an n-gram branch,
                                  TreeShape(8, 5, 27, 16)])  # one reaching past the depth
def test_random_head_trees_in_graphs_fallback_and_eager_agree(loaded, monkeypatch, tree):
    """Requests join one a step and finish at different lengths: the fused graphs, the
    per-step fallback (each beam step's tree-row metadata rebuilt eagerly between replays)
    and the eager body draft the same trees replay after replay and give the same tokens."""
    prompts = _prompts(loaded.config.vocab_size)
    head = random_head(loaded.config, "draft_vocab=8192", "cuda", torch.float32, seed=2)
    runs = {}
    for arm in ARMS:
        if arm == "fallback":
            monkeypatch.setattr(TritonBackend, "draft_step_update", False)
        drafter = TreeHeadDrafter(head, tree)
        engine = _engine(loaded, drafter, use_graphs=arm != "eager", tree=tree)
        ptrs = [t.data_ptr() for t in (drafter.bufs.node_tok, drafter.tree_meta.positions,
                                        engine.spec_graphs.body.tv.path)]
        runs[arm] = _drafts_and_outputs(engine, prompts)
        assert ptrs == [t.data_ptr() for t in (drafter.bufs.node_tok, drafter.tree_meta.positions,
                                                engine.spec_graphs.body.tv.path)]
        assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots
        assert engine.stats["num_draft_tokens"] > 0
        monkeypatch.undo()
    assert_arms_agree(runs, _engine(loaded), prompts)
