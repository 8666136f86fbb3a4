"""GPU: `--tensor-core-rows` routes products of gemv.DOT_ROWS rows to the tensor-core matmul
(kernels/matmul.py, with programmatic dependent launch) and leaves fewer and more rows on
cuBLAS; with it, speculative greedy output (draft trees: 17 verify rows a step) still equals
plain greedy output (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig, TreeShape
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.kernels import gemv
from draftgraph.kernels import matmul as MM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_rows_in_the_range_take_the_matmul_and_the_rest_cublas():
    lin = torch.nn.Linear(576, 960, bias=False).cuda().to(torch.bfloat16)
    gemv.mark_dot_rows(lin)
    w = lin.weight
    x = torch.randn(80, 576, device="cuda", dtype=torch.bfloat16)
    lo, hi = gemv.DOT_ROWS
    for m in (lo, 17, hi):
        assert torch.equal(gemv.linear(x[:m], w), MM.dot_linear(x[:m], w)), m
    for m in (lo - 1, hi + 1):
        assert torch.equal(gemv.linear(x[:m], w), F.linear(x[:m], w)), m
    gemv.mark_dot_rows(lin, None)
    assert torch.equal(gemv.linear(x[:17], w), F.linear(x[:17], w))


def _greedy(spec: SpecConfig, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(
        model="random:smollm2-135m", device="cuda", dtype="float32", seed=0,
        tensor_core_rows="on", cache=CacheConfig(kv_cache_tokens=8192),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024,
                                  max_model_len=1024), spec=spec))
    assert getattr(engine.target.model.lm_head_weight, gemv.DOT_ROWS_ATTR) == gemv.DOT_ROWS
    outs = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0,
                                                   ignore_eos=True))
    return [o.token_ids for o in outs]


def test_tree_speculation_on_tensor_core_rows_equals_plain_decoding():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 40, 200)]
    plain = _greedy(SpecConfig(), prompts)
    tree = _greedy(SpecConfig(method="chain", draft_head="random", tree=TreeShape(4, 5, 16)),
                   prompts)
    assert tree == plain


@pytest.mark.parametrize("m", [9, 17, 33, 64])
def test_norm_and_swiglu_inside_the_matmul_compiled(m):
    """The fused forms of the tensor-core rows, compiled, bf16, SmolLM2's shapes (qkv and
    gate_up with the norm, down with SwiGLU and split K): their twins', the unfused chain's
    within bf16 rounding, each row as alone."""
    from draftgraph.kernels.ops import rms_norm_ref, silu_and_mul

    gen = torch.Generator(device="cuda").manual_seed(m)
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(bf)

    x, res, g = rnd(m, 576, scale=3.0), rnd(m, 576), rnd(576).abs() + 0.5
    for n in (960, 3072):
        w = rnd(n, 576, scale=576 ** -0.5)
        y, h = MM.dot_rmsnorm_linear(x, g, 1e-5, w, None, res)
        ref, ref_h = MM.dot_rmsnorm_linear_ref(x, g, 1e-5, w, None, res)
        assert torch.equal(h, ref_h)
        torch.testing.assert_close(y.float(), ref.float(), atol=3e-2, rtol=3e-2)
        normed, _ = rms_norm_ref(x, g, 1e-5, res)
        torch.testing.assert_close(y.float(), F.linear(normed, w).float(), atol=6e-2, rtol=6e-2)
        assert torch.equal(MM.dot_rmsnorm_linear(x[m - 1 :], g, 1e-5, w, None,
                                                 res[m - 1 :])[0][0], y[m - 1])
    gate_up, w = rnd(m, 2 * 1536, scale=2.0), rnd(576, 1536, scale=1536 ** -0.5)
    y = MM.dot_silu_mul_linear(gate_up, w)
    torch.testing.assert_close(y.float(), MM.dot_linear(silu_and_mul(gate_up), w).float(),
                               atol=3e-2, rtol=3e-2)
    assert torch.equal(MM.dot_silu_mul_linear(gate_up[:1], w)[0], y[0])
