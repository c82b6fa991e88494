"""Sending a routed request to its replica, and retrying it elsewhere when the replica fails.

A request is retried at most once, on another healthy replica, and only
when the first failed before returning anything (ReplicaUnavailable); a request
a replica refuses as invalid (ReplicaRejected) would be refused anywhere,
so the client gets 400. While a request is out, its replica's
:class:`~kvstore.router.load.PrefillLoad` counts the prefill it was sent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from kvstore.openai.protocol import ApiError, ParsedPrompt
from kvstore.router.backends import ReplicaRejected, ReplicaResult, ReplicaUnavailable
from kvstore.router.index_lookup import NO_MATCH
from kvstore.router.metrics import RouterMetrics
from kvstore.router.replicas import ReplicaSet
from kvstore.router.routing import RouteResult

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 2


class Dispatched(NamedTuple):
    result: ReplicaResult
    replica: str  # the replica that served it
    retried: bool


class Dispatcher:
    """Dispatches to the replicas of one :class:`ReplicaSet`; ``route`` chooses a retry's replica."""

    def __init__(
        self,
        replicas: ReplicaSet,
        route: Callable[[ParsedPrompt], RouteResult],
        metrics: RouterMetrics,
        block_size: int,
    ) -> None:
        self._replicas = replicas
        self._route = route
        self._metrics = metrics
        self._block_size = block_size

    async def dispatch(self, prompt: ParsedPrompt, request_id: str, routed: RouteResult) -> Dispatched:
        """Send ``prompt`` to the routed replica, retrying once elsewhere.

        Raises ApiError: 400 when the replica rejected the request, 503 when
        it failed and no other replica could serve.
        """
        tried: list[str] = []
        target = routed.decision.replica
        while True:
            tried.append(target)
            try:
                result = await self._send(target, prompt, request_id, routed)
                break
            except ReplicaRejected as exc:
                self._metrics.finished("rejected")
                raise ApiError(400, str(exc)) from None
            except ReplicaUnavailable as exc:
                logger.warning("replica %s failed request %s: %s", target, request_id, exc)
                self._replicas.mark_unhealthy(target)
                retry = self._retry_target(prompt, tried)
                if retry is None or len(tried) >= MAX_ATTEMPTS:
                    self._metrics.finished("failed")
                    raise ApiError(503, f"replica {target} failed and no other replica could serve: {exc}") from None
                self._metrics.retried()
                target = retry
        self._metrics.finished("ok")
        self._metrics.served_from_cache(result.cached_tokens_by_medium)
        return Dispatched(result, target, retried=len(tried) > 1)

    def _retry_target(self, prompt: ParsedPrompt, tried: list[str]) -> str | None:
        healthy = [r.spec.name for r in self._replicas.healthy() if r.spec.name not in tried]
        if not healthy:
            return None
        try:
            decision = self._route(prompt).decision
        except ApiError:
            return None
        return decision.replica if decision.replica in healthy else healthy[0]

    async def _send(self, name: str, prompt: ParsedPrompt, request_id: str, routed: RouteResult) -> ReplicaResult:
        replica = self._replicas.get(name)
        if replica is None:
            raise ReplicaUnavailable(f"{name} was removed")
        matched = routed.matched.get(name, NO_MATCH)
        cached_guess = min(matched.total * self._block_size, len(prompt.token_ids) - 1)
        prefill = max(0, len(prompt.token_ids) - cached_guess)
        replica.prefill.dispatched(prefill, time.monotonic())
        try:
            result = await replica.spec.backend.generate(
                prompt.token_ids,
                prompt.max_tokens,
                request_id=request_id,
                cache_salt=prompt.cache_salt,
                lora_name=prompt.lora_name,
            )
        finally:
            replica.prefill.finished(prefill)
        if result.ttft_s is not None and result.queue_s is not None:
            replica.prefill.observe(result.prompt_tokens - result.cached_tokens, result.ttft_s - result.queue_s)
        return result
