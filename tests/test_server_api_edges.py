"""Edges of the OpenAI API that a fuzzing pass against `draftgraph serve` found (the default
model on CPU): null as a field's default, fields valid alone but not together, chat fields the
server does not implement, bounds on ids, and streamed chat logprobs of tokens whose text is
held back. Each answer is checked for its status and the error's `param`."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_reliability_server import _stream_events  # noqa: E402
from test_server import MESSAGES, MODEL, _serve  # noqa: E402

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
              "temperature": 0}
BOTH = [(COMPLETIONS_PATH, COMPLETION), (CHAT_PATH, CHAT)]
# fields OpenAI (or vLLM, for its extras) lets be null, on both endpoints
NULLABLE = ["stream", "stream_options", "n", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "ignore_eos", "min_tokens", "min_p", "return_token_ids", "seed",
            "stop", "stop_token_ids", "logit_bias", "prompt_logprobs", "logprobs", "echo",
            "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids",
            "truncate_prompt_tokens", "detokenize", "bad_words"]


@pytest.fixture(scope="module")
def server(default_model):
    st = _serve(default_model)
    yield st
    st.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def _error(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err


def _chunks(server, path: str, body: dict) -> list[dict]:
    return _stream_events(server, path, body, timeout=120)  # the default model, on a CPU


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_streamed_chat_logprobs_include_tokens_whose_text_is_held_back(server):
    """Token 10813 is part of an emoji's UTF-8 bytes: biased to the top, its text waits for
    bytes that never come, yet each token's logprob is streamed, equal to the non-streamed."""
    body = {**CHAT, "max_tokens": 8, "logprobs": True, "top_logprobs": 2,
            "logit_bias": {"10813": 100}}
    full = _post(server, CHAT_PATH, body).json()
    content = full["choices"][0]["logprobs"]["content"]
    assert len(content) == full["usage"]["completion_tokens"] == 8
    chunks = [c["choices"][0] for c in _chunks(server, CHAT_PATH, body) if c["choices"]]
    streamed = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx(
        [e["logprob"] for e in content], abs=1e-5)
    assert [[t["token"] for t in e["top_logprobs"]] for e in streamed] == \
        [[t["token"] for t in e["top_logprobs"]] for e in content]
    assert any(c["logprobs"] and "content" not in c["delta"] for c in chunks)  # held back


@pytest.mark.parametrize("path,body", BOTH, ids=["completions", "chat"])
def test_prompt_logprobs_with_stream_is_refused(server, path, body):
    """vLLM's rule: prompt logprobs are never streamed, so asking for them while streaming is
    a 400 (it was a 200 that left them out)."""
    err = _error(_post(server, path, {**body, "stream": True, "prompt_logprobs": 0}),
                 "prompt_logprobs")
    assert "stream" in err["message"]
    assert _post(server, path, {**body, "prompt_logprobs": 0}).status_code == 200


@pytest.mark.parametrize("path,body", BOTH, ids=["completions", "chat"])
def test_null_means_the_default_and_other_values_are_still_checked(server, path, body):
    plain = _text(_post(server, path, body))
    extra = ["top_logprobs", "max_completion_tokens"] if path == CHAT_PATH else []
    assert _text(_post(server, path, {**body, **dict.fromkeys(NULLABLE + extra)})) == plain
    for field, value in (("n", 0), ("presence_penalty", 3), ("min_tokens", -1),
                         ("ignore_eos", "yes"), ("stream", 1)):
        _error(_post(server, path, {**body, field: value}), field)


@pytest.mark.parametrize("key", ["²", "١", "-1", "1.0"])
def test_logit_bias_keys_must_be_ascii_decimal_token_ids(server, key):
    """str.isdigit() takes superscripts and Arabic-Indic digits: "²" failed in int() (a 400
    without a param) and "١" silently biased token 1."""
    err = _error(_post(server, COMPLETIONS_PATH, {**COMPLETION, "logit_bias": {key: 5}}),
                 "logit_bias")
    assert "token ids" in err["message"] and repr(key) in err["message"]


def test_chat_top_logprobs_without_logprobs_is_refused(server):
    for logprobs in ({}, {"logprobs": False}):
        err = _error(_post(server, CHAT_PATH, {**CHAT, **logprobs, "top_logprobs": 2}),
                     "top_logprobs")
        assert "logprobs" in err["message"]
    r = _post(server, CHAT_PATH, {**CHAT, "logprobs": True, "top_logprobs": 2})
    assert all(len(e["top_logprobs"]) == 2
               for e in r.json()["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("path,body", BOTH, ids=["completions", "chat"])
def test_stream_options_without_stream_is_refused(server, path, body):
    options = {"stream_options": {"include_usage": True}}
    for stream in ({}, {"stream": False}):
        err = _error(_post(server, path, {**body, **stream, **options}), "stream_options")
        assert "stream" in err["message"]
    usage = _chunks(server, path, {**body, **options})[-1]["usage"]
    assert usage["completion_tokens"] == 4


def test_chat_context_error_names_the_field_the_client_sent(server):
    for field in ("max_completion_tokens", "max_tokens"):
        body = {**CHAT, "max_tokens": None, field: 100000}
        err = _error(_post(server, CHAT_PATH, body), field)
        assert f"{field} is 100000" in err["message"] and "--max-model-len" in err["message"]


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("messages,word", [
    ([{"role": "user"}], "no content"),
    ([{"role": "user", "content": None}], "no content"),
    ([{"role": "user", "content": []}], "no content"),
    ([{"role": "system", "content": None}, *MESSAGES], "no content"),
    ([*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [CALL]}, *MESSAGES],
     "tool"),
    ([*MESSAGES, {"role": "assistant", "content": "x", "tool_calls": [CALL]}, *MESSAGES],
     "tool"),
], ids=["user missing", "user null", "user []", "system null", "tool call, no content",
        "tool call with content"])
def test_chat_messages_without_content_or_with_tool_calls_are_refused(server, messages, word):
    err = _error(_post(server, CHAT_PATH, {**CHAT, "messages": messages}), "messages")
    assert word in err["message"]


def test_chat_messages_with_empty_text_or_no_tool_calls_are_accepted(server):
    for messages in ([{"role": "user", "content": ""}],
                     [*MESSAGES, {"role": "assistant", "content": "Red.", "tool_calls": []},
                      *MESSAGES]):
        assert _post(server, CHAT_PATH, {**CHAT, "messages": messages}).status_code == 200


def test_a_requests_own_chat_template_is_refused(server):
    """As vLLM does by default: a template from the request is code the server would run."""
    template = "{{ messages[0]['content'] }}"
    err = _error(_post(server, CHAT_PATH, {**CHAT, "chat_template": template}), "chat_template")
    assert err["code"] == "unsupported_field"


def test_chat_template_kwargs_reach_the_template(server):
    """They are passed to the render (tokenizer tests show them used); one that would replace
    a variable the render sets is a 400 naming the messages."""
    ok = _post(server, CHAT_PATH, {**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert _text(ok) == _text(_post(server, CHAT_PATH, CHAT))  # SmolLM2's template has no use
    err = _error(_post(server, CHAT_PATH, {**CHAT, "chat_template_kwargs":
                                           {"add_generation_prompt": False}}), "messages")
    assert "own variables" in err["message"]


def test_chat_template_fields_and_echo_with_their_default_are_accepted(server):
    defaults = {"add_generation_prompt": True, "continue_final_message": False,
                "chat_template": None, "chat_template_kwargs": {}, "echo": False}
    assert _text(_post(server, CHAT_PATH, {**CHAT, **defaults})) == \
        _text(_post(server, CHAT_PATH, CHAT))


@pytest.mark.parametrize("path,body", BOTH, ids=["completions", "chat"])
def test_stop_token_ids_outside_the_vocabulary_are_refused(server, path, body):
    err = _error(_post(server, path, {**body, "stop_token_ids": [2, 10**9]}), "stop_token_ids")
    assert "vocabulary size 49152" in err["message"] and str(10**9) in err["message"]
