"""GPU: the block head in captured step graphs. The in-graph proposal (block metadata built
inside the replay), the eager-metadata fallback and the eager body propose the same drafts step
after step and give plain decoding's output; with drafts that get accepted, the head's context
KV after every replayed step equals a from-scratch injection (the injection inside the graph);
captured buffers keep their addresses over growing and shrinking batches (fp32); with an
n-gram branch beside the block and with a tree of the block's rows too."""

from __future__ import annotations

import pytest
import torch
from test_gpu_chain_head import _drafts_and_outputs, _engine, _prompts

from draftgraph.config import TreeShape
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.heads import random_head
from draftgraph.models.loader import load_model
from draftgraph.spec.block import BlockHeadDrafter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def loaded():
    return load_model("random:smollm2-135m", device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("spec,tree", [
    ("block_size=5,window=64", None),
    ("block_size=8,window=16,markov_rank=32,confidence=1", None),
    ("block_size=5,window=64", "1x4:4+g6"),  # an n-gram branch beside the block: tree steps
    ("block_size=5,window=64,markov_rank=32", "2x4:8+g6"),  # a tree of the block's rows
])
def test_in_graph_fallback_and_eager_blocks_draft_the_same_and_are_lossless(loaded, spec,
                                                                           tree, monkeypatch):
    prompts = _prompts(loaded.config.vocab_size)
    head = random_head(loaded.config, spec, "cuda", torch.float32, seed=2, kind="block")
    runs = {}
    for arm in ("in_graph", "fallback", "eager"):
        if arm == "fallback":  # what a backend without in-graph block metadata gets
            monkeypatch.setattr(BlockHeadDrafter, "in_graph", property(lambda self: False))
        drafter = BlockHeadDrafter(head, confidence_threshold=0.45,
                                   tree=TreeShape.parse(tree) if tree else None)
        engine = _engine(loaded, drafter, use_graphs=arm != "eager")
        assert engine.spec_graphs.body.fused_draft == (arm != "fallback")
        ptrs = [t.data_ptr() for t in (drafter.block_ids, drafter.drafts, drafter.num_drafts,
                                       drafter.capture.out)]
        runs[arm] = _drafts_and_outputs(engine, prompts)
        assert ptrs == [t.data_ptr() for t in (drafter.block_ids, drafter.drafts,
                                                drafter.num_drafts, drafter.capture.out)]
        assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots
        monkeypatch.undo()
    for arm in ("fallback", "eager"):
        assert len(runs[arm][0]) == len(runs["in_graph"][0])
        assert all(torch.equal(a, b) for a, b in zip(runs["in_graph"][0], runs[arm][0],
                                                     strict=True)), arm
        assert runs[arm][1] == runs["in_graph"][1], arm
    ref = [o.token_ids for o in _engine(loaded).generate(
        prompts, [SamplingParams(max_tokens=20 + 7 * (len(prompts) - i), temperature=0,
                                 ignore_eos=True) for i in range(len(prompts))])]
    assert sum(a == b for a, b in zip(runs["in_graph"][1], ref, strict=True)) >= len(ref) - 1


def test_the_context_kv_in_graphs_equals_a_from_scratch_injection(loaded):
    from test_spec_block import KV_PROMPT, LONG, _Accepting, _max_kv_error

    (out,) = _engine(loaded).generate([KV_PROMPT], LONG)
    head = random_head(loaded.config, "block_size=5,window=32", "cuda", torch.float32, seed=2,
                       kind="block")
    drafter = _Accepting(head, future=KV_PROMPT + out.token_ids)
    drafter.future = drafter.future.cuda()
    engine = _engine(loaded, drafter)
    assert engine.spec_graphs.use_graphs and engine.spec_graphs.body.fused_draft
    assert _max_kv_error(engine, drafter) < 1e-3
    s = engine.stats
    assert s["num_accepted_tokens"] >= 0.9 * s["num_draft_tokens"] > 30
