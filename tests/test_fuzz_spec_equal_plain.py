"""Cases a fuzzing pass over the engine's API found (speculative method x batch x sampling
parameters, each request against itself run alone without speculation), kept as the
behaviours they broke: seeded sampling with top_k = 1 emits greedy decoding's tokens, plain
and speculative (a uniform that fp32 rounded to 1 drew a token of weight 0); a stop string in
text streamed before min_tokens does not cut that text afterwards (the final text was shorter
than what the stream had sent)."""

from __future__ import annotations

import pytest

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams

# its chat-templated prompt has 47 tokens: the first token is drawn at position 47, where
# this seed's uniform of token 42297 rounded to 1 in fp32 (tests/test_kernels_sampling.py)
PROMPT = "a b c d e f g a b c d e f g a b c"
SEED = 674094508383


def _engine(loaded, spec: SpecConfig | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model="default", cache=CacheConfig(kv_cache_tokens=1024),
                                  scheduler=SchedulerConfig(max_num_seqs=4),
                                  spec=spec or SpecConfig()), loaded=loaded)


@pytest.fixture(scope="module")
def greedy(default_model):
    return _engine(default_model).generate([PROMPT], SamplingParams(max_tokens=4,
                                                                   temperature=0))[0]


@pytest.mark.parametrize("spec", [None, SpecConfig(method="ngram", adaptive=False),
                                  SpecConfig(method="chain", num_draft_tokens=3)],
                         ids=["plain", "ngram", "chain"])
def test_seeded_top_k_1_emits_the_greedy_tokens(default_model, greedy, spec):
    assert len(greedy.prompt_token_ids) == 47 and 42297 not in greedy.token_ids
    top1 = SamplingParams(max_tokens=4, temperature=1.0, top_k=1, seed=SEED)
    out = _engine(default_model, spec).generate([PROMPT], top1)[0]
    assert out.token_ids == greedy.token_ids


@pytest.mark.parametrize("spec", [None, SpecConfig(method="chain", num_draft_tokens=3)],
                         ids=["plain", "chain"])
def test_a_stop_string_before_min_tokens_never_cuts_streamed_text(default_model, spec):
    """The first two tokens are "\\n" "\\n": min_tokens = 2 lets the first through (streamed),
    the second ends the request there, its own "\\n" cut."""
    engine = _engine(default_model, spec)
    prompt = engine.encode_prompt("Repeat after me: the cat sat on the mat. the cat sat on the "
                                  "mat. the cat sat on the mat.", use_chat_template=False)
    (first,) = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    assert engine.tokenizer.decode(first.token_ids) == "\n\n"
    streamed = []
    sp = SamplingParams(max_tokens=8, temperature=0, stop=["\n"], min_tokens=2)
    (out,) = engine.generate([prompt], sp, on_output=streamed.append)
    assert out.finish_reason == "stop" and out.token_ids == first.token_ids
    assert out.text == "".join(o.delta_text for o in streamed) == "\n"
