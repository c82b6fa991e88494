"""The router service: the one object the HTTP app and the deployers drive.

It wires the parts, each in its own module: the replicas and their health
(:mod:`~kvstore.router.replicas`), the node tiers' streams
(:mod:`~kvstore.router.tier_watch`), the prefix index and the event listener
feeding it, routing (:mod:`~kvstore.router.routing`), dispatch with retries
(:mod:`~kvstore.router.dispatch`), the completion body
(:mod:`~kvstore.router.response`) and metrics (:mod:`~kvstore.router.metrics`).

Thread model: HTTP handlers and the health task run on one asyncio loop;
the listener thread writes the index, which is internally locked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from kvstore.hashing import BlockHasher
from kvstore.openai.protocol import ModelLimits, ParsedPrompt
from kvstore.openai.tokenizer import Tokenizer
from kvstore.router.config import RouterSettings
from kvstore.router.dispatch import Dispatcher
from kvstore.router.fleet_metrics import PageSources
from kvstore.router.index import PrefixIndex
from kvstore.router.metrics import RouterMetrics
from kvstore.router.replicas import ReplicaSet, ReplicaSpec
from kvstore.router.response import completion_body
from kvstore.router.routing import Router, RouteResult
from kvstore.router.scoring import Scorer
from kvstore.router.streams import ProducerSpec
from kvstore.router.tier_watch import TierLocator, TierWatch
from kvstore.subscriber import EventListener

# The specs it takes are part of its interface: deployers import them from here.
__all__ = ["ProducerSpec", "ReplicaSpec", "RouterService"]

logger = logging.getLogger(__name__)


class RouterService:
    """Routes prompts to replicas by cached prefix and load, and proxies completions."""

    def __init__(
        self,
        config: RouterSettings,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        *,
        registry: CollectorRegistry | None = None,
        seed: int | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits
        self.hasher = BlockHasher.from_config(config.cache)
        self.index = PrefixIndex(config.cache)
        self.scorer = Scorer(config.router, config.cache.block_size)
        self.listener = EventListener(self.index, sync_timeout_s=config.router.sync_timeout_s)
        self.registry = registry or CollectorRegistry()
        self._rng = random.Random(seed)  # the scorer's tie-breaks and the baselines' draws
        self._replicas = ReplicaSet(self.index, self.listener, config.router)
        self._tiers = TierWatch(self.index, self.listener)
        self._pages = PageSources()
        self._router = Router(self.hasher, self.index, self.scorer, self._rng)
        self._metrics = RouterMetrics(self.registry, self.listener, self._replicas.healthy_count, self._fleet_pages)
        self._dispatcher = Dispatcher(self._replicas, self.route, self._metrics, self.hasher.block_size)
        self._health_task: asyncio.Task[None] | None = None

    # --------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self.listener.start()
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(), name="router-health")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        self.listener.close()
        await self._replicas.close()

    # ---------------------------------------------------------------- registry

    def add_replica(self, spec: ReplicaSpec) -> None:
        """Register (or replace) a replica and subscribe to its event stream."""
        self._replicas.add(spec)

    def remove_replica(self, name: str) -> None:
        """Forget a replica and its blocks."""
        self._replicas.remove(name)

    def replica_names(self) -> list[str]:
        return list(self._replicas)

    def add_tier_producer(
        self,
        node: str,
        producer: ProducerSpec,
        *,
        shared_storage: bool = False,
        locate: TierLocator | None = None,
    ) -> None:
        """A node tier's stream: its blocks count for every replica of ``node``.

        With ``shared_storage`` its STORAGE blocks count for every replica of the cluster.
        ``locate``, when given, is asked on every health poll where the tier's event
        endpoints are now (see :meth:`poll_tiers`).
        """
        self._tiers.add(node, producer, shared_storage=shared_storage, locate=locate)

    def tier_producers(self) -> dict[str, ProducerSpec]:
        """The tier streams subscribed to now, by producer name."""
        return self._tiers.producers()

    async def poll_tiers(self) -> None:
        """Follow every watched tier: down, its blocks leave the index; moved, resubscribe to its new endpoints."""
        await self._tiers.poll()

    def add_metrics_source(self, name: str, fetch: Callable[[], Awaitable[str]]) -> None:
        """Another Prometheus page (e.g. a node's tier actor) polled with the replicas and merged into /metrics."""
        self._pages.add(name, fetch)

    # ------------------------------------------------------- routing, dispatch

    def route(self, prompt: ParsedPrompt) -> RouteResult:
        """Choose a healthy replica for the prompt under ``router.policy``; ApiError(503) when none is healthy."""
        routed = self._router.route(prompt, self._replicas.healthy(), self.config.router.policy)
        self._metrics.routed(routed.decision.replica, routed.route_s)
        return routed

    async def complete(self, prompt: ParsedPrompt) -> dict[str, Any]:
        """Route, dispatch (retrying once elsewhere on ReplicaUnavailable) and build the OpenAI response."""
        request_id = f"cmpl-{uuid.uuid4().hex}"
        routed = self.route(prompt)
        done = await self._dispatcher.dispatch(prompt, request_id, routed)
        return completion_body(
            request_id,
            prompt,
            done.replica,
            routed,
            done.result,
            retried=done.retried,
            tokenizer=self.tokenizer,
            default_model=self.config.router.model_name,
        )

    # ------------------------------------------------------------------ health

    async def poll_health(self) -> None:
        """Poll every watched tier, metrics source and replica once; update health."""
        await self._tiers.poll()
        await self._pages.poll()
        await self._replicas.poll()

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.poll_health()
            except Exception:
                logger.exception("health poll failed")
            await asyncio.sleep(self.config.router.health_interval_s)

    def workers(self) -> list[dict[str, Any]]:
        """Per replica: health, load, in-flight work and its event stream's health (``GET /workers``)."""
        return self._replicas.summary({h.producer: h for h in self.listener.health()})

    def healthy_count(self) -> int:
        return self._replicas.healthy_count()

    def _fleet_pages(self) -> list[str]:
        """The healthy replicas' Prometheus pages and the other sources', merged into /metrics."""
        return self._replicas.pages() + self._pages.pages()
