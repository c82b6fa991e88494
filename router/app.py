"""The router's HTTP front (FastAPI), OpenAI-compatible with vLLM's server as the reference.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (plain or
``stream: true``), ``GET /v1/models[/{id}]``, ``POST /route`` (the decision
only, with per-replica scores), ``GET /workers``, ``GET /healthz`` (or vLLM's ``/health``),
``GET /metrics``.

Two ways to serve a completion, by the kind of fleet:

- our workers: the body is parsed and checked here (every rejection a 400
  naming the field, an unknown model a 404), the prompt tokenised as the
  worker will, routed, and run on the chosen worker; the answer is built
  here from the worker's stream, with a ``kvstore`` object;
- external servers (vLLM, SGLang): the body is only read, to route it
  (:mod:`kvstore.openai.routing`), and forwarded byte for byte; status,
  body and SSE chunks come back as the replica sent them, and what the
  router adds travels in ``x-kvstore-*`` headers. This path is plain ASGI
  beside the FastAPI app (:mod:`kvstore.router.relay`): :class:`RouterApp`
  sends those requests there, under the request counting and the guard
  that every request passes, off the framework's per-request and per-chunk
  costs.

Every failure of the router's own is an OpenAI-style error body: 400 for bad
input, 401 without the configured bearer token, 404 for a model or LoRA
adapter our workers do not serve, 413 for an oversized body, 503 when no
healthy replica can serve. A body is read within ``router``'s bounds (bytes,
values, containers, depth: :mod:`kvstore.openai.bounds`) before anything
decodes it. A client that disconnects cancels its request (on our worker, or
by closing the upstream connection). Slow or idle connections are the HTTP
server's to close (:mod:`kvstore.deploy.http_server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from kvstore.openai.batch import batch_ids, joined
from kvstore.openai.errors import ApiError, model_not_found
from kvstore.openai.http import (
    ClientDisconnected,
    answer_errors_openai_style,
    answered,
    error_response,
    read_body,
    respond,
    until_disconnected,
)
from kvstore.openai.protocol import (
    ParsedRequest,
    detokenize,
    parse_request_async,
    tokenize,
)
from kvstore.openai.responses import ResponseBuilder
from kvstore.openai.routing import read_for_routing, read_token_ids
from kvstore.openai.tokenizer import Tokenizer
from kvstore.router.dispatch import Opened
from kvstore.router.metrics import RequestCounting
from kvstore.router.relay import FORWARDED, KINDS, Kind, RelayApp
from kvstore.router.response import batch_route, kvstore_extras, medium_dict, routing_headers
from kvstore.router.routing import Prompt, RouteResult
from kvstore.router.service import RouterService
from kvstore.worker_api import GenerateRequest

_OPEN_PATHS = frozenset({"/healthz", "/health"})


def create_app(
    service: RouterService,
    *,
    manage_lifecycle: bool = True,
    tasks: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
) -> ASGIApp:
    """Build the app around a service. With ``manage_lifecycle`` the app starts and closes it.

    ``tasks`` run on the app's loop from after the service starts until before it closes (a deployer's
    supervisor, say); each is cancelled at shutdown, and one that fails is logged by asyncio, not retried.
    """
    config = service.config.router
    bounds = config.body_bounds()
    trust_template = config.trust_request_chat_template
    tool_parser = config.tool_call_parser or None
    reasoning_parser = config.reasoning_parser or None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await service.start()
        running = [asyncio.create_task(task()) for task in tasks]
        try:
            yield
        finally:
            for task in running:
                task.cancel()
            for task in running:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if manage_lifecycle:
                await service.close()

    app = FastAPI(title="kvstore router", lifespan=lifespan, docs_url=None, redoc_url=None)

    answer_errors_openai_style(app)

    async def completion(request: Request, kind: Kind) -> Response:
        body = await read_body(request, bounds)
        try:
            tokenizer = service.tokenizer
            assert tokenizer is not None, "a fleet of our workers always has the model's tokenizer"
            parsed = await parse_request_async(
                body, kind == "chat", tokenizer, service.limits, service.model_name, trust_template=trust_template,
                tool_parser=tool_parser, reasoning_parser=reasoning_parser,
            )  # fmt: skip
        except ApiError as exc:
            # Answered here, not raised on: the error's traceback would keep the decoded body alive
            # while the response is sent, and concurrent bad bodies would add up.
            service.counted("rejected")
            return error_response(exc)
        del body
        return await _run(service, request, parsed)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completion(request, "chat")

    def tokenizer() -> Tokenizer:
        assert service.tokenizer is not None, "a fleet of our workers always has the model's tokenizer"
        return service.tokenizer

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        """vLLM's /tokenize, for our workers' model (a vLLM fleet's goes to a replica: the relay)."""
        return await answered(
            request,
            bounds,
            lambda body: tokenize(body, tokenizer(), service.limits, service.model_name, trust_template=trust_template),
        )

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await answered(
            request, bounds, lambda body: detokenize(body, tokenizer(), service.limits, service.model_name)
        )

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": service.models()})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        card = next((c for c in service.models() if c["id"] == model_id), None)
        if card is None:
            raise model_not_found(model_id)
        return JSONResponse(card)

    @app.post("/route")
    async def route(request: Request) -> JSONResponse:
        body = await read_body(request, bounds)
        kind: Kind = "chat" if "messages" in _top_level_keys(body) else "completion"
        view = read_token_ids(body) if kind == "completion" else None
        if view is None:  # text or a chat (a request's template, if trusted): off the loop
            view = await asyncio.to_thread(
                read_for_routing, body, kind, service.tokenizer, trust_template=trust_template
            )
        tokens = view.token_ids or []
        routed = service.route(Prompt(tokens, view.cache_salt, model=view.model if service.forwards else None))
        d = routed.decision
        return JSONResponse(
            {
                "replica": d.replica,
                "scores": d.scores,
                "matched_blocks": {name: medium_dict(m) for name, m in routed.matched.items()},
                "prompt_tokens": len(tokens),
                "prompt_blocks": routed.prompt_blocks,
                "route_s": routed.route_s,
            }
        )

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse({"workers": service.workers()})

    @app.get("/healthz")
    @app.get("/health")  # vLLM's name for it: a probe written for a vLLM server works here too
    async def healthz() -> JSONResponse:
        healthy = service.healthy_count()
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "no healthy replica", "healthy_replicas": healthy}, status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    # Outermost the request counting (which so sees the guard's refusals too), then the guard, then the
    # split between the relay and the FastAPI app: both paths pass the same two, once.
    front = _Guard(RouterApp(app, service), api_key=config.api_key, max_body_bytes=config.max_body_bytes)
    return RequestCounting(front, metrics=service.metrics, paths=KINDS)


class RouterApp:
    """Completions for an external fleet go to the relay, everything else to the FastAPI app.

    The relay path (:mod:`kvstore.router.relay`) is the hot one -- every chunk of every stream -- so it
    runs off the framework; the FastAPI app serves the rest, our workers' completions included, and the
    lifespan. :func:`create_app` puts the request counting and the guard around both.
    """

    def __init__(self, fastapi: FastAPI, service: RouterService) -> None:
        self._fastapi = fastapi
        self._relay = RelayApp(service)
        self._service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] in FORWARDED
            and scope["method"] == "POST"
            and self._service.forwards
        ):
            await self._relay(scope, receive, send)
        else:
            await self._fastapi(scope, receive, send)


class _Guard:
    """The bearer token and the body size, checked before any route runs.

    Plain ASGI on purpose: Starlette's ``@app.middleware("http")`` would pass
    every chunk of every stream through an extra task and memory channel, a
    large share of what relaying a stream costs the router.
    """

    def __init__(self, app: ASGIApp, *, api_key: str, max_body_bytes: int) -> None:
        self._app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self._refusal(scope)
            if refused is not None:
                await error_response(refused)(scope, receive, send)
                return
        await self._app(scope, receive, send)

    def _refusal(self, scope: Scope) -> ApiError | None:
        headers = Headers(scope=scope)
        expected, token = self._expected, headers.get("authorization", "").encode()
        if expected is not None and scope["path"] not in _OPEN_PATHS and not hmac.compare_digest(token, expected):
            return ApiError(401, "missing or wrong bearer token")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self._max_body_bytes):
            return ApiError(413, f"request body larger than {self._max_body_bytes} bytes")
        return None


async def _run(service: RouterService, request: Request, batch: list[ParsedRequest]) -> Response:
    """Serve ``batch`` (one prompt, unless a completions request sent several) on our workers: each prompt is
    routed, run and retried on its own, and their outputs are joined (:mod:`kvstore.openai.batch`)."""
    first = batch[0]
    prefix = "chatcmpl" if first.kind == "chat" else "cmpl"
    # vLLM's form: the prefix, then the client's x-request-id if it sent one
    request_id = f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"
    prompts = [Prompt(p.token_ids, p.cache_salt, p.lora_name) for p in batch]
    routes = [service.route(prompt) for prompt in prompts]
    generates = [
        GenerateRequest(p.token_ids, p.max_tokens, rid, p.cache_salt, p.lora_name, p.sampling)
        for p, rid in zip(batch, batch_ids(request_id, len(batch)), strict=True)
    ]
    if first.stream:
        opened = await _all(service.open, prompts, generates, routes)
    else:
        try:  # the whole answer is collected (retryable until then); a client that leaves cancels it
            opened = await until_disconnected(request, _all(service.complete, prompts, generates, routes))
        except ClientDisconnected:
            return Response(status_code=499)
    tokenizer = service.tokenizer
    assert tokenizer is not None
    replica, route = batch_route(routes, [o.replica for o in opened])
    retried = any(o.retried for o in opened)
    builder = ResponseBuilder(
        first,
        tokenizer,
        model=service.model_name,
        request_id=request_id,
        extras=lambda stats: kvstore_extras(replica, retried, route, stats),
        batch=batch,
    )
    headers = routing_headers(replica, retried, route)
    chunks = joined([o.chunks for o in opened], first.sampling.n, request_id)
    return await respond(request, builder, chunks, headers=headers)


async def _all(
    start: Callable[[Prompt, GenerateRequest, RouteResult], Awaitable[Opened]],
    prompts: list[Prompt],
    generates: list[GenerateRequest],
    routes: list[RouteResult],
) -> list[Opened]:
    """Every prompt's request opened (or collected) at once; if one fails, the others are closed and it raises."""
    if len(prompts) == 1:
        return [await start(prompts[0], generates[0], routes[0])]
    tasks = [asyncio.ensure_future(start(*args)) for args in zip(prompts, generates, routes, strict=True)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        settled = await asyncio.gather(*tasks, return_exceptions=True)
        for done in settled:
            if isinstance(done, Opened):
                await done.chunks.aclose()
        raise
    return [task.result() for task in tasks]


_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])


def _top_level_keys(body: bytes) -> dict[str, msgspec.Raw]:
    """The body's top-level members, undecoded; {} when it is no JSON object (reading it says why)."""
    try:
        return _KEYS.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return {}
