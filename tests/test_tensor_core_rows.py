"""`--tensor-core-rows`: the executor marks its model's weights so that products of
gemv.DOT_ROWS rows take the tensor-core matmul on CUDA ("auto": models of at most
gemv.DOT_ROWS_MAX_BYTES of weights), and a drafter's executor takes the target's setting;
the marks are read only on CUDA (the routing itself: test_kernels_gemv.py; on the GPU:
test_gpu_tensor_core_rows.py)."""

from __future__ import annotations

import pytest
from _tiny import tiny_hf_model, tiny_loaded

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.kernels import gemv
from draftgraph.models.heads import random_head
from draftgraph.spec.chain_head import ChainHeadDrafter


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model()


def _engine(hf, rows: str, with_head: bool = False) -> LLMEngine:
    loaded = tiny_loaded(hf)
    drafter = ChainHeadDrafter(random_head(loaded.config), k=2) if with_head else None
    return LLMEngine(EngineConfig(
        model="tiny", device="cpu", tensor_core_rows=rows,
        cache=CacheConfig(kv_cache_tokens=1024),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64),
        spec=SpecConfig(method="chain", num_draft_tokens=2) if with_head else SpecConfig()),
        loaded=loaded, drafter=drafter)


def _marks(module) -> set:
    return {getattr(p, gemv.DOT_ROWS_ATTR, "unset") for p in module.parameters()}


def test_the_setting_marks_the_target_and_the_drafters_weights(hf):
    on = _engine(hf, "on", with_head=True)
    assert on.target.tensor_core_rows == "on"
    assert _marks(on.target.model) == {gemv.DOT_ROWS}
    assert _marks(on.drafter.head) == {gemv.DOT_ROWS}  # the head's executor took it
    off = _engine(hf, "off", with_head=True)
    assert _marks(off.target.model) == {None} and _marks(off.drafter.head) == {None}
    auto = _engine(hf, "auto")  # a tiny model: well under the size bound
    assert auto.target.tensor_core_rows == "on" and _marks(auto.target.model) == {gemv.DOT_ROWS}


def test_auto_is_for_small_models_and_bad_values_name_the_flag(hf, monkeypatch):
    monkeypatch.setattr(gemv, "DOT_ROWS_MAX_BYTES", 1000)  # the tiny model is "large" now
    assert _engine(hf, "auto").target.tensor_core_rows == "off"
    with pytest.raises(ValueError, match="--tensor-core-rows must be auto, on or off"):
        EngineConfig(device="cpu", tensor_core_rows="maybe")


def test_the_cli_flag_reaches_the_engine_config():
    from draftgraph.cli import parse_args
    from draftgraph.flags import engine_config_from_args

    assert engine_config_from_args(parse_args(["generate", "random:tiny", "hi"])) \
        .tensor_core_rows == "auto"
    cfg = engine_config_from_args(parse_args(["generate", "random:tiny", "hi",
                                              "--tensor-core-rows", "off"]))
    assert cfg.tensor_core_rows == "off"


def test_the_attention_scratch_is_sized_by_the_engines_own_rows_per_request(hf):
    """The target's backend holds 1 + k rows a request (a verify's), not the largest tree's,
    and a drafter's executor takes the target's bound (its beams and catch-up fit in it)."""
    from draftgraph.attention.triton_backend import TritonBackend

    loaded = tiny_loaded(hf)
    drafter = ChainHeadDrafter(random_head(loaded.config), k=2)
    engine = LLMEngine(EngineConfig(
        model="tiny", device="cpu", attention_backend="triton",
        cache=CacheConfig(kv_cache_tokens=1024),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64),
        spec=SpecConfig(method="chain", num_draft_tokens=2)), loaded=loaded, drafter=drafter)
    assert engine.target.backend.rows_per_request == 3
    assert drafter.executor.backend.rows_per_request == 3
    assert TritonBackend.MAX_VERIFY_ROWS > 3  # the default without an engine: the largest tree
