"""The step's glue kernels inside the engine (on a CPU through Triton's interpreter, where the
engine would take their torch twins): a tree verify's pack and acceptance, a chain verify's
pack, the greedy tail, a chain step's take and the chain head's catch-up staging, fed the
step body's own buffers and views. Greedy output equals plain decoding with an oracle tree
accepted to full depth, a chain head and n-gram drafts; a sampled oracle tree gives plain
seeded sampling's tokens; the chain head's drafts, KV pool and last features equal the
twins' to the bit (a wrong tree KV copy or catch-up row fails them)."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from _tiny import tiny_engine, tiny_loaded  # noqa: E402
from test_spec_tree import GREEDY, PROMPTS, TREE, _oracle_engine, oracle_run  # noqa: E402

import draftgraph.spec.chain as chain  # noqa: E402
import draftgraph.spec.chain_head as chain_head  # noqa: E402
import draftgraph.spec.step as step  # noqa: E402
import draftgraph.spec.verify as verify  # noqa: E402
from draftgraph.config import SpecConfig  # noqa: E402
from draftgraph.engine.sampling import SamplingParams  # noqa: E402
from draftgraph.kernels import tokens, tree  # noqa: E402
from draftgraph.kernels._triton import compiled_for_cpu_missing  # noqa: E402
from draftgraph.models.heads import random_head  # noqa: E402
from draftgraph.spec.chain_head import ChainHeadDrafter  # noqa: E402

if compiled_for_cpu_missing(tree._tree_pack_kernel):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set "
                "(set it in the environment to run them on CPU)", allow_module_level=True)


@pytest.fixture
def kernels(monkeypatch):
    """The glue as its Triton launchers, counted by name."""
    calls: dict[str, int] = {}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(step, "tree_pack", counted("tree_pack", tree.tree_pack_triton))
    monkeypatch.setattr(step, "tree_accept", counted("tree_accept", tree.tree_accept_triton))
    monkeypatch.setattr(step, "pack_chain", counted("pack_chain", tokens.pack_chain_triton))
    monkeypatch.setattr(chain_head, "stage_catch_up",
                        counted("stage_catch_up", tokens.stage_catch_up_triton))
    monkeypatch.setattr(chain, "draft_take", counted("draft_take", tokens.draft_take_triton))
    monkeypatch.setattr(verify, "greedy_emit_triton",
                        counted("greedy_emit", verify.greedy_emit_triton))
    monkeypatch.setattr(verify, "_greedy_emit_fused", lambda logits: True)
    return calls


def test_an_oracle_tree_through_the_kernels_is_accepted_deep_and_equals_plain(hf, kernels):
    tokens_, ref, s = oracle_run(*_oracle_engine(hf), PROMPTS[2])
    assert tokens_ == ref
    assert s["num_accepted_tokens"] >= 0.9 * TREE.depth * s["num_drafts"]
    assert kernels["tree_pack"] == kernels["tree_accept"] >= 3  # ~6 tokens a round
    assert kernels["stage_catch_up"] >= kernels["tree_accept"]


def test_a_sampled_oracle_tree_through_the_kernels_gives_plain_samplings_tokens(hf, kernels):
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
    tokens_, ref, s = oracle_run(*_oracle_engine(hf), PROMPTS[2], params=params)
    assert tokens_ == ref
    assert s["num_accepted_tokens"] >= 0.9 * TREE.depth * s["num_drafts"]
    assert kernels["tree_accept"] >= 3


def test_a_tree_drafters_chain_steps_through_the_kernels_equal_plain(hf, kernels):
    """Steps of several requests with a tree drafter capped at one request a tree draft its
    chain of D: packed from the first D columns of its proposal, accepted 1 + D wide and
    copied into the results (pack_chain, greedy_emit, stage_catch_up as kernels)."""
    from draftgraph.spec.tree import TreeHeadDrafter

    plain = [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, GREEDY)]
    drafter = TreeHeadDrafter(random_head(tiny_loaded(hf).config, "", seed=3), TREE, max_bs=1)
    spec = SpecConfig(method="chain", tree=TREE, adaptive=False)
    engine = tiny_engine(hf, budget=128, spec=spec, drafter=drafter)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain
    assert kernels["pack_chain"] > 5 and kernels["greedy_emit"] >= kernels["pack_chain"]
    assert kernels["stage_catch_up"] == kernels["pack_chain"]  # every step a chain


def _head_drafts(hf, spec) -> tuple[list, list, torch.Tensor, torch.Tensor]:
    """A random chain head's outputs, every step's recorded drafts, and at the end its KV pool
    and last features, which the catch-up writes (outputs alone cannot see a wrong one)."""
    head = ChainHeadDrafter(random_head(tiny_loaded(hf).config, "", seed=3), 4)
    engine = tiny_engine(hf, spec=spec, drafter=head)
    body, drafts = engine.spec_graphs.body, []
    pack = body._pack

    def recorded(ctx, prop):
        pack(ctx, prop)
        drafts.append(body.draft_tokens[: ctx.seq_lens.shape[0]].tolist())

    body._pack = recorded
    out = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    return out, drafts, head.executor.kv_pool.kv.clone(), head.last_feat.clone()


def test_a_chain_head_and_ngram_through_the_kernels_equal_plain(hf, kernels, monkeypatch):
    plain = [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, GREEDY)]
    spec = SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    chained, drafts, kv, feat = _head_drafts(hf, spec)
    assert chained == plain
    assert kernels["pack_chain"] > 5 and kernels["stage_catch_up"] > 5
    assert kernels["draft_take"] >= 4 * kernels["stage_catch_up"]  # k = 4 takes a round
    with monkeypatch.context() as m:  # the twins: the same drafts and head state
        m.setattr(step, "pack_chain", tokens.pack_chain_ref)
        m.setattr(chain_head, "stage_catch_up", tokens.stage_catch_up_ref)
        m.setattr(chain, "draft_take", tokens.draft_take_ref)
        m.setattr(verify, "_greedy_emit_fused", lambda logits: False)
        twin_out, twin_drafts, twin_kv, twin_feat = _head_drafts(hf, spec)
    assert (twin_out, twin_drafts) == (plain, drafts)
    assert torch.equal(twin_kv, kv) and torch.equal(twin_feat, feat)
    ngram = tiny_engine(hf, spec=spec).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in ngram] == plain
    assert kernels["greedy_emit"] >= kernels["pack_chain"] > 10
