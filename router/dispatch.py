"""Sending a routed request to its replica, and retrying it elsewhere when the replica fails first.

A request is retried at most once, on another healthy replica, and only
when the first replica failed before the client received anything
(ReplicaUnavailable): for a stream, before its first chunk (or an external
replica's status line); for a plain request, before the whole answer
exists -- a worker that dies mid-decode costs a plain request a
recomputation elsewhere, not an error. Once output has reached the client a
retry would repeat it, so a failure then ends the stream with an error
event. A request a replica refuses as invalid (ReplicaRejected) would
be refused anywhere: the client gets 400.

Load bookkeeping: while a request is out, its replica's
:class:`~kvstore.router.load.PrefillLoad` counts the prefill it was sent,
until the first chunk arrives -- the first token exists only once the
prefill is done. The drain rate is learned from what each path can see: our
workers report their queueing and TTFT; for an external replica the router
times the first chunk of a stream itself (a plain answer arrives only after
the whole decode, so it teaches nothing about prefill).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from functools import partial
from typing import Any, NamedTuple, TypeVar

from kvstore.openai.errors import ApiError
from kvstore.router.backends import (
    Forwarded,
    HttpBackend,
    RayActorBackend,
    ReplicaRejected,
    ReplicaUnavailable,
)
from kvstore.router.index_lookup import NO_MATCH
from kvstore.router.metrics import RouterMetrics
from kvstore.router.replicas import Replica, ReplicaSet
from kvstore.router.routing import Prompt, RouteResult
from kvstore.worker_api import GenerateRequest, StreamChunk

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 2
T = TypeVar("T")


class Opened(NamedTuple):
    """A request that reached a replica: which one, whether it was a retry, and its output."""

    replica: str
    retried: bool
    chunks: AsyncGenerator[StreamChunk, None]


class Relayed(NamedTuple):
    replica: str
    retried: bool
    upstream: Forwarded


class Dispatcher:
    """Dispatches to the replicas of one :class:`ReplicaSet`; ``route`` chooses a retry's replica."""

    def __init__(
        self,
        replicas: ReplicaSet,
        route: Callable[[Prompt], RouteResult],
        metrics: RouterMetrics,
        block_size: int,
    ) -> None:
        self._replicas = replicas
        self._route = route
        self._metrics = metrics
        self._block_size = block_size

    # -------------------------------------------------------------- our workers

    async def stream(self, prompt: Prompt, request: GenerateRequest, routed: RouteResult) -> Opened:
        """Open ``request`` on a worker (the routed one, or one retry elsewhere) and return its chunks.

        Returns once the first chunk exists. Closing ``chunks`` cancels the request on the worker.
        Raises ApiError: 400 if the worker refused it, 503 if it failed and no other could serve.
        """

        async def attempt(replica: Replica, prefill: int) -> tuple[StreamChunk, AsyncGenerator[StreamChunk, None]]:
            backend = replica.spec.backend
            assert isinstance(backend, RayActorBackend), f"{replica.spec.name} is not one of our workers"
            chunks = backend.stream(request)
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                raise ReplicaUnavailable(f"{replica.spec.name} ended the stream without output") from None
            except BaseException:
                await chunks.aclose()
                raise
            finally:
                replica.prefill.finished(prefill)
            return first, chunks

        (first, rest), name, retried = await self._try(prompt, routed, attempt)
        return Opened(name, retried, self._relay_chunks(name, first, rest))

    async def collect(self, prompt: Prompt, request: GenerateRequest, routed: RouteResult) -> Opened:
        """Run ``request`` to its end on a worker (retrying once elsewhere if it fails at any point).

        For a plain request: returns with every chunk already received. Cancelling the call cancels
        the request on the worker. Raises as :meth:`stream` does.
        """

        async def attempt(replica: Replica, prefill: int) -> list[StreamChunk]:
            backend = replica.spec.backend
            assert isinstance(backend, RayActorBackend), f"{replica.spec.name} is not one of our workers"
            chunks = backend.stream(request)
            received: list[StreamChunk] = []
            try:
                async for chunk in chunks:
                    if not received:
                        replica.prefill.finished(prefill)
                    received.append(chunk)
            finally:
                if not received:
                    replica.prefill.finished(prefill)
                await chunks.aclose()
            if not received:
                raise ReplicaUnavailable(f"{replica.spec.name} ended the stream without output")
            return received

        received, name, retried = await self._try(prompt, routed, attempt)
        return Opened(name, retried, self._relay_chunks(name, received[0], _replay(received[1:])))

    def _relay_chunks(
        self, name: str, first: StreamChunk, rest: AsyncGenerator[StreamChunk, None]
    ) -> AsyncGenerator[StreamChunk, None]:
        async def settle(outcome: str) -> None:
            self._metrics.finished(outcome)  # type: ignore[arg-type]
            await rest.aclose()

        async def relay() -> AsyncGenerator[StreamChunk, None]:
            outcome = "cancelled"
            try:
                chunk = first
                while True:
                    if chunk.stats is not None:
                        self._learn(name, chunk)
                    yield chunk
                    try:
                        chunk = await anext(rest)
                    except StopAsyncIteration:
                        outcome = "ok"
                        return
            except ReplicaUnavailable as exc:
                outcome = "failed"
                raise ApiError(502, f"replica {name} failed during the stream: {public_reason(exc)}") from None
            finally:
                await settle(outcome)

        return _Settling(relay(), partial(settle, "cancelled"))

    def _learn(self, name: str, last: StreamChunk) -> None:
        stats = last.stats
        assert stats is not None
        self._metrics.served_from_cache(stats.cached_tokens_by_medium)
        replica = self._replicas.get(name)
        if replica is not None:
            replica.prefill.observe(stats.prompt_tokens - stats.cached_tokens, stats.ttft_s - stats.queue_s)

    # --------------------------------------------------------- external replicas

    async def forward(
        self, prompt: Prompt, routed: RouteResult, path: str, body: bytes, headers: Mapping[str, str]
    ) -> Relayed:
        """POST the client's ``body`` to a replica (the routed one, or one retry elsewhere), unchanged.

        Returns once the replica answered with a status; its body is relayed as it arrives.
        Raises ApiError(503) when it failed and no other replica could serve.
        """
        started = time.monotonic()

        async def attempt(replica: Replica, prefill: int) -> Forwarded:
            backend = replica.spec.backend
            assert isinstance(backend, HttpBackend), f"{replica.spec.name} is not an HTTP replica"
            try:
                upstream = await backend.forward(path, body, headers)
            except BaseException:
                replica.prefill.finished(prefill)
                raise
            relayed = self._relay_bytes(replica, prefill, upstream, started)
            return upstream._replace(body=relayed)

        try:
            upstream, name, retried = await self._try(prompt, routed, attempt)
        except asyncio.CancelledError:  # the client left before the replica answered
            self._metrics.finished("cancelled")
            raise
        return Relayed(name, retried, upstream)

    def _relay_bytes(
        self, replica: Replica, prefill: int, upstream: Forwarded, started: float
    ) -> AsyncGenerator[bytes, None]:
        async def settle(pending: bool, outcome: str) -> None:
            if pending:  # the prefill still counted as in flight
                replica.prefill.finished(prefill)
            self._metrics.finished(outcome)  # type: ignore[arg-type]
            await upstream.close()

        async def relay() -> AsyncGenerator[bytes, None]:
            pending = True
            outcome = "cancelled"
            try:
                async for data in upstream.body:
                    if pending:
                        pending = False
                        replica.prefill.finished(prefill)
                        if _is_event_stream(upstream.headers):
                            replica.prefill.observe(prefill, time.monotonic() - started)
                    yield data
                outcome = "ok" if upstream.status < 400 else "rejected"
            except Exception:  # the answer broke off (not the client leaving: that closes or cancels this generator)
                outcome = "failed"
                raise
            finally:
                await settle(pending, outcome)

        return _Settling(relay(), partial(settle, True, "cancelled"))

    # ------------------------------------------------------------------ shared

    async def _try(
        self, prompt: Prompt, routed: RouteResult, attempt: Callable[[Replica, int], Awaitable[T]]
    ) -> tuple[T, str, bool]:
        tried: list[str] = []
        target = routed.decision.replica
        while True:
            tried.append(target)
            replica = self._replicas.get(target)
            try:
                if replica is None:
                    raise ReplicaUnavailable(f"{target} was removed")
                prefill = self._prefill_guess(prompt, routed, target)
                replica.prefill.dispatched(prefill, time.monotonic())
                return await attempt(replica, prefill), target, len(tried) > 1
            except ReplicaRejected as exc:
                self._metrics.finished("rejected")
                raise ApiError(400, str(exc)) from None
            except ReplicaUnavailable as exc:
                logger.warning("replica %s failed a request: %s", target, exc)
                self._replicas.mark_unhealthy(target)
                retry = self._retry_target(prompt, tried)
                if retry is None or len(tried) >= MAX_ATTEMPTS:
                    self._metrics.finished("failed")
                    reason = public_reason(exc)
                    raise ApiError(503, f"replica {target} failed and no other replica could serve: {reason}") from None
                self._metrics.retried()
                target = retry

    def _prefill_guess(self, prompt: Prompt, routed: RouteResult, name: str) -> int:
        matched = routed.matched.get(name, NO_MATCH)
        tokens = len(prompt.token_ids)
        cached = min(matched.total * self._block_size, max(tokens - 1, 0))
        return max(0, tokens - cached)

    def _retry_target(self, prompt: Prompt, tried: list[str]) -> str | None:
        untried = [r for r in self._replicas.healthy() if r.spec.name not in tried]
        healthy = [r.spec.name for r in untried if r.serves(prompt.model)] or [r.spec.name for r in untried]
        if not healthy:
            return None
        try:
            decision = self._route(prompt).decision
        except ApiError:
            return None
        return decision.replica if decision.replica in healthy else healthy[0]


def public_reason(exc: BaseException) -> str:
    """What a client is told of a replica's failure: its first line. The rest -- Ray's actor ids, process ids
    and node addresses -- is for the router's log (which has it whole), not for whoever sent the request."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first if len(first) <= 300 else first[:297] + "..."


class _Settling(AsyncGenerator[T, None]):
    """A relay generator whose clean-up also runs when it is closed before its first step.

    An async generator closed unstarted never runs its body, ``finally`` included: a client gone before
    the first chunk was read (or the other prompts of a batch one of which failed) would leave the
    replica's in-flight load counted for good, the request uncounted in the metrics and the upstream
    connection open. ``unstarted`` is that clean-up, run by :meth:`aclose` in that case (once).
    """

    def __init__(self, gen: AsyncGenerator[T, None], unstarted: Callable[[], Awaitable[None]]) -> None:
        self._gen = gen
        self._unstarted: Callable[[], Awaitable[None]] | None = unstarted

    async def asend(self, value: None) -> T:
        self._unstarted = None  # from its first step on, the generator's own finally settles it
        return await self._gen.asend(value)

    async def athrow(self, typ: Any, val: Any = None, tb: Any = None) -> T:
        unstarted, self._unstarted = self._unstarted, None
        try:
            return await self._gen.athrow(typ, val, tb)
        finally:
            if unstarted is not None:  # thrown into before its first step: its body never ran
                await unstarted()

    async def aclose(self) -> None:
        unstarted, self._unstarted = self._unstarted, None
        await self._gen.aclose()
        if unstarted is not None:
            await unstarted()


async def _replay(chunks: list[StreamChunk]) -> AsyncGenerator[StreamChunk, None]:
    for chunk in chunks:
        yield chunk


def _is_event_stream(headers: Mapping[str, str]) -> bool:
    return str(headers.get("content-type", "")).startswith("text/event-stream")
