"""The engine in its own process: the server's default on a GPU (`serve --engine-process`).

In one process the event loop (HTTP parsing, JSON, SSE writes: some tens of microseconds per
streamed chunk) and the engine thread share one GIL, so at 64 streams a step waited on ~64
chunks' worth of Python (measured on the H200: 0.60 / 0.45 of offline throughput at
concurrency 64, smollm2-135m / llama-3.2-1b). vLLM (EngineCore) and SGLang (the scheduler
process) run the engine loop in a process of its own; so does this:

    server process                                   engine process (spawned)
    EngineClient: facts, admission checks,  ─cmd─▶  receiver thread: add_request / abort
      in-flight count (queue limit)                 main thread: run_steps(LLMEngine)
    ProcessAsyncEngine: reader thread  ◀─out──────  sender thread: what the steps emitted
      → event loop (_dispatch, as in-thread)        since its last send, merged per request,
                                                    + running / waiting / free KV / counters

The server process keeps what it reads of the engine (`EngineClient`: config, model config,
context, KV capacity, tokenizer, sent once when the engine is up), tokenises and checks every
request itself (`admission.admit`, the engine's own checks), and counts its requests in flight
for the queue limit, so a refusal is still an immediate 4xx / 503. Outputs cross as tuples
without the prompt's ids (the client re-attaches them) and without the accumulated text
except in a request's final output (streams read `delta_text`). When the server process
lags, the sender merges a request's outputs of several steps into one, so the server's work
per step shrinks and the engine never waits for it.

When the engine process dies, every stream ends with an error and `/health` turns 503; when
the server process goes away, the engine process sees its command pipe close and exits.

`serve --api-server-count N` runs N server processes on one listening socket (the kernel hands
each connection to one of them), each with its own pipe pair to the one engine process: the
receiver waits on every command pipe, notes which one a request came on, and the sender
routes its outputs back there (every pipe gets the counters). The first server process
(the primary) started the engine and stops it, after the others; another one going away only
aborts the requests it sent (and one left without an engine exits). Each sends its request
metrics to the others through the engine every second (`ServerMetrics.state`), so any one's
/metrics counts them all. Measured on the H200 (`benchmarks/NOTES.md`): 4 processes served
a 135M model's 128 streams at 33.8k tokens/s against 21-28k for one; no change at 64 streams.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import operator
import pickle
import signal
import threading
import time
from collections import deque

import torch

from draftgraph.engine.errors import EngineError, QueueFullError
from draftgraph.engine.request import RequestOutput
from draftgraph.engine.sampling import SamplingParams
from draftgraph.server.async_engine import AsyncEngine, merge_outputs, run_steps

logger = logging.getLogger(__name__)

# RequestOutput's fields as they cross the pipe, all but the prompt's ids: the head alone for
# the common output (a stream's tokens and text, nothing else asked), the tail too when the
# output is final (its text, sent in the final output only) or carries logprobs or an error.
# Fewer fields, less pickling: the sender's time holds the GIL the engine's host loop needs
WIRE_HEAD = ("request_id", "new_token_ids", "delta_text", "finished", "finish_reason",
             "metrics")
WIRE_TAIL = ("token_ids", "logprobs", "new_logprobs", "top_logprobs", "new_top_logprobs",
             "prompt_logprobs", "prompt_top_logprobs", "error", "text")
_wire_head = operator.attrgetter(*WIRE_HEAD)
_wire_tail = operator.attrgetter(*WIRE_TAIL)


def to_wire(out: RequestOutput) -> tuple:
    if out.finished:
        return _wire_head(out) + _wire_tail(out)
    if out.logprobs is None and out.prompt_logprobs is None and out.error is None:
        return _wire_head(out)  # token_ids [] and text "" before the final output
    return _wire_head(out) + _wire_tail(out)[:-1] + ("",)


def from_wire(t: tuple, prompt_token_ids: list[int]) -> RequestOutput:
    if len(t) == len(WIRE_HEAD):
        rid, new_ids, delta, finished, reason, metrics = t
        return RequestOutput(request_id=rid, prompt_token_ids=prompt_token_ids, token_ids=[],
                             new_token_ids=new_ids, text="", delta_text=delta,
                             finished=finished, finish_reason=reason, metrics=metrics)
    return RequestOutput(prompt_token_ids=prompt_token_ids,
                         **dict(zip(WIRE_HEAD + WIRE_TAIL, t, strict=True)))

_FINISHED_AT = WIRE_HEAD.index("finished")


# ---- engine process ------------------------------------------------------------------------


def _facts(engine) -> dict:
    """What the server process reads of the engine (EngineClient's attributes)."""
    return {"config": engine.config, "model_config": engine.model_config,
            "max_model_len": engine.max_model_len, "spec_k": engine.spec_k,
            "kv_capacity": engine.kv_capacity, "kv_page_size": engine.kv_page_size,
            "tokenizer": engine.tokenizer, "source": engine.source,
            "num_threads": torch.get_num_threads()}


def _snapshot(engine) -> tuple:
    return (engine.num_running(), engine.num_waiting(), engine.num_free_kv_slots(),
            dict(engine.stats, accepted_per_pos=list(engine.stats["accepted_per_pos"])))


class _Sender:
    """The engine process's outgoing messages, sent by a thread of their own: the engine loop
    queues each step's outputs and goes on; the thread sends what has queued since its last
    send as one message per API-server process, a request's consecutive outputs merged into
    one (`merge_outputs`). So when a server process falls behind (a full pipe), its work per
    step shrinks instead of the engine waiting for it: fewer, larger outputs, no token lost
    or reordered. `owner` maps a request id to the index of the pipe it came on (absent: 0);
    every pipe gets every message's counters, a pipe whose process has gone is skipped."""

    def __init__(self, pipes: list, owner: dict[str, int] | None = None) -> None:
        self.pipes: list = list(pipes)  # None once its process is gone
        self.owner = owner if owner is not None else {}
        self.pending: deque = deque()
        self.ready = threading.Event()
        self.cpu_s = 0.0  # the thread's CPU time, when it has stopped
        self.thread = threading.Thread(target=self._run, name="draftgraph-sender", daemon=True)
        self.thread.start()

    def put(self, item: tuple) -> None:
        """("out", outputs, snapshot), ("failed", message), ("bye", pipe index): that API
        server detached, its pipe is closed after what was queued before; ("metrics", pipe
        index, state): that API server's request metrics, for every other one; ("stop",)."""
        self.pending.append(item)
        self.ready.set()

    def _run(self) -> None:
        outputs: dict[str, list[RequestOutput]] = {}  # request id -> its outputs, in order
        snapshot = None
        while True:
            self.ready.wait()
            self.ready.clear()
            while self.pending:
                item = self.pending.popleft()
                if item[0] == "out":
                    for out in item[1]:
                        outputs.setdefault(out.request_id, []).append(out)
                    snapshot = item[2]
                    continue
                self._flush(outputs, snapshot)
                if item[0] == "stop":
                    self.cpu_s = time.thread_time()
                    return
                if item[0] == "bye":
                    self._send(item[1], ("bye",))
                    if self.pipes[item[1]] is not None:
                        self.pipes[item[1]].close()
                        self.pipes[item[1]] = None
                    continue
                if item[0] == "metrics":
                    for i in range(len(self.pipes)):
                        if i != item[1]:
                            self._send(i, item)
                    continue
                for i in range(len(self.pipes)):  # "failed": after the outputs queued before
                    self._send(i, item)
            self._flush(outputs, snapshot)

    def _flush(self, outputs: dict, snapshot) -> None:
        if not outputs:
            return
        per_pipe: list[list[tuple]] = [[] for _ in self.pipes]
        for rid, outs in outputs.items():
            last = outs[-1]
            i = self.owner.pop(rid, 0) if last.finished else self.owner.get(rid, 0)
            per_pipe[i].append(to_wire(merge_outputs(outs[0], outs[1:])))
        outputs.clear()
        for i, wire in enumerate(per_pipe):
            self._send(i, ("out", wire, snapshot))

    def _send(self, i: int, msg: tuple) -> None:
        pipe = self.pipes[i]
        if pipe is None:
            return
        try:
            # plain pickle + send_bytes (what `recv` on the other end unpickles): the
            # Connection's own `send` pickles through ForkingPickler, whose dispatch table is
            # consulted per object: 64 outputs' message 121 -> 63 us of this thread's CPU on
            # the CPU machine, 175 -> 143 us with the write
            pipe.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, ValueError):  # that API server is gone; the receiver aborts its work
            self.pipes[i] = None

    def close(self) -> None:
        self.put(("stop",))
        self.thread.join(10)


def _engine_main(config, links: list, log_level: int, num_threads: int) -> None:
    """The engine process: build the engine, tell every API server it is ready (or why it
    failed), then step. `links`: (commands, results) pipe ends, one pair per API-server
    process; the first is the primary's, whose "shutdown" (or going away) stops the engine."""
    from multiprocessing.connection import wait

    from draftgraph.engine.engine import LLMEngine
    from draftgraph.engine.stats import step_accounts

    torch.set_num_threads(num_threads)  # the server process's (--threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process decides when to stop
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("draftgraph").setLevel(log_level)
    try:
        engine = LLMEngine(config)
        ready = ("ready", _facts(engine))
    except BaseException as e:  # noqa: BLE001 - reported to the server process, which exits
        ready = ("error", f"{type(e).__name__}: {e}")
    for _, results in links:
        try:
            results.send(ready)
        except (OSError, ValueError):
            pass
    if ready[0] == "error":
        return
    owner: dict[str, int] = {}  # request id -> the link it came on (0 not stored)
    sender = _Sender([results for _, results in links], owner)
    stop, wake = threading.Event(), threading.Event()
    receiver_cpu_s = [0.0]

    def detach(i: int) -> None:
        """API server i is gone: abort the requests it sent (its streams are gone with it)."""
        for rid in [rid for rid, j in list(owner.items()) if j == i]:
            engine.abort(rid)

    # adds read and their seconds from the API server's send to this engine's queue (the
    # pipe, and the receiver thread's wait for the GIL the step loop holds)
    adds = {"n": 0, "wait_s": 0.0}

    def receive() -> None:
        index = {id(commands): i for i, (commands, _) in enumerate(links)}
        open_ = [commands for commands, _ in links]
        while open_ and not stop.is_set():
            for commands in wait(open_):
                i = index[id(commands)]
                try:
                    msg = commands.recv()
                except (EOFError, OSError):  # that API server's process is gone
                    msg = ("detach",)
                if msg[0] == "add":
                    _, ids, params, request_id, arrival, sent = msg
                    if i:
                        owner[request_id] = i
                    try:
                        engine.add_request(ids, params, request_id=request_id,
                                           use_chat_template=False, arrival_time=arrival)
                    except Exception as e:  # noqa: BLE001 - the client checked; end this one
                        sender.put(("out", [RequestOutput.failed(request_id, str(e))],
                                    _snapshot(engine)))
                    adds["n"] += 1
                    adds["wait_s"] += time.perf_counter() - sent
                elif msg[0] == "abort":
                    engine.abort(msg[1])
                elif msg[0] == "metrics":
                    sender.put(("metrics", i, msg[1]))
                    continue
                elif msg[0] == "detach" and i:
                    open_.remove(commands)
                    detach(i)
                    sender.put(("bye", i))
                else:  # "shutdown", or the primary gone
                    stop.set()
                    break
                wake.set()
        receiver_cpu_s[0] = time.thread_time()
        stop.set()
        wake.set()

    threading.Thread(target=receive, name="draftgraph-commands", daemon=True).start()
    times = run_steps(engine, stop, wake,
                      lambda outputs: sender.put(("out", outputs, _snapshot(engine))),
                      lambda message: sender.put(("failed", message)))
    sender.close()
    logger.info("%s; by kind %s; CPU s: sender thread %.2f, receiver %.2f; %d requests, "
                "%.2f ms each from the API server's send to the engine's queue",
                times.summary(), step_accounts(engine.stats), sender.cpu_s,
                receiver_cpu_s[0], adds["n"], 1e3 * adds["wait_s"] / max(adds["n"], 1))
    engine.shutdown()


# ---- server process ------------------------------------------------------------------------


class EngineClient:
    """An API server's handle on an engine in another process: the attributes the server and
    `admission` read, requests checked here and sent, the engine's counters as of its last
    message. Thread-safe like LLMEngine's add_request / abort.

    With several API-server processes (`serve --api-server-count N`) each holds one: the
    primary's (`start`) owns the engine process and stops it; the others' (`attach`) only
    detach. Each counts its own requests in flight against its share (1 / N, rounded down)
    of the queue limit, --max-num-seqs + --max-waiting, so a refusal is an immediate 503."""

    def __init__(self, process, commands, results, facts: dict,
                 num_api_servers: int = 1) -> None:
        self.process = process  # None in a secondary API server: the primary owns it
        self.commands = commands
        self.results = results
        self.config = facts["config"]
        self.model_config = facts["model_config"]
        self.max_model_len = facts["max_model_len"]
        self.spec_k = facts["spec_k"]
        self.kv_capacity = facts["kv_capacity"]
        self.kv_page_size = facts["kv_page_size"]
        self.tokenizer = facts["tokenizer"]
        self.source = facts["source"]
        self.num_threads = facts["num_threads"]  # torch's, in the engine process
        sched = self.config.scheduler
        # rounded down: the shares never add up to more than the engine itself admits
        self.max_in_flight = max(1, (sched.max_num_seqs + sched.max_waiting) // num_api_servers)
        self.stats: dict = {}
        self._counts = (0, 0, self.kv_capacity)  # running, waiting, free KV slots
        self._prompts: dict[str, list[int]] = {}  # requests in flight: their prompt ids
        self._send_lock = threading.Lock()
        self.closed = False
        self._gone = False  # the engine's pipe closed (a secondary's only sign of its death)
        self.num_api_servers = num_api_servers
        self.peer_metrics: dict[int, dict] = {}  # the other API servers' request metrics
        self.links: list[tuple] = []  # the primary: the other API servers' (commands, results)
        self.api_servers: list = []  # the primary: their processes, stopped before the engine
        self.drain_s = 0.0  # their --shutdown-timeout: how long each may take to stop

    @classmethod
    def start(cls, config, log_level: int = logging.INFO, timeout_s: float | None = None,
              num_api_servers: int = 1) -> EngineClient:
        """Spawn the engine process (torch's thread count and the environment, so the weight
        cache switch, go with it) and wait until its engine is built; EngineError with the
        engine's own message when it could not be. With num_api_servers > 1 the other API
        servers' pipe ends are in `links`, for `attach` in their processes."""
        if num_api_servers < 1:
            raise ValueError(f"num_api_servers must be >= 1, got {num_api_servers}")
        ctx = mp.get_context("spawn")  # CUDA cannot be initialised in a forked child
        ours, theirs = [], []
        for _ in range(num_api_servers):
            commands_recv, commands = ctx.Pipe(duplex=False)
            results, results_send = ctx.Pipe(duplex=False)
            ours.append((commands, results))
            theirs.append((commands_recv, results_send))
        process = ctx.Process(target=_engine_main, name="draftgraph-engine",
                              args=(config, theirs, log_level, torch.get_num_threads()))
        process.start()
        for commands_recv, results_send in theirs:
            commands_recv.close()
            results_send.close()
        commands, results = ours[0]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not results.poll(0.1):
            if not process.is_alive():
                raise EngineError(f"the engine process exited with code {process.exitcode} "
                                  "before it was ready (see its log above)")
            if deadline is not None and time.monotonic() > deadline:
                process.kill()
                raise EngineError(f"the engine was not ready within {timeout_s:.0f} s")
        kind, payload = results.recv()
        if kind == "error":
            process.join(10)
            raise EngineError(payload)
        client = cls(process, commands, results, payload, num_api_servers)
        client.links = ours[1:]
        return client

    @classmethod
    def attach(cls, commands, results, num_api_servers: int) -> EngineClient:
        """In a secondary API server's process: the handle on the engine the primary
        started, from the pipe ends the primary passed (`links`)."""
        kind, payload = results.recv()  # the engine sends "ready" on every pipe
        if kind == "error":
            raise EngineError(payload)
        return cls(None, commands, results, payload, num_api_servers)

    # ---- what the server reads ---------------------------------------------------------
    def encode_prompt(self, prompt, use_chat_template: bool = True,
                      add_special_tokens: bool | None = None, **chat) -> list[int]:
        from draftgraph.engine import admission

        return admission.encode_prompt(self, prompt, use_chat_template, add_special_tokens,
                                       **chat)

    def num_running(self) -> int:
        return self._counts[0]

    def num_waiting(self) -> int:
        return self._counts[1]

    def num_free_kv_slots(self) -> int:
        return self._counts[2]

    def kv_usage(self) -> float:
        return 1.0 - self._counts[2] / self.kv_capacity

    def num_in_flight(self) -> int:
        return len(self._prompts)

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, use_chat_template: bool = True,
                    arrival_time: float | None = None) -> str:
        """As LLMEngine.add_request (arrival_time: a time.perf_counter() of this process,
        the system's monotonic clock, which the engine process reads too): checked here,
        then sent; QueueFullError when the requests in flight fill --max-num-seqs +
        --max-waiting (what the engine's own check amounts to)."""
        import uuid

        from draftgraph.engine import admission

        ids, params = admission.admit(self, prompt, params or SamplingParams(),
                                      use_chat_template)
        if len(self._prompts) + 1 > self.max_in_flight:
            share = (f" (this API server's share of {self.num_api_servers}: "
                     f"{self.max_in_flight} requests in flight)"
                     if self.num_api_servers > 1 else "")
            raise QueueFullError(f"{self.config.scheduler.max_waiting} requests are waiting "
                                 f"(--max-waiting){share}; retry later")
        request_id = request_id or uuid.uuid4().hex
        self._prompts[request_id] = ids
        try:
            self._send(("add", ids, params, request_id, arrival_time, time.perf_counter()))
        except BaseException:
            self._prompts.pop(request_id, None)
            raise
        return request_id

    def send_metrics(self, state: dict) -> None:
        """This API server's request metrics, for the others (through the engine process)."""
        self._send(("metrics", state))

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except EngineError:
            self._prompts.pop(request_id, None)  # no engine left to report its end

    def _send(self, msg) -> None:
        try:
            with self._send_lock:
                self.commands.send(msg)
        except (OSError, ValueError) as e:  # pipe closed: the engine process is gone
            raise EngineError("the engine process is not running") from e

    def receive(self) -> tuple[str, object]:
        """The next message of the engine process, decoded: ("out", outputs),
        ("failed", message) or ("metrics", None) (another API server's, stored in
        `peer_metrics`); EOFError once it has exited. Call from one thread."""
        try:
            msg = self.results.recv()
        except (EOFError, OSError):
            self._gone = True
            raise
        if msg[0] == "bye":  # detached (close): nothing more will come
            self._gone = True
            raise EOFError
        if msg[0] == "metrics":  # another API server's request metrics (ServerMetrics.peers)
            self.peer_metrics[msg[1]] = msg[2]
            return "metrics", None
        if msg[0] != "out":
            return msg
        outputs = []
        for t in msg[1]:
            rid, finished = t[0], t[_FINISHED_AT]
            prompt = self._prompts.pop(rid, None) if finished else self._prompts.get(rid)
            outputs.append(from_wire(t, prompt if prompt is not None else []))
        running, waiting, free, self.stats = msg[2]
        self._counts = (running, waiting, free)
        return "out", outputs

    def close(self, timeout_s: float = 10.0) -> None:
        """The primary: stop the other API servers (each drains its requests; up to
        `timeout_s` + their --shutdown-timeout), then the engine process: asked first, killed
        when it does not exit in time. A secondary: detach from the engine."""
        if self.closed:
            return
        self.closed = True
        for p in self.api_servers:
            p.terminate()  # SIGTERM: the server drains, as on a SIGTERM of its own
        for p in self.api_servers:
            p.join(timeout_s + self.drain_s)
            if p.is_alive():
                p.kill()
        try:
            self._send(("shutdown",) if self.process is not None else ("detach",))
        except EngineError:
            pass
        if self.process is not None:
            self.process.join(timeout_s)
            if self.process.is_alive():
                logger.warning("the engine process did not exit in %.0f s; killing it",
                               timeout_s)
                self.process.kill()
                self.process.join(5)
        self.commands.close()

    @property
    def is_alive(self) -> bool:
        if self.process is None:
            return not self._gone
        return self.process.is_alive()


class ProcessAsyncEngine(AsyncEngine):
    """AsyncEngine over an EngineClient: its thread reads the engine process's messages
    instead of stepping an engine; everything on the event loop is AsyncEngine's."""

    on_engine_gone = None  # called (reader thread) once the engine process has gone

    def _run(self) -> None:
        client: EngineClient = self.engine
        while not self._stop.is_set():
            try:
                kind, payload = client.receive()
            except (EOFError, OSError):
                if not self._stop.is_set():
                    logger.error("the engine process exited (code %s); failing the requests "
                                 "in flight", client.process.exitcode
                                 if client.process is not None else "unknown")
                    self._call_in_loop(self._fail_all, "the engine process exited")
                    if self.on_engine_gone is not None:
                        self.on_engine_gone()
                return
            if kind == "out":
                self._call_in_loop(self._dispatch, payload)
            elif kind == "metrics":
                continue
            else:  # "failed": a step raised in the engine process
                self.num_step_errors += 1
                self._call_in_loop(self._fail_all, payload)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.engine.close(timeout)  # the reader sees the pipe close and returns
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return super().is_running and self.engine.is_alive
