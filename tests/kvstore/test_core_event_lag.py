"""Event lag and staleness, as the listener measures them over real loopback ZeroMQ.

Lag is per applied batch: from the batch's timestamp to the moment the sink
has applied it (so a slow apply counts). An idle producer adds no lag; its
silence shows as staleness. Times for people (``connected_since``,
``last_batch_at``) are wall-clock.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from prometheus_client import CollectorRegistry

from kvstore.config import EventsConfig
from kvstore.events import BlockRemoved, EventBatch
from kvstore.metrics import EventStreamCollector
from kvstore.publisher import ZmqEventPublisher
from kvstore.subscriber import LAG_BUCKETS_S, EventListener, ProducerHealth
from tests.kvstore.test_core_transport import wait_until

LOOPBACK = "tcp://127.0.0.1:*"
SLOW_APPLY_S = 0.3
OLD_BY_S = 3.0


class SlowSink:
    """Applies batches, taking SLOW_APPLY_S over those of one marked timestamp."""

    def __init__(self, slow_ts: float) -> None:
        self.slow_ts = slow_ts
        self.applied: list[float] = []
        self.lock = threading.Lock()

    def apply_batch(self, producer: str, seq: int, batch: EventBatch) -> None:
        if batch.ts == self.slow_ts:
            time.sleep(SLOW_APPLY_S)
        with self.lock:
            self.applied.append(batch.ts)

    def reset_producer(self, producer: str) -> None:
        pass


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context: zmq.Context = zmq.Context()
    yield context
    context.destroy(linger=0)


def bucket(seconds: float) -> int:
    return bisect.bisect_left(LAG_BUCKETS_S, seconds)


def only(listener: EventListener) -> ProducerHealth:
    (health,) = listener.health()
    return health


def test_lag_is_measured_at_application_and_an_idle_producer_only_grows_stale(ctx: zmq.Context) -> None:
    started = time.time()
    publisher = ZmqEventPublisher(EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK), context=ctx)
    now = time.time()
    fresh, old, slow = now, now - OLD_BY_S, now + 1e-6  # ts of the three batches
    sink = SlowSink(slow)
    listener = EventListener(sink, context=ctx)
    listener.start()
    try:
        listener.add_producer("p", publisher.endpoint, publisher.replay_endpoint)
        for ts in (fresh, old, slow):
            publisher.publish([BlockRemoved(block_hashes=[1], medium="GPU")], ts=ts)
        assert wait_until(lambda: len(listener.health()) == 1 and sum(only(listener).lag_counts) == 3)
        health = only(listener)
        applied_at = time.time()
        # Each batch counts its own lag: the old one at least its age, the slow one at least its apply (it is
        # the last applied, so lag_s is its lag); only the fresh one can be under the slow apply. The upper
        # bound leaves delivery on a loaded machine 2 s in all.
        cumulative = list(itertools.accumulate(health.lag_counts))
        assert cumulative[bucket(SLOW_APPLY_S) - 1] <= 1 and cumulative[bucket(OLD_BY_S) - 1] <= 2, health
        assert cumulative[-1] == 3
        assert health.lag_s is not None and health.lag_s >= SLOW_APPLY_S
        assert OLD_BY_S + SLOW_APPLY_S <= health.lag_sum_s < OLD_BY_S + SLOW_APPLY_S + 2.0
        # Wall-clock times: when it was subscribed and when its last batch was applied.
        assert started <= health.connected_since <= health.last_batch_at <= applied_at  # type: ignore[operator]

        # Idle: no new lag, however long; the silence is staleness, and it grows.
        time.sleep(0.5)
        idle = only(listener)
        assert idle.lag_counts == health.lag_counts and idle.lag_sum_s == health.lag_sum_s
        assert idle.last_batch_at == health.last_batch_at
        assert idle.staleness_s >= health.staleness_s + 0.5 - 0.05  # clocks read a little apart

        registry = CollectorRegistry()
        registry.register(EventStreamCollector(listener))
        get = registry.get_sample_value
        assert get("kvstore_router_event_lag_seconds_count", {"producer": "p"}) == 3
        assert get("kvstore_router_event_lag_seconds_bucket", {"producer": "p", "le": "+Inf"}) == 3
        assert get("kvstore_router_event_lag_seconds_sum", {"producer": "p"}) == health.lag_sum_s
        staleness = registry.get_sample_value("kvstore_router_event_staleness_seconds", {"producer": "p"})
        assert staleness is not None and staleness >= 0.5 - 0.05
    finally:
        listener.close()
        publisher.close()


def test_staleness_before_the_first_batch_counts_from_the_subscription(ctx: zmq.Context) -> None:
    publisher = ZmqEventPublisher(EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK), context=ctx)
    listener = EventListener(SlowSink(-1.0), context=ctx)
    listener.start()
    try:
        listener.add_producer("silent", publisher.endpoint, publisher.replay_endpoint)
        assert wait_until(lambda: len(listener.health()) == 1)
        time.sleep(0.3)
        health = only(listener)
        assert health.last_batch_at is None and health.lag_s is None and sum(health.lag_counts) == 0
        assert health.staleness_s >= 0.3 - 0.05
    finally:
        listener.close()
        publisher.close()
