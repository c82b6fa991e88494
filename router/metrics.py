"""The router's own Prometheus metrics (``kvstore_router_*``), and the collectors of its /metrics page.

The page also carries the event listener's per-producer health and the
fleet's own ``kvstore_*`` families (:mod:`kvstore.router.fleet_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstore.events import Medium
from kvstore.metrics import EventStreamCollector
from kvstore.router.fleet_metrics import MergedPagesCollector
from kvstore.subscriber import EventListener

Outcome = Literal["ok", "rejected", "failed", "cancelled"]
"""How a request sent to a replica ended: served, refused (4xx), failed (5xx, or everywhere it was tried), or
cancelled because its client went away."""


class RouterMetrics:
    """Counters of routing and dispatch, registered in ``registry`` with the page's other collectors."""

    def __init__(
        self,
        registry: CollectorRegistry,
        listener: EventListener,
        healthy_replicas: Callable[[], float],
        fleet_pages: Callable[[], list[str]],
    ) -> None:
        """``healthy_replicas`` and ``fleet_pages`` are read at scrape time."""
        self._decisions = Counter("kvstore_router_decisions", "Routing decisions.", ["replica"], registry=registry)
        self._route_seconds = Histogram(
            "kvstore_router_route_seconds",
            "Time to choose a replica (hash + lookup + score).",
            registry=registry,
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1),
        )
        self._requests = Counter(
            "kvstore_router_requests", "Completion requests by outcome.", ["outcome"], registry=registry
        )
        self._retries = Counter("kvstore_router_retries", "Requests retried on another replica.", registry=registry)
        self._cached_tokens = Counter(
            "kvstore_router_cached_tokens", "Prompt tokens served from cache, by medium.", ["medium"],
            registry=registry,
        )  # fmt: skip
        healthy = Gauge("kvstore_router_healthy_replicas", "Replicas routed to.", registry=registry)
        healthy.set_function(healthy_replicas)
        registry.register(EventStreamCollector(listener))
        registry.register(MergedPagesCollector(fleet_pages))

    def routed(self, replica: str, seconds: float) -> None:
        self._decisions.labels(replica).inc()
        self._route_seconds.observe(seconds)

    def finished(self, outcome: Outcome) -> None:
        self._requests.labels(outcome).inc()

    def retried(self) -> None:
        self._retries.inc()

    def served_from_cache(self, tokens_by_medium: Mapping[Medium, int]) -> None:
        for medium, tokens in tokens_by_medium.items():
            self._cached_tokens.labels(medium).inc(tokens)
