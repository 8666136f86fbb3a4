"""CPU row packing (`--row-pack`, models/row_pack.py): products of 2 .. ROWS_MAX rows through a
blocked copy of each weight, others through the dense weight; the engine packs fp32 CPU models
by default and speculation still equals plain decoding."""

import pytest
import torch
import torch.nn.functional as F
from _tiny import tiny_engine, tiny_loaded

from draftgraph.config import EngineConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.kernels import gemv
from draftgraph.models import row_pack
from draftgraph.models.quant import Int4Linear, quantize_int4_

pytestmark = pytest.mark.skipif(not row_pack.available(), reason="torch without oneDNN")


def test_rows_between_2_and_the_max_take_the_blocked_copy_others_the_dense_weight(monkeypatch):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    form = row_pack.RowsLinear(w)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counted)
    for m in (1, 2, 5, row_pack.ROWS_MAX, row_pack.ROWS_MAX + 1):
        x = torch.randn(m, 64)
        y = form(x, w, b)
        assert y.shape == (m, 96)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        if m in (1, row_pack.ROWS_MAX + 1):  # the dense weight's own product, to the bit
            assert torch.equal(y, F.linear(x, w, b))
    assert calls == [2, 5, row_pack.ROWS_MAX]
    x3 = torch.randn(2, 3, 64)  # leading dims kept
    torch.testing.assert_close(form(x3, w), F.linear(x3, w), rtol=1e-5, atol=1e-5)


def test_the_engine_packs_fp32_cpu_models_by_default_and_int4_replaces_the_copy(hf):
    loaded = tiny_loaded(hf)
    LLMEngine(EngineConfig(model="tiny", device="cpu"), loaded=loaded)
    model = loaded.model
    qkv = model.layers[0].self_attn.qkv_proj.weight
    assert isinstance(getattr(qkv, gemv.PACKED_ATTR), row_pack.RowsLinear)
    assert isinstance(getattr(model.lm_head_weight, gemv.PACKED_ATTR), row_pack.RowsLinear)
    assert gemv.dense_form(qkv)  # the dense weight stays the product (prefill's split)
    x = torch.randn(20, model.config.hidden_size)
    assert model.layers[0].mlp.split_pays(x)
    off = tiny_loaded(hf)
    LLMEngine(EngineConfig(model="tiny", device="cpu", row_pack="off"), loaded=off)
    assert getattr(off.model.layers[0].self_attn.qkv_proj.weight, gemv.PACKED_ATTR, None) is None
    quantize_int4_(model)  # int4 takes over a row-packed weight
    assert isinstance(getattr(qkv, gemv.PACKED_ATTR), Int4Linear)
    assert not gemv.dense_form(qkv)


@pytest.mark.parametrize("kw, match", [
    (dict(row_pack="sometimes"), "--row-pack must be auto, on or off"),
    (dict(row_pack="on", dtype="bfloat16"), "--row-pack on is for fp32 weights on the CPU"),
    (dict(row_pack="on", quantization="int4"), "--row-pack on is for fp32 weights on the CPU"),
    (dict(row_pack="on", tensor_parallel_size=2), "one process"),
])
def test_row_pack_refuses_what_it_cannot_run(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="tiny", device="cpu", **kw)


def test_speculation_over_row_packed_weights_equals_plain_decoding(hf, monkeypatch):
    """n-gram verify rows (up to 5 a request, 4 requests) through the blocked copies, decode
    rows through the dense weights: the same greedy tokens as plain decoding; the copies were
    used."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11], [3, 4, 3, 4, 3], [1, 2, 1, 2]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    calls = []
    real = row_pack.RowsLinear.__call__

    def counted(self, x, weight, bias=None):
        calls.append(x.numel() // x.shape[-1])
        return real(self, x, weight, bias)

    monkeypatch.setattr(row_pack.RowsLinear, "__call__", counted)
    plain = [o.token_ids for o in tiny_engine(hf).generate(prompts, params)]
    spec = tiny_engine(hf, spec=SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False))
    assert [o.token_ids for o in spec.generate(prompts, params)] == plain
    assert any(1 < m <= row_pack.ROWS_MAX for m in calls)
