"""The replicas the router sends requests to: their registry, health and load as last polled.

A replica is marked unhealthy when a dispatch fails with ReplicaUnavailable
or ``router.unhealthy_after`` consecutive load polls fail; its producer is
then dropped from the index (its blocks vanish from routing within one
health interval) and re-subscribed -- a fresh replay or snapshot -- when it
answers again. Only healthy replicas are candidates.

Not thread-safe: the router's HTTP handlers and health task share one
asyncio loop; the index and listener it drives are locked on their own.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from kvstore.router.backends import ReplicaBackend, ReplicaLoad, ReplicaPoll
from kvstore.router.config import RouterConfig
from kvstore.router.index import PrefixIndex
from kvstore.router.load import PrefillLoad
from kvstore.router.streams import ProducerSpec, subscribe
from kvstore.subscriber import EventListener, ProducerHealth

logger = logging.getLogger(__name__)


class ReplicaSpec(NamedTuple):
    """A replica: where to send requests, and the stream of its own (GPU) cache."""

    name: str
    node: str | None
    backend: ReplicaBackend
    events: ProducerSpec


class Replica:
    """One replica as the router knows it: health, load as last polled, and its own dispatches there."""

    def __init__(self, spec: ReplicaSpec, prefill_tps: float) -> None:
        self.spec = spec
        self.healthy = True
        self.failed_polls = 0
        self.load = ReplicaLoad(0, 0, 0.0)
        self.prefill = PrefillLoad(prefill_tps)
        self.last_ok = time.monotonic()
        self.metrics_text = ""  # its Prometheus page as of the last poll
        self.models: list[dict[str, Any]] = []  # its /v1/models cards as of the last poll

    def serves(self, model: str | None) -> bool:
        """Whether a request naming ``model`` may go here: it lists the model, or the router names the model
        for it (a replica ``model`` is configured), or nothing is known yet (no model named, none listed)."""
        if model is None or not self.models or getattr(self.spec.backend, "model", None) is not None:
            return True
        return any(card.get("id") == model for card in self.models)


class ReplicaSet(Mapping[str, Replica]):
    """The registered replicas by name; adding one registers its producer in the index and subscribes to it."""

    def __init__(self, index: PrefixIndex, listener: EventListener, config: RouterConfig) -> None:
        self._index = index
        self._listener = listener
        self._prefill_tps = config.prefill_tps
        self._unhealthy_after = config.unhealthy_after
        self._replicas: dict[str, Replica] = {}

    def __getitem__(self, name: str) -> Replica:
        return self._replicas[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._replicas)

    def __len__(self) -> int:
        return len(self._replicas)

    def add(self, spec: ReplicaSpec) -> None:
        """Register (or replace) a replica and subscribe to its event stream.

        Registered in the index first: a registration it refuses leaves no replica routable without events.
        """
        if spec.name in self._replicas:
            self.remove(spec.name)
        self._index.add_producer(spec.events.name, "gpu", [spec.name], spec.node, rekey=spec.events.rekey)
        self._replicas[spec.name] = Replica(spec, self._prefill_tps)
        subscribe(self._listener, spec.events)

    def remove(self, name: str) -> None:
        """Forget a replica and its blocks (its producer's registration removes the replica from the index).

        The listener unsubscribes on its own thread, and may deliver a batch of the old subscription
        before it does; were the replica re-added under the same name meanwhile, that batch would land in
        the new registration (and the new stream's replay from 0 count its blocks twice). So the
        listener also resets the producer once it has unsubscribed: anything that slipped in goes.
        """
        replica = self._replicas.pop(name, None)
        if replica is None:
            return
        self._listener.remove_producer(replica.spec.events.name, reset=True)
        self._index.remove_producer(replica.spec.events.name)

    def healthy(self) -> list[Replica]:
        """The candidates for routing, in registration order."""
        return [r for r in self._replicas.values() if r.healthy]

    def healthy_count(self) -> int:
        return sum(r.healthy for r in self._replicas.values())

    def mark_unhealthy(self, name: str) -> None:
        replica = self._replicas.get(name)
        if replica is None or not replica.healthy:
            return
        replica.healthy = False
        logger.warning("replica %s marked unhealthy; dropping its blocks from the index", name)
        # The reset runs on the listener thread after the unsubscribe, so no batch still being delivered
        # can put blocks back (they would outlive the replica's health and corrupt its resync).
        self._listener.remove_producer(replica.spec.events.name, reset=True)

    def _mark_healthy(self, name: str) -> None:
        replica = self._replicas.get(name)
        if replica is None or replica.healthy:
            return
        replica.healthy = True
        logger.info("replica %s is healthy again; resubscribing", name)
        subscribe(self._listener, replica.spec.events)

    async def poll(self) -> None:
        """Poll every replica's load and metrics once; update health."""
        replicas = list(self._replicas.items())
        results = await asyncio.gather(*(r.spec.backend.poll() for _, r in replicas), return_exceptions=True)
        for (name, replica), result in zip(replicas, results, strict=True):
            if isinstance(result, ReplicaPoll):
                replica.load = result.load
                replica.metrics_text = result.metrics_text
                replica.models = result.models
                replica.failed_polls = 0
                replica.last_ok = time.monotonic()
                self._mark_healthy(name)
            else:
                replica.failed_polls += 1
                if replica.failed_polls >= self._unhealthy_after:
                    self.mark_unhealthy(name)

    def pages(self) -> list[str]:
        """The Prometheus pages of the healthy replicas, as last polled."""
        return [r.metrics_text for r in self._replicas.values() if r.healthy and r.metrics_text]

    def summary(self, stream_health: Mapping[str, ProducerHealth]) -> list[dict[str, Any]]:
        """One JSON object per replica (``GET /workers``); ``stream_health``: the listener's health by producer."""
        now = time.monotonic()
        out = []
        for name, r in self._replicas.items():
            events = stream_health.get(r.spec.events.name)
            out.append(
                {
                    "name": name,
                    "node": r.spec.node,
                    "healthy": r.healthy,
                    "running": r.load.running,
                    "waiting": r.load.waiting,
                    "kv_usage": r.load.kv_usage,
                    "inflight": r.prefill.inflight_requests,
                    "inflight_prefill_tokens": r.prefill.inflight_tokens,
                    "outstanding_prefill_tokens": round(r.prefill.outstanding(now), 1),
                    "prefill_tokens_per_s": round(r.prefill.tokens_per_s, 1),
                    "events": _stream_json(events) if events is not None else None,
                }
            )
        return out

    async def close(self) -> None:
        """Close every replica's backend."""
        for replica in self._replicas.values():
            await replica.spec.backend.close()


def _stream_json(health: ProducerHealth) -> dict[str, Any]:
    """A replica's event stream for people: times as UTC ISO 8601 (the lag histogram is on /metrics)."""
    out = health._asdict()
    del out["lag_counts"], out["lag_sum_s"]
    out["connected_since"] = _utc(health.connected_since)
    out["last_batch_at"] = None if health.last_batch_at is None else _utc(health.last_batch_at)
    return out


def _utc(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).isoformat(timespec="milliseconds")
