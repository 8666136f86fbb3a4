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


def _greedy(spec: SpecConfig, prompts: list[list[int]], dtype: str = "float32") -> list[list[int]]:
    engine = LLMEngine(EngineConfig(
        model="random:smollm2-135m", device="cuda", dtype=dtype, seed=0,
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


def test_the_matmuls_epilogues_change_no_bit_of_the_output(monkeypatch):
    """bf16 trees (17 verify rows a request, 51 a step) with SwiGLU, the next norm and RoPE +
    the KV store in the matmul's epilogues give the tokens of the unfused chain: each epilogue
    is bitwise the kernel it replaces (test_kernels_matmul.py), so every logit is."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (12, 40, 63)]
    spec = SpecConfig(method="chain", draft_head="random", tree=TreeShape(4, 5, 16))
    calls: dict[str, list[bool]] = {"linear_rmsnorm": [], "linear_rope_store": []}
    for name, seen in calls.items():
        def spy(*args, _fused=getattr(gemv, name), _seen=seen, **kwargs):
            out = _fused(*args, **kwargs)
            _seen.append(out is not None)
            return out

        monkeypatch.setattr(gemv, name, spy)
    assert gemv.DOT_ROPE
    fused = _greedy(spec, prompts, "bfloat16")
    assert any(calls["linear_rmsnorm"])  # the norm ran in down's combine
    assert any(calls["linear_rope_store"])  # RoPE and the KV store in qkv's epilogue
    monkeypatch.setattr(gemv, "DOT_EPILOGUES", False)
    assert _greedy(spec, prompts, "bfloat16") == fused
