"""One request never fails another (issue 17), through HTTP: hostile parameters and bodies get
an OpenAI-style 4xx naming what to change while concurrent innocent requests finish with the
tokens they get alone; capacity is checked at admission; the server stays responsive; shutdown
drains. Random tiny weights (token-id prompts) and a tiny byte-level tokenizer for chat.
Also the token ids a response returns when asked (`return_token_ids`, issue 15)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from draftgraph.engine import admission  # noqa: E402
from draftgraph.engine.engine import LLMEngine  # noqa: E402
from draftgraph.engine.sampling import SamplingParams, choice_params  # noqa: E402
from draftgraph.server.app import build_app  # noqa: E402
from draftgraph.server.async_engine import AsyncEngine  # noqa: E402
from draftgraph.server.config import ServerConfig  # noqa: E402
from draftgraph.server.launcher import ServerThread  # noqa: E402

MODEL = "tiny"
PROMPT = [5, 6, 7, 8]
INNOCENT = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.9,
            "seed": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny():
    from draftgraph.models.loader import load_model

    return load_model("random:tiny")


def _serve(loaded, model: str = "random:tiny", kv_cache_tokens: int = 4096,
           max_waiting: int = 1024, max_model_len: int = 512, **server_kw) -> ServerThread:
    config = EngineConfig(model=model, device="cpu",
                          cache=CacheConfig(kv_cache_tokens=kv_cache_tokens),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_waiting=max_waiting,
                                                    max_model_len=max_model_len))
    engine = LLMEngine(config, loaded=loaded)
    app = build_app(AsyncEngine(engine), ServerConfig(served_model_names=[MODEL], **server_kw))
    return ServerThread(app).start()


@pytest.fixture(scope="module")
def server(tiny):
    st = _serve(tiny)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def chat_server(tiny_hf_dir):
    from draftgraph.models.loader import load_model

    st = _serve(load_model(tiny_hf_dir), model=tiny_hf_dir, max_model_len=256)
    yield st
    st.stop()


def _post(st: ServerThread, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(st.base_url + path, content=body,
                          headers={"Content-Type": "application/json"}, timeout=60, **kw)
    return httpx.post(st.base_url + path, json=body, timeout=60, **kw)


def _assert_error(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] in ("invalid_request_error", "server_error", "authentication_error")
    if param is not None:
        assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


def _tokens(r: httpx.Response) -> list:
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"]


# ---- 1. hostile sampling parameters: 400, and batch-mates unchanged ---------------------------
def test_overflowing_top_k_gets_400_and_a_concurrent_request_keeps_its_tokens(server):
    url = server.base_url + "/v1/completions"
    innocent = {**INNOCENT, "logprobs": 0}
    alone = _tokens(httpx.post(url, json=innocent, timeout=60))
    hostile = [{**INNOCENT, "top_k": 9223372036854775808, "temperature": 1},
               {**INNOCENT, "top_k": 10**30, "temperature": 1}]

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[client.post(url, json=b)
                                          for b in [hostile[0], innocent, hostile[1],
                                                    innocent]])

    bad1, good1, bad2, good2 = asyncio.run(main())
    _assert_error(bad1, 400, "top_k")
    _assert_error(bad2, 400, "top_k")
    assert _tokens(good1) == alone and _tokens(good2) == alone
    # a top_k past the vocabulary is "no limit": the same draw as top_k off
    assert _tokens(httpx.post(url, json={**innocent, "top_k": 10**6}, timeout=60)) == alone


@pytest.mark.parametrize("raw,param,word", [
    ('"temperature": NaN', "temperature", "finite"),
    ('"temperature": Infinity', "temperature", "finite"),
    ('"top_p": NaN', "top_p", "finite"),
    ('"max_tokens": true', "max_tokens", "integer"),
    ('"max_tokens": "4"', "max_tokens", "integer"),
    ('"n": true', "n", "integer"),
    ('"seed": "7"', "seed", "integer"),
    ('"top_k": 1.5', "top_k", "integer"),
    ('"ignore_eos": "yes"', "ignore_eos", "boolean"),
    ('"echo": 1', "echo", "boolean"),
    ('"logprobs": true', "logprobs", "integer"),
    ('"return_token_ids": "yes"', "return_token_ids", "boolean"),
    ('"return_token_ids": 1', "return_token_ids", "boolean"),
    ('"stop": ["x", 3]', "stop", None),
])
def test_lax_or_non_finite_fields_get_400_naming_the_field(server, raw, param, word):
    body = '{"model": "tiny", "prompt": [5, 6], "max_tokens": 2, ' + raw + "}"
    r = _post(server, "/v1/completions", body.replace('"max_tokens": 2, "max_tokens"',
                                                       '"max_tokens"'))
    err = _assert_error(r, 400, param)
    if word:
        assert word in err["message"].lower(), err


def test_up_to_20_logprobs_return_that_many_alternatives_and_21_is_refused(server,
                                                                           chat_server):
    """Issue 17 item 6: top_logprobs / logprobs up to 20 return that many alternatives (from
    the device tail), most likely first; more is a 400 naming the field."""
    r = _post(server, "/v1/completions", {**INNOCENT, "logprobs": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    for tok, tlp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                             strict=True):
        assert len(top) == 5 and max(top.values()) == pytest.approx(tlp)  # greedy: the top
        assert tok in top and list(top.values()) == sorted(top.values(), reverse=True)
    _assert_error(_post(server, "/v1/completions", {**INNOCENT, "logprobs": 21}), 400,
                  "logprobs")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 20}
    r = _post(chat_server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert all(len(c["top_logprobs"]) == 20 for c in r.json()["choices"][0]["logprobs"]["content"])
    _assert_error(_post(chat_server, "/v1/chat/completions", {**chat, "top_logprobs": 21}), 400,
                  "top_logprobs")


@pytest.mark.parametrize("field,value,word", [
    ("presence_penalty", 2.5, "2"), ("frequency_penalty", -3, "-2"),
    ("repetition_penalty", 0, "0"), ("logit_bias", {"5": 150}, "100"),
    ("logit_bias", {"abc": 1}, "token ids"), ("logit_bias", {"100000": 1}, "vocabulary"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "300"), ("min_tokens", -1, "0"),
    ("min_tokens", 5, "max_tokens"), ("prompt_logprobs", 21, "20"), ("min_p", 1.5, "1"),
    ("min_p", -0.1, "0"), ("allowed_token_ids", [3, 100000], "vocabulary"),
    ("allowed_token_ids", [], "1 to 1024"),
])
def test_sampling_controls_out_of_bounds_get_400_naming_the_field(server, field, value, word):
    r = _post(server, "/v1/completions", {**INNOCENT, "max_tokens": 2, field: value})
    err = _assert_error(r, 400, field)
    assert word in err["message"], err


def test_min_p_is_applied_on_both_endpoints(server, chat_server):
    """min_p = 1 at a high temperature leaves only the likeliest token: greedy's tokens
    (without it the same seed strays)."""
    hot = {**INNOCENT, "temperature": 5.0, "logprobs": 0}
    greedy = _tokens(_post(server, "/v1/completions", {**hot, "temperature": 0}))
    assert _tokens(_post(server, "/v1/completions", {**hot, "min_p": 1.0})) == greedy
    assert _tokens(_post(server, "/v1/completions", hot)) != greedy
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": 5.0, "seed": 3, "ignore_eos": True}
    text = lambda r: r.json()["choices"][0]["message"]["content"]  # noqa: E731
    greedy = text(_post(chat_server, "/v1/chat/completions", {**chat, "temperature": 0}))
    assert text(_post(chat_server, "/v1/chat/completions", {**chat, "min_p": 1.0})) == greedy


def test_allowed_token_ids_bound_what_is_emitted(server):
    allowed = [7, 11, 13]
    r = _post(server, "/v1/completions", {**INNOCENT, "logprobs": 0, "return_token_ids": True,
                                          "allowed_token_ids": allowed})
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    assert len(ids) == INNOCENT["max_tokens"] and set(ids) <= set(allowed)


@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}]),
    ("tool_choice", "auto"), ("suffix", "x"), ("best_of", 3),
    ("spaces_between_special_tokens", False),
])
def test_unsupported_fields_get_400_naming_them(server, field, value):
    r = _post(server, "/v1/completions", {**INNOCENT, field: value})
    err = _assert_error(r, 400, field, field)
    assert err["code"] == "unsupported_field"


def test_continuous_usage_stats_is_refused_unless_off(server):
    stream = {**INNOCENT, "stream": True}
    r = _post(server, "/v1/completions",
              {**stream, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    err = _assert_error(r, 400, "stream_options.continuous_usage_stats")
    assert err["code"] == "unsupported_field"
    r = _post(server, "/v1/completions",
              {**stream, "stream_options": {"include_usage": True,
                                            "continuous_usage_stats": False}})
    assert r.status_code == 200, r.text


def test_unsupported_fields_with_their_off_value_and_unknown_fields_are_accepted(server):
    body = {**INNOCENT, "logprobs": 0, "tools": [], "logit_bias": {}, "user": "me",
            "response_format": {"type": "text"}, "include_stop_str_in_output": False,
            "skip_special_tokens": True, "truncate_prompt_tokens": None}
    assert _tokens(_post(server, "/v1/completions", body)) == \
        _tokens(_post(server, "/v1/completions", {**INNOCENT, "logprobs": 0}))


# ---- 2. capacity ------------------------------------------------------------------------------
def test_a_request_larger_than_the_kv_pool_gets_400_and_does_not_block_the_queue(tiny):
    st = _serve(tiny, kv_cache_tokens=256)
    try:
        r = _post(st, "/v1/completions", {"model": MODEL, "prompt": list(range(3, 38)),
                                          "max_tokens": 400})
        _assert_error(r, 400, None, "--kv-cache-tokens", "--gpu-memory-utilization",
                      "--max-model-len")
        r = _post(st, "/v1/completions", {**INNOCENT, "max_tokens": 8})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        # without max_tokens, the default fills what the pool holds instead of being refused
        r = _post(st, "/v1/completions", {**INNOCENT, "max_tokens": None})
        assert r.status_code == 200, r.text
        capacity = admission.kv_capacity(st.app.state.server.engine)
        assert capacity < 400
        assert r.json()["usage"]["completion_tokens"] == capacity - len(PROMPT)
    finally:
        st.stop()


def test_more_choices_than_the_queue_holds_get_400_not_503(tiny):
    st = _serve(tiny, max_waiting=2)  # 8 decode rows + 2 waiting
    try:
        r = _post(st, "/v1/completions", {**INNOCENT, "n": 11})
        _assert_error(r, 400, "n", "--max-waiting")
        r = _post(st, "/v1/completions", {**INNOCENT, "prompt": [[5, 6]] * 11})
        _assert_error(r, 400, "prompt", "--max-num-seqs")
        # on an idle server the choices about to run do not count against --max-waiting
        r = _post(st, "/v1/completions", {**INNOCENT, "n": 10})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 10
    finally:
        st.stop()


# ---- 3. hostile bodies --------------------------------------------------------------------
def test_a_body_over_the_limit_gets_413_declared_or_chunked(tiny):
    st = _serve(tiny, max_body_bytes=2 * 1024 * 1024)
    try:
        # 10 MB: the client is still sending when the server has decided; it reads the 413
        # (the rest of the body is drained before the answer, not reset)
        async def post_big() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as client:
                return await client.post(st.base_url + "/v1/completions",
                                         json={**INNOCENT, "prompt": [5] * 3_400_000})

        _assert_error(asyncio.run(post_big()), 413, None, "--max-body-bytes")
        big = {**INNOCENT, "prompt": [5] * 1_500_000}
        r = _post(st, "/v1/completions", big)
        err = _assert_error(r, 413, None, "--max-body-bytes")
        assert err["code"] == "request_too_large"
        assert r.headers["connection"] == "close"

        def chunks():  # no Content-Length: counted while read
            data = json.dumps(big).encode()
            for i in range(0, len(data), 100_000):
                yield data[i:i + 100_000]

        r = httpx.post(st.base_url + "/v1/completions", content=chunks(),
                       headers={"Content-Type": "application/json"}, timeout=60)
        _assert_error(r, 413, None, "--max-body-bytes")
        assert _post(st, "/v1/completions", {**INNOCENT, "max_tokens": 2}).status_code == 200
    finally:
        st.stop()


def test_a_body_that_never_arrives_gets_408(tiny):
    st = _serve(tiny, body_read_timeout_s=0.3)
    try:
        with socket.create_connection((st.host, st.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"")
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                data = sock.recv(4096)
                if not data:
                    break
                reply += data
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert httpx.get(st.base_url + "/health").status_code == 200
    finally:
        st.stop()


def test_tokenising_runs_off_the_event_loop(server, monkeypatch):
    """While text prompts are being tokenised (held here, on both of the tokenizer's worker
    threads), /health and other requests are served; a token-id prompt needs no tokenizer and
    is checked on the loop itself, so it does not wait for a worker either."""
    engine = server.app.state.server.engine
    texts = ("nine nine nine", "ten ten ten")
    started, release = threading.Semaphore(0), threading.Event()
    real = engine.encode_prompt

    def slow_encode(prompt, use_chat_template=True, **kw):
        if prompt in texts:  # a slow tokenizer (the tiny model has none): these ids, late
            started.release()
            assert release.wait(60)
            prompt = [9, 9, 9]
        return real(prompt, use_chat_template, **kw)

    monkeypatch.setattr(engine, "encode_prompt", slow_encode)
    results = {}
    held = [threading.Thread(target=lambda t=t: results.update({t: _post(
        server, "/v1/completions", {**INNOCENT, "prompt": t, "max_tokens": 3})}))
        for t in texts]
    for h in held:
        h.start()
    try:
        assert all(started.acquire(timeout=60) for _ in texts)  # both workers held
        assert httpx.get(server.base_url + "/health", timeout=30).json() == {"status": "ok"}
        r = httpx.post(server.base_url + "/v1/completions", timeout=15,
                       json={**INNOCENT, "max_tokens": 2})  # token ids: PROMPT
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert all(h.is_alive() for h in held)  # still held in the tokenizer
    finally:
        release.set()
        for h in held:
            h.join(60)
    for t in texts:
        assert results[t].status_code == 200
        assert results[t].json()["usage"]["completion_tokens"] == 3


# ---- 4. bad text, and an error handler that cannot fail -------------------------------------
@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", '{"model": "tiny", "prompt": "hi \\ud800"}', "prompt"),
    ("/v1/completions", '{"model": "tiny\\ud800", "prompt": [5]}', "model"),
    ("/v1/completions", '{"model": "tiny", "prompt": [5], "stop": "\\udfff"}', "stop"),
    ("/v1/chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": '
     '[{"type": "text", "text": "\\ud800"}]}]}', None),
])
def test_lone_surrogates_get_400_with_an_openai_body(server, path, raw, param):
    r = _post(server, path, raw)
    err = _assert_error(r, 400, param, "surrogate")
    assert err["type"] == "invalid_request_error"
    r.content.decode("utf-8")  # the body itself is valid UTF-8


def test_invalid_utf8_bytes_get_400(server):
    r = _post(server, "/v1/completions", b'{"model": "tiny", "prompt": "hi \xff\xfe"}')
    _assert_error(r, 400, None)


def test_the_error_handler_survives_a_failure_while_counting_the_error(server, monkeypatch):
    metrics = server.app.state.server.metrics

    def broken(status):
        raise RuntimeError("metrics down")

    monkeypatch.setattr(metrics, "count_error", broken)
    _assert_error(_post(server, "/v1/completions", {**INNOCENT, "top_k": -7}), 400, "top_k")
    _assert_error(_post(server, "/v1/completions", {**INNOCENT, "model": "gpt-9"}), 404,
                  "model", "gpt-9")


def test_the_error_handler_falls_back_when_the_body_cannot_be_built(server, monkeypatch):
    from draftgraph.server import serving

    def broken(*args, **kwargs):
        raise RuntimeError("cannot build")

    monkeypatch.setattr(serving, "error_body", broken)
    r = _post(server, "/v1/completions", {**INNOCENT, "top_k": -7})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "internal error", "type": "server_error",
                                 "param": None, "code": "internal_error"}


# ---- 5. usage ---------------------------------------------------------------------------------
def test_usage_counts_the_prompt_once_per_prompt_not_per_choice(server, chat_server):
    r = _post(server, "/v1/completions", {**INNOCENT, "max_tokens": 3, "n": 3})
    assert r.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 9,
                                 "total_tokens": 13}
    r = _post(server, "/v1/completions", {**INNOCENT, "prompt": [[5, 6], [7, 8, 9]],
                                          "max_tokens": 2, "n": 2})
    assert len(r.json()["choices"]) == 4
    assert r.json()["usage"]["prompt_tokens"] == 5
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "ignore_eos": True}
    one = _post(chat_server, "/v1/chat/completions", chat).json()["usage"]["prompt_tokens"]
    three = _post(chat_server, "/v1/chat/completions", {**chat, "n": 3}).json()["usage"]
    assert three["prompt_tokens"] == one and three["completion_tokens"] == 6
    with httpx.stream("POST", chat_server.base_url + "/v1/chat/completions", timeout=60,
                      json={**chat, "n": 3, "stream": True,
                            "stream_options": {"include_usage": True}}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["prompt_tokens"] == one


# ---- token ids (return_token_ids, issue 15) ----------------------------------------------------
def _stream_events(st: ServerThread, path: str, body: dict,
                   timeout: float = 60) -> list[dict]:
    with httpx.stream("POST", st.base_url + path, json={**body, "stream": True},
                      timeout=timeout) as s:
        assert s.status_code == 200, s.read()
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_returned_token_ids_are_the_engines_and_the_streamed_ids_add_up_to_them(server, tiny):
    """A random-weight model streams no text; with return_token_ids each choice carries the
    ids the engine generated (in process, same seeds), each stream chunk the ids it adds,
    and the prompt's ids come once per choice (on its first chunk)."""
    body = {**INNOCENT, "n": 2, "return_token_ids": True}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu",
                                    cache=CacheConfig(kv_cache_tokens=4096),
                                    scheduler=SchedulerConfig(max_num_seqs=8,
                                                              max_model_len=512)),
                       loaded=tiny)
    finals = engine.generate([PROMPT] * 2, choice_params(SamplingParams(
        max_tokens=12, temperature=0.9, seed=3, ignore_eos=True), 2), use_chat_template=False)
    assert [c["token_ids"] for c in choices] == [f.token_ids for f in finals]
    assert all(len(c["token_ids"]) == 12 and c["prompt_token_ids"] == PROMPT for c in choices)
    assert choices[0]["token_ids"] != choices[1]["token_ids"]  # seed + i

    streamed: dict[int, list[int]] = {0: [], 1: []}
    prompts: dict[int, list] = {0: [], 1: []}
    for event in _stream_events(server, "/v1/completions", body):
        (c,) = event["choices"]
        assert c["text"] == "" and c["token_ids"]  # no text, yet every chunk has its ids
        if "prompt_token_ids" in c:
            assert not streamed[c["index"]]  # on the choice's first chunk
            prompts[c["index"]].append(c["prompt_token_ids"])
        streamed[c["index"]] += c["token_ids"]
    assert [streamed[0], streamed[1]] == [c["token_ids"] for c in choices]
    assert prompts == {0: [PROMPT], 1: [PROMPT]}
    plain = _post(server, "/v1/completions", INNOCENT).json()  # off by default
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_chat_token_ids_match_the_text_and_the_prompt_ids_come_once(chat_server):
    """Chat (a byte-level tokenizer: random bytes leave text held back): the ids decode to
    the message, the prompt's ids are the templated prompt's, once on the response (vLLM's
    placement), in a stream once on its first chunk; the chunks' ids add up to the choice's."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
            "temperature": 0.9, "seed": 1, "ignore_eos": True, "n": 2, "return_token_ids": True}
    r = _post(chat_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    prompt = _post(chat_server, "/tokenize", {"messages": body["messages"]}).json()["tokens"]
    assert out["prompt_token_ids"] == prompt
    choices = sorted(out["choices"], key=lambda c: c["index"])
    for c in choices:
        assert len(c["token_ids"]) == 10 and "prompt_token_ids" not in c
        decoded = _post(chat_server, "/detokenize", {"tokens": c["token_ids"]}).json()
        assert decoded["prompt"] == c["message"]["content"]
    events = _stream_events(chat_server, "/v1/chat/completions", body)
    assert [i for i, e in enumerate(events) if "prompt_token_ids" in e] == [0]
    assert events[0]["prompt_token_ids"] == prompt
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for event in events:
        (c,) = event["choices"]
        streamed[c["index"]] += c["token_ids"]
    assert [streamed[0], streamed[1]] == [c["token_ids"] for c in choices]


def test_tokenize_honours_add_special_tokens_as_lm_evals_remote_tokenizer_needs(tmp_path):
    """lm-evaluation-harness's remote tokenizer sends add_special_tokens false and takes
    /tokenize(eos)[0] as the EOS id and a text's ids as its tokens, so a tokenizer that adds
    a BOS (Llama 3's) must not add it then; by default a prompt still gets it (vLLM)."""
    from conftest import save_tiny_hf_checkpoint, save_tiny_tokenizer, tiny_llama_config

    from draftgraph.models.loader import load_model

    path = str(tmp_path)
    save_tiny_hf_checkpoint(path, tiny_llama_config(), tokenizer=False)
    save_tiny_tokenizer(path, add_bos=True)
    st = _serve(load_model(path), model=path, max_model_len=256)
    try:
        bos, eos, ab = 256, 257, [64, 65]  # <s>, </s> after the 256 byte tokens; "ab"

        def tokenize(**kw) -> list[int]:
            r = _post(st, "/tokenize", kw)
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        assert tokenize(prompt="ab") == [bos, *ab]
        assert tokenize(prompt="ab", add_special_tokens=True) == [bos, *ab]
        assert tokenize(prompt="ab", add_special_tokens=False) == ab
        info = httpx.get(st.base_url + "/tokenizer_info").json()
        assert (info["bos_token"], info["eos_token"]) == ("<s>", "</s>")
        assert tokenize(prompt=info["eos_token"], add_special_tokens=False) == [eos]
        chat = [{"role": "user", "content": "hi"}]
        templated = tokenize(messages=chat)
        assert templated[0] != bos and tokenize(messages=chat, add_special_tokens=True) == \
            [bos, *templated]
        # a completion's text prompt is tokenised as before: with the BOS
        r = _post(st, "/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 1,
                                          "return_token_ids": True})
        assert r.json()["choices"][0]["prompt_token_ids"] == [bos, *ab]
        bad = _post(st, "/tokenize", {"prompt": "ab", "add_special_tokens": "no"})
        _assert_error(bad, 400, "add_special_tokens")
    finally:
        st.stop()


# ---- 7. HEAD /health --------------------------------------------------------------------------
def test_head_health_is_200(server):
    r = httpx.head(server.base_url + "/health")
    assert r.status_code == 200 and r.content == b""


# ---- 8. graceful shutdown -----------------------------------------------------------------
def _open_stream(client: httpx.Client, st: ServerThread, max_tokens: int):
    body = {**INNOCENT, "max_tokens": max_tokens, "stream": True}
    cm = client.stream("POST", st.base_url + "/v1/completions", json=body)
    r = cm.__enter__()
    assert r.status_code == 200
    lines = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
    first = next(lines)
    return cm, [first], lines


def test_drain_lets_running_streams_finish_and_refuses_new_requests(tiny):
    st = _serve(tiny, shutdown_timeout_s=120)
    engine = st.app.state.server.engine
    gate = threading.Event()
    real_step = engine.step

    def gated_step():  # the engine waits here until the test has seen the drain start
        gate.wait(60)
        return real_step()

    try:
        with httpx.Client(timeout=60) as client:
            cm, events, lines = _open_stream(client, st, max_tokens=40)
            engine.step = gated_step
            drainer = threading.Thread(target=st.drain)
            drainer.start()
            for _ in range(1000):  # the drain starts on the server's event loop
                if httpx.get(st.base_url + "/health").status_code == 503:
                    break
            assert httpx.get(st.base_url + "/health").json() == {"status": "shutting down"}
            r = _post(st, "/v1/completions", INNOCENT)
            err = _assert_error(r, 503, None, "shutting down")
            assert err["code"] == "server_shutting_down"
            gate.set()
            events += list(lines)
            cm.__exit__(None, None, None)
            drainer.join(60)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        engine.step = real_step
        gate.set()
        st.stop()


def test_drain_timeout_ends_remaining_streams_with_an_error_event_and_done(tiny):
    st = _serve(tiny, shutdown_timeout_s=0)
    engine = st.app.state.server.engine
    gate = threading.Event()
    real_step = engine.step

    def stuck_step():  # a request that would run past the shutdown timeout
        gate.wait(60)
        return real_step()

    try:
        with httpx.Client(timeout=60) as client:
            cm, events, lines = _open_stream(client, st, max_tokens=200)
            engine.step = stuck_step
            st.drain()
            events += list(lines)
            cm.__exit__(None, None, None)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "server_shutting_down" and "--shutdown-timeout" in err["message"]
        gate.set()
        # the engine side is cleaned up too: the request was aborted, its KV freed
        for _ in range(100):
            if not engine.has_unfinished():
                break
            threading.Event().wait(0.05)
        assert not engine.has_unfinished()
        assert engine.num_free_kv_slots() == admission.kv_capacity(engine)
    finally:
        engine.step = real_step
        gate.set()
        st.stop()


# ---- 9. auth ----------------------------------------------------------------------------------
def test_auth_challenges_and_closes_docs_when_a_key_is_set(tiny, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    st = _serve(tiny, api_key_file=str(key_file))
    try:
        r = _post(st, "/v1/completions", INNOCENT)
        _assert_error(r, 401, None)
        assert r.headers["www-authenticate"] == "Bearer"
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(st.base_url + path).status_code == 404, path
        assert httpx.get(st.base_url + "/info").status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.get(st.base_url + "/info", headers=auth).json()["kv_slots"] > 0
        assert _post(st, "/v1/completions", INNOCENT, headers=auth).status_code == 200
        assert httpx.get(st.base_url + "/health").status_code == 200  # open, as in vLLM
        assert httpx.get(st.base_url + "/metrics").status_code == 200
    finally:
        st.stop()


def test_docs_stay_open_without_a_key(server):
    assert httpx.get(server.base_url + "/openapi.json").status_code == 200


def test_api_key_file_is_read_and_checked(tmp_path):
    path = tmp_path / "key"
    path.write_text("  abc  \nignored\n")
    assert ServerConfig(api_key_file=str(path)).api_key == "abc"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="--api-key-file .* is empty"):
        ServerConfig(api_key_file=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="--api-key-file"):
        ServerConfig(api_key_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not both"):
        ServerConfig(api_key="x", api_key_file=str(path))


_SERVE_SCRIPT = """
import sys, time, uvicorn
from draftgraph.config import EngineConfig, SchedulerConfig
from draftgraph.server.cli import build_server
from draftgraph.server.config import ServerConfig

config = EngineConfig(model="random:tiny", device="cpu",
                      scheduler=SchedulerConfig(max_model_len=2048))
app, _ = build_server(config, ServerConfig(served_model_names=["tiny"],
                                           shutdown_timeout_s=float(sys.argv[2])))
engine = app.state.server.engine
real_step = engine.step

def slow_step():  # a long request: it is still running when the signal comes
    time.sleep(0.01)
    return real_step()

engine.step = slow_step
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_sigterm_drains_then_ends_streams_with_an_error_event_and_done(tmp_path):
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "serve.py"
    script.write_text(_SERVE_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(port), "0.5"])
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                threading.Event().wait(0.1)
        else:
            raise AssertionError("server did not start")
        body = {**INNOCENT, "max_tokens": 1500, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            lines = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
            events = [next(lines)]
            proc.send_signal(signal.SIGTERM)
            events += list(lines)
        assert events[-1] == "[DONE]"
        assert len(events) < 1500
        err = json.loads(events[-2])["error"]
        assert err["code"] == "server_shutting_down"
        assert all("error" not in json.loads(e) for e in events[:-2])
        proc.wait(timeout=60)
        with pytest.raises(httpx.TransportError):
            httpx.get(base + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
