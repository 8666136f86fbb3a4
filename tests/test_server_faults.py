"""The server under faults: bad requests, auth, a full queue, engine errors, and a load test
with clients disconnecting mid-stream. A random-weight tiny model (no tokenizer: prompts are
token ids) keeps it fast."""

from __future__ import annotations

import asyncio
import random
import re

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from draftgraph.server.cli import build_server  # noqa: E402
from draftgraph.server.config import ServerConfig  # noqa: E402
from draftgraph.server.launcher import ServerThread  # noqa: E402

API_KEY = "sekret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny"


def _start(max_num_seqs: int = 16, max_waiting: int = 1024, kv_cache_tokens: int = 4096,
           api_key: str | None = API_KEY):
    config = EngineConfig(model="random:tiny", device="cpu",
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                    max_num_batched_tokens=256,
                                                    max_waiting=max_waiting,
                                                    max_model_len=512),
                          cache=CacheConfig(kv_cache_tokens=kv_cache_tokens))
    app, async_engine = build_server(config, ServerConfig(api_key=api_key,
                                                          served_model_names=[MODEL]))
    return ServerThread(app).start(), async_engine


@pytest.fixture(scope="module")
def server():
    st, async_engine = _start()
    yield st, async_engine
    st.stop()


def _metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if labels in m.group(1):
            total += float(m.group(2))
    return total


def _wait_idle(base_url: str, async_engine, timeout: float = 20.0) -> None:
    import time

    engine = async_engine.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (not engine.has_unfinished() and async_engine.num_active_streams == 0
                and engine.num_free_kv_slots() == engine.slots.allocator.usable_slots):
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {engine.num_free_kv_slots()} of "
                         f"{engine.slots.allocator.usable_slots} KV slots free, "
                         f"{async_engine.num_active_streams} streams")


# ---- bad requests ----------------------------------------------------------------------------
GOOD = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

BAD_REQUESTS = [
    # (name, path, body (dict or raw bytes), headers, status, error type, param)
    ("max_tokens wrong type", "/v1/completions", {**GOOD, "max_tokens": "many"}, AUTH, 400,
     "invalid_request_error", "max_tokens"),
    ("negative max_tokens", "/v1/completions", {**GOOD, "max_tokens": -3}, AUTH, 400,
     "invalid_request_error", "max_tokens"),
    ("temperature wrong type", "/v1/completions", {**GOOD, "temperature": "hot"}, AUTH, 400,
     "invalid_request_error", "temperature"),
    ("top_p out of range", "/v1/completions", {**GOOD, "top_p": 1.5}, AUTH, 400,
     "invalid_request_error", "top_p"),
    ("stream wrong type", "/v1/completions", {**GOOD, "stream": "yes"}, AUTH, 400,
     "invalid_request_error", "stream"),
    ("prompt missing", "/v1/completions", {"model": MODEL}, AUTH, 400,
     "invalid_request_error", "prompt"),
    ("prompt wrong type", "/v1/completions", {**GOOD, "prompt": {"a": 1}}, AUTH, 400,
     "invalid_request_error", "prompt"),
    ("empty prompt", "/v1/completions", {**GOOD, "prompt": []}, AUTH, 400,
     "invalid_request_error", "prompt"),
    ("token id out of vocabulary", "/v1/completions", {**GOOD, "prompt": [1, 10**6]}, AUTH,
     400, "invalid_request_error", "prompt"),
    ("huge prompt", "/v1/completions", {**GOOD, "prompt": [3] * 5000}, AUTH, 400,
     "invalid_request_error", "prompt"),
    ("max_tokens past the context", "/v1/completions", {**GOOD, "max_tokens": 100000}, AUTH,
     400, "invalid_request_error", "max_tokens"),
    ("max_tokens 0 without echo", "/v1/completions", {**GOOD, "max_tokens": 0}, AUTH, 400,
     "invalid_request_error", "max_tokens"),
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": [1,', AUTH, 400,
     "invalid_request_error", None),
    ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, AUTH, 400,
     "invalid_request_error", "messages"),
    ("bad role", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, AUTH, 400,
     "invalid_request_error", None),
    ("chat without a tokenizer", "/v1/chat/completions", CHAT, AUTH, 400,
     "invalid_request_error", "messages"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-9"}, AUTH, 404,
     "invalid_request_error", "model"),
    ("missing key", "/v1/completions", GOOD, {}, 401, "authentication_error", None),
    ("wrong key", "/v1/completions", GOOD, {"Authorization": "Bearer nope"}, 401,
     "authentication_error", None),
    ("wrong key on models", "/v1/models", None, {"Authorization": "Bearer nope"}, 401,
     "authentication_error", None),
    ("tokenizer_info without a tokenizer", "/tokenizer_info", None, AUTH, 404,
     "not_found_error", None),
    ("wrong key on tokenizer_info", "/tokenizer_info", None, {"Authorization": "Bearer nope"},
     401, "authentication_error", None),
]


@pytest.mark.parametrize("name,path,body,headers,status,err_type,param", BAD_REQUESTS,
                         ids=[r[0] for r in BAD_REQUESTS])
def test_bad_request_gets_openai_error_body(server, name, path, body, headers, status,
                                            err_type, param):
    st, _ = server
    url = st.base_url + path
    if body is None:
        r = httpx.get(url, headers=headers)
    elif isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={**headers,
                                                   "Content-Type": "application/json"})
    else:
        r = httpx.post(url, json=body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == err_type
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    # the server keeps serving after every refusal
    ok = httpx.post(st.base_url + "/v1/completions", json=GOOD, headers=AUTH)
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] >= 1


def test_health_metrics_and_models_are_served(server):
    st, _ = server
    assert httpx.get(st.base_url + "/health").json() == {"status": "ok"}
    models = httpx.get(st.base_url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 512
    text = httpx.get(st.base_url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        assert name in text, name
    for kind in ("decode", "spec", "ahead", "extend"):  # the engine's steps by kind
        assert f'vllm:engine_steps_total{{kind="{kind}",model_name="{MODEL}"}}' in text


def test_token_id_completion_counts_tokens_and_logprobs(server):
    st, _ = server
    r = httpx.post(st.base_url + "/v1/completions", headers=AUTH,
                   json={**GOOD, "max_tokens": 7, "ignore_eos": True, "temperature": 0,
                         "logprobs": 1})
    body = r.json()
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == 7 and all(lp <= 0 for lp in lps)


# ---- queue full, engine errors -----------------------------------------------------------------
def test_full_queue_gets_503_with_retry_after_and_others_are_served():
    st, async_engine = _start(max_num_seqs=1, max_waiting=1, api_key=None)
    try:
        url = st.base_url + "/v1/completions"
        long = {"model": MODEL, "prompt": [4, 5], "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", url, json=long) as running:
                assert running.status_code == 200
                lines = running.iter_lines()
                next(line for line in lines if line.startswith("data:"))  # it is decoding
                with client.stream("POST", url, json=long) as waiting:
                    assert waiting.status_code == 200
                    # the engine moves the second request from its inbox to `waiting`
                    r = client.post(url, json={**GOOD, "max_tokens": 1})
                    assert r.status_code == 503, r.text
                    assert r.headers["Retry-After"] == "1"
                    assert r.json()["error"]["code"] == "queue_full"
            # both streams closed mid-way: aborted, the queue drains, new requests are served
            _wait_idle(st.base_url, async_engine)
            r = client.post(url, json={**GOOD, "max_tokens": 3})
            assert r.status_code == 200
            assert r.json()["usage"]["completion_tokens"] >= 1
        text = httpx.get(st.base_url + "/metrics").text
        assert _metric(text, "vllm:request_success_total", 'finished_reason="abort"') == 2
    finally:
        st.stop()


def test_engine_error_fails_the_request_with_500_and_the_loop_keeps_serving(server, caplog):
    st, async_engine = server
    engine = async_engine.engine
    url = st.base_url + "/v1/completions"
    # a failing forward: the engine fails the batch's requests
    real_forward = engine.target.forward
    calls = {"n": 0}

    def broken_forward(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom in forward")
        return real_forward(batch)

    engine.target.forward = broken_forward
    try:
        r = httpx.post(url, json=GOOD, headers=AUTH)
    finally:
        engine.target.forward = real_forward
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "boom in forward" in err["message"]
    assert re.search(r"cmpl-[0-9a-f]+", err["message"])

    # an exception escaping step() itself: the async engine fails in-flight requests
    real_schedule = engine.scheduler.schedule
    calls["n"] = 0

    def broken_schedule(drafts):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom in scheduler")
        return real_schedule(drafts)

    engine.scheduler.schedule = broken_schedule
    try:
        r = httpx.post(url, json=GOOD, headers=AUTH)
    finally:
        engine.scheduler.schedule = real_schedule
    assert r.status_code == 500
    assert async_engine.is_running
    r = httpx.post(url, json=GOOD, headers=AUTH)
    assert r.status_code == 200
    _wait_idle(st.base_url, async_engine)


# ---- load test ---------------------------------------------------------------------------------
def test_load_with_disconnecting_clients_frees_every_kv_slot(server):
    """64 concurrent streaming clients, 500 requests, a quarter disconnecting at a random
    point: each request completes or is aborted, no 5xx, and afterwards the KV pool is empty."""
    st, async_engine = server
    url = st.base_url + "/v1/completions"
    rng = random.Random(0)
    num_requests, concurrency = 500, 64
    before = httpx.get(st.base_url + "/metrics").text
    results: list[str] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 40))]
        max_tokens = rng.randrange(4, 17)
        disconnect_after = rng.randrange(1, max_tokens) if i % 4 == 0 else None
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0.8, "seed": i}
        async with client.stream("POST", url, json=body, headers=AUTH) as r:
            assert r.status_code == 200, await r.aread()
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    results.append("completed")
                    return
                assert '"error"' not in line, line
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    results.append("disconnected")
                    return  # leaving the block closes the connection mid-stream
        results.append("truncated")

    async def main() -> None:
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            async def bounded(i: int) -> None:
                async with sem:
                    await one(client, i)

            await asyncio.gather(*[bounded(i) for i in range(num_requests)])

    asyncio.run(main())
    assert len(results) == num_requests
    assert "truncated" not in results
    assert results.count("completed") + results.count("disconnected") == num_requests
    assert results.count("disconnected") > 0

    _wait_idle(st.base_url, async_engine)
    engine = async_engine.engine
    assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots
    assert httpx.get(st.base_url + "/health").json() == {"status": "ok"}
    after = httpx.get(st.base_url + "/metrics").text
    finished = {reason: _metric(after, "vllm:request_success_total", f'"{reason}"')
                - _metric(before, "vllm:request_success_total", f'"{reason}"')
                for reason in ("length", "abort", "error", "stop")}
    assert finished["error"] == 0
    # a disconnect may race with the last token, so it can still finish by length
    assert finished["length"] + finished["abort"] == num_requests
    assert finished["abort"] >= 1
    assert _metric(after, "vllm:http_request_errors_total", 'status="5') == \
        _metric(before, "vllm:http_request_errors_total", 'status="5')
    assert _metric(after, "vllm:num_requests_running") == 0
    assert _metric(after, "vllm:kv_cache_usage_perc") == 0


def test_the_served_socket_turns_nagle_off_on_every_connection():
    """`draftgraph serve` hands uvicorn its own bound socket; asyncio sets TCP_NODELAY on the
    connections it accepts only when that socket's proto says TCP. With proto 0 every
    response after a connection's first waited ~40 ms (Nagle's algorithm against the
    client's delayed ACK): 48 vs 3 ms for a one-token request over keep-alive."""
    import socket

    from draftgraph.server.cli import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    sock.listen()

    async def accepted_nodelay() -> int:
        seen = asyncio.get_running_loop().create_future()

        async def on_connection(reader, writer) -> None:
            s = writer.get_extra_info("socket")
            seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            value = await asyncio.wait_for(seen, 30)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0
