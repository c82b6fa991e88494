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
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from kvstore.hashing import BlockHasher
from kvstore.openai.http import model_card
from kvstore.openai.protocol import ModelLimits
from kvstore.openai.tokenizer import Tokenizer
from kvstore.router.backends import HttpBackend
from kvstore.router.config import RouterSettings
from kvstore.router.dispatch import Dispatcher, Opened, Relayed
from kvstore.router.fleet_metrics import PageSources
from kvstore.router.index import PrefixIndex
from kvstore.router.metrics import RouterMetrics
from kvstore.router.replicas import ReplicaSet, ReplicaSpec
from kvstore.router.routing import Prompt, Router, RouteResult
from kvstore.router.scoring import Scorer
from kvstore.router.streams import ProducerSpec
from kvstore.router.tier_watch import TierLocator, TierWatch
from kvstore.subscriber import EventListener
from kvstore.worker_api import GenerateRequest

# The specs it takes are part of its interface: deployers import them from here.
__all__ = ["ProducerSpec", "ReplicaSpec", "RouterService"]

logger = logging.getLogger(__name__)


class RouterService:
    """Routes prompts to replicas by cached prefix and load, and proxies completions.

    A fleet is of one kind: our workers (the router parses each request and
    runs it on a worker through the typed contract), or external OpenAI
    servers (the router forwards each body untouched: :attr:`forwards`).
    ``tokenizer`` is the replicas' (None: text cannot be read, only token ids).
    """

    def __init__(
        self,
        config: RouterSettings,
        tokenizer: Tokenizer | None,
        limits: ModelLimits,
        *,
        registry: CollectorRegistry | None = None,
        seed: int | None = None,
        model_name: str | None = None,
    ) -> None:
        """``model_name``: the served model of our workers (default ``router.model_name``)."""
        self.config = config
        self.model_name = model_name or config.router.model_name
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
        self._router = Router(self.hasher, self.index, self.scorer, self._rng, config.router.hash_memo_blocks)
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
        """Register (or replace) a replica and subscribe to its event stream; a fleet is of one kind."""
        kinds = {isinstance(r.spec.backend, HttpBackend) for r in self._replicas.values() if r.spec.name != spec.name}
        if kinds and kinds != {isinstance(spec.backend, HttpBackend)}:
            raise ValueError(f"replica {spec.name}: a fleet is either our workers or external servers, not both")
        self._replicas.add(spec)

    @property
    def forwards(self) -> bool:
        """True when the replicas are external servers, to which client bodies are forwarded unchanged."""
        return any(isinstance(r.spec.backend, HttpBackend) for r in self._replicas.values())

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

    def route(self, prompt: Prompt) -> RouteResult:
        """Choose a healthy replica under ``router.policy`` -- one that serves the model the prompt names, when
        any does; ApiError(503) when none is healthy."""
        healthy = self._replicas.healthy()
        # A mixed fleet: only the replicas that serve the model the client named. When none lists it, any
        # replica answers (with its own 404, as it would without a router in front).
        candidates = [replica for replica in healthy if replica.serves(prompt.model)] or healthy
        routed = self._router.route(prompt, candidates, self.config.router.policy)
        self._metrics.routed(routed.decision.replica, routed.route_s)
        return routed

    async def open(self, prompt: Prompt, request: GenerateRequest, routed: RouteResult) -> Opened:
        """Start ``request`` on one of our workers (retrying once elsewhere if it fails before its first chunk)."""
        return await self._dispatcher.stream(prompt, request, routed)

    async def complete(self, prompt: Prompt, request: GenerateRequest, routed: RouteResult) -> Opened:
        """Run a plain (not streamed) request to its end on one of our workers, retrying once on failure."""
        return await self._dispatcher.collect(prompt, request, routed)

    async def relay(
        self, prompt: Prompt, routed: RouteResult, path: str, body: bytes, headers: Mapping[str, str]
    ) -> Relayed:
        """Forward a client's body unchanged to an external replica (retrying once elsewhere before any answer)."""
        return await self._dispatcher.forward(prompt, routed, path, body, headers)

    def models(self) -> list[dict[str, Any]]:
        """``/v1/models``: the served model of our workers, or the cards the healthy external replicas list."""
        if not self.forwards:
            return [model_card(self.model_name, self.limits.max_context)]
        cards: dict[str, dict[str, Any]] = {}
        for replica in self._replicas.healthy():
            for card in replica.models:
                cards.setdefault(card["id"], card)
        return list(cards.values())

    @property
    def metrics(self) -> RouterMetrics:
        """The router's own metrics: the HTTP front wraps its completion routes in their RequestCounting."""
        return self._metrics

    def counted(self, outcome: str) -> None:
        """Count a request the router answered itself (a 4xx before any replica saw it)."""
        self._metrics.finished(outcome)  # type: ignore[arg-type]

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
