"""GPU, bf16: verify rows are computed exactly as decode rows, so speculative greedy output
equals plain greedy output token for token (batch 1), and the fused kernels' rows do not
depend on how many rows run with them."""

from __future__ import annotations

import pytest
import torch

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.kernels import gemv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _outputs(spec: SpecConfig, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(
        model="random:smollm2-135m", device="cuda", dtype="bfloat16", seed=0, exact_rows="on",
        cache=CacheConfig(kv_cache_tokens=8192),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1024,
                                  max_model_len=1024), spec=spec))
    assert getattr(engine.target.model.lm_head_weight, gemv.EXACT_ROWS_ATTR) > 1
    outs = []
    for p in prompts:  # one at a time: batch 1 throughout
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0,
                                             ignore_eos=True), request_id="r")
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs.append(out.token_ids)
    return outs


def test_ngram_speculation_in_bf16_equals_plain_decoding_token_for_token():
    g = torch.Generator().manual_seed(0)
    # prompts that repeat a motif, so n-gram drafts are proposed on every step
    prompts = [torch.randint(0, 49152, (8,), generator=g).repeat(40).tolist()
               for _ in range(6)]
    plain = _outputs(SpecConfig(), prompts, 96)
    spec = _outputs(SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False), prompts, 96)
    assert spec == plain


@pytest.mark.parametrize("m", [2, 5, 16])
def test_fused_rows_are_batch_invariant_on_the_gpu(m):
    w = torch.randn(3072, 576, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(m, 576, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(576, device="cuda", dtype=torch.bfloat16) + 0.5
    y, _ = gemv.rmsnorm_gemv_triton(x, norm_w, 1e-5, w)
    for i in range(m):
        yi, _ = gemv.rmsnorm_gemv_triton(x[i : i + 1], norm_w, 1e-5, w)
        assert torch.equal(y[i], yi[0])
