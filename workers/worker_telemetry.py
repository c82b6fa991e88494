"""What a KV worker reports about itself: its step log and the Prometheus registry its metrics are read from.

Data structures
    - :class:`StepRecord`: one step that ran work -- its wall time, what it
      computed, and its time inside the offloader's bookkeeping. The worker
      keeps the last :data:`STEP_LOG` of them in a bounded deque, appended
      by the step loop under the worker's lock (``KVWorker.recent_steps``
      copies it under the same lock), so benchmarks read per-step times
      the worker measured itself instead of guessing from outside.
    - :func:`worker_registry`: one registry per worker, its collectors
      reading plain counters and small state snapshots at scrape time, so
      the step loop pays nothing per request.

Invariants
    - A scrape never waits on a tier: the offload and tier-link state
      functions read plain ints and ``connected`` (a cheap property, by
      the backend contract), never a backend call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from prometheus_client import CollectorRegistry

from kvstore.kv_cache_manager import KVCacheManager
from kvstore.metrics import CacheCollector
from kvstore.workers.metrics import (
    LoopGauges,
    OffloadCollector,
    OffloadState,
    TierLinkCollector,
    TierLinkState,
    VllmCollector,
    WorkerCollector,
    WorkerCounters,
)

STEP_LOG = 8192
"""How many of the last steps that ran work a worker keeps (``KVWorker.recent_steps``)."""


class StepRecord(NamedTuple):
    """One step that ran work: its wall time, what it computed, and its time inside the offloader."""

    seconds: float
    requests: int  # requests scheduled
    tokens: int  # tokens computed (a decode is one)
    offload_seconds: float  # of ``seconds``, spent in the offloader's bookkeeping on the step loop


def worker_registry(
    name: str,
    manager: KVCacheManager,
    counters: WorkerCounters,
    gauges: Callable[[], LoopGauges],
    tier_link: Callable[[], TierLinkState | None],
    offload: Callable[[], OffloadState | None],
    model_name: str | None = None,
) -> CollectorRegistry:
    """The registry of worker ``name``: its pool and prefix cache, its request loop, its tier link and offloader;
    with ``model_name``, the load and cache numbers under vLLM's names too (:class:`VllmCollector`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CacheCollector(lambda: [(name, manager)]))
    registry.register(WorkerCollector(name, counters, gauges))
    if model_name is not None:
        registry.register(VllmCollector(model_name, manager, counters, gauges))
    registry.register(TierLinkCollector(name, tier_link))
    registry.register(OffloadCollector(name, counters, offload))
    return registry
