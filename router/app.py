"""The router's HTTP front (FastAPI).

Routes: ``POST /v1/completions`` (OpenAI-compatible, proxied to the chosen
replica), ``POST /route`` (the decision only, with per-replica scores),
``GET /workers``, ``GET /healthz``, ``GET /metrics``.

Every failure is an OpenAI-style error body: 400 for bad input (each check
names the field), 401 without the configured bearer token, 413 for an
oversized body, 503 when no healthy replica can serve.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstore.openai.protocol import ApiError, decode_request, prompt_token_ids, validate
from kvstore.router.response import medium_dict
from kvstore.router.service import RouterService

_OPEN_PATHS = frozenset({"/healthz"})


def create_app(service: RouterService, *, manage_lifecycle: bool = True) -> FastAPI:
    """Build the app around a service. With ``manage_lifecycle`` the app starts and closes it."""
    config = service.config.router

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await service.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await service.close()

    app = FastAPI(title="kvstore router", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if config.api_key and request.url.path not in _OPEN_PATHS:
            header = request.headers.get("authorization", "")
            expected = f"Bearer {config.api_key}"
            if not hmac.compare_digest(header.encode(), expected.encode()):
                return _error(ApiError(401, "missing or wrong bearer token", kind="authentication_error"))
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > config.max_body_bytes):
            return _error(ApiError(413, f"request body larger than {config.max_body_bytes} bytes"))
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(ApiError(exc.status_code, str(exc.detail)))

    async def parse(request: Request) -> Any:
        body = await _read_body(request, config.max_body_bytes)
        req = decode_request(body)
        tokens = prompt_token_ids(req, service.tokenizer.encode)
        return validate(req, tokens, service.limits)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        prompt = await parse(request)
        return JSONResponse(await service.complete(prompt))

    @app.post("/route")
    async def route(request: Request) -> JSONResponse:
        prompt = await parse(request)
        routed = service.route(prompt)
        d = routed.decision
        return JSONResponse(
            {
                "replica": d.replica,
                "scores": d.scores,
                "matched_blocks": {name: medium_dict(m) for name, m in routed.matched.items()},
                "prompt_tokens": len(prompt.token_ids),
                "prompt_blocks": routed.prompt_blocks,
                "route_s": routed.route_s,
            }
        )

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse({"workers": service.workers()})

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        healthy = service.healthy_count()
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "no healthy replica", "healthy_replicas": healthy}, status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """Read at most ``limit`` bytes (a chunked body has no Content-Length to check up front)."""
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)
