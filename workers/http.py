"""One KV worker behind an OpenAI-compatible HTTP front, no Ray (``kvstore worker`` serves it).

This is a replica exactly as a vLLM server is one: ``POST /v1/completions``
and ``POST /v1/chat/completions`` (plain or ``stream: true``),
``GET /v1/models``, ``GET /health`` (also ``/healthz``), ``GET /metrics`` (503 once the worker
can no longer serve: the router's health poll reads this page), and KV
events on ZeroMQ. A fleet of these behind ``kvstore router`` is the same
deployment as a vLLM fleet behind it, so the plain-HTTP path is tested end
to end without Ray.

Bodies are read within ``bounds`` before anything decodes them
(:mod:`kvstore.openai.bounds`); a model other than the worker's, or any LoRA
adapter (it serves none), is vLLM's 404.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvstore.errors import InvalidRequestError
from kvstore.openai.batch import batch_ids, joined
from kvstore.openai.bounds import BodyBounds
from kvstore.openai.errors import ApiError, model_not_found
from kvstore.openai.http import answer_errors_openai_style, answered, error_response, model_card, read_body, respond
from kvstore.openai.protocol import (
    ModelLimits,
    ParsedRequest,
    detokenize,
    parse_request_async,
    tokenize,
)
from kvstore.openai.responses import ResponseBuilder
from kvstore.worker_api import GenerateRequest, RequestStats, StreamChunk, WorkerShutdownError
from kvstore.workers.stream import RequestStream
from kvstore.workers.worker import KVWorker


def create_worker_app(
    worker: KVWorker,
    *,
    bounds: BodyBounds | None = None,
    trust_template: bool = False,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """An OpenAI-compatible app over ``worker`` (which the caller owns and shuts down).

    ``bounds``: what a request body may hold (default: 4 MiB and :class:`BodyBounds`' defaults).
    ``trust_template``: render a ``chat_template`` a request sends (``router.trust_request_chat_template``).
    ``tool_parser``: parse tool calls out of chat answers (``router.tool_call_parser``; None: no parser).
    ``reasoning_parser``: split chat answers' reasoning from their content (``router.reasoning_parser``).
    """
    bounds = bounds or BodyBounds(4 << 20)
    info = worker.info()
    limits = ModelLimits(info.vocab_size, info.max_context, info.max_new_tokens)
    tokenizer = worker.tokenizer
    app = FastAPI(title=f"kvstore worker {worker.name}", docs_url=None, redoc_url=None)

    answer_errors_openai_style(app)

    async def serve(request: Request, batch: list[ParsedRequest], prefix: str) -> Response:
        """Run each prompt of ``batch`` (one, unless a completions request sent several) as its own request."""
        # vLLM's form: the prefix, then the client's x-request-id if it sent one
        request_id = f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"
        streams = []
        try:
            for parsed, rid in zip(batch, batch_ids(request_id, len(batch)), strict=True):
                generate = GenerateRequest(
                    parsed.token_ids, parsed.max_tokens, rid, parsed.cache_salt, parsed.lora_name, parsed.sampling
                )
                streams.append(await worker.asubmit(generate))
        except (InvalidRequestError, WorkerShutdownError) as exc:
            for stream in streams:  # the prompts already submitted
                stream.cancel()
            raise ApiError(400 if isinstance(exc, InvalidRequestError) else 503, str(exc)) from None

        async def chunks(stream: RequestStream) -> AsyncGenerator[StreamChunk, None]:
            try:
                async for chunk in stream:
                    yield chunk
            except WorkerShutdownError as exc:
                raise ApiError(503, str(exc)) from None
            except InvalidRequestError as exc:  # refused mid-way (a grammar its parser could not follow)
                raise ApiError(400, str(exc)) from None
            finally:
                stream.cancel()  # a no-op once the request finished

        first = batch[0]
        output = joined([chunks(s) for s in streams], first.sampling.n, request_id)
        builder = ResponseBuilder(
            first, tokenizer, model=info.model_name, request_id=request_id, extras=_extras, batch=batch
        )
        return await respond(request, builder, output)

    async def endpoint(request: Request, chat: bool) -> Response:
        try:
            body = await read_body(request, bounds)
            parsed = await parse_request_async(
                body, chat, tokenizer, limits, info.model_name, trust_template=trust_template, tool_parser=tool_parser,
                reasoning_parser=reasoning_parser,
            )  # fmt: skip
        except ApiError as exc:  # answered here: a raised error's traceback would keep the decoded body alive
            return error_response(exc)
        return await serve(request, parsed, "chatcmpl" if chat else "cmpl")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await endpoint(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await endpoint(request, chat=True)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await answered(
            request,
            bounds,
            lambda body: tokenize(body, tokenizer, limits, info.model_name, trust_template=trust_template),
        )

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await answered(request, bounds, lambda body: detokenize(body, tokenizer, limits, info.model_name))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(info.model_name, info.max_context)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != info.model_name:
            raise model_not_found(model_id)
        return JSONResponse(model_card(info.model_name, info.max_context))

    @app.get("/health")
    @app.get("/healthz")  # the router's name for it: either answers, so one probe fits both fronts
    async def health() -> JSONResponse:
        state = worker.health()
        return JSONResponse(state, status_code=200 if state["alive"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # The router's health poll reads this page: a worker that can no longer serve must not look healthy.
        state = worker.health()
        if not state["alive"]:
            reason = state["last_error"] or "shut down"
            raise ApiError(503, f"worker {worker.name} is not serving ({reason})")
        return Response(worker.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


def _extras(stats: RequestStats) -> dict[str, Any]:
    return {
        "replica": stats.replica,
        "cached_tokens": stats.cached_tokens_by_medium,
        "queue_s": stats.queue_s,
        "ttft_s": stats.ttft_s,
        "total_s": stats.total_s,
        "preempted": stats.preempted,
    }
