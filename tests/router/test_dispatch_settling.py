"""A relayed answer closed before its first chunk still settles: the replica's in-flight load, the request's
count, and the upstream connection (an async generator closed unstarted never runs its own ``finally``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from kvstore.router.backends import HttpBackend
from kvstore.router.dispatch import Dispatcher
from kvstore.router.replicas import Replica, ReplicaSpec
from kvstore.router.routing import Prompt, RouteResult
from kvstore.router.scoring import Decision
from kvstore.router.streams import ProducerSpec
from kvstore.worker_api import StreamChunk
from tests.http_servers import ServerThread


class Finished:
    """The part of RouterMetrics the dispatcher reports a request's end to."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def finished(self, outcome: str) -> None:
        self.outcomes.append(outcome)


def replica_app() -> Starlette:
    async def completions(request: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b'data: {"choices": []}\n\n'
                await asyncio.sleep(0.01)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def test_a_forwarded_answer_closed_before_its_first_chunk_settles_the_replica_and_the_count() -> None:
    server = ServerThread(replica_app()).start()

    async def scenario() -> None:
        backend = HttpBackend("r0", server.url)
        replica = Replica(ReplicaSpec("r0", None, backend, ProducerSpec("r0", "tcp://127.0.0.1:1", None)), 0.0)
        metrics = Finished()
        dispatcher = Dispatcher({"r0": replica}, None, metrics, 16)  # type: ignore[arg-type]
        routed = RouteResult(Decision("r0", {}, None), {}, 4, 0.0)
        for read_first in (False, True):
            relayed = await dispatcher.forward(Prompt(list(range(64))), routed, "/v1/completions", b"{}", {})
            assert (replica.prefill.inflight_requests, replica.prefill.inflight_tokens) == (1, 64)
            body = relayed.upstream.body
            if read_first:
                assert (await anext(body)).startswith(b"data: ")  # type: ignore[call-overload]
            await body.aclose()  # type: ignore[attr-defined]
            assert (replica.prefill.inflight_requests, replica.prefill.inflight_tokens) == (0, 0)
        assert metrics.outcomes == ["cancelled", "cancelled"]
        await backend.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_worker_stream_closed_before_its_first_chunk_is_counted_and_cancelled() -> None:
    async def scenario() -> None:
        closed: list[bool] = []

        async def rest() -> AsyncGenerator[StreamChunk, None]:
            try:
                yield StreamChunk("r", [])
            finally:
                closed.append(True)

        metrics = Finished()
        dispatcher = Dispatcher({}, None, metrics, 16)  # type: ignore[arg-type]
        remaining = rest()
        await anext(remaining)  # started: its own finally runs when closed
        chunks = dispatcher._relay_chunks("w0", StreamChunk("r", []), remaining)
        await chunks.aclose()
        assert metrics.outcomes == ["cancelled"] and closed == [True]
        thrown = dispatcher._relay_chunks("w0", StreamChunk("r", []), rest())
        with pytest.raises(RuntimeError, match="stop"):  # thrown into before its first step
            await thrown.athrow(RuntimeError("stop"))
        assert metrics.outcomes == ["cancelled", "cancelled"]

    asyncio.run(scenario())
