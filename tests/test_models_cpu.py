"""The CPU prefill MLP: gate and up multiplied separately (contiguous halves: faster in MKL)
give what the fused [gate | up] product and silu * up give; decode rows, exact rows and packed
weights keep the fused path."""

from __future__ import annotations

import torch

from draftgraph.distributed.parallel import TPInfo
from draftgraph.kernels import gemv, ops
from draftgraph.models.llama import LlamaMLP
from draftgraph.models.presets import preset_config


def test_cpu_prefill_splits_gate_up_and_gives_the_fused_activation():
    torch.manual_seed(0)
    mlp = LlamaMLP(preset_config("smollm2-135m"), TPInfo())
    x = torch.randn(64, mlp.gate_up_proj.in_features)
    assert mlp.split_pays(x)
    fused = ops.silu_and_mul(torch.nn.functional.linear(x, mlp.gate_up_proj.weight))
    torch.testing.assert_close(mlp.split_activation(x), fused, rtol=1e-5, atol=1e-6)
    assert not mlp.split_pays(x[: gemv.EXACT_ROWS_MAX_M])  # decode / verify rows: fused
    setattr(mlp.gate_up_proj.weight, gemv.PACKED_ATTR, lambda *a: None)
    assert not mlp.split_pays(x)  # a packed weight has no dense halves
