"""Serving one request's output over HTTP, plain or streamed, and noticing a client that leaves.

Both fronts that run our workers (the router, and a worker's own HTTP app)
answer the same way: :func:`respond` takes the request's chunks as an async
iterator and either streams them as SSE events the moment each arrives, or
waits for the whole result. In both cases a client that disconnects stops
the work: the chunk iterator is closed, which is how its producer learns to
cancel the request (the worker then frees its blocks within one step).

Contract for ``chunks``: an async generator whose ``aclose()`` cancels the
request if it is still running, and which raises
:class:`~kvstore.openai.errors.ApiError` for failures a client should see.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvstore.openai.bounds import BodyBounds, check_body
from kvstore.openai.errors import ApiError
from kvstore.openai.responses import DONE, ResponseBuilder, sse
from kvstore.worker_api import GenerateResult, StreamChunk, fold_stream

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


async def read_body(request: Request, bounds: BodyBounds) -> bytes:
    """The body, once it is within ``bounds`` (:func:`~kvstore.openai.bounds.check_body`: nothing is decoded).

    A chunked body has no Content-Length to check up front: reading stops with a 413 at the byte limit.
    A client that disconnects before its body is in is an ApiError(499), for the logs: nobody reads it.
    """
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > bounds.max_bytes:
                raise ApiError(413, f"request body larger than {bounds.max_bytes} bytes")
    except ClientDisconnect:  # gone mid-body (or closed by the server's body deadline): nobody reads the answer
        raise ApiError(499, "the client disconnected before its body was read") from None
    data = bytes(body)
    del body  # one copy of the body at a time: bodies of many concurrent clients add up
    check_body(data, bounds)
    return data


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected.

    Call after the body was read: the next ASGI message is then the disconnect. ``work`` runs in the
    calling task -- not a task of its own, which would start only at the event loop's next turn, behind
    every other stream's chunks, on the path to a request's first token. A watcher task waits for the
    disconnect and cancels the caller while ``work`` is still running; a cancellation from anywhere else
    passes through as it came.
    """
    caller = asyncio.current_task()
    assert caller is not None, "until_disconnected runs inside a task"
    working, left = True, False

    async def watch() -> None:
        nonlocal left
        await _disconnect(request)
        if working:  # the loop runs one thing at a time: once work returned, this can no longer cancel it
            left = True
            caller.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        result = await work
    except asyncio.CancelledError:
        if not left:
            raise
        caller.uncancel()
        raise ClientDisconnected() from None
    finally:
        working = False
        watcher.cancel()
    if left:  # work caught the cancellation and returned anyway: the client is gone all the same
        caller.uncancel()
        raise ClientDisconnected()
    return result


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def respond(
    request: Request,
    builder: ResponseBuilder,
    chunks: AsyncGenerator[StreamChunk, None],
    *,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The response for one request whose output is ``chunks`` (see the module docstring)."""
    if builder.parsed.stream:
        return StreamingResponse(_events(builder, chunks), media_type="text/event-stream", headers=headers)
    try:
        result = await until_disconnected(request, _fold(chunks, builder.num_choices))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the status is for logs and metrics
    finally:
        await chunks.aclose()
    return JSONResponse(builder.body(result), headers=headers)


async def _fold(chunks: AsyncIterator[StreamChunk], n: int) -> GenerateResult:
    return fold_stream([chunk async for chunk in chunks], n)


async def _events(builder: ResponseBuilder, chunks: AsyncGenerator[StreamChunk, None]) -> AsyncIterator[bytes]:
    # A client that goes away cancels this generator (Starlette); closing ``chunks`` cancels the request.
    try:
        async for chunk in chunks:
            for event in builder.events(chunk):
                yield event
    except ApiError as exc:
        yield sse(exc.body())
    except Exception as exc:
        logger.exception("stream %s failed", builder.id)
        yield sse(ApiError(500, f"the stream failed: {type(exc).__name__}: {exc}").body())
    finally:
        await chunks.aclose()
    yield DONE


async def answered(request: Request, bounds: BodyBounds, answer: Callable[[bytes], dict[str, Any]]) -> Response:
    """The JSON ``answer(body)`` makes of the request's body (``/tokenize``, ``/detokenize``), computed off the
    event loop -- a chat template or a long prompt takes a while; an ApiError as the error body it names."""
    try:
        body = await read_body(request, bounds)
        return JSONResponse(await asyncio.to_thread(answer, body))
    except ApiError as exc:
        return error_response(exc)


def error_response(exc: ApiError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def answer_errors_openai_style(app: FastAPI) -> None:
    """Every error ``app`` answers gets the OpenAI error body (as vLLM's server does): an ApiError a route
    raises, and the framework's own -- an unknown path's 404, a wrong method's 405."""

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(ApiError(exc.status_code, str(exc.detail)), headers=exc.headers)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)


def model_card(name: str, max_context: int | None, owned_by: str = "kvstore") -> dict[str, Any]:
    """One ``/v1/models`` entry, with vLLM's fields (``created``: now, as vLLM stamps each listing; one
    ``model_permission`` with its defaults, as vLLM lists for every model it serves)."""
    created = int(time.time())
    permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                  "organization": "*", "group": None, "is_blocking": False}  # fmt: skip
    return {"id": name, "object": "model", "created": created, "owned_by": owned_by, "root": name,
            "parent": None, "max_model_len": max_context, "permission": [permission]}  # fmt: skip
