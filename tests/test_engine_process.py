"""The engine in its own process (server/engine_process.py) behind the OpenAI server, on the
CPU with the default model: the same greedy tokens as the engine in this process, streamed and
not; counters and KV state from the engine's messages; the queue limit counted by the client;
a dead engine process ending every stream with an error; a model that cannot load reported
before the server starts."""

from __future__ import annotations

import json
import pickle
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from draftgraph.config import EngineConfig, SchedulerConfig  # noqa: E402
from draftgraph.engine.errors import EngineError, QueueFullError  # noqa: E402
from draftgraph.engine.request import RequestOutput  # noqa: E402
from draftgraph.engine.sampling import SamplingParams  # noqa: E402
from draftgraph.server.app import build_app  # noqa: E402
from draftgraph.server.config import ServerConfig  # noqa: E402
from draftgraph.server.engine_process import (  # noqa: E402
    EngineClient,
    ProcessAsyncEngine,
    _Sender,
    from_wire,
    to_wire,
)
from draftgraph.server.launcher import ServerThread  # noqa: E402

MODEL = "smol"
PROMPT = "List the planets of the solar system:"


def _config(**sched) -> EngineConfig:
    return EngineConfig(model="default", device="cpu", scheduler=SchedulerConfig(
        max_num_seqs=sched.pop("max_num_seqs", 4), max_model_len=1024, **sched))


@pytest.fixture(scope="module")
def server(default_model):  # default_model: skips when the GGUF is not installed
    ae = ProcessAsyncEngine(EngineClient.start(_config(max_waiting=2)))
    st = ServerThread(build_app(ae, ServerConfig(served_model_names=[MODEL]))).start()
    yield st
    st.stop()
    assert not ae.engine.is_alive  # the engine process exits with the server


def _reference(loaded, prompt: str, max_tokens: int) -> list[int]:
    from draftgraph.engine.engine import LLMEngine

    engine = LLMEngine(_config(), loaded=loaded)
    out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0),
                          use_chat_template=False)[0]
    return out.token_ids


def _stream(base_url: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_wire_drops_the_prompt_and_unfinished_text():
    out = RequestOutput(request_id="r", prompt_token_ids=[1, 2, 3], token_ids=[],
                        new_token_ids=[7], text="hello", delta_text="o", finished=False,
                        finish_reason=None, metrics={"ttft": 0.1})
    back = from_wire(to_wire(out), [1, 2, 3])
    assert back.text == "" and back.delta_text == "o" and back.new_token_ids == [7]
    assert back.prompt_token_ids == [1, 2, 3] and back.metrics == {"ttft": 0.1}
    final = RequestOutput(request_id="r", prompt_token_ids=[1, 2, 3], token_ids=[7, 8],
                          new_token_ids=[8], text="hello!", delta_text="!", finished=True,
                          finish_reason="length")
    assert from_wire(to_wire(final), [1, 2, 3]) == final


def test_the_wire_carries_every_field_the_engine_sets():
    """The short form (a stream's common output) and the long one give back the output as
    the engine made it, but for the text before the final output."""
    plain = RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[], new_token_ids=[7],
                          text="", delta_text="o", finished=False, finish_reason=None)
    logprobs = RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[],
                             new_token_ids=[7], text="", delta_text="o", finished=False,
                             finish_reason=None, logprobs=[], new_logprobs=[-0.5],
                             top_logprobs=[], new_top_logprobs=[[(7, -0.5)]])
    prompt_lps = RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[],
                               new_token_ids=[7], text="", delta_text="o", finished=False,
                               finish_reason=None, prompt_logprobs=[None],
                               prompt_top_logprobs=[None], metrics={"ttft": 0.1})
    final = RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[7, 8],
                          new_token_ids=[8], text="ab", delta_text="b", finished=True,
                          finish_reason="stop", logprobs=[-0.5, -0.1], new_logprobs=[-0.1],
                          metrics={"seconds": 1.0})
    failed = RequestOutput.failed("r", "boom")
    failed.prompt_token_ids = [1]
    assert len(to_wire(plain)) < len(to_wire(logprobs)) == len(to_wire(final))
    for out in (plain, logprobs, prompt_lps, final, failed):
        assert from_wire(to_wire(out), [1]) == out


def _out(rid: str, ids: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=rid, prompt_token_ids=[], token_ids=[], new_token_ids=ids,
                         text="", delta_text="".join(chr(97 + i) for i in ids),
                         finished=finished, finish_reason="length" if finished else None)


def test_the_sender_merges_what_queued_while_the_pipe_was_full():
    sent, gate = [], threading.Event()

    class Pipe:  # a pipe the server process does not read until `gate`
        def send_bytes(self, data):  # as Connection.recv reads it
            gate.wait(10)
            sent.append(pickle.loads(data))

    sender = _Sender([Pipe()])
    sender.put(("out", [_out("a", [1])], "snapshot 1"))  # taken at once, then blocked
    time.sleep(0.2)
    sender.put(("out", [_out("a", [2]), _out("b", [5])], "snapshot 2"))
    sender.put(("out", [_out("a", [3, 4], finished=True)], "snapshot 3"))
    sender.put(("failed", "boom"))
    sender.put(("out", [_out("b", [6])], "snapshot 4"))
    gate.set()
    sender.close()
    assert [m[0] for m in sent] == ["out", "out", "failed", "out"]
    first = [from_wire(t, []) for t in sent[0][1]]
    assert [(o.request_id, o.new_token_ids) for o in first] == [("a", [1])]
    merged = {o.request_id: o for o in (from_wire(t, []) for t in sent[1][1])}
    assert merged["a"].new_token_ids == [2, 3, 4] and merged["a"].finished
    assert merged["a"].delta_text == "cde" and merged["b"].new_token_ids == [5]
    assert sent[1][2] == "snapshot 3"  # the latest counters
    assert [from_wire(t, []).new_token_ids for t in sent[3][1]] == [[6]]


def test_served_tokens_equal_the_engine_in_process(server, default_model):
    ref = _reference(default_model, PROMPT, 24)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == ref and len(ref) == 24
    chunks = _stream(server.base_url, {**body, "stream": True})
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert streamed == ref
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == choice["text"]
    assert len(chunks) > 2  # streamed as it was generated, not in one piece


def test_counters_and_kv_state_come_from_the_engine_process(server):
    r = httpx.post(server.base_url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    info = httpx.get(server.base_url + "/info").json()
    assert info["free_kv_slots"] == info["kv_slots"] > 0  # every slot back after the request
    metrics = httpx.get(server.base_url + "/metrics").text
    line = next(ln for ln in metrics.splitlines()
                if ln.startswith("vllm:generation_tokens_total"))
    assert float(line.split()[-1]) >= 5


def test_the_queue_limit_is_counted_in_the_server_process(server):
    client: EngineClient = server.app.state.server.ae.engine
    limit = 4 + 2  # --max-num-seqs + --max-waiting of the fixture
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True}
    streams = [httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120)
               for _ in range(limit)]
    try:
        for s in streams:
            assert s.__enter__().status_code == 200
        assert client.num_in_flight() == limit
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 503 and "max-waiting" in r.json()["error"]["message"]
    finally:
        for s in streams:
            s.__exit__(None, None, None)  # client gone: the server aborts its request
    deadline = time.monotonic() + 60
    while client.num_in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.num_in_flight() == 0
    with pytest.raises(QueueFullError):
        for _ in range(limit + 1):
            client.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    for rid in list(client._prompts):
        client.abort(rid)


def test_a_model_that_cannot_load_is_reported_before_serving():
    with pytest.raises(EngineError, match="no-such-preset"):
        EngineClient.start(EngineConfig(model="random:no-such-preset", device="cpu"),
                           timeout_s=120)


def test_a_dead_engine_process_ends_every_stream_with_an_error(default_model):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # --threads 1: the engine process runs with it too
    try:
        ae = ProcessAsyncEngine(EngineClient.start(_config()))
    finally:
        torch.set_num_threads(threads)
    assert ae.engine.num_threads == 1
    with ServerThread(build_app(ae, ServerConfig(served_model_names=[MODEL]))) as st:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "temperature": 0,
                "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", st.base_url + "/v1/completions", json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        ae.engine.process.kill()
        assert events[-1] == "[DONE]" or "error" in events[-1]
        assert any("engine process exited" in e for e in events)
        assert httpx.get(st.base_url + "/health").status_code == 503
        r = httpx.post(st.base_url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503


def test_engine_loop_accounts_its_steps():
    """run_steps counts the steps it ran and the time in them and in emitting their outputs."""
    from draftgraph.server.async_engine import run_steps

    class Fake:
        def __init__(self):
            self.left = 3

        def has_unfinished(self):
            return self.left > 0

        def step(self):
            self.left -= 1
            time.sleep(0.01)
            return [RequestOutput(request_id="r", prompt_token_ids=[], token_ids=[],
                                  new_token_ids=[1], text="", delta_text="", finished=False,
                                  finish_reason=None)]

    stop, wake, emitted = threading.Event(), threading.Event(), []

    def emit(outputs):
        emitted.append(outputs)
        time.sleep(0.005)
        if len(emitted) == 3:
            stop.set()

    times = run_steps(Fake(), stop, wake, emit, lambda message: None)
    assert times.steps == 3 and len(emitted) == 3
    assert 0.03 <= times.step_s < 1.0 and 0.015 <= times.emit_s < 1.0
    assert "3 steps" in times.summary()
