"""Sending a routed request to its replica, and retrying it elsewhere when the replica fails first.

A request is retried at most once, on another healthy replica, and only
when the first replica failed before the client received anything
(ReplicaUnavailable; the replica is then marked unhealthy): for a stream,
before its first chunk (or an external replica's status line); for a plain
request, before the whole answer exists -- a worker that dies mid-decode
costs a plain request a recomputation elsewhere, not an error. Once output
has reached the client a retry would repeat it, so a failure then ends the
stream with an error event. A request a replica refuses as invalid
(ReplicaRejected) would be refused anywhere: the client gets 400.

An external replica's answer is the replica's: whatever its status, it goes
to the client as it came, once, and says nothing about the replica's health
(vLLM answers 500/501 for one request's own failure: sending it elsewhere
would run a bad request twice and mark a good fleet unhealthy; the health
poll judges replicas). The one exception is 502, 503 and 504 -- a proxy or a
draining server saying the request was not processed -- which is tried once
on another replica, still without marking the first; when no other can take
it, the client gets that answer as it came. A request that went out and got
no status line within the replica's timeout (ReplicaTimedOut: vLLM writes a
plain answer's only after its whole decode) is not sent again -- it may
still be running -- and the client gets 504 (its connection to the replica
closed, which makes vLLM abort it).

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
    ReplicaTimedOut,
    ReplicaUnavailable,
)
from kvstore.router.index_lookup import NO_MATCH
from kvstore.router.metrics import RouterMetrics
from kvstore.router.replicas import Replica, ReplicaSet
from kvstore.router.routing import Prompt, RouteResult
from kvstore.worker_api import GenerateRequest, StreamChunk

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 2
# An external replica's statuses that say the request was not processed there (a proxy in front of it, a server
# draining): tried once elsewhere, and relayed as they came when no other replica can take the request.
NOT_PROCESSED = frozenset({502, 503, 504})
T = TypeVar("T")


class _Declined(Exception):
    """A replica's answer that another replica may be asked instead (NOT_PROCESSED); the answer is kept open.

    ``keep()``: the answer to relay after all; ``drop()``: discard it (its prefill finished, connection closed).
    """

    def __init__(self, reason: str, keep: Callable[[], Any], drop: Callable[[], Awaitable[None]]) -> None:
        super().__init__(reason)
        self.keep = keep
        self.drop = drop


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
        """POST the client's ``body`` to ``path`` (with the client's ``?query``) on a replica, unchanged.

        Returns once a replica answered with a status line, whatever the status; its body is relayed as it
        arrives (module docstring: which answers are tried on another replica first). Raises ApiError(503)
        when the replica gave no answer and no other could serve, ApiError(504) when it took the request
        and gave no answer in time.
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

            def keep() -> Forwarded:
                return upstream._replace(body=self._relay_bytes(replica, prefill, upstream, started))

            if upstream.status in NOT_PROCESSED:

                async def drop() -> None:
                    replica.prefill.finished(prefill)
                    await upstream.close()

                raise _Declined(f"{replica.spec.name} answered {upstream.status}", keep, drop)
            return keep()

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
                # the replica's answer, relayed whole: counted by its status, as one of the router's own would be
                outcome = "ok" if upstream.status < 400 else "rejected" if upstream.status < 500 else "failed"
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
        held: tuple[_Declined, str] | None = None  # a declined answer, relayed if no other replica answers
        try:
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
                except ReplicaTimedOut as exc:  # it took the request and may still run it: never sent again
                    logger.warning("replica %s did not answer in time: %s", target, exc)
                    self._metrics.finished("failed")
                    raise ApiError(504, f"replica {target} did not answer in time: {public_reason(exc)}") from None
                except _Declined as declined:  # not processed there: another replica may take it (health untouched)
                    retry = self._retry_target(prompt, tried) if len(tried) < MAX_ATTEMPTS else None
                    if retry is None:
                        return declined.keep(), target, len(tried) > 1
                    logger.info("%s; trying %s", declined, retry)
                    if held is not None:
                        await held[0].drop()
                    held = (declined, target)
                    self._metrics.retried()
                    target = retry
                except ReplicaUnavailable as exc:
                    logger.warning("replica %s failed a request: %s", target, exc)
                    self._replicas.mark_unhealthy(target)
                    retry = self._retry_target(prompt, tried)
                    if retry is None or len(tried) >= MAX_ATTEMPTS:
                        if held is not None:  # an earlier replica's own answer beats one of the router's
                            kept, name = held
                            held = None
                            return kept.keep(), name, len(tried) > 1
                        self._metrics.finished("failed")
                        reason = public_reason(exc)
                        raise ApiError(
                            503, f"replica {target} failed and no other replica could serve: {reason}"
                        ) from None
                    self._metrics.retried()
                    target = retry
        finally:
            if held is not None:  # another replica answered, or the request ended otherwise
                await held[0].drop()

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
