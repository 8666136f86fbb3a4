"""GPU, bf16, `--deterministic`: every row's bits independent of its batch. The batch-invariant
matmul at the engine's shapes and every M; decode attention in fixed-length splits at every
batch size; and in the engine, a request's tokens and logprobs alone equal to those among 31
others of other lengths arriving while it decodes, and n-gram speculation equal to plain
decoding at batch 32 (where exact rows alone gave 81 / 164)."""

from __future__ import annotations

import pytest
import torch

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.kernels import attention as attn
from draftgraph.kernels import gemv
from draftgraph.kernels import matmul as MM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# SmolLM2-135M's projections and LM head, Llama-3.1-8B's down (split K) and o
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (4096, 14336),
          (4096, 4096)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_dot_linear_rows_are_batch_invariant(n, k):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(300, k, device="cuda", generator=g).to(torch.bfloat16)
    full = MM.dot_linear(x, w)
    torch.testing.assert_close(full.float(), MM.dot_linear_ref(x, w).float(), atol=3e-2,
                               rtol=2e-2)
    for m in (1, 2, 5, 16, 17, 64, 65, 130):
        part = MM.dot_linear(x[:m], w)
        assert torch.equal(part, full[:m]), m
    for i in (0, 3, 63, 64, 200, 299):  # alone: the row at index 0 of a batch of one
        assert torch.equal(MM.dot_linear(x[i : i + 1], w)[0], full[i]), i


def test_invariant_decode_plan_rows_equal_across_batch_sizes():
    """The backend's plan at batch 1, 8 and 64 (1, 8 and 32 programs per row here) gives a
    row the same bits; the tuned plan does not (its splits follow the batch size)."""
    hq, hkv, d, max_len = 9, 3, 64, 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(4096, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    v_cache = torch.randn(4096, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(1, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    n = 700
    args = (k_cache, v_cache, torch.tensor([0, n], device="cuda"),
            torch.randperm(4096, device="cuda", generator=g)[:n], torch.zeros(1, device="cuda",
                                                                                dtype=torch.long),
            torch.tensor([n - 1], device="cuda"), None, d ** -0.5)

    def run(programs, cfg, slots):
        out = torch.empty_like(q)
        attn.decode_attention(q, *args, out, num_splits=programs, config=cfg,
                              mid_o=torch.empty(1, hq, slots, d, device="cuda"),
                              mid_lse=torch.empty(1, hq, slots, device="cuda"),
                              kv_counters=torch.zeros(hkv, dtype=torch.int32, device="cuda"))
        return out

    outs = [run(*attn.invariant_decode_plan(bs, hkv, max_len), attn.INVARIANT_MAX_SPLITS)
            for bs in (1, 8, 64)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    tuned = [run(*attn.decode_plan(bs, hq, hkv, d, 32), 32) for bs in (1, 64)]
    assert not torch.equal(tuned[0], tuned[1])


def _engine(deterministic: bool, spec: SpecConfig | None = None, seqs: int = 32) -> LLMEngine:
    engine = LLMEngine(EngineConfig(
        model="random:smollm2-135m", device="cuda", dtype="bfloat16", seed=0,
        deterministic=deterministic, cache=CacheConfig(kv_cache_tokens=seqs * 1024),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=512,
                                  max_model_len=1024), spec=spec or SpecConfig()))
    assert getattr(engine.target.model.lm_head_weight, gemv.INVARIANT_ATTR) is deterministic
    return engine


def _generate(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int,
              late: set[str] = frozenset()) -> dict[str, tuple]:
    """Greedy outputs (tokens, logprobs) by request id; `late` requests arrive after the
    others have decoded 5 steps (their prefill then shares steps with decode rows)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=True)
    for rid, p in prompts.items():
        if rid not in late:
            engine.add_request(p, sp, request_id=rid)
    done, steps = {}, 0
    while engine.has_unfinished() or steps <= 5:
        if steps == 5:
            for rid in late:
                engine.add_request(prompts[rid], sp, request_id=rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.logprobs)
        steps += 1
    return done


def _prompts(n: int, motif: bool) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for i in range(n):
        if motif:  # n-gram drafts on every step
            out[f"r{i}"] = torch.randint(0, 49152, (8,), generator=g).repeat(10 + i).tolist()
        else:
            out[f"r{i}"] = torch.randint(0, 49152, (20 + 13 * i,), generator=g).tolist()
    return out


def test_a_request_alone_equals_it_among_31_others():
    prompts = _prompts(32, motif=False)
    engine = _engine(True)
    alone = _generate(engine, {"r7": prompts["r7"]}, 48)["r7"]
    for late in ({"r7"}, {f"r{i}" for i in range(32) if i % 2}):
        crowd = _generate(engine, prompts, 48, late=late)
        assert crowd["r7"] == alone, late


def test_ngram_speculation_equals_plain_decoding_at_batch_32():
    prompts = _prompts(32, motif=True)
    plain = _generate(_engine(True), prompts, 64)
    engine = _engine(True, SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False))
    spec = _generate(engine, prompts, 64)
    assert engine.stats["num_accepted_tokens"] > 32 * 16
    assert spec == plain
