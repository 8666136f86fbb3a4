"""Admission (issue 17): every sampling parameter bounded where a request enters, and a request
that could never run refused with an error naming the flag to change, instead of failing its
batch-mates or blocking the queue. Engine-level, CPU, random tiny weights."""

from __future__ import annotations

import math

import pytest
import torch

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
from draftgraph.engine import admission
from draftgraph.engine.engine import EngineError, LLMEngine
from draftgraph.engine.sampling import MAX_TOP_K, SamplingParams, SamplingParamsError


@pytest.fixture(scope="module")
def tiny():
    from draftgraph.models.loader import load_model

    return load_model("random:tiny")


def _engine(loaded, kv_cache_tokens: int = 2048, max_model_len: int = 512) -> LLMEngine:
    config = EngineConfig(model="random:tiny", device="cpu",
                          cache=CacheConfig(kv_cache_tokens=kv_cache_tokens),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=max_model_len))
    return LLMEngine(config, loaded=loaded)


# ---- SamplingParams -------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,param,match", [
    ({"top_k": 2**63}, "top_k", "top_k"),
    ({"top_k": 10**30}, "top_k", "top_k"),
    ({"top_k": -5}, "top_k", "top_k"),
    ({"top_k": 2.5}, "top_k", "top_k"),
    ({"temperature": math.nan}, "temperature", "finite"),
    ({"temperature": math.inf}, "temperature", "finite"),
    ({"temperature": -0.1}, "temperature", "temperature"),
    ({"temperature": True}, "temperature", "number"),
    ({"top_p": math.nan}, "top_p", "finite"),
    ({"top_p": 0.0}, "top_p", "top_p"),
    ({"top_p": 1.5}, "top_p", "top_p"),
    ({"max_tokens": True}, "max_tokens", "integer"),
    ({"max_tokens": "4"}, "max_tokens", "integer"),
    ({"max_tokens": 2**40}, "max_tokens", "max_tokens"),
    ({"seed": -1}, "seed", "seed"),
    ({"seed": 2**64}, "seed", "seed"),
    ({"stop": ["x"] * 17}, "stop", "stop"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids", "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos", "ignore_eos"),
    ({"logprobs": "yes"}, "logprobs", "logprobs"),
])
def test_sampling_params_refuse_out_of_range_values_naming_the_field(kwargs, param, match):
    with pytest.raises(SamplingParamsError, match=match) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_sampling_params_keep_the_step_tensors_finite():
    # every accepted value fits the step's dtypes (top_k, seed int64; temperature, top_p fp32)
    sp = SamplingParams(top_k=MAX_TOP_K, seed=2**63 - 1, temperature=1e-30, top_p=1e-300)
    assert torch.tensor([sp.top_k, sp.seed]).dtype == torch.int64
    assert sp.temperature == 0.0 and sp.greedy  # 1e-30 would overflow fp32 logits / T
    assert float(torch.tensor(sp.top_p, dtype=torch.float32)) > 0  # fp32 0 would keep no token
    assert SamplingParams(top_k=0).top_k == -1


# ---- admission against the model and the capacity -------------------------------------------
def test_top_k_past_the_vocabulary_is_clamped_to_it(tiny):
    engine = _engine(tiny)
    vocab = engine.model_config.vocab_size
    sp = admission.bound_params(engine, SamplingParams(top_k=10**6))
    assert sp.top_k == vocab
    assert admission.bound_params(engine, SamplingParams(top_k=7)).top_k == 7
    rid = engine.add_request([5, 6, 7], SamplingParams(top_k=10**6, max_tokens=2))
    engine._drain_inbox([])
    assert engine.scheduler.waiting[0].params.top_k == vocab
    engine.abort(rid)


def test_a_request_larger_than_the_kv_pool_is_refused_naming_the_flags(tiny):
    engine = _engine(tiny, kv_cache_tokens=256)
    capacity = admission.kv_capacity(engine)
    assert capacity < 35 + 400
    with pytest.raises(EngineError) as e:
        engine.add_request(list(range(3, 38)), SamplingParams(max_tokens=400))
    for flag in ("--kv-cache-tokens", "--gpu-memory-utilization", "--max-model-len"):
        assert flag in str(e.value)
    assert str(capacity) in str(e.value)
    assert not engine.has_unfinished()
    # one that fits the pool alone is admitted and runs to its end
    out = engine.generate([list(range(3, 38))], SamplingParams(max_tokens=capacity - 40,
                                                               temperature=0, ignore_eos=True))
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == capacity - 40
    assert engine.num_free_kv_slots() == capacity


def test_kv_need_is_capped_at_the_context(tiny):
    # max_tokens past the context ends at the context ("length"), so it needs only that much KV
    engine = _engine(tiny, kv_cache_tokens=600, max_model_len=512)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=10_000))
    assert engine.has_unfinished()


# ---- prompt text: bounded before tokenising, valid Unicode -----------------------------------
@pytest.fixture(scope="module")
def with_tokenizer(tiny_hf_dir):
    from draftgraph.models.loader import load_model

    loaded = load_model(tiny_hf_dir)
    config = EngineConfig(model=tiny_hf_dir, device="cpu",
                          scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=128))
    return LLMEngine(config, loaded=loaded)


def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenised(with_tokenizer,
                                                                          monkeypatch):
    engine = with_tokenizer
    limit = (engine.max_model_len * admission.max_token_chars(engine.tokenizer)
             * admission.NORMALISATION_FACTOR)
    calls = []
    real = admission.encode_text
    monkeypatch.setattr(admission, "encode_text",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for prompt, what in (("a" * (limit + 1), "prompt"),
                         ([{"role": "user", "content": "a" * (limit + 1)}], "messages")):
        with pytest.raises(EngineError, match=rf"{what} has {limit + 1} characters"):
            engine.encode_prompt(prompt, use_chat_template=False)
    assert calls == []  # refused without tokenising
    # under the bound it is tokenised and then measured in tokens
    with pytest.raises(EngineError, match="tokens; the model's context is 128"):
        engine.encode_prompt("a b " * 200, use_chat_template=False)
    assert calls == [1]


def test_encode_text_gives_the_tokenizers_ids(with_tokenizer):
    tok = with_tokenizer.tokenizer
    text = "Hello, wörld! ünïcode"
    assert admission.encode_text(tok, text) == tok.encode(text)
    assert admission.encode_text(tok, text, add_special_tokens=False) == \
        tok.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    assert with_tokenizer.encode_prompt(messages) == tok.apply_chat_template(messages)


@pytest.mark.parametrize("prompt", ["hi \ud800", [{"role": "user", "content": "a\udfffb"}]])
def test_lone_surrogates_are_refused_as_bad_text(with_tokenizer, prompt):
    with pytest.raises(EngineError, match="surrogate"):
        with_tokenizer.add_request(prompt, SamplingParams(max_tokens=2))
    assert not with_tokenizer.has_unfinished()


# ---- the queue ------------------------------------------------------------------------------
def test_requests_about_to_run_do_not_count_against_max_waiting(tiny):
    from draftgraph.engine.engine import QueueFullError

    config = EngineConfig(model="random:tiny", device="cpu",
                          cache=CacheConfig(kv_cache_tokens=2048),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_waiting=2,
                                                    max_model_len=512))
    engine = LLMEngine(config, loaded=tiny)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    for i in range(6):  # idle: 4 start at the next step, 2 wait
        engine.add_request([5, 6, 7], sp, request_id=f"r{i}")
    with pytest.raises(QueueFullError, match="--max-waiting"):
        engine.add_request([5, 6, 7], sp, request_id="r6")
    engine.step()
    assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 2
    with pytest.raises(QueueFullError):  # running full, 2 waiting: still full
        engine.add_request([5, 6, 7], sp, request_id="r6")
    while engine.has_unfinished():
        engine.step()
    engine.add_request([5, 6, 7], sp, request_id="r6")  # drained: admitted again
