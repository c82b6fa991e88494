"""Prometheus metrics, vLLM-style names under ``kvstore_``.

Components keep plain integer counters on their hot paths; these collectors
read them at scrape time. So the pool pays nothing per operation, and tests
may build many pools in one process without clashing in a global registry:
each owner registers its collectors in the registry it serves.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.kv_cache_manager import KVCacheManager
from kvstore.subscriber import LAG_BUCKETS_S, EventListener

# The load signals a worker exports and the router's HTTP backend reads (beside vLLM's names for them).
REQUESTS_RUNNING = "kvstore_requests_running"
"""Gauge: requests holding KV blocks."""
REQUESTS_WAITING = "kvstore_requests_waiting"
"""Gauge: requests queued for admission."""
GPU_CACHE_USAGE = "kvstore_gpu_cache_usage_perc"
"""Gauge: fraction of KV blocks referenced by requests (0-1)."""


class CacheCollector(Collector):
    """Pool usage and prefix-cache counters of one or more managers, labelled by replica."""

    def __init__(self, managers: Callable[[], Iterable[tuple[str, KVCacheManager]]]) -> None:
        self._managers = managers

    def collect(self) -> Iterator[Metric]:
        usage = GaugeMetricFamily(
            GPU_CACHE_USAGE, "Fraction of KV blocks referenced by requests (0-1).", labels=["replica"]
        )
        queries = CounterMetricFamily(
            "kvstore_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=["replica"]
        )
        hits = CounterMetricFamily(
            "kvstore_prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels=["replica"]
        )
        evictions = CounterMetricFamily(
            "kvstore_evicted_blocks", "Cached blocks evicted for reuse.", labels=["replica"]
        )
        collisions = CounterMetricFamily(
            "kvstore_hash_collisions", "Lookups whose hash matched but tokens did not.", labels=["replica"]
        )
        for replica, manager in self._managers():
            stats = manager.prefix_cache_stats
            usage.add_metric([replica], manager.usage)
            queries.add_metric([replica], stats.queries)
            hits.add_metric([replica], stats.hits)
            evictions.add_metric([replica], manager.pool.num_evictions)
            collisions.add_metric([replica], manager.pool.num_hash_collisions)
        yield from (usage, queries, hits, evictions, collisions)


class EventStreamCollector(Collector):
    """Per-producer health of an EventListener: events, gaps, decode errors, lag and staleness.

    Lag is a histogram of every applied batch's lag, so an idle producer adds
    nothing to it; how long a producer has been silent is the staleness gauge.
    """

    def __init__(self, listener: EventListener, prefix: str = "kvstore_router") -> None:
        self._listener = listener
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        p = self._prefix
        events = CounterMetricFamily(f"{p}_events", "KV events applied.", labels=["producer"])
        gaps = CounterMetricFamily(f"{p}_event_gaps", "Sequence gaps detected.", labels=["producer"])
        errors = CounterMetricFamily(
            f"{p}_decode_errors", "Frames or events that could not be decoded.", labels=["producer"]
        )
        resyncs = CounterMetricFamily(f"{p}_resyncs", "Replays and snapshots requested.", labels=["producer", "kind"])
        losses = CounterMetricFamily(
            f"{p}_event_losses",
            "Where the view of a producer may have lost batches: resumed without an exact resync (lossy), live "
            "batches not kept (dropped), snapshots too large to hold (oversized).",
            labels=["producer", "kind"],
        )
        lag = HistogramMetricFamily(
            f"{p}_event_lag_seconds",
            "Time from a batch's timestamp (the producer's clock) to its application in the index, per batch.",
            labels=["producer"],
        )
        staleness = GaugeMetricFamily(
            f"{p}_event_staleness_seconds",
            "Seconds since the producer's last batch was applied (since it was subscribed, before any).",
            labels=["producer"],
        )
        bounds = [repr(bound) for bound in LAG_BUCKETS_S] + ["+Inf"]
        for h in self._listener.health():
            events.add_metric([h.producer], h.events)
            gaps.add_metric([h.producer], h.gaps)
            errors.add_metric([h.producer], h.decode_errors + h.skipped_events)
            resyncs.add_metric([h.producer, "replay"], h.replays)
            resyncs.add_metric([h.producer, "snapshot"], h.snapshots)
            losses.add_metric([h.producer, "lossy"], h.lossy)
            losses.add_metric([h.producer, "dropped"], h.dropped)
            losses.add_metric([h.producer, "oversized"], h.oversized)
            cumulative = [float(c) for c in itertools.accumulate(h.lag_counts)]
            lag.add_metric([h.producer], list(zip(bounds, cumulative, strict=True)), sum_value=h.lag_sum_s)
            staleness.add_metric([h.producer], h.staleness_s)
        yield from (events, gaps, errors, resyncs, losses, lag, staleness)


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text exposition format."""
    return generate_latest(registry)
