"""The HTTP application: routes, authentication, body limits and error bodies (FastAPI on uvicorn).

Routes: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/messages``,
``GET /v1/models`` (and ``/v1/models/{model}``), ``/health`` and ``/metrics``.

Safe defaults:

* with an API key, every route but ``/health`` needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, compared
  in constant time (``hmac.compare_digest``); a missing or wrong key is a 401;
* a body larger than ``max_request_body_bytes`` is a 413, refused from its ``Content-Length`` or while it is read,
  before it is parsed;
* every refusal is a 4xx with OpenAI's error body naming the field (:mod:`deepinfer_jax.server.errors`), raised
  before the engine sees the request; over the admission bound a request gets 429 with ``Retry-After``;
* a client that disconnects aborts its request, streaming or not: its blocks and slot are freed at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer_jax.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError, RequestStream
from deepinfer_jax.server import completions as completions_lib
from deepinfer_jax.server import protocols
from deepinfer_jax.server.errors import APIError
from deepinfer_jax.server.metrics import CONTENT_TYPE, ServerMetrics

__all__ = ["ROUTES", "build_app"]

ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/models",
    "/health",
    "/metrics",
)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body; 413 over ``limit`` bytes (announced or read), 400 when it does not parse."""
    announced = request.headers.get("content-length")
    if announced is not None:
        try:
            size = int(announced)
        except ValueError:
            raise APIError(400, f"Content-Length = {announced!r} is not a number") from None
        if size > limit:
            raise APIError(413, f"the request body has {size} bytes; the limit is {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


def _admit(add: Callable[[], Any]) -> Any:
    try:
        return add()
    except QueueFullError as exc:
        raise APIError(
            429,
            str(exc),
            code="rate_limit_exceeded",
            headers={"Retry-After": f"{max(1, round(exc.retry_after))}"},
        ) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), type="server_error") from None
    except (TypeError, ValueError) as exc:
        raise APIError(400, str(exc)) from None


def _add_all(engine: AsyncLLM, choices: list[Any]) -> list[RequestStream]:
    """One engine request per choice; if one is refused, those already queued are aborted."""
    streams: list[RequestStream] = []
    try:
        for j, prepared in enumerate(choices):
            prompt = {"prompt_token_ids": prepared.prompt_token_ids}
            streams.append(engine.add_request(prompt, prepared.params, f"{prepared.response_id}-{j}"))
    except BaseException:
        for stream in streams:
            engine.abort_nowait(stream.request_id)
        raise
    return streams


async def _unless_disconnected(
    request: Request, work: Awaitable[str], streams: list[RequestStream]
) -> Response:
    """Run a non-streaming request's work; a client that disconnects meanwhile cancels it (and so aborts)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return Response(task.result(), media_type="application/json")
    task.cancel()
    with_abort = [s for s in streams if not s.finished]
    for stream in with_abort:
        request.app.state.engine.abort_nowait(stream.request_id)
    return Response(status_code=499)


class _Guard:
    """ASGI middleware: the API key check (every route but ``/health``) and the per-route request counter."""

    def __init__(self, app: Any, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app = app
        self.key = None if api_key is None else api_key.encode()
        self.metrics = metrics

    def _authorized(self, scope: dict[str, Any]) -> bool:
        assert self.key is not None
        given = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
                break
            if name == b"x-api-key":
                given = value.strip()
                break
        # Constant time in the key's content: a wrong key of the right length takes as long as a right one.
        return hmac.compare_digest(given, self.key)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = (
            path if path in ROUTES else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")
        )
        status = [500]

        async def counted_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.key is not None and path != "/health" and not self._authorized(scope):
                error = APIError(
                    401, "a valid API key is required: Authorization: Bearer KEY, or x-api-key: KEY"
                )
                error.code = "invalid_api_key"
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, counted_send)
                return
            await self.app(scope, receive, counted_send)
        finally:
            self.metrics.http_requests.labels(route, str(status[0])).inc()


def build_app(
    engine: AsyncLLM,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_request_body_bytes: int | None = None,
    default_thinking: bool | None = None,
) -> FastAPI:
    """The application serving ``engine`` as ``served_model_name``; settings left at ``None`` come from the
    engine's ``server`` config section."""
    config = engine.llm.config.server
    limit = config.max_request_body_bytes if max_request_body_bytes is None else max_request_body_bytes
    thinking = config.default_thinking if default_thinking is None else default_thinking
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty; give a key or None (no authentication)")
    ctx = protocols.ServingContext.build(engine, served_model_name, default_thinking=thinking)
    metrics = ServerMetrics(engine)
    app = FastAPI(title="deepinfer-jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.ctx = ctx
    app.state.metrics = metrics
    app.add_middleware(_Guard, api_key=api_key, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = (
            f"{request.method} {request.url.path}: no such route"
            if exc.status_code == 404
            else f"{request.method} is not allowed on {request.url.path}"
            if exc.status_code == 405
            else str(exc.detail)
        )
        error = APIError(exc.status_code, message)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(_request: Request, exc: Exception) -> JSONResponse:
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    def model_card() -> dict[str, Any]:
        llm = engine.llm
        return {
            "id": served_model_name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "deepinfer-jax",
            "max_model_len": llm.max_model_len,
            "vocab_size": llm.model.config.vocab_size,
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        reason = "the engine loop failed" if engine.error is not None else "shutting down"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if model != served_model_name:
            raise APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
        return JSONResponse(model_card())

    async def run_protocol(request: Request, protocol: protocols.Protocol) -> Response:
        body = await read_json(request, limit)
        choices = await run_in_threadpool(protocols.prepare_all, ctx, protocol, body)
        if len(choices) > 1:
            streams = _admit(lambda: _add_all(engine, choices))
            if choices[0].stream:
                events = protocols.generate_sse_n(ctx, choices, streams, metrics.observe)
                return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
            return await _unless_disconnected(
                request, protocols.generate_json_n(ctx, choices, streams, metrics.observe), streams
            )
        (prepared,) = choices
        stream = _admit(
            lambda: engine.add_request(
                {"prompt_token_ids": prepared.prompt_token_ids}, prepared.params, prepared.response_id
            )
        )
        if prepared.stream:
            events = protocols.generate_sse(ctx, prepared, stream, metrics.observe)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        return await _unless_disconnected(
            request, protocols.generate_json(ctx, prepared, stream, metrics.observe), [stream]
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run_protocol(request, protocols.CHAT)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await run_protocol(request, protocols.RESPONSES)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await run_protocol(request, protocols.MESSAGES)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request, limit)
        job = await run_in_threadpool(completions_lib.prepare_completion, ctx, body)
        streams = _admit(lambda: completions_lib.start_streams(ctx, job))
        if job.stream:
            events = completions_lib.completion_sse(ctx, job, streams, metrics.observe)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        return await _unless_disconnected(
            request, completions_lib.completion_json(ctx, job, streams, metrics.observe), streams
        )

    return app
