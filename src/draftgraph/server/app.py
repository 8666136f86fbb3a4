"""The OpenAI-compatible HTTP app (FastAPI): routes, authentication, admission and error mapping.

Errors follow the OpenAI shape `{"error": {"message", "type", "param", "code"}}`:
400 bad parameters (FastAPI's 422 included), unsupported fields, or a request that could never
run (prompt past the context, prompt + max_tokens past the KV pool, more choices than
--max-waiting), 401 missing/wrong API key (with `WWW-Authenticate: Bearer`), 404 unknown
model, 408 a body not received in time, 413 a body over --max-body-bytes, 503 + Retry-After
when the waiting queue is full, 503 while shutting down, 500 when the engine fails a request
(logged with the request id).

Nothing slow runs on the event loop: bodies are size-bounded before they are parsed, prompt
text is length-bounded before it is tokenised, and tokenising and templating run on worker
threads with the GIL released (engine/admission.py).

Shutdown drains: SIGTERM (or `OpenAIServer.drain`) stops admitting new requests, lets the
running ones finish for up to --shutdown-timeout seconds, then ends each remaining stream with
an error event and `[DONE]`; only then is uvicorn told to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftgraph.engine import admission
from draftgraph.engine.engine import EngineError, QueueFullError
from draftgraph.engine.request import RequestOutput
from draftgraph.engine.sampling import SamplingParamsError, choice_params
from draftgraph.server import serving
from draftgraph.server.async_engine import AsyncEngine, EngineDeadError
from draftgraph.server.config import ServerConfig
from draftgraph.server.metrics import CONTENT_TYPE, ServerMetrics
from draftgraph.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "the server is shutting down (--shutdown-timeout passed)"
# what a client gets if even building the error response fails
_FALLBACK_ERROR = (b'{"error":{"message":"internal error","type":"server_error",'
                   b'"param":null,"code":"internal_error"}}')
# routes that need the key when one is set (/health and /metrics stay open, as in vLLM)
_PROTECTED_PREFIXES = ("/v1/", "/info", "/tokenize", "/tokenizer_info", "/detokenize")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.headers = headers


def _safe_str(x) -> str:
    try:
        return str(x)
    except Exception:
        return f"<unprintable {type(x).__name__}>"


class _AbortingStreamingResponse(StreamingResponse):
    """A stream that aborts its requests however it ends (client gone, cancelled, error);
    aborting a finished request is a no-op."""

    def __init__(self, content, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _merge(streams: list[AsyncIterator[RequestOutput]],
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several request streams, in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        async for out in stream:
            queue.put_nowait((i, out))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out = await queue.get()
            yield i, out
            remaining -= out.finished
    finally:
        for t in tasks:
            t.cancel()


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = None
    async for out in stream:  # noqa: B007
        pass
    return out


async def _prompt_only(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """The outputs of an echo + max_tokens 0 request without the token the engine generated."""
    async for out in stream:
        yield serving.without_output(out)


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


class OpenAIServer:
    def __init__(self, async_engine: AsyncEngine, config: ServerConfig,
                 metrics: ServerMetrics) -> None:
        self.ae = async_engine
        self.engine = async_engine.engine
        self.config = config
        self.metrics = metrics
        self.model_name = config.served_model_names[0]
        # tokenising and chat templating: off the event loop, a few at a time
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="draftgraph-tok")
        self.draining = False
        self.num_open_responses = 0  # admitted HTTP requests whose response is not done
        self._drained: asyncio.Event | None = None
        # requests queued, and their seconds from the HTTP arrival to the handler (the body,
        # its validation) and from there to the engine (tokenizing, admission, the send):
        # logged at shutdown, the API server's part of a TTFT by stage
        self.stages = {"n": 0, "to_handler": 0.0, "to_engine": 0.0}

    # ---- checks --------------------------------------------------------------------------
    def check_admitting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down; send the request to another "
                           "replica", "server_error", code="server_shutting_down",
                           headers={"Connection": "close"})

    def check_supported(self, body) -> None:
        fields = body.unsupported_fields()
        if fields:
            raise APIError(400, f"unsupported field{'s' if len(fields) > 1 else ''}: "
                           f"{', '.join(fields)} (this server does not implement "
                           f"{'them' if len(fields) > 1 else 'it'}; leave "
                           f"{'them' if len(fields) > 1 else 'it'} out)", param=fields[0],
                           code="unsupported_field")
        conflict = body.conflicting_field()
        if conflict is not None:
            param, message = conflict
            raise APIError(400, message, param=param)

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model_name
        if model not in self.config.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"{', '.join(self.config.served_model_names)}", param="model",
                           code="model_not_found")
        return model

    def check_queue_fits(self, num_choices: int, param: str) -> None:
        """A request with more choices than an idle server runs and queues could never be
        admitted: 400, not a 503 the client would retry forever."""
        sched = self.engine.config.scheduler
        if num_choices > sched.max_num_seqs + sched.max_waiting:
            raise APIError(400, f"this request asks for {num_choices} completions (prompts x "
                           f"n); the server runs {sched.max_num_seqs} at once (--max-num-seqs) "
                           f"and queues at most {sched.max_waiting} more (--max-waiting)",
                           param=param)

    def encode(self, prompt, use_chat_template: bool,
               add_special_tokens: bool | None = None, **chat) -> list[int]:
        """Token ids of a prompt (runs on a worker thread; `chat`: `admission.encode_prompt`'s
        keyword options, truncation and how chat messages render)."""
        import jinja2

        param = ("messages" if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
                 else "prompt")
        try:
            return self.engine.encode_prompt(prompt, use_chat_template=use_chat_template,
                                             add_special_tokens=add_special_tokens, **chat)
        except (EngineError, jinja2.TemplateError, ValueError) as e:
            raise APIError(400, _safe_str(e), param=param) from None

    async def run_blocking(self, fn: Callable):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    def max_tokens_for(self, prompt_len: int, requested: int | None,
                       param: str = "max_tokens") -> int:
        """param: the field `requested` came in (chat's max_completion_tokens or max_tokens)."""
        room = self.engine.max_model_len - prompt_len
        if requested is None:
            # the default fills the context, or what of it the KV pool can hold
            kv_room = admission.kv_capacity(self.engine) - self.engine.spec_k - prompt_len
            return max(1, min(room, kv_room))
        if requested > room:
            raise APIError(400, f"prompt has {prompt_len} tokens and {param} is {requested}; "
                           f"the model's context is {self.engine.max_model_len} tokens "
                           f"(--max-model-len): ask for at most {room}", param=param)
        return requested

    def sampling_params(self, body, prompt_len: int, requested: int | None,
                        max_tokens_param: str = "max_tokens"):
        max_tokens = self.max_tokens_for(prompt_len, requested, max_tokens_param)
        try:
            return body.sampling_params(max_tokens)
        except SamplingParamsError as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def add(self, prompts: list[list[int]], params: list, request_id: str, raw_request: Request,
            handler_time: float) -> tuple[list[str], list[AsyncIterator[RequestOutput]]]:
        """Queue every sub-request or none: on a refusal the ones already queued are aborted.
        Each is timed from the HTTP request's arrival (the body-limit middleware's stamp);
        handler_time: when the handler began (`stages`)."""
        arrival = getattr(raw_request.state, "arrival_time", None)
        rids: list[str] = []
        streams = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                queue = self.ae.add_request(ids, sp, rid, arrival_time=arrival)
                rids.append(rid)
                streams.append(self.ae.stream(rid, queue))
        except QueueFullError as e:
            self._abort(rids)
            raise APIError(503, str(e), "server_overloaded", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except EngineDeadError as e:
            self._abort(rids)
            raise APIError(503, str(e), "server_error", code="engine_not_running") from None
        except SamplingParamsError as e:  # a bound that depends on the model (logit_bias)
            self._abort(rids)
            raise APIError(400, str(e), param=e.param) from None
        except (EngineError, ValueError) as e:
            self._abort(rids)
            raise APIError(400, str(e)) from None
        if arrival is not None:
            self.stages["n"] += 1
            self.stages["to_handler"] += handler_time - arrival
            self.stages["to_engine"] += time.perf_counter() - handler_time
        return rids, streams

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.ae.abort(rid)

    def check_failed(self, request_id: str, finals: list[RequestOutput]) -> None:
        for out in finals:
            if out.finish_reason == "error":
                if out.error == SHUTDOWN_MESSAGE:
                    raise APIError(503, f"request {request_id}: {SHUTDOWN_MESSAGE}",
                                   "server_error", code="server_shutting_down")
                logger.error("request %s failed: %s", out.request_id, out.error)
                raise APIError(500, f"request {request_id} failed: {out.error}", "server_error",
                               code="internal_error")

    async def collect(self, streams, raw_request: Request) -> list[RequestOutput] | None:
        """Final outputs of non-streamed requests; None if the client went away first (the
        requests are then aborted)."""
        gathered = asyncio.gather(*[_last(s) for s in streams])
        watcher = asyncio.ensure_future(_wait_disconnect(raw_request))
        try:
            await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not gathered.done():
            gathered.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gathered
            return None
        return gathered.result()

    @contextlib.contextmanager
    def _open_response(self):
        self.num_open_responses += 1
        try:
            yield
        finally:
            self.num_open_responses -= 1

    # ---- endpoints -----------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw_request: Request):
        handler_time = time.perf_counter()
        self.check_admitting()
        self.check_supported(body)
        model = self.check_model(body.model)
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        self.check_queue_fits(len(prompts) * body.n, "n" if len(prompts) == 1 else "prompt")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens 0 generates nothing: it is only accepted with echo "
                           "(the prompt scored, with logprobs)", param="max_tokens")
        tok = self.engine.tokenizer

        cut = body.truncate_prompt_tokens

        def prepare() -> tuple[list[list[int]], list[str]]:
            encoded = [self.encode(p, use_chat_template=False, truncate=cut) for p in prompts]
            # echo writes the prompt as it ran: decoded where it was truncated
            texts = [p if isinstance(p, str) and cut is None else
                     (tok.decode(ids) if tok is not None and body.echo else "")
                     for p, ids in zip(prompts, encoded, strict=True)]
            return encoded, texts

        if body.echo or any(isinstance(p, str) for p in prompts):
            encoded, texts = await self.run_blocking(prepare)
        else:
            # token ids need no tokenizer: checked here on the loop (~40 us for 512 ids); a
            # worker thread's hop waits for the GIL and then for the loop, milliseconds when
            # the loop streams to many clients
            encoded, texts = prepare()
        prompt_tokens = sum(len(ids) for ids in encoded)  # each prompt once, not once per n
        encoded = [ids for ids in encoded for _ in range(body.n)]
        texts = [t for t in texts for _ in range(body.n)]
        # choice j of each prompt draws from its own stream (seed + j)
        max_tokens = 1 if body.prompt_only else body.max_tokens
        params = [p for ids in encoded[:: body.n] for p in choice_params(
            self.sampling_params(body, len(ids), max_tokens), body.n)]
        states = [serving.ChoiceState(i, prompt_text=text, prompt_token_ids=ids)
                  for i, (text, ids) in enumerate(zip(texts, encoded, strict=True))]
        self.check_admitting()  # tokenising took a while: still admitting?
        request_id = f"cmpl-{uuid.uuid4().hex}"
        rids, streams = self.add(encoded, params, request_id, raw_request, handler_time)
        if body.prompt_only:
            streams = [_prompt_only(s) for s in streams]
        created = serving.now()

        if body.stream:
            def chunk(i: int, out: RequestOutput):
                return serving.completion_chunk(request_id, model, created, out, states[i], tok,
                                                body.logprobs, body.echo, body.return_token_ids)

            events = self._sse_events(streams, request_id, model, created, chunk,
                                      "text_completion", body.include_usage, prompt_tokens)
            return _AbortingStreamingResponse(events, lambda: self._abort(rids))

        with self._open_response():
            finals = await self.collect(streams, raw_request)
        if finals is None:
            return Response(status_code=499)
        self.check_failed(request_id, finals)
        return serving.completion_body(request_id, model, created, finals, states, tok,
                                       body.logprobs, body.echo, prompt_tokens,
                                       body.prompt_logprobs, body.return_token_ids)

    async def _sse_events(self, streams, request_id: str, model: str, created: int, chunk,
                          usage_object: str, include_usage: bool,
                          prompt_tokens: int) -> AsyncIterator[str]:
        """OpenAI SSE: one chunk per engine output (several tokens under speculation), usage
        if asked, then [DONE]. If the engine fails the request (or shutdown ends it), an
        error event and [DONE] end the stream."""
        finals: list[RequestOutput] = []
        with self._open_response():
            async for i, out in _merge(streams):
                if out.finish_reason == "error":
                    yield self._stream_error(request_id, out)
                    yield serving.sse("[DONE]")
                    return
                body = chunk(i, out)
                if body is not None:
                    yield serving.sse(body)
                if out.finished:
                    finals.append(out)
            if include_usage:
                yield serving.sse(serving.usage_chunk(request_id, model, created, usage_object,
                                                      finals, prompt_tokens))
            yield serving.sse("[DONE]")

    async def chat(self, body: ChatCompletionRequest, raw_request: Request):
        handler_time = time.perf_counter()
        self.check_admitting()
        self.check_supported(body)
        model = self.check_model(body.model)
        self.check_queue_fits(body.n, "n")
        messages = body.chat_messages()
        ids = await self.run_blocking(lambda: self.encode(
            messages, use_chat_template=True, truncate=body.truncate_prompt_tokens,
            **body.render_options()))
        params = self.sampling_params(body, len(ids), body.requested_max_tokens,
                                      body.max_tokens_param)
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        tok = self.engine.tokenizer
        self.check_admitting()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        rids, streams = self.add([ids] * body.n, choice_params(params, body.n), request_id,
                                 raw_request, handler_time)
        created = serving.now()
        prompt_tokens = len(ids)  # the prompt once, not once per choice
        last = messages[-1]
        echoed = last["content"] if body.echo and last["role"] == "assistant" else ""

        if body.stream:
            states = [serving.ChoiceState(i, prompt_text=echoed) for i in range(body.n)]
            unsent_prompt_ids = ids if body.return_token_ids else None  # on the first chunk

            def chunk(i: int, out: RequestOutput):
                nonlocal unsent_prompt_ids
                c = serving.chat_chunk(request_id, model, created, out, states[i], tok,
                                       num_logprobs, body.return_token_ids, unsent_prompt_ids)
                if c is not None:
                    unsent_prompt_ids = None
                return c

            events = self._sse_events(streams, request_id, model, created, chunk,
                                      "chat.completion.chunk", body.include_usage,
                                      prompt_tokens)
            return _AbortingStreamingResponse(events, lambda: self._abort(rids))

        with self._open_response():
            finals = await self.collect(streams, raw_request)
        if finals is None:
            return Response(status_code=499)
        self.check_failed(request_id, finals)
        return serving.chat_body(request_id, model, created, finals, tok, num_logprobs,
                                 prompt_tokens, body.prompt_logprobs,
                                 ids if body.return_token_ids else None, echoed)

    def _stream_error(self, request_id: str, out: RequestOutput) -> str:
        if out.error == SHUTDOWN_MESSAGE:
            self.metrics.count_error(503)
            return serving.sse(serving.error_body(f"request {request_id}: {SHUTDOWN_MESSAGE}",
                                                  "server_error", code="server_shutting_down"))
        logger.error("request %s failed: %s", out.request_id, out.error)
        self.metrics.count_error(500)
        return serving.sse(serving.error_body(f"request {request_id} failed: {out.error}",
                                              "server_error", code="internal_error"))

    # ---- shutdown ------------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """Stop admitting; let running requests finish for up to `timeout` seconds; then end
        the rest (streams get an error event and [DONE], others a 503) and wait for their
        responses to be written. Idempotent."""
        if self._drained is not None:
            await self._drained.wait()
            return
        self._drained = asyncio.Event()
        self.draining = True
        loop = asyncio.get_running_loop()
        logger.info("shutting down: %d requests in flight, up to %g s to finish "
                    "(--shutdown-timeout)", self.ae.num_active_streams, timeout)
        deadline = loop.time() + timeout
        while self.ae.num_active_streams and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.ae.num_active_streams:
            logger.warning("shutting down: ending %d requests still running after %g s",
                           self.ae.num_active_streams, timeout)
            self.ae.fail_all(SHUTDOWN_MESSAGE)
        deadline = loop.time() + 5.0  # the responses write their last events
        while self.num_open_responses and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self._drained.set()

    def drain_then(self, then: Callable[[], None]) -> None:
        """Start `drain` (on the event loop) and call `then` when it is done."""
        async def run() -> None:
            try:
                await self.drain(self.config.shutdown_timeout_s)
            finally:
                then()

        self._drain_task = asyncio.ensure_future(run())

    def models(self) -> dict:
        created = serving.now()
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "draftgraph",
             "root": self.engine.config.model, "max_model_len": self.engine.max_model_len,
             "vocab_size": self.engine.model_config.vocab_size}
            for name in self.config.served_model_names]}

    def info(self) -> dict:
        cfg = self.engine.config
        spec = cfg.spec
        return {"model": cfg.model, "served_model_names": self.config.served_model_names,
                "device": _device_name(cfg.device), "dtype": cfg.dtype,
                "max_model_len": self.engine.max_model_len,
                "max_num_seqs": cfg.scheduler.max_num_seqs,
                "speculative": spec.method,
                "num_draft_tokens": spec.num_draft_tokens if spec.method else 0,
                "kv_slots": admission.kv_capacity(self.engine),
                "free_kv_slots": self.engine.num_free_kv_slots(),
                "server_pid": os.getpid()}  # which API-server process answered


class _APIKeyMiddleware:
    """Checks `Authorization: Bearer <key>` on /v1/ routes and /info before anything else
    runs (a malformed body from a client without the key gets 401, not 400)."""

    def __init__(self, app, api_key: str, reject: Callable[[], Response]) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.reject = reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES):
            headers = dict(scope.get("headers") or [])
            scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    key.strip().encode("latin-1"), self.api_key):
                await self.reject()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyGuardMiddleware:
    """Reads a request body before the app sees it: larger than `max_bytes` gets 413, not
    received within `timeout_s` gets 408. The app then reads the buffered body; its later
    `receive` calls (disconnect detection) go to the client.

    # NOTE: before a 413 the rest of the body is read and dropped (up to DISCARD_FACTOR times
    # the limit, within the timeout): a server that answers and closes while the client is
    # still sending resets the connection, and the client never sees the 413.
    """

    DISCARD_FACTOR = 8

    def __init__(self, app, max_bytes: int, timeout_s: float,
                 reject: Callable[[int, str], Response]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.reject = reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        # the request's arrival, before its body is read (`Request.state.arrival_time`): what
        # the engine times its TTFT and latency from, as vLLM does from its front end's
        scope.setdefault("state", {})["arrival_time"] = time.perf_counter()
        declared = dict(scope.get("headers") or []).get(b"content-length")
        declared = int(declared) if declared is not None and declared.isdigit() else None
        chunks: list[bytes] = []
        total = 0
        more = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        too_large = declared is not None and declared > self.max_bytes
        try:
            while more and not (too_large and (declared or total) >
                                self.DISCARD_FACTOR * self.max_bytes):
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                total += len(chunk)
                more = message.get("more_body", False)
                too_large |= total > self.max_bytes
                if not too_large:
                    chunks.append(chunk)
        except TimeoutError:
            if not too_large:
                await self.reject(408, f"request body not received within {self.timeout_s:g} "
                                  "s (--body-read-timeout)")(scope, receive, send)
                return
        if too_large:
            size = f"{declared} bytes" if declared is not None else f"over {self.max_bytes} bytes"
            await self.reject(413, f"request body is {size}; this server takes at most "
                              f"{self.max_bytes} bytes (--max-body-bytes)")(scope, receive, send)
            return
        buffered = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return buffered
            return await receive()

        await self.app(scope, replay, send)


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # in a union the first error is often a branch that was never meant (a string expected
    # where a list was sent); an error raised by one of our validators says more
    err = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {err.get('ctx', {}).get('error', '')}", None
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # drop pydantic's union-branch names (e.g. 'str', 'list[int]') from the path
    param = ".".join(x for x in loc if not any(c in x for c in "[]") and x not in
                     ("str", "int", "function-after", "constrained-str")) or None
    msg = err.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def _drain_on_signals(server: OpenAIServer) -> None:
    """Chain SIGTERM/SIGINT: the first one drains (`OpenAIServer.drain`) before the handler
    already installed (uvicorn's: exit) runs; a second one goes straight to it. Only in the
    main thread (where uvicorn installs its handlers, before the lifespan starts)."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        prev = signal.getsignal(sig)
        if not callable(prev):
            continue

        def handler(signum, frame, prev=prev) -> None:
            if server.draining:
                prev(signum, frame)
                return
            server.draining = True  # a second signal before the drain starts exits
            loop.call_soon_threadsafe(server.drain_then, lambda: prev(signum, None))

        signal.signal(sig, handler)


METRICS_SHARE_S = 1.0  # how often an API server sends its request metrics to the others


async def _share_metrics(client, metrics: ServerMetrics) -> None:
    """With several API servers on one engine: this one's request metrics to the others
    (through the engine process) every METRICS_SHARE_S while they change."""
    last = None
    while True:
        await asyncio.sleep(METRICS_SHARE_S)
        state = metrics.state()
        if state != last:
            _send_metrics(client, state)
            last = state


def _send_metrics(client, state: dict) -> None:
    try:
        client.send_metrics(state)
    except Exception:  # noqa: BLE001 - the engine gone: nobody left to tell
        logger.debug("could not send the request metrics", exc_info=True)


def build_app(async_engine: AsyncEngine, config: ServerConfig,
              metrics: ServerMetrics | None = None) -> FastAPI:
    """The app; its lifespan starts and stops the engine thread (or the engine process's
    reader)."""
    metrics = metrics or ServerMetrics(async_engine.engine, config.served_model_names[0])
    if async_engine.observer is None:
        async_engine.observer = metrics.observe_output
    server = OpenAIServer(async_engine, config, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        _drain_on_signals(server)
        logger.info("serving %s (%s)", config.served_model_names[0],
                    "engine in its own process" if hasattr(async_engine.engine, "process")
                    else "engine on a thread")
        share = (asyncio.create_task(_share_metrics(async_engine.engine, metrics))
                 if getattr(async_engine.engine, "num_api_servers", 1) > 1 else None)
        try:
            yield
        finally:
            if share is not None:
                share.cancel()
                _send_metrics(async_engine.engine, metrics.state())  # the last counts
            async_engine.shutdown()
            server.executor.shutdown(wait=False, cancel_futures=True)
            st = server.stages
            if st["n"]:
                logger.info("API server: %d requests, %.2f ms each from the HTTP arrival to "
                            "the handler, %.2f ms from there to the engine", st["n"],
                            1e3 * st["to_handler"] / st["n"], 1e3 * st["to_engine"] / st["n"])

    docs = {} if config.api_key is None else {"docs_url": None, "redoc_url": None,
                                              "openapi_url": None}
    app = FastAPI(title="draftgraph", lifespan=lifespan, **docs)
    app.state.server = server

    def error_json(e: APIError) -> Response:
        try:
            metrics.count_error(e.status)
        except Exception:
            logger.exception("could not count an error response")
        try:
            return JSONResponse(serving.error_body(e.message, e.type, e.param, e.code),
                                status_code=e.status, headers=e.headers)
        except Exception:  # building an error must never fail
            logger.exception("could not build the error response for %s", e.status)
            return Response(_FALLBACK_ERROR, status_code=500, media_type="application/json")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return error_json(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        try:
            msg, param = _validation_message(e)
        except Exception:
            logger.exception("could not describe a validation error")
            msg, param = "invalid request", None
        return error_json(APIError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        return error_json(APIError(e.status_code, _safe_str(e.detail),
                                   "not_found_error" if e.status_code == 404 else
                                   "invalid_request_error", headers=e.headers))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> Response:
        logger.exception("internal error serving %s %s", request.method, request.url.path)
        return error_json(APIError(500, f"internal error: {_safe_str(e)}", "server_error",
                                   code="internal_error"))

    def reject_body(status: int, message: str) -> Response:
        return error_json(APIError(status, message, code="request_too_large" if status == 413
                                   else "request_timeout", headers={"Connection": "close"}))

    app.add_middleware(_BodyGuardMiddleware, max_bytes=config.max_body_bytes,
                       timeout_s=config.body_read_timeout_s, reject=reject_body)
    if config.api_key is not None:  # outermost: no body is read for a client without the key
        app.add_middleware(_APIKeyMiddleware, api_key=config.api_key,
                           reject=lambda: error_json(APIError(
                               401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               "authentication_error", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})))

    @app.head("/health", include_in_schema=False)
    @app.get("/health")
    async def health() -> Response:
        if server.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not async_engine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.head("/ping", include_in_schema=False)
    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": _package_version()}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        server.check_model(body.model)
        try:
            prompt, chat = body.target()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        if server.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (random weights)", param="prompt")
        how = body.render_options() if chat else {}
        ids = await server.run_blocking(lambda: server.encode(
            prompt, use_chat_template=chat, add_special_tokens=body.add_special_tokens, **how))
        return {"tokens": ids, "count": len(ids), "max_model_len": server.engine.max_model_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        """vLLM's /tokenizer_info: lm-evaluation-harness (`tokenizer_backend=remote`, which it
        picks when this route answers) reads the special tokens here and tokenises through
        /tokenize, so it needs no copy of the tokenizer."""
        tok = server.engine.tokenizer
        if tok is None:
            raise APIError(404, "this model has no tokenizer (random weights)",
                           "not_found_error")
        return serving.tokenizer_info(tok, server.engine.max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        server.check_model(body.model)
        tok = server.engine.tokenizer
        vocab = server.engine.model_config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token ids must be below the vocabulary size {vocab}; got "
                           f"{bad[:3]}", param="tokens")
        if tok is None:
            raise APIError(400, "this model has no tokenizer (random weights)", param="tokens")
        return {"prompt": await server.run_blocking(lambda: tok.decode(body.tokens))}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/info")
    async def info() -> dict:
        return server.info()

    @app.get("/v1/models")
    async def models() -> dict:
        return server.models()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request):
        return await server.completions(body, raw_request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw_request: Request):
        return await server.chat(body, raw_request)

    return app


def _package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("draftgraph")
    except metadata.PackageNotFoundError:  # run from a source tree without installing
        return "unknown"
