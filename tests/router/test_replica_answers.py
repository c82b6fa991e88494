"""What a replica answers is the client's answer: errors relayed as they came, once, and never taken as the
replica's health; only "not processed here" (502/503/504) goes to another replica, and a slow replica is
waited for, not replaced.

Replicas here are small Starlette apps answering as vLLM's server does (its error bodies, its statuses: 500
for a request's own failure, 501 for what it does not implement), each on a real socket, with a router built
by ``kvstore router``'s own code in front of them, all on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kvstore.deploy.config import config_from_dict
from kvstore.deploy.router_cli import build_router
from kvstore.router.app import create_app
from kvstore.router.config import ExternalReplica
from kvstore.router.service import RouterService
from tests.http_servers import ServerThread
from tests.router.router_helpers import wait_for

MODEL = "m"
Handler = Callable[[Request, bytes], Awaitable[Response]]


async def ok(request: Request, body: bytes) -> Response:
    return JSONResponse({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "hi"}]})


def vllm_error(status: int, message: str) -> Response:
    """An error as vLLM's server writes one (its ErrorResponse), with a header of the replica's own."""
    kind = {500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError"}.get(status, "Error")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers={"x-request-id": f"replica-{status}"})


class Replica:
    """A vLLM-like server: ``handler`` answers completions; it keeps each request it received, and its waiting
    gauge (``waiting``) steers the router's choice."""

    def __init__(self, name: str, handler: Handler = ok) -> None:
        self.name = name
        self.handler = handler
        self.seen: list[dict[str, Any]] = []
        self.waiting = 0
        self.disconnected = 0  # requests whose client (the router) hung up before the answer

        async def completions(request: Request) -> Response:
            body = await request.body()
            self.seen.append(
                {"path": request.url.path, "query": request.url.query, "body": body, "headers": request.headers.raw}
            )
            return await self.handler(request, body)

        async def metrics(request: Request) -> Response:
            return PlainTextResponse(f"vllm:num_requests_running 0\nvllm:num_requests_waiting {self.waiting}\n")

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        app = Starlette(
            routes=[
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", completions, methods=["POST"]),
                Route("/metrics", metrics),
                Route("/v1/models", models),
            ]
        )
        self.server = ServerThread(app).start()
        self.url = self.server.url

    def stop(self) -> None:
        self.server.stop()


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Router:
    """``kvstore router`` over some replicas, and a client of it."""

    def __init__(self, replicas: list[Replica], *, model: str | None = None, **router: Any) -> None:
        specs = [ExternalReplica(name=r.name, url=r.url, events=_free_endpoint(), model=model) for r in replicas]
        section = {"health_interval_s": 0.1, "waiting_weight": 1.0, "unhealthy_after": 1, **router}
        config = config_from_dict(
            {"cache": {"block_size": 16}, "router": {**section, "replicas": [msgspec.to_builtins(s) for s in specs]}}
        )
        self.service: RouterService = build_router(config)
        self.server = ServerThread(create_app(self.service)).start()
        self.client = httpx.Client(base_url=self.server.url, timeout=30)
        assert wait_for(lambda: all(w["healthy"] for w in self.workers().values()), timeout=10)

    def post(self, path: str, raw: bytes, **headers: str) -> httpx.Response:
        return self.client.post(path, content=raw, headers={"content-type": "application/json", **headers})

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["name"]: w for w in self.client.get("/workers").json()["workers"]}

    def polled(self, name: str, waiting: int) -> bool:
        return wait_for(lambda: self.workers()[name]["waiting"] == waiting, timeout=10)

    def counted(self) -> dict[tuple[str, str], float]:
        """``kvstore_router_requests_total`` by (code, outcome)."""
        return {
            (sample.labels["code"], sample.labels["outcome"]): sample.value
            for family in text_string_to_metric_families(self.client.get("/metrics").text)
            if family.name == "kvstore_router_requests"
            for sample in family.samples
            if sample.name == "kvstore_router_requests_total" and sample.value
        }

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """Whatever a test starts (replicas, routers), stopped when it ends."""
    started: list[Any] = []
    yield started
    for thing in reversed(started):
        thing.close() if isinstance(thing, Router) else thing.stop()


GOOD = b'{"model":"m","prompt":[1,2,3],"max_tokens":1}'
BAD = b'{"model":"m","prompt":[1,2,3],"max_tokens":1,"user":"bad"}'


@pytest.mark.parametrize(("status", "message"), [(500, "EngineCore hit a request it cannot run"), (501, "n > 1")])
def test_a_replica_s_5xx_is_relayed_once_as_it_came_and_leaves_the_fleet_healthy(
    made: list[Any], status: int, message: str
) -> None:
    """vLLM answers 500/501 for one request's own failure. The client gets that answer -- status, body and
    headers -- from the one replica that ran it; no other replica runs it, and no replica is marked unhealthy
    (so the next ordinary requests are served, and the index keeps their blocks)."""

    async def fails_bad_requests(request: Request, body: bytes) -> Response:
        return vllm_error(status, message) if b'"bad"' in body else await ok(request, body)

    replicas = [Replica(name, fails_bad_requests) for name in ("a", "b")]
    made.extend(replicas)
    router = Router(replicas)
    made.append(router)
    response = router.post("/v1/completions", BAD)
    assert response.status_code == status, response.text
    assert response.json() == {"error": {"message": message, "type": response.json()["error"]["type"], "param": None,
                                         "code": status}}  # fmt: skip
    assert response.headers["x-request-id"] == f"replica-{status}" and response.headers["x-kvstore-retried"] == "false"
    assert sum(len(r.seen) for r in replicas) == 1, "the failed request ran on one replica only"
    assert router.counted() == {("5xx", "failed"): 1.0}, "counted once, as a failure"
    time.sleep(0.3)  # a few health polls: the replicas answer them
    assert all(w["healthy"] for w in router.workers().values()), router.workers()
    for _ in range(4):
        assert router.post("/v1/completions", GOOD).status_code == 200


@pytest.mark.parametrize("status", [502, 503, 504])
def test_not_processed_answers_go_once_to_another_replica_and_else_reach_the_client_as_they_came(
    made: list[Any], status: int
) -> None:
    """502/503/504 say the request was not processed there (a proxy, a draining server): it is tried on another
    replica, the first not marked unhealthy for it (its health poll decides). With no other replica to try, the
    client gets that answer as it came."""

    async def declines(request: Request, body: bytes) -> Response:
        return vllm_error(status, "draining")

    first, other = Replica("first", declines), Replica("other")
    made.extend([first, other])
    other.waiting = 50  # so the router's first choice is the declining replica
    router = Router([first, other], unhealthy_after=1000)
    made.append(router)
    assert router.polled("other", 50)
    response = router.post("/v1/completions", GOOD)
    assert response.status_code == 200, response.text
    assert response.headers["x-kvstore-replica"] == "other" and response.headers["x-kvstore-retried"] == "true"
    assert len(first.seen) == len(other.seen) == 1
    assert router.workers()["first"]["healthy"]
    alone = Router([first])
    made.append(alone)
    response = alone.post("/v1/completions", GOOD)
    assert response.status_code == status and response.json()["error"]["message"] == "draining", response.text
    assert response.headers["x-request-id"] == f"replica-{status}"
    assert alone.workers()["first"]["healthy"]


def test_a_replica_slower_than_the_timeout_is_answered_504_and_not_sent_the_request_again(made: list[Any]) -> None:
    """vLLM writes a plain completion's status line only after its whole decode. A replica slower than
    ``request_timeout_s`` still has the request: it is not sent elsewhere (it would run twice) and the replica is
    not marked unhealthy; the client gets a 504 in vLLM's error shape, and the replica's connection is closed,
    which is how vLLM learns to abort the request."""
    hung_up = asyncio.Event()

    async def slow(request: Request, body: bytes) -> Response:
        if b'"bad"' not in body:
            return await ok(request, body)
        for _ in range(100):  # as vLLM does: the request is aborted once its client disconnects
            if await request.is_disconnected():
                replicas[0].disconnected += 1
                hung_up.set()
                break
            await asyncio.sleep(0.05)
        return await ok(request, body)

    replicas = [Replica("a", slow), Replica("b", slow)]
    made.extend(replicas)
    router = Router(replicas, request_timeout_s=0.5)
    made.append(router)
    started = time.monotonic()
    response = router.post("/v1/completions", BAD)
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["type"] == "GatewayTimeoutError" and error["code"] == 504 and "in time" in error["message"], error
    assert time.monotonic() - started < 3
    assert sum(len(r.seen) for r in replicas) == 1, "the request was sent to a second replica"
    assert wait_for(lambda: sum(r.disconnected for r in replicas) == 1, timeout=5), "the replica never saw it end"
    assert all(w["healthy"] for w in router.workers().values())
    assert router.post("/v1/completions", GOOD).status_code == 200


def test_the_query_string_and_repeated_headers_pass_both_ways_as_they_came(made: list[Any]) -> None:
    """The request goes to the path the client named with its query string, its headers in order (a repeated one
    repeated); the answer's repeated headers -- ``set-cookie`` above all, which no comma may join -- come back
    one line each."""

    async def cookies(request: Request, body: bytes) -> Response:
        answer = await ok(request, body)
        answer.raw_headers += [(b"set-cookie", b"a=1; Expires=Wed, 21 Oct 2026 07:28:00 GMT"),
                               (b"set-cookie", b"b=2"), (b"x-multi", b"one"), (b"x-multi", b"two")]  # fmt: skip
        return answer

    replica = Replica("a", cookies)
    made.append(replica)
    router = Router([replica])
    made.append(router)
    headers = [("content-type", "application/json"), ("x-dup", "1"), ("x-other", "o"), ("x-dup", "2")]
    response = router.client.post("/v1/completions?api-version=2024-06-01&x=a%20b&x=c", content=GOOD, headers=headers)
    assert response.status_code == 200, response.text
    seen = replica.seen[-1]
    assert seen["path"] == "/v1/completions" and seen["query"] == "api-version=2024-06-01&x=a%20b&x=c"
    sent = [(name.decode(), value.decode()) for name, value in seen["headers"] if name.startswith(b"x-")]
    assert sent == [("x-dup", "1"), ("x-other", "o"), ("x-dup", "2")]
    assert response.headers.get_list("set-cookie") == ["a=1; Expires=Wed, 21 Oct 2026 07:28:00 GMT", "b=2"]
    assert response.headers.get_list("x-multi") == ["one", "two"]


@pytest.mark.parametrize(
    ("raw", "forwarded"),
    [
        # Every byte but the model's value as sent: spacing, escapes, number spellings, key order, a number no
        # float holds, duplicate keys (the last model is the one a parser keeps, and the one replaced).
        (b'{ "model" : "alias",\n "prompt":[1,2,3], "max_tokens":1, "stop":["\\u00e9"], "temperature":1.0,'
         b' "vendor_x":1e400, "top_p":1E0, "s":"\\"model\\": \\"no\\"", "nested":{"model":"kept"}}',
         b'{ "model" : "m",\n "prompt":[1,2,3], "max_tokens":1, "stop":["\\u00e9"], "temperature":1.0,'
         b' "vendor_x":1e400, "top_p":1E0, "s":"\\"model\\": \\"no\\"", "nested":{"model":"kept"}}'),
        (b'{"model":"x","prompt":[1],"model":  "alias" ,"max_tokens":1}',
         b'{"model":"x","prompt":[1],"model":  "m" ,"max_tokens":1}'),
        (b'{"mod\\u0065l":"alias","prompt":[1],"max_tokens":1}', b'{"mod\\u0065l":"m","prompt":[1],"max_tokens":1}'),
        # No model: one put first, the rest untouched.
        (b'{"prompt":[1,2],"max_tokens":1,"seed":18446744073709551616}',
         b'{"model": "m", "prompt":[1,2],"max_tokens":1,"seed":18446744073709551616}'),
    ],
    ids=["spelling", "duplicate-keys", "escaped-key", "no-model"],
)  # fmt: skip
def test_the_configured_model_rewrites_only_the_model_value_s_bytes(
    made: list[Any], raw: bytes, forwarded: bytes
) -> None:
    """``[[router.replicas]].model`` replaces the model's value and nothing else: the body is not decoded and
    encoded again (a number beyond a float was a 500 with a traceback; escapes, spellings and key order
    changed)."""
    replica = Replica("a")
    made.append(replica)
    router = Router([replica], model=MODEL)
    made.append(router)
    response = router.post("/v1/completions", raw)
    assert response.status_code == 200, response.text
    assert replica.seen[-1]["body"] == forwarded
