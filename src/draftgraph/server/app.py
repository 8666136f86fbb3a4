"""The OpenAI-compatible HTTP app (FastAPI): routes, authentication and error mapping.

Errors follow the OpenAI shape `{"error": {"message", "type", "param", "code"}}`:
400 bad parameters (FastAPI's 422 included) or a prompt that does not fit the context,
401 missing/wrong API key, 404 unknown model, 503 + Retry-After when the waiting queue is full,
500 when the engine fails a request (logged with the request id).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftgraph.engine.engine import EngineError, QueueFullError
from draftgraph.engine.request import RequestOutput
from draftgraph.engine.sampling import SamplingParams
from draftgraph.server import serving
from draftgraph.server.async_engine import AsyncEngine, EngineDeadError
from draftgraph.server.config import ServerConfig
from draftgraph.server.metrics import CONTENT_TYPE, ServerMetrics
from draftgraph.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.headers = headers


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

    # ---- checks --------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model_name
        if model not in self.config.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"{', '.join(self.config.served_model_names)}", param="model",
                           code="model_not_found")
        return model

    def encode(self, prompt, use_chat_template: bool) -> list[int]:
        try:
            return self.engine.encode_prompt(prompt, use_chat_template=use_chat_template)
        except EngineError as e:
            raise APIError(400, str(e), param="messages" if isinstance(prompt, list) and prompt
                           and isinstance(prompt[0], dict) else "prompt") from None

    def max_tokens_for(self, prompt_len: int, requested: int | None) -> int:
        room = self.engine.max_model_len - prompt_len
        if requested is None:
            return room
        if requested > room:
            raise APIError(400, f"prompt has {prompt_len} tokens and max_tokens is {requested}; "
                           f"the model's context is {self.engine.max_model_len} tokens "
                           f"(--max-model-len): ask for at most {room}", param="max_tokens")
        return requested

    def add(self, prompts: list[list[int]], params: list[SamplingParams],
            request_id: str) -> tuple[list[str], list[AsyncIterator[RequestOutput]]]:
        """Queue every sub-request or none: on a refusal the ones already queued are aborted."""
        rids: list[str] = []
        streams = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                queue = self.ae.add_request(ids, sp, rid)
                rids.append(rid)
                streams.append(self.ae.stream(rid, queue))
        except QueueFullError as e:
            self._abort(rids)
            raise APIError(503, str(e), "server_overloaded", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except EngineDeadError as e:
            self._abort(rids)
            raise APIError(503, str(e), "server_error", code="engine_not_running") from None
        except (EngineError, ValueError) as e:
            self._abort(rids)
            raise APIError(400, str(e)) from None
        return rids, streams

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.ae.abort(rid)

    def check_failed(self, request_id: str, finals: list[RequestOutput]) -> None:
        for out in finals:
            if out.finish_reason == "error":
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

    # ---- endpoints -----------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw_request: Request):
        model = self.check_model(body.model)
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        prompts = [p for p in prompts for _ in range(body.n)]
        encoded = [self.encode(p, use_chat_template=False) for p in prompts]
        try:
            params = [body.sampling_params(self.max_tokens_for(len(ids), body.max_tokens))
                      for ids in encoded]
        except ValueError as e:
            raise APIError(400, str(e)) from None
        tok = self.engine.tokenizer
        states = []
        for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True)):
            text = p if isinstance(p, str) else (tok.decode(ids) if tok is not None else "")
            states.append(serving.ChoiceState(i, prompt_text=text, prompt_token_ids=ids))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        rids, streams = self.add(encoded, params, request_id)
        created = serving.now()

        if body.stream:
            def chunk(i: int, out: RequestOutput):
                return serving.completion_chunk(request_id, model, created, out, states[i], tok,
                                                body.logprobs, body.echo)

            events = self._sse_events(streams, request_id, model, created, chunk,
                                      "text_completion", body.include_usage)
            return _AbortingStreamingResponse(events, lambda: self._abort(rids))

        finals = await self.collect(streams, raw_request)
        if finals is None:
            return Response(status_code=499)
        self.check_failed(request_id, finals)
        return serving.completion_body(request_id, model, created, finals, states, tok,
                                       body.logprobs, body.echo)

    async def _sse_events(self, streams, request_id: str, model: str, created: int, chunk,
                          usage_object: str, include_usage: bool) -> AsyncIterator[str]:
        """OpenAI SSE: one chunk per engine output (several tokens under speculation), an
        error event if the engine failed the request, usage if asked, then [DONE]."""
        finals: list[RequestOutput] = []
        async for i, out in _merge(streams):
            if out.finish_reason == "error":
                yield self._stream_error(request_id, out)
                return
            body = chunk(i, out)
            if body is not None:
                yield serving.sse(body)
            if out.finished:
                finals.append(out)
        if include_usage:
            yield serving.sse(serving.usage_chunk(request_id, model, created, usage_object,
                                                  finals))
        yield serving.sse("[DONE]")

    async def chat(self, body: ChatCompletionRequest, raw_request: Request):
        model = self.check_model(body.model)
        ids = self.encode(body.chat_messages(), use_chat_template=True)
        try:
            params = body.sampling_params(self.max_tokens_for(len(ids),
                                                              body.requested_max_tokens))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        tok = self.engine.tokenizer
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        rids, streams = self.add([ids] * body.n, [params] * body.n, request_id)
        created = serving.now()

        if body.stream:
            states = [serving.ChoiceState(i) for i in range(body.n)]

            def chunk(i: int, out: RequestOutput):
                return serving.chat_chunk(request_id, model, created, out, states[i], tok,
                                          num_logprobs)

            events = self._sse_events(streams, request_id, model, created, chunk,
                                      "chat.completion.chunk", body.include_usage)
            return _AbortingStreamingResponse(events, lambda: self._abort(rids))

        finals = await self.collect(streams, raw_request)
        if finals is None:
            return Response(status_code=499)
        self.check_failed(request_id, finals)
        return serving.chat_body(request_id, model, created, finals, tok, num_logprobs)

    def _stream_error(self, request_id: str, out: RequestOutput) -> str:
        logger.error("request %s failed: %s", out.request_id, out.error)
        self.metrics.count_error(500)
        return serving.sse(serving.error_body(f"request {request_id} failed: {out.error}",
                                              "server_error", code="internal_error"))

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
                "kv_slots": self.engine.runner.allocator.usable_slots,
                "free_kv_slots": self.engine.num_free_kv_slots()}


class _APIKeyMiddleware:
    """Checks `Authorization: Bearer <key>` on /v1/ routes before anything else runs (a
    malformed body from a client without the key gets 401, not 400)."""

    def __init__(self, app, api_key: str, reject: Callable[[], Response]) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.reject = reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope.get("headers") or [])
            scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                     self.api_key):
                await self.reject()(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
    err = errors[0]
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {err.get('ctx', {}).get('error', '')}", None
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # drop pydantic's union-branch names (e.g. 'str', 'list[int]') from the path
    param = ".".join(x for x in loc if not any(c in x for c in "[]") and x not in
                     ("str", "int", "function-after", "constrained-str")) or None
    msg = err.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def build_app(async_engine: AsyncEngine, config: ServerConfig,
              metrics: ServerMetrics | None = None) -> FastAPI:
    """The app; its lifespan starts and stops the engine thread."""
    metrics = metrics or ServerMetrics(async_engine.engine, config.served_model_names[0])
    if async_engine.observer is None:
        async_engine.observer = metrics.observe_output
    server = OpenAIServer(async_engine, config, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        logger.info("serving %s on the engine thread", config.served_model_names[0])
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="draftgraph", lifespan=lifespan)
    app.state.server = server

    def error_json(e: APIError) -> JSONResponse:
        metrics.count_error(e.status)
        return JSONResponse(serving.error_body(e.message, e.type, e.param, e.code),
                            status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_json(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(e)
        return error_json(APIError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_json(APIError(e.status_code, str(e.detail),
                                   "not_found_error" if e.status_code == 404 else
                                   "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error serving %s %s", request.method, request.url.path)
        return error_json(APIError(500, f"internal error: {e}", "server_error",
                                   code="internal_error"))

    if config.api_key is not None:
        app.add_middleware(_APIKeyMiddleware, api_key=config.api_key,
                           reject=lambda: error_json(APIError(
                               401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               "authentication_error", code="invalid_api_key")))

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

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
