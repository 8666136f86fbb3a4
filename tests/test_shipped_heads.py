"""The heads that ship for the default model load with no --draft-head, stay lossless (greedy
output equals plain decoding, CPU fp32) and are trained: their accept length on real prompts is
well above a random head's 1.0 (a misconfigured or untrained head shows as exactly 1.0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.spec import shipped_head

SETS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "accept_sets_smollm2_ids.json"
GREEDY = SamplingParams(max_tokens=48, temperature=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    sets = json.loads(SETS.read_text())
    return sets["humaneval"][:2] + sets["sharegpt_heldout"][:2]


@pytest.fixture(scope="module")
def plain(default_model, prompts):
    return _run(default_model, prompts, SpecConfig())[0]


def _run(loaded, prompts, spec: SpecConfig):
    engine = LLMEngine(EngineConfig(model="default", cache=CacheConfig(kv_cache_tokens=2048),
                                    scheduler=SchedulerConfig(max_num_seqs=4), spec=spec),
                       loaded=loaded)
    outs = engine.generate(prompts, GREEDY)
    s = engine.stats
    accept = 1 + s["num_accepted_tokens"] / max(s["num_drafts"], 1) if spec.method else None
    return [o.token_ids for o in outs], accept, engine


# (method, accept length at least): measured on these prompts chain 1.96, block 1.79 (the
# heads of stops 58 and 59)
@pytest.mark.parametrize("method, floor", [("chain", 1.6), ("block", 1.5)])
def test_a_shipped_head_is_lossless_and_trained(default_model, prompts, plain, method, floor):
    spec = SpecConfig(method=method, adaptive=False)
    tokens, accept, engine = _run(default_model, prompts, spec)
    assert tokens == plain
    assert accept >= floor, accept
    assert engine.drafter.head.head_config.kind == method
    assert Path(shipped_head(method, "default")).is_dir()
    # the control: a random head of the kind, through the same path, is what the floor excludes
    tokens, accept, _ = _run(default_model, prompts, SpecConfig(method=method,
                                                                 draft_head="random",
                                                                 adaptive=False))
    assert tokens == plain and accept < 1.1, accept


def test_the_default_gguf_by_path_gets_the_shipped_heads(tmp_path):
    """The default model named by its file, or by a copy of it elsewhere (as on a machine the
    GGUF was staged onto), gets the heads that ship for "default"; another file gets none."""
    import shutil

    from draftgraph.models.loader import default_model_path

    try:
        gguf = default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model is not installed")
    copy = tmp_path / "staged.gguf"
    shutil.copyfile(gguf, copy)
    for method in ("chain", "block"):
        want = shipped_head(method, "default")
        assert shipped_head(method, gguf) == want
        assert shipped_head(method, str(copy)) == want
    other = tmp_path / "other.gguf"
    with open(gguf, "rb") as f:
        other.write_bytes(f.read()[: 1 << 20])
    with pytest.raises(ValueError, match="needs --draft-head"):
        shipped_head("block", str(other))
    # same size, one sampled block changed: not the default model
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="needs --draft-head"):
        shipped_head("chain", str(copy))
