"""Prometheus metrics of a tier store, read from its stats at scrape time.

Names (vLLM-style, under ``kvstore_``), every one labelled ``node`` -- the
Ray node the store serves -- because the router merges every node's page
into its own, where two nodes' series must not be the same series:

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
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.tiers.stats import DIRECTIONS, TierStats

_Label = TypeVar("_Label", bound=str)  # a label value: a medium, a direction, a reason


class TierCollector(Collector):
    """Collects one tier store's metrics from ``stats`` (e.g. ``store.stats``) on each scrape, labelled ``node``."""

    def __init__(self, stats: Callable[[], TierStats], node: str) -> None:
        self._stats = stats
        self._node = node

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        node = self._node
        usage = GaugeMetricFamily("kvstore_tier_usage_bytes", "Bytes of KV held per tier.", labels=["node", "medium"])
        capacity = GaugeMetricFamily(
            "kvstore_tier_capacity_bytes", "Capacity in force per tier.", labels=["node", "medium"]
        )
        blocks = GaugeMetricFamily("kvstore_tier_blocks", "Blocks held per tier.", labels=["node", "medium"])
        for medium, value in stats.usage_bytes.items():
            usage.add_metric([node, medium], value)
            capacity.add_metric([node, medium], stats.capacity_bytes[medium])
            blocks.add_metric([node, medium], stats.blocks[medium])
        # Every medium and direction from zero, so rates work before the first hit or copy.
        hits = self._counter(
            "kvstore_tier_hits",
            "Blocks served to workers per tier.",
            "medium",
            {medium: stats.hits.get(medium, 0) for medium in stats.usage_bytes},
        )
        moved = self._counter(
            "kvstore_offload_bytes",
            "Bytes moved between tiers.",
            "direction",
            {direction: stats.offload_bytes.get(direction, 0) for direction in DIRECTIONS},
        )
        seconds = HistogramMetricFamily(
            "kvstore_offload_seconds", "Latency of one batch moved between tiers.", labels=["node", "direction"]
        )
        for direction, hist in stats.offload_seconds.items():
            cumulative = list(itertools.accumulate(hist.counts))
            buckets = [(_le(bound), float(count)) for bound, count in zip(hist.bounds, cumulative, strict=False)]
            buckets.append(("+Inf", float(cumulative[-1])))
            seconds.add_metric([node, direction], buckets, sum_value=hist.total)
        not_stored = CounterMetricFamily(
            "kvstore_tier_not_stored", "Blocks a tier did not store, by reason.", labels=["node", "medium", "reason"]
        )
        for medium, reasons in stats.not_stored.items():
            for reason, value in reasons.items():
                not_stored.add_metric([node, medium, reason], value)
        yield from (usage, capacity, blocks, hits, moved, seconds, not_stored)
        yield self._counter("kvstore_tier_evictions", "Blocks evicted per tier.", "medium", stats.evictions)
        yield self._counter(
            "kvstore_tier_hash_collisions",
            "Lookups whose hash matched a block of other tokens.",
            "medium",
            stats.collisions,
        )
        yield self._counter("kvstore_tier_disk_errors", "Failed or late disk I/Os.", "reason", stats.disk_errors)
        yield self._counter(
            "kvstore_tier_integrity_failures",
            "Block files refused on read, by reason.",
            "reason",
            stats.integrity_failures,
        )
        yield self._counter(
            "kvstore_tier_scan_removed", "Files the start-up scan removed, by reason.", "reason", stats.scan_removed
        )

    def _counter(self, name: str, documentation: str, label: str, values: Mapping[_Label, int]) -> CounterMetricFamily:
        """A counter family with one sample per key of ``values``, labelled ``node`` and ``label``."""
        family = CounterMetricFamily(name, documentation, labels=["node", label])
        for key, value in values.items():
            family.add_metric([self._node, key], value)
        return family


def _le(bound: float) -> str:
    return repr(float(bound))
