"""`--deterministic` on the CPU: the engine side of batch invariance (a decode row never rides
in a prefill step's forward; an eager decode-only step takes the decode phase) and exact rows,
which it implies here. The kernels' side (batch-invariant matmul, fixed-length decode splits)
is in test_kernels_matmul.py / test_kernels_attention.py, on the GPU in
test_gpu_deterministic.py."""

from __future__ import annotations

import torch
from _tiny import tiny_hf_model, tiny_loaded
from test_exact_rows_cpu import NGRAM, _prompts

from draftgraph.attention.backend import Phase
from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams


def _engine(deterministic: bool, **kw) -> LLMEngine:
    cfg = EngineConfig(model="tiny", device="cpu", deterministic=deterministic,
                       cache=CacheConfig(page_size=1, kv_cache_tokens=2048),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16),
                       **kw)
    return LLMEngine(cfg, loaded=tiny_loaded(tiny_hf_model(seed=3)))


def _staggered(engine: LLMEngine) -> tuple[dict[str, list[int]], list[tuple[Phase, int, int]]]:
    """Requests arriving while others decode, prompts longer than the 16-token budget (chunked
    prefill): steps that would mix decode rows and prefill chunks. Returns the tokens and,
    per forward, (phase, decode rows, prefill rows)."""
    forwards = []
    real = engine.target.forward

    def spy(sb):
        decode = sum(1 for e, s in zip(sb.extend_lens, sb.seq_lens, strict=True)
                     if e == 1 and s > 30)  # every prompt is at least 30 tokens
        forwards.append((sb.phase, decode, len(sb.extend_lens) - decode))
        return real(sb)

    engine.target.forward = spy
    g = torch.Generator().manual_seed(1)
    tokens: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    pending = [(f"r{i}", torch.randint(0, 128, (30 + 7 * i,), generator=g).tolist())
               for i in range(4)]
    while pending or engine.has_unfinished():
        if pending:
            engine.add_request(pending[0][1], params, request_id=pending[0][0])
            pending.pop(0)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return tokens, forwards


def test_deterministic_never_mixes_decode_rows_into_a_prefill_forward():
    plain_tokens, plain_fwd = _staggered(_engine(False, use_graphs=False))
    det_tokens, det_fwd = _staggered(_engine(True, use_graphs=False))
    # the control: without it, decode rows ride in prefill steps' EXTEND forwards
    assert any(d and p for _, d, p in plain_fwd)
    assert not any(d and p for _, d, p in det_fwd)
    assert {ph for ph, d, p in det_fwd if p} == {Phase.EXTEND}
    assert det_tokens == plain_tokens and len(det_tokens) == 4  # fp32: same greedy tokens
    # decode steps without a graph bucket run eagerly: in the decode phase (the replays'
    # attention), not as an extend forward
    engine = _engine(True, use_graphs=False)
    engine.decode_graphs.bucket_for = lambda bs: None
    eager_tokens, eager_fwd = _staggered(engine)
    assert {ph for ph, d, p in eager_fwd if d and not p} == {Phase.DECODE}
    assert not any(d and p for _, d, p in eager_fwd)
    assert eager_tokens == plain_tokens


def test_deterministic_implies_exact_rows_on_the_cpu():
    """bf16 n-gram speculation equals plain decoding bit for bit with --deterministic alone
    (exact rows default off): the CPU's half of the mode."""
    def run(spec):
        engine = LLMEngine(EngineConfig(
            model="random:smollm2-135m", device="cpu", dtype="bfloat16", seed=0,
            deterministic=True, cache=CacheConfig(kv_cache_tokens=4096),
            scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512,
                                      max_model_len=512), spec=spec))
        outs = []
        for p in _prompts():
            engine.add_request(p, SamplingParams(max_tokens=24, temperature=0,
                                                 ignore_eos=True, logprobs=True),
                               request_id="r")
            while engine.has_unfinished():
                outs += [(o.token_ids, o.logprobs) for o in engine.step() if o.finished]
        return outs, engine

    plain, _ = run(SpecConfig())
    spec, engine = run(NGRAM)
    assert engine.target.backend.exact_rows and engine.config.exact_rows == "off"
    assert engine.stats["num_accepted_tokens"] > 0
    assert spec == plain
