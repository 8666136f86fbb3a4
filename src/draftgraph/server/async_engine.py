"""AsyncEngine: the LLMEngine on its own thread, feeding per-request asyncio queues.

The engine thread runs `step()` in a loop and sleeps on a `threading.Event` when idle. Each
step's outputs are handed to the event loop with `call_soon_threadsafe` and put on the queue of
their request. A request's generator aborts the request when its consumer goes away (client
disconnect, cancelled task), so its KV slots are freed at the next step.

# NOTE: `_streams` is only touched on the event-loop thread; the engine thread only calls
# `engine.step()` and `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from draftgraph.engine.request import RequestOutput
from draftgraph.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)

# called on the event loop for every dispatched output: (output, arrival time on the loop)
OutputObserver = Callable[[RequestOutput, float], None]


def merge_outputs(first: RequestOutput, later: list[RequestOutput]) -> RequestOutput:
    """One output standing for several consecutive outputs of the same request (a consumer
    slower than the engine reads what accumulated as one chunk)."""
    if not later:
        return first
    last = later[-1]
    new_ids = list(first.new_token_ids)
    delta = first.delta_text
    new_lps = list(first.new_logprobs) if first.new_logprobs is not None else None
    new_tops = list(first.new_top_logprobs) if first.new_top_logprobs is not None else None
    prompt = next((o for o in [first, *later] if o.prompt_logprobs is not None), first)
    for o in later:
        new_ids += o.new_token_ids
        delta += o.delta_text
        if new_lps is not None and o.new_logprobs is not None:
            new_lps += o.new_logprobs
        if new_tops is not None and o.new_top_logprobs is not None:
            new_tops += o.new_top_logprobs
    return RequestOutput(
        request_id=last.request_id, prompt_token_ids=last.prompt_token_ids,
        token_ids=last.token_ids, new_token_ids=new_ids, text=last.text, delta_text=delta,
        finished=last.finished, finish_reason=last.finish_reason, logprobs=last.logprobs,
        new_logprobs=new_lps, top_logprobs=last.top_logprobs, new_top_logprobs=new_tops,
        prompt_logprobs=prompt.prompt_logprobs, prompt_top_logprobs=prompt.prompt_top_logprobs,
        metrics=last.metrics, error=last.error,
    )


class LoopTimes:
    """Where the engine loop's time went: steps, seconds in `engine.step()` and in `emit`
    (handing the outputs on), and seconds asleep with nothing to do."""

    def __init__(self) -> None:
        self.steps = 0
        self.step_s = 0.0
        self.emit_s = 0.0
        self.idle_s = 0.0

    def summary(self) -> str:
        per = 1e3 / max(self.steps, 1)
        return (f"engine loop: {self.steps} steps, {self.step_s:.2f} s in steps "
                f"({self.step_s * per:.3f} ms each), {self.emit_s:.2f} s emitting "
                f"({self.emit_s * per:.3f} ms each), {self.idle_s:.1f} s idle")


def run_steps(engine, stop: threading.Event, wake: threading.Event,
              emit: Callable[[list[RequestOutput]], None],
              failed: Callable[[str], None], times: LoopTimes | None = None) -> LoopTimes:
    """The engine loop: `engine.step()` while requests are unfinished, each step's outputs
    that carry anything handed to `emit`; asleep on `wake` when idle (whoever queues a
    request or an abort sets it after queueing, so nothing is missed) until `stop`. A step
    that raises is logged and reported to `failed`, and the loop goes on. Returns `times`
    (or a new LoopTimes), filled in as it went."""
    times = times or LoopTimes()
    clock = time.perf_counter
    while not stop.is_set():
        wake.clear()
        t0 = clock()
        if not engine.has_unfinished():
            wake.wait(1.0)
            times.idle_s += clock() - t0
            continue
        try:
            outputs = engine.step()
        except Exception:  # the loop must survive anything a step throws
            logger.exception("engine step failed; failing the in-flight requests")
            failed("internal error in the engine step")
            time.sleep(0.01)
            continue
        t1 = clock()
        times.steps += 1
        times.step_s += t1 - t0
        outputs = [o for o in outputs if o.new_token_ids or o.finished or o.delta_text]
        if outputs:
            emit(outputs)
            times.emit_s += clock() - t1
        elif engine.has_unfinished():
            wake.wait(0.002)  # nothing schedulable yet: do not spin
            times.idle_s += clock() - t1
    return times


class EngineDeadError(RuntimeError):
    """The engine thread is not running (server shutting down)."""


class AsyncEngine:
    """Runs `engine.step()` on one thread beside an asyncio event loop."""

    def __init__(self, engine, observer: OutputObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._aborting: set[str] = set()  # aborted by the server; final output still to observe
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_step_errors = 0

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="draftgraph-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_active_streams(self) -> int:
        return len(self._streams)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the outputs are dispatched to (None before `start`)."""
        return self._loop

    # ---- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        def failed(message: str) -> None:
            self.num_step_errors += 1
            self._call_in_loop(self._fail_all, message)

        times = run_steps(self.engine, self._stop, self._wake,
                          lambda outputs: self._call_in_loop(self._dispatch, outputs), failed)
        logger.info(times.summary())

    def _call_in_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    # ---- event-loop side -----------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is None:  # consumer gone: only the final output of an abort is observed
                if out.finished and out.request_id in self._aborting:
                    self._aborting.discard(out.request_id)
                    self._observe(out, now)
                continue
            self._observe(out, now)
            queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]

    def _observe(self, out: RequestOutput, now: float) -> None:
        if self.observer is not None:
            try:
                self.observer(out, now)
            except Exception:
                logger.exception("metrics observer failed for request %s", out.request_id)

    def fail_all(self, message: str) -> None:
        """End every request in flight: aborted in the engine, its stream given a final output
        with finish_reason "error" and `message` (shutdown). Call on the event loop."""
        self._fail_all(message)

    def _fail_all(self, message: str) -> None:
        for request_id, queue in list(self._streams.items()):
            logger.error("request %s failed: %s", request_id, message)
            self.engine.abort(request_id)
            queue.put_nowait(RequestOutput.failed(request_id, message))
        self._streams.clear()
        self._wake.set()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str,
                    arrival_time: float | None = None) -> asyncio.Queue[RequestOutput]:
        """Queue a request; raises EngineError (bad input) or QueueFullError synchronously.
        Must be called on the event loop. arrival_time: the HTTP request's receipt
        (time.perf_counter()), what the engine times its latencies from."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id}")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = queue  # registered first: no output can be missed
        try:
            self.engine.add_request(prompt_token_ids, params, request_id=request_id,
                                    use_chat_template=False, arrival_time=arrival_time)
        except BaseException:
            del self._streams[request_id]
            raise
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Abort a request still in flight (idempotent; no-op once it has finished)."""
        if self._streams.pop(request_id, None) is not None:
            logger.debug("aborting request %s", request_id)
            self._aborting.add(request_id)
            self.engine.abort(request_id)
            self._wake.set()

    async def stream(self, request_id: str,
                     queue: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Outputs of a request added with `add_request`, several engine steps merged into one
        when the consumer falls behind. Closing or cancelling the iterator aborts the request."""
        try:
            while True:
                out = await queue.get()
                later = []
                while not out.finished and not queue.empty():
                    later.append(queue.get_nowait())
                    if later[-1].finished:
                        break
                out = merge_outputs(out, later)
                yield out
                if out.finished:
                    return
        finally:
            self.abort(request_id)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        queue = self.add_request(prompt_token_ids, params, request_id)
        async for out in self.stream(request_id, queue):
            yield out
