"""Prometheus metrics of a tier store, read from its stats at scrape time.

Names (vLLM-style, under ``kvstore_``):

- ``kvstore_tier_usage_bytes{medium}``, ``kvstore_tier_capacity_bytes{medium}``,
  ``kvstore_tier_blocks{medium}`` -- gauges;
- ``kvstore_tier_hits_total{medium}`` -- blocks served from each medium;
- ``kvstore_offload_bytes_total{direction}`` and the histogram
  ``kvstore_offload_seconds{direction}`` -- direction one of spill,
  promote, disk_write, disk_read;
- ``kvstore_tier_not_stored_total{medium,reason}``,
  ``kvstore_tier_evictions_total{medium}``,
  ``kvstore_tier_hash_collisions_total{medium}``,
  ``kvstore_tier_disk_errors_total{reason}``,
  ``kvstore_tier_integrity_failures_total{reason}`` (files refused on read),
  ``kvstore_tier_scan_removed_total{reason}`` (temporaries and invalid files at start).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.tiers.stats import DIRECTIONS, TierStats


class TierCollector(Collector):
    """Collects one tier store's metrics from ``stats`` (e.g. ``store.stats``) on each scrape."""

    def __init__(self, stats: Callable[[], TierStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        usage = GaugeMetricFamily("kvstore_tier_usage_bytes", "Bytes of KV held per tier.", labels=["medium"])
        capacity = GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity in force per tier.", labels=["medium"])
        blocks = GaugeMetricFamily("kvstore_tier_blocks", "Blocks held per tier.", labels=["medium"])
        for medium, value in stats.usage_bytes.items():
            usage.add_metric([medium], value)
            capacity.add_metric([medium], stats.capacity_bytes[medium])
            blocks.add_metric([medium], stats.blocks[medium])
        hits = CounterMetricFamily("kvstore_tier_hits", "Blocks served to workers per tier.", labels=["medium"])
        for medium in stats.usage_bytes:  # every medium from zero, so rates work before the first hit
            hits.add_metric([medium], stats.hits.get(medium, 0))
        moved = CounterMetricFamily("kvstore_offload_bytes", "Bytes moved between tiers.", labels=["direction"])
        for direction in DIRECTIONS:
            moved.add_metric([direction], stats.offload_bytes.get(direction, 0))
        seconds = HistogramMetricFamily(
            "kvstore_offload_seconds", "Latency of one batch moved between tiers.", labels=["direction"]
        )
        for direction, hist in stats.offload_seconds.items():
            cumulative = list(itertools.accumulate(hist.counts))
            buckets = [(_le(bound), float(count)) for bound, count in zip(hist.bounds, cumulative, strict=False)]
            buckets.append(("+Inf", float(cumulative[-1])))
            seconds.add_metric([direction], buckets, sum_value=hist.total)
        not_stored = CounterMetricFamily(
            "kvstore_tier_not_stored", "Blocks a tier did not store, by reason.", labels=["medium", "reason"]
        )
        for medium, reasons in stats.not_stored.items():
            for reason, value in reasons.items():
                not_stored.add_metric([medium, reason], value)
        evictions = CounterMetricFamily("kvstore_tier_evictions", "Blocks evicted per tier.", labels=["medium"])
        for medium, value in stats.evictions.items():
            evictions.add_metric([medium], value)
        collisions = CounterMetricFamily(
            "kvstore_tier_hash_collisions", "Lookups whose hash matched a block of other tokens.", labels=["medium"]
        )
        for medium, value in stats.collisions.items():
            collisions.add_metric([medium], value)
        disk_errors = CounterMetricFamily("kvstore_tier_disk_errors", "Failed or late disk I/Os.", labels=["reason"])
        for reason, value in stats.disk_errors.items():
            disk_errors.add_metric([reason], value)
        integrity = CounterMetricFamily(
            "kvstore_tier_integrity_failures", "Block files refused on read, by reason.", labels=["reason"]
        )
        for reason, value in stats.integrity_failures.items():
            integrity.add_metric([reason], value)
        scan = CounterMetricFamily(
            "kvstore_tier_scan_removed", "Files the start-up scan removed, by reason.", labels=["reason"]
        )
        for reason, value in stats.scan_removed.items():
            scan.add_metric([reason], value)
        yield from (usage, capacity, blocks, hits, moved, seconds, not_stored, evictions, collisions)
        yield from (disk_errors, integrity, scan)


def _le(bound: float) -> str:
    return repr(float(bound))
