"""Prometheus metrics of one KV worker.

Pool usage and prefix-cache counters come from the core's
:class:`kvstore.metrics.CacheCollector`; this module adds the request loop's
counters. Both read plain integers at scrape time, so the step loop pays
nothing per request. Names follow vLLM's under ``kvstore_``; the load gauges'
names are the core's constants, which the router's HTTP backend reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.metrics import REQUESTS_RUNNING, REQUESTS_WAITING

if TYPE_CHECKING:
    from kvstore.kv_cache_manager import KVCacheManager


class WorkerCounters:
    """Counters the worker bumps (under its lock); read racily by scrapes, which is fine for ints."""

    __slots__ = (
        "aborted",
        "failed",
        "finished",
        "generation_tokens",
        "prompt_tokens",
        "prompts_started",
        "rejected",
        "step_seconds",
        "steps",
        "tokens_sampled",
    )  # fmt: skip

    def __init__(self) -> None:
        self.finished = 0  # requests that returned a result
        self.aborted = 0  # requests cancelled by their consumer (a client that went away): blocks freed
        self.failed = 0  # requests that got an error after being queued (shutdown, model failure)
        self.rejected = 0  # requests refused as invalid before queuing
        self.prompt_tokens = 0  # of finished requests
        self.generation_tokens = 0  # of finished and of cancelled choices
        self.steps = 0
        self.step_seconds = 0.0  # wall time of the step loop's steps (schedule, forward, sampling, update)
        # As vLLM counts them, per step: tokens sampled, and the prompt tokens of requests whose first token came.
        self.tokens_sampled = 0
        self.prompts_started = 0


class TierLinkCounters:
    """Counters of a worker's link to its node's tier (bumped on the step loop and the reconnect thread)."""

    __slots__ = (
        "promote_failures",
        "promote_skipped",
        "reconnect_failures",
        "reconnects",
        "spill_failures",
        "spill_skipped_blocks",
        "unavailable",
    )

    def __init__(self) -> None:
        self.unavailable = 0  # times the tier was found unavailable (link taken down)
        self.reconnects = 0  # links re-established after an outage
        self.reconnect_failures = 0  # reconnection attempts that found no tier (yet)
        self.spill_skipped_blocks = 0  # evicted blocks dropped, not spilled, because the tier was down
        self.promote_skipped = 0  # admissions that did not ask the tier because it was down
        self.spill_failures = 0  # spills that failed for another reason (their KV dropped)
        self.promote_failures = 0  # promotions that failed (the GPU hit served alone)


class OffloadCounters:
    """The offloader's work (bumped on the step loop, under the worker's lock, but for ``busy_seconds``)."""

    __slots__ = (
        "blocks_loaded",
        "blocks_stored",
        "busy_seconds",
        "gave_up",
        "loads_done",
        "loads_started",
        "lookups",
        "slow_skipped",
        "step_loop_seconds",
        "store_missed_blocks",
        "stores_done",
        "stores_started",
    )

    def __init__(self) -> None:
        self.lookups = 0  # admissions that asked the tier what it holds
        self.loads_started = 0  # load jobs queued (pool blocks allocated for them)
        self.loads_done = 0  # load jobs collected
        self.blocks_loaded = 0  # pool blocks filled from the tier and registered in the prefix cache
        self.stores_started = 0  # store jobs queued (their blocks held until done)
        self.stores_done = 0  # store jobs collected (their blocks back in the free queue)
        self.blocks_stored = 0  # blocks the tier newly stored
        self.store_missed_blocks = 0  # cached blocks evicted before their store: KV dropped
        self.gave_up = 0  # admissions that stopped waiting for a slow tier and recomputed
        self.slow_skipped = 0  # admissions that did not ask the tier while a job waited on it past the deadline
        self.step_loop_seconds = 0.0  # time the step loop spent inside the offloader (bookkeeping; never a copy)
        self.busy_seconds = 0.0  # time the offload thread spent in tier calls and copies (bumped on that thread)


class OffloadState(NamedTuple):
    counters: OffloadCounters
    lookups_in_flight: int
    loads_in_flight: int
    stores_in_flight: int
    store_held_blocks: int


class TierLinkState(NamedTuple):
    counters: TierLinkCounters
    connected: bool


class LoopGauges(NamedTuple):
    running: int
    waiting: int
    preemptions: int


def _families(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    label_names: list[str],
    labels: list[str],
    rows: Iterable[tuple[str, str, float]],
) -> Iterator[Metric]:
    """One family of ``kind`` per ``(name, doc, value)`` row, each holding the one sample ``labels``."""
    for name, doc, value in rows:
        family = kind(name, doc, labels=label_names)
        family.add_metric(labels, value)
        yield family


class WorkerCollector(Collector):
    """Request counters, queue gauges and preemptions of one worker, labelled by replica."""

    def __init__(self, replica: str, counters: WorkerCounters, gauges: Callable[[], LoopGauges]) -> None:
        self._replica = replica
        self._counters = counters
        self._gauges = gauges

    def collect(self) -> Iterator[Metric]:
        labels = [self._replica]
        c = self._counters
        g = self._gauges()
        requests = CounterMetricFamily("kvstore_requests", "Requests by outcome.", labels=["replica", "outcome"])
        outcomes = (("finished", c.finished), ("aborted", c.aborted), ("failed", c.failed), ("rejected", c.rejected))
        for outcome, value in outcomes:
            requests.add_metric([*labels, outcome], value)
        yield requests
        yield from _families(CounterMetricFamily, ["replica"], labels, (
            ("kvstore_prompt_tokens", "Prompt tokens of finished requests.", c.prompt_tokens),
            ("kvstore_generation_tokens", "Tokens generated (finished and cancelled requests).", c.generation_tokens),
            ("kvstore_preemptions", "Requests preempted (blocks freed, recomputed later).", g.preemptions),
            ("kvstore_steps", "Scheduler steps run.", c.steps),
        ))  # fmt: skip
        yield from _families(GaugeMetricFamily, ["replica"], labels, (
            (REQUESTS_RUNNING, "Requests holding KV blocks.", g.running),
            (REQUESTS_WAITING, "Requests queued for admission.", g.waiting),
        ))  # fmt: skip


class VllmCollector(Collector):
    """The same numbers under vLLM's own metric names (``vllm:...``, labelled ``model_name``), so what reads a
    vLLM server's ``/metrics`` -- a vLLM-aware router or autoscaler, vLLM's Grafana dashboards -- reads ours.

    Each series is one of the ``kvstore_`` ones above, read at the same scrape: the load gauges
    (``num_requests_running`` / ``_waiting``, ``kv_cache_usage_perc`` 0-1), the prefix cache's query and hit
    tokens, prompt and generation tokens, and preemptions. The token counters move every step, as vLLM's
    do (generation: each token sampled; prompt: a request's prompt once its first token is sampled), not when
    a request finishes as the ``kvstore_`` ones; the ``engine`` label is vLLM's (one engine: ``0``).
    """

    def __init__(
        self, model_name: str, manager: KVCacheManager, counters: WorkerCounters, gauges: Callable[[], LoopGauges]
    ) -> None:
        self._model = model_name
        self._manager = manager
        self._counters = counters
        self._gauges = gauges

    def collect(self) -> Iterator[Metric]:
        labels, c, g, manager = [self._model, "0"], self._counters, self._gauges(), self._manager  # one engine
        stats = manager.prefix_cache_stats
        names = ["model_name", "engine"]
        yield from _families(GaugeMetricFamily, names, labels, (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", g.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", g.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", manager.usage),
        ))  # fmt: skip
        yield from _families(CounterMetricFamily, names, labels, (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", stats.queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.hits),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompts_started),
            ("vllm:generation_tokens", "Number of generation tokens processed.", c.tokens_sampled),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", g.preemptions),
        ))  # fmt: skip


class TierLinkCollector(Collector):
    """The worker's link to its node's tier: connected or not, outages, reconnections, skipped work.

    ``state`` returns None when the worker has no tier (nothing is exported then).
    """

    def __init__(self, replica: str, state: Callable[[], TierLinkState | None]) -> None:
        self._replica = replica
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        if state is None:
            return
        labels = [self._replica]
        c = state.counters
        connected = GaugeMetricFamily(
            "kvstore_tier_connected", "1 while the worker is linked to its node's tier, 0 while it is down.",
            labels=["replica"],
        )  # fmt: skip
        connected.add_metric(labels, 1.0 if state.connected else 0.0)
        yield connected
        yield from _families(CounterMetricFamily, ["replica"], labels, (
            ("kvstore_tier_unavailable", "Times the node's tier was found unavailable (spill and promotion "
             "then off until it is back).", c.unavailable),
            ("kvstore_tier_reconnects", "Links to the node's tier re-established after an outage.", c.reconnects),
            ("kvstore_tier_reconnect_failures", "Reconnection attempts that found no tier.", c.reconnect_failures),
            ("kvstore_tier_spill_skipped_blocks", "Evicted blocks dropped, not spilled, while the tier was down.",
             c.spill_skipped_blocks),
            ("kvstore_tier_promote_skipped", "Admissions that skipped the tier while it was down.",
             c.promote_skipped),
            ("kvstore_tier_spill_failures", "Spills that failed (their KV dropped).", c.spill_failures),
            ("kvstore_tier_promote_failures", "Promotions that failed (the GPU hit served alone).",
             c.promote_failures),
        ))  # fmt: skip


class OffloadCollector(Collector):
    """The offloader's jobs and the step loop's time in it, against the step loop's total (None: no tier)."""

    def __init__(self, replica: str, counters: WorkerCounters, state: Callable[[], OffloadState | None]) -> None:
        self._replica = replica
        self._counters = counters
        self._state = state

    def collect(self) -> Iterator[Metric]:
        labels = [self._replica]
        step = CounterMetricFamily(
            "kvstore_worker_step_seconds", "Wall time of the worker's steps.", labels=["replica"]
        )
        step.add_metric(labels, self._counters.step_seconds)
        yield step
        state = self._state()
        if state is None:
            return
        c = state.counters
        yield from _families(CounterMetricFamily, ["replica"], labels, (
            ("kvstore_worker_offload_blocked_seconds", "Time the step loop spent in the offloader (bookkeeping "
             "only: copies and tier calls run on the offload thread).", c.step_loop_seconds),
            ("kvstore_worker_offload_busy_seconds", "Time the offload thread spent in tier calls and copies.",
             c.busy_seconds),
            ("kvstore_worker_offload_lookups", "Admissions that asked the node's tier what it holds.", c.lookups),
            ("kvstore_worker_offload_loads", "Load jobs finished (pool blocks filled from the tier).", c.loads_done),
            ("kvstore_worker_offload_loaded_blocks", "Pool blocks filled from the tier and registered.",
             c.blocks_loaded),
            ("kvstore_worker_offload_stores", "Store jobs finished (their blocks back in the free queue).",
             c.stores_done),
            ("kvstore_worker_offload_stored_blocks", "Blocks the node's tier newly stored.", c.blocks_stored),
            ("kvstore_worker_offload_store_missed_blocks", "Cached blocks evicted before their store ran: KV "
             "dropped.", c.store_missed_blocks),
            ("kvstore_worker_offload_gave_up", "Admissions that stopped waiting for a slow tier and recomputed.",
             c.gave_up),
            ("kvstore_worker_offload_slow_skipped", "Admissions that did not ask the tier while a job waited on "
             "it past the deadline.", c.slow_skipped),
        ))  # fmt: skip
        inflight = GaugeMetricFamily(
            "kvstore_worker_offload_in_flight", "Offload jobs queued or running, by kind.", labels=["replica", "kind"]
        )
        for kind, value in (("lookup", state.lookups_in_flight), ("load", state.loads_in_flight),
                            ("store", state.stores_in_flight)):  # fmt: skip
            inflight.add_metric([*labels, kind], value)
        yield inflight
        held = GaugeMetricFamily(
            "kvstore_worker_offload_store_held_blocks", "Pool blocks held until their store is done.",
            labels=["replica"],
        )  # fmt: skip
        held.add_metric(labels, state.store_held_blocks)
        yield held
