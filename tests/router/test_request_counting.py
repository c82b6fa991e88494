"""Every completion request counted once, by outcome and the class of the status the client got.

A small ASGI app stands in for the router's front: one endpoint per way a
request can end (an answer, a refusal by the app or by a guard middleware
before it, a crash, a 499, a stream that completes, fails after its 200 or
loses its client), so each case is exact; RequestCounting wraps it as it
wraps the real app. Without RequestCounting the dispatcher's reports count.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from starlette.types import Message

from kvstore.router.metrics import RequestCounting, RouterMetrics
from kvstore.subscriber import EventListener

PATH = "/v1/completions"


class NoSink:
    def apply_batch(self, *args: object) -> None:
        pass

    def reset_producer(self, producer: str) -> None:
        pass


def new_metrics() -> tuple[RouterMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return RouterMetrics(registry, EventListener(NoSink()), lambda: 1.0, lambda: []), registry


def counts(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    out = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "kvstore_router_requests_total" and sample.value:
                out[(sample.labels["outcome"], sample.labels["code"])] = sample.value
    return out


def front(metrics: RouterMetrics) -> Starlette:
    """An app whose completion endpoint ends each request as its ``case`` query parameter says."""

    async def stream(fail: bool) -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        if fail:  # as the dispatcher reports a replica lost mid-stream, then the app's error event
            metrics.finished("failed")
            yield b'data: {"error": {}}\n\n'
            return
        yield b"data: [DONE]\n\n"

    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"data: 1\n\n"
                await asyncio.sleep(0.01)
        finally:
            metrics.finished("cancelled")  # as the dispatcher reports it; the front saw it already

    async def completions(request: Request) -> Response:
        case = request.query_params["case"]
        if case == "ok":
            metrics.finished("ok")
            return JSONResponse({"choices": []})
        if case == "invalid":
            metrics.finished("rejected")  # as the app reports a body it refused
            return JSONResponse({"error": {}}, status_code=400)
        if case == "no_replica":
            return JSONResponse({"error": {}}, status_code=503)
        if case == "client_left":
            return Response(status_code=499)
        if case == "crash":
            raise RuntimeError("a bug")
        if case == "endless":
            return StreamingResponse(endless(), media_type="text/event-stream")
        return StreamingResponse(stream(fail=case == "stream_fails"), media_type="text/event-stream")

    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.headers.get("authorization") != "Bearer k":
            return JSONResponse({"error": {}}, status_code=401)
        return await call_next(request)

    async def workers(request: Request) -> Response:
        return JSONResponse({"workers": []})

    app = Starlette(routes=[Route(PATH, completions, methods=["POST"]), Route("/workers", workers)])
    app.add_middleware(BaseHTTPMiddleware, dispatch=guard)
    app.add_middleware(RequestCounting, metrics=metrics, paths=[PATH])  # outermost, as the router adds it
    return app


def test_every_request_is_counted_once_by_outcome_and_status_class() -> None:
    metrics, registry = new_metrics()
    sent = {
        "ok": ("ok", "2xx"),
        "stream_ok": ("ok", "2xx"),
        "stream_fails": ("failed", "2xx"),
        "invalid": ("rejected", "4xx"),
        "client_left": ("cancelled", "4xx"),
        "no_replica": ("failed", "5xx"),
        "crash": ("failed", "5xx"),
    }
    with TestClient(front(metrics), raise_server_exceptions=False) as client:
        auth = {"authorization": "Bearer k"}
        for case in sent:
            client.post(PATH, params={"case": case}, headers=auth)
        assert client.post(PATH, params={"case": "ok"}).status_code == 401  # refused by the guard
        assert client.get("/workers", headers=auth).status_code == 200  # not a completion: not counted
    expected: dict[tuple[str, str], float] = {("rejected", "4xx"): 1.0}  # the guard's 401
    for label in sent.values():
        expected[label] = expected.get(label, 0.0) + 1
    assert counts(registry) == expected
    # A report from outside any request (a stream closed later by the garbage collector) counts nothing.
    metrics.finished("cancelled")
    assert counts(registry) == expected


def test_a_stream_whose_client_leaves_is_cancelled_with_its_200() -> None:
    """The client goes away after the first chunk; the guard (a BaseHTTPMiddleware) between it and the
    stream still ends the body it relays, which the server drops: cancelled, not answered."""
    metrics, registry = new_metrics()
    first_chunk = asyncio.Event()
    sent: list[Message] = []
    received: list[Message] = []

    async def receive() -> Message:
        """The request's (empty) body, then the disconnect once the first chunk went out."""
        if received:
            await first_chunk.wait()
        received.append({"type": "http.disconnect"} if received else {"type": "http.request", "body": b""})
        return received[-1]

    async def send(message: Message) -> None:
        sent.append(message)  # as uvicorn does after a disconnect (ASGI spec 2.3): nothing, no error
        if message["type"] == "http.response.body" and message.get("body"):
            first_chunk.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "path": PATH, "raw_path": PATH.encode(), "query_string": b"case=endless",
        "headers": [(b"authorization", b"Bearer k")], "scheme": "http", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 1), "root_path": "",
    }  # fmt: skip
    asyncio.run(asyncio.wait_for(front(metrics)(scope, receive, send), 10))
    assert sent[0]["status"] == 200 and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert counts(registry) == {("cancelled", "2xx"): 1.0}


@pytest.mark.parametrize(
    ("outcome", "code"), [("ok", "2xx"), ("rejected", "4xx"), ("failed", "5xx"), ("cancelled", "4xx")]
)
def test_without_the_front_the_dispatchers_reports_count(outcome: str, code: str) -> None:
    metrics, registry = new_metrics()
    metrics.finished(outcome)  # type: ignore[arg-type]
    assert counts(registry) == {(outcome, code): 1.0}
