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
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import operator
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

# RequestOutput's fields as they cross the pipe: all but the prompt's ids, text last (sent in
# the final output only)
WIRE_FIELDS = ("request_id", "token_ids", "new_token_ids", "delta_text", "finished",
               "finish_reason", "logprobs", "new_logprobs", "top_logprobs", "new_top_logprobs",
               "prompt_logprobs", "prompt_top_logprobs", "metrics", "error", "text")
_wire_tuple = operator.attrgetter(*WIRE_FIELDS)


def to_wire(out: RequestOutput) -> tuple:
    t = _wire_tuple(out)
    return t if out.finished else t[:-1] + ("",)


def from_wire(t: tuple, prompt_token_ids: list[int]) -> RequestOutput:
    return RequestOutput(prompt_token_ids=prompt_token_ids, **dict(zip(WIRE_FIELDS, t,
                                                                       strict=True)))


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
    send as one message, a request's consecutive outputs merged into one (`merge_outputs`).
    So when the server process falls behind (a full pipe), its work per step shrinks instead
    of the engine waiting for it: fewer, larger outputs, no token lost or reordered."""

    def __init__(self, results) -> None:
        self.results = results
        self.pending: deque = deque()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="draftgraph-sender", daemon=True)
        self.thread.start()

    def put(self, item: tuple) -> None:
        """("out", outputs, snapshot), ("failed", message), or ("stop",)."""
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
                    return
                self.results.send(item)  # "failed": after the outputs queued before it
            self._flush(outputs, snapshot)

    def _flush(self, outputs: dict, snapshot) -> None:
        if outputs:
            self.results.send(("out", [to_wire(merge_outputs(outs[0], outs[1:]))
                                   for outs in outputs.values()], snapshot))
            outputs.clear()

    def close(self) -> None:
        self.put(("stop",))
        self.thread.join(10)


def _engine_main(config, commands, results, log_level: int, num_threads: int) -> None:
    """The engine process: build the engine, say it is ready (or why it failed), then step."""
    from draftgraph.engine.engine import LLMEngine

    torch.set_num_threads(num_threads)  # the server process's (--threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process decides when to stop
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("draftgraph").setLevel(log_level)
    try:
        engine = LLMEngine(config)
        results.send(("ready", _facts(engine)))
    except BaseException as e:  # noqa: BLE001 - reported to the server process, which exits
        results.send(("error", f"{type(e).__name__}: {e}"))
        return
    sender = _Sender(results)
    stop, wake = threading.Event(), threading.Event()

    def receive() -> None:
        while True:
            try:
                msg = commands.recv()
            except (EOFError, OSError):  # the server process is gone
                break
            if msg[0] == "add":
                _, ids, params, request_id = msg
                try:
                    engine.add_request(ids, params, request_id=request_id,
                                       use_chat_template=False)
                except Exception as e:  # noqa: BLE001 - the client checked; end this one only
                    sender.put(("out", [RequestOutput.failed(request_id, str(e))],
                                _snapshot(engine)))
            elif msg[0] == "abort":
                engine.abort(msg[1])
            else:  # "shutdown"
                break
            wake.set()
        stop.set()
        wake.set()

    threading.Thread(target=receive, name="draftgraph-commands", daemon=True).start()
    times = run_steps(engine, stop, wake,
                      lambda outputs: sender.put(("out", outputs, _snapshot(engine))),
                      lambda message: sender.put(("failed", message)))
    logger.info(times.summary())
    sender.close()
    engine.shutdown()


# ---- server process ------------------------------------------------------------------------


class EngineClient:
    """The server's handle on an engine in another process: the attributes the server and
    `admission` read, requests checked here and sent, the engine's counters as of its last
    message. Thread-safe like LLMEngine's add_request / abort."""

    def __init__(self, process, commands, results, facts: dict) -> None:
        self.process = process
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
        self.stats: dict = {}
        self._counts = (0, 0, self.kv_capacity)  # running, waiting, free KV slots
        self._prompts: dict[str, list[int]] = {}  # requests in flight: their prompt ids
        self._send_lock = threading.Lock()
        self.closed = False

    @classmethod
    def start(cls, config, log_level: int = logging.INFO,
              timeout_s: float | None = None) -> EngineClient:
        """Spawn the engine process (torch's thread count and the environment, so the weight
        cache switch, go with it) and wait until its engine is built; EngineError with the
        engine's own message when it could not be."""
        ctx = mp.get_context("spawn")  # CUDA cannot be initialised in a forked child
        commands_recv, commands = ctx.Pipe(duplex=False)
        results, results_send = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_engine_main, name="draftgraph-engine",
                              args=(config, commands_recv, results_send, log_level,
                                    torch.get_num_threads()))
        process.start()
        commands_recv.close()
        results_send.close()
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
        return cls(process, commands, results, payload)

    # ---- what the server reads ---------------------------------------------------------
    def encode_prompt(self, prompt, use_chat_template: bool = True,
                      add_special_tokens: bool | None = None) -> list[int]:
        from draftgraph.engine import admission

        return admission.encode_prompt(self, prompt, use_chat_template, add_special_tokens)

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
                    request_id: str | None = None, use_chat_template: bool = True) -> str:
        """As LLMEngine.add_request: checked here, then sent; QueueFullError when the
        requests in flight fill --max-num-seqs + --max-waiting (what the engine's own
        check amounts to)."""
        import uuid

        from draftgraph.engine import admission

        ids, params = admission.admit(self, prompt, params or SamplingParams(),
                                      use_chat_template)
        sched = self.config.scheduler
        if len(self._prompts) + 1 > sched.max_num_seqs + sched.max_waiting:
            raise QueueFullError(f"{sched.max_waiting} requests are waiting (--max-waiting); "
                                 "retry later")
        request_id = request_id or uuid.uuid4().hex
        self._prompts[request_id] = ids
        try:
            self._send(("add", ids, params, request_id))
        except BaseException:
            self._prompts.pop(request_id, None)
            raise
        return request_id

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
        """The next message of the engine process, decoded: ("out", outputs) or
        ("failed", message); EOFError once it has exited. Call from one thread."""
        msg = self.results.recv()
        if msg[0] != "out":
            return msg
        outputs = []
        for t in msg[1]:
            rid, finished = t[0], t[4]
            prompt = self._prompts.pop(rid, None) if finished else self._prompts.get(rid)
            outputs.append(from_wire(t, prompt if prompt is not None else []))
        running, waiting, free, self.stats = msg[2]
        self._counts = (running, waiting, free)
        return "out", outputs

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process: asked first, killed when it does not exit in time."""
        if self.closed:
            return
        self.closed = True
        try:
            self._send(("shutdown",))
        except EngineError:
            pass
        self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("the engine process did not exit in %.0f s; killing it", timeout_s)
            self.process.kill()
            self.process.join(5)
        self.commands.close()

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive()


class ProcessAsyncEngine(AsyncEngine):
    """AsyncEngine over an EngineClient: its thread reads the engine process's messages
    instead of stepping an engine; everything on the event loop is AsyncEngine's."""

    def _run(self) -> None:
        client: EngineClient = self.engine
        while not self._stop.is_set():
            try:
                kind, payload = client.receive()
            except (EOFError, OSError):
                if not self._stop.is_set():
                    logger.error("the engine process exited (code %s); failing the requests "
                                 "in flight", client.process.exitcode)
                    self._call_in_loop(self._fail_all, "the engine process exited")
                return
            if kind == "out":
                self._call_in_loop(self._dispatch, payload)
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
