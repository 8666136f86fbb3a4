"""Several API-server processes on one engine process (`serve --api-server-count N`): each
server's requests get their own outputs (greedy tokens equal the engine in process), a server
that goes away has its requests aborted in the engine while the others keep serving, each
counts its share of the queue limit, and the CLI spawns them on one port."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from draftgraph.config import EngineConfig, SchedulerConfig  # noqa: E402
from draftgraph.engine.errors import QueueFullError  # noqa: E402
from draftgraph.engine.request import RequestOutput  # noqa: E402
from draftgraph.engine.sampling import SamplingParams  # noqa: E402
from draftgraph.server.app import build_app  # noqa: E402
from draftgraph.server.config import ServerConfig  # noqa: E402
from draftgraph.server.engine_process import (  # noqa: E402
    EngineClient,
    ProcessAsyncEngine,
    _Sender,
    from_wire,
)
from draftgraph.server.launcher import ServerThread  # noqa: E402

MODEL = "smol"
PROMPTS = ["List the planets of the solar system:", "def fib(n):", "The capital of France"]


def _config() -> EngineConfig:
    return EngineConfig(model="default", device="cpu", scheduler=SchedulerConfig(
        max_num_seqs=4, max_waiting=20, max_model_len=1024))


def _tokens(base_url: str, prompt: str, max_tokens: int, stream: bool) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "stream": stream}
    if not stream:
        r = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    import json

    ids = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    ids += ch.get("token_ids") or []
    return ids


def test_the_sender_routes_each_request_to_its_server():
    sent: list[list] = [[], []]

    class Pipe:
        def __init__(self, i):
            self.i = i

        def send_bytes(self, data):  # as Connection.recv reads it
            sent[self.i].append(pickle.loads(data))

        def close(self):
            pass

    def out(rid, ids, finished=False):
        return RequestOutput(request_id=rid, prompt_token_ids=[], token_ids=ids,
                             new_token_ids=ids, text="", delta_text="", finished=finished,
                             finish_reason="length" if finished else None)

    owner = {"b": 1}
    sender = _Sender([Pipe(0), Pipe(1)], owner)
    sender.put(("out", [out("a", [1]), out("b", [2], finished=True)], "snap"))
    sender.put(("bye", 1))
    sender.put(("out", [out("a", [3])], "snap 2"))
    sender.close()
    got = [[(m[0], [from_wire(t, []).request_id for t in m[1]] if m[0] == "out" else None)
            for m in msgs] for msgs in sent]
    # every server gets the counters; each only its own requests; after "bye" nothing
    assert got[0] == [("out", ["a"]), ("out", ["a"])]
    assert got[1] == [("out", ["b"]), ("bye", None)]
    assert owner == {}  # a finished request's route is forgotten


def test_two_api_servers_share_one_engine(default_model):
    from draftgraph.engine.engine import LLMEngine

    reference = LLMEngine(_config(), loaded=default_model)
    want = {p: o.token_ids for p, o in zip(PROMPTS, reference.generate(
        PROMPTS, SamplingParams(max_tokens=16, temperature=0), use_chat_template=False),
        strict=True)}
    import asyncio

    primary = EngineClient.start(_config(), num_api_servers=3)
    (commands, results), idle_link = primary.links
    secondary = EngineClient.attach(commands, results, 3)
    assert primary.max_in_flight == secondary.max_in_flight == 8  # (4 + 20) // 3
    ae1, ae2 = ProcessAsyncEngine(primary), ProcessAsyncEngine(secondary)
    # a third server that never serves: it must learn when the engine has gone
    idle = ProcessAsyncEngine(EngineClient.attach(*idle_link, 3))
    gone = threading.Event()
    idle.on_engine_gone = gone.set
    idle.start(asyncio.new_event_loop())
    st1 = ServerThread(build_app(ae1, ServerConfig(served_model_names=[MODEL]))).start()
    st2 = ServerThread(build_app(ae2, ServerConfig(served_model_names=[MODEL]))).start()
    try:
        got, errors = {}, []

        def ask(st, prompt, stream):
            try:
                got[(st.port, prompt, stream)] = _tokens(st.base_url, prompt, 16, stream)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=ask, args=(st, p, s))
                   for st in (st1, st2) for p in PROMPTS for s in (False, True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors
        assert len(got) == 12
        for (_, prompt, _), ids in got.items():
            assert ids == want[prompt], prompt
        # either server's /metrics counts the requests of both (the other's within ~1 s)
        for st in (st1, st2):
            deadline = time.monotonic() + 10
            while _finished(st) < 12 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _finished(st) == 12

        # a request in flight on the second server, which then goes away: the engine aborts
        # it, the first server keeps serving
        rid = secondary.add_request(PROMPTS[0], SamplingParams(max_tokens=500,
                                                               ignore_eos=True),
                                    use_chat_template=False)
        assert rid
        time.sleep(0.5)
        st2.stop()
        assert not ae2.is_running and primary.is_alive
        deadline = time.monotonic() + 60
        while primary.num_running() and time.monotonic() < deadline:
            assert _tokens(st1.base_url, PROMPTS[1], 2, False) == want[PROMPTS[1]][:2]
        assert primary.num_running() == 0  # the abandoned request was aborted
        assert _tokens(st1.base_url, PROMPTS[2], 16, True) == want[PROMPTS[2]]

        # the first server's share of the queue limit
        with pytest.raises(QueueFullError, match="share of 3: 8 requests"):
            for _ in range(primary.max_in_flight + 1):
                primary.add_request([1, 2, 3], SamplingParams(max_tokens=1))
        for r in list(primary._prompts):
            primary.abort(r)
    finally:
        st1.stop()
        st2.stop()
    assert not primary.is_alive  # the primary stopped the engine process
    assert gone.wait(30) and not idle.is_running  # and the idle server heard of it


def test_more_api_servers_need_the_engine_process():
    r = subprocess.run([sys.executable, "-m", "draftgraph.cli", "serve", "random:tiny",
                        "--device", "cpu", "--api-server-count", "2", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--engine-process on" in r.stderr


def test_serve_spawns_api_servers_on_one_port(default_gguf_path, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "draftgraph.cli", "serve", default_gguf_path, "--device", "cpu",
         "--engine-process", "on", "--api-server-count", "3", "--port", "0",
         "--served-model-name", MODEL, "--threads", "1", "--log-level", "warning"],
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        for line in proc.stderr:
            m = re.search(r"serving \S+ on (http://\S+)/v1", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server did not start"
        # fresh connections: the kernel hands them to whichever process accepts first
        deadline = time.monotonic() + 120
        pids = set()
        while len(pids) < 3 and time.monotonic() < deadline:
            with httpx.Client() as c:
                r = c.get(url + "/info", timeout=30)
                assert r.status_code == 200
                pids.add(r.json()["server_pid"])
        assert len(pids) == 3  # three API servers answer on the one port
        with httpx.Client() as c:
            ids = [c.post(url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
                "return_token_ids": True}).json()["choices"][0]["token_ids"] for _ in range(3)]
        assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 8
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode in (0, -15)  # uvicorn re-raises the SIGTERM it drained on
    deadline = time.monotonic() + 30
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_running, pids))  # the other API servers stopped with it


def _finished(st) -> float:
    """Requests finished, by /metrics (vllm:request_success_total, over its reasons)."""
    text = httpx.get(st.base_url + "/metrics", timeout=30).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith("vllm:request_success_total{"))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False
