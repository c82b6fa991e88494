"""Event-stream faults between real workers and the router's index: lost frames, a restarted router,
a restarted producer.

Producers are KV workers (real model, real paged pool, real publisher)
kept busy by :class:`Traffic`, so they publish a batch nearly every step,
as in service. Loss is injected by a :class:`LossyProxy` (seeded RNG)
between each worker's PUB socket and the router's EventListener; replay and
snapshot requests go to the real worker. The truth the index must converge
to is each worker's pool (``cached_hashes``).

10,000 malformed frames on a live router's stream are tested in
tests/router/test_service_garbage.py.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import zmq
from faults_helpers import Traffic, fault_config, held, pool_state, wait_for

from kvstore.benchmarks.lossy_proxy import LossyProxy
from kvstore.config import CacheConfig, EventsConfig
from kvstore.deploy.config import Config
from kvstore.publisher import ZmqEventPublisher
from kvstore.router.index import PrefixIndex
from kvstore.subscriber import EventListener
from kvstore.workers.worker import KVWorker
from tests.router.router_helpers import BLOCK_SIZE, WorkloadProducer

LOSS = 0.01
T = TypeVar("T")
BUFFER_BATCHES = 64  # replay window: a router that restarts after more batches than this needs a snapshot


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def small_config(**events: object) -> Config:
    """4-token blocks and a 64-block pool: many batches per second, evictions, duplicates."""
    return fault_config(
        cache={"block_size": 4},
        pool={"num_blocks": 64},
        worker={"max_context": 256},
        events={"buffer_batches": BUFFER_BATCHES, **events},
    )


def index_matches(index: PrefixIndex, workers: dict[str, KVWorker]) -> bool:
    return all(held(index, name) == pool_state(worker) for name, worker in workers.items())


def subscribe(
    ctx: zmq.Context[zmq.Socket[bytes]], workers: dict[str, KVWorker], endpoints: dict[str, str]
) -> tuple[PrefixIndex, EventListener]:
    """A fresh router-side index and listener over ``endpoints`` (live) and each worker's replay socket."""
    index = PrefixIndex(next(iter(workers.values())).config.cache)
    listener = EventListener(index, context=ctx, sync_timeout_s=1.0)
    for name, worker in workers.items():
        index.add_producer(name, "gpu", [name])
        listener.add_producer(name, endpoints[name], worker.event_endpoints().replay_endpoint)
    return index, listener.start()


def test_lossy_stream_and_a_restarted_router_converge_to_the_pools(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    config = small_config()
    workers = {f"w{i}": KVWorker(f"w{i}", config) for i in range(2)}
    proxies = {
        name: LossyProxy(ctx, worker.event_endpoints().endpoint, loss=LOSS, seed=i)
        for i, (name, worker) in enumerate(workers.items())
    }
    via_proxy = {name: proxy.endpoint for name, proxy in proxies.items()}
    index, listener = subscribe(ctx, workers, via_proxy)
    traffic: list[Traffic] = []
    try:
        time.sleep(0.3)  # subscriptions reach the proxies (a late joiner would recover too, by replay)
        traffic = [Traffic(worker, seed=i) for i, worker in enumerate(workers.values())]

        # 1. The router restarts mid-stream: a new index and listener, long after the replay window.
        assert wait_for(lambda: min(w.publisher.last_seq for w in workers.values()) > 2 * BUFFER_BATCHES, 30)
        listener.close()
        index, listener = subscribe(ctx, workers, via_proxy)

        # 2. 1% of the frames are lost while the workers keep serving.
        dropped_before = sum(p.dropped for p in proxies.values())
        forwarded_before = sum(p.forwarded for p in proxies.values())
        assert wait_for(lambda: sum(p.dropped for p in proxies.values()) - dropped_before >= 5, timeout=30)
        for proxy in proxies.values():
            proxy.loss = 0.0
        loss_stopped = time.monotonic()
        # Traffic flows on for a moment: the next batch after a lost tail shows the gap.
        time.sleep(0.3)
        for t in traffic:
            t.stop()
        assert wait_for(lambda: index_matches(index, workers), timeout=1.0, interval=0.01), {
            name: (len(held(index, name)), len(pool_state(w))) for name, w in workers.items()
        }
        converged_s = time.monotonic() - loss_stopped
        index.check_invariants()

        health = {h.producer: h for h in listener.health()}
        dropped = sum(p.dropped for p in proxies.values()) - dropped_before
        forwarded = sum(p.forwarded for p in proxies.values()) - forwarded_before
        print(
            f"\nevent loss: {dropped} of {dropped + forwarded} frames dropped; "
            f"gaps {sum(h.gaps for h in health.values())}, replays {sum(h.replays for h in health.values())}, "
            f"snapshots {sum(h.snapshots for h in health.values())}; converged {converged_s:.3f} s after the loss "
            f"stopped; {sum(t.completed for t in traffic)} requests served"
        )
        assert converged_s <= 1.0
        assert all(t.failed == 0 for t in traffic)
        # The restarted router could only have caught up by snapshot (the replay window had moved on),
        # and the lost frames were noticed as gaps and repaired.
        assert all(h.snapshots >= 1 for h in health.values()), health
        assert sum(h.gaps for h in health.values()) >= 1 and all(h.lossy == 0 for h in health.values())
    finally:
        for t in traffic:
            t.stop()
        listener.close()
        for proxy in proxies.values():
            proxy.close()
        for worker in workers.values():
            worker.shutdown()


def rebind(start: Callable[[], T], timeout_s: float = 5.0) -> T:
    """Bind ports just released in this process: ZeroMQ closes a listening socket asynchronously."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return start()
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_restarted_producer_is_cleared_and_resynced(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    old = KVWorker("p", small_config())
    ep = old.event_endpoints()
    index, listener = subscribe(ctx, {"p": old}, {"p": ep.endpoint})
    new: KVWorker | None = None
    try:
        time.sleep(0.3)
        traffic = Traffic(old, seed=1, max_requests=400)
        assert wait_for(lambda: traffic.completed >= 400, timeout=30)
        traffic.stop()
        assert wait_for(lambda: index_matches(index, {"p": old}), timeout=5)
        before = held(index, "p")
        assert before and old.publisher.last_seq > 20

        # The producer goes away and a new incarnation binds the same endpoints: its seq starts at 0 again.
        old.shutdown()
        new = rebind(lambda: KVWorker("p", small_config(endpoint=ep.endpoint, replay_endpoint=ep.replay_endpoint)))
        assert new.event_endpoints() == ep
        time.sleep(0.3)  # the router's SUB reconnects (ZeroMQ retries every 100 ms)
        traffic = Traffic(new, seed=2, max_requests=40)  # another workload: other prefixes, other blocks
        assert wait_for(lambda: traffic.completed >= 40, timeout=30)
        traffic.stop()
        assert new.publisher.last_seq < old.publisher.last_seq

        assert wait_for(lambda: index_matches(index, {"p": new}), timeout=5), (
            len(held(index, "p")), len(pool_state(new))
        )  # fmt: skip
        now = held(index, "p")
        assert not (set(before) - set(pool_state(new))) & set(now), "a block of the old incarnation survived"
        health = listener.health()[0]
        assert health.restarts == 1 and health.lossy == 0
        index.check_invariants()
    finally:
        listener.close()
        old.shutdown()
        if new is not None:
            new.shutdown()


def published(producer: WorkloadProducer, config: EventsConfig) -> ZmqEventPublisher:
    """A publisher for ``producer`` whose snapshots are taken under the producer's lock."""
    publisher: list[ZmqEventPublisher] = []
    publisher.append(ZmqEventPublisher(config, snapshot_source=lambda: producer.snapshot(publisher[0])))
    return publisher[0]


def test_restarted_producer_that_outruns_the_old_seq_is_still_cleared(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """The new incarnation publishes more batches than the old one ever did before the router reconnects.

    Its seq then jumps *ahead* of the router's, which looks like a gap, not a
    restart: a replay would graft the new incarnation's batches onto the old
    one's blocks. The router must notice the dropped connection and resync by
    snapshot. Producers: real pools and cache managers under a random workload.
    """
    old = WorkloadProducer(seed=31)
    old_pub = published(old, EventsConfig())
    index = PrefixIndex(CacheConfig(block_size=BLOCK_SIZE))
    index.add_producer("p", "gpu", ["p"])
    listener = EventListener(index, context=ctx, sync_timeout_s=1.0)
    listener.add_producer("p", old_pub.endpoint, old_pub.replay_endpoint)
    listener.start()
    new_pub: ZmqEventPublisher | None = None
    try:
        time.sleep(0.3)
        for _ in range(5):
            with old.lock:
                old_pub.publish(old.step())
        assert wait_for(lambda: held(index, "p") == old.cached() != {}, timeout=5)
        old_blocks = set(old.cached())

        old_pub.close()
        new = WorkloadProducer(seed=32)
        config = EventsConfig(endpoint=old_pub.endpoint, replay_endpoint=old_pub.replay_endpoint)
        new_pub = rebind(lambda: published(new, config))
        for _ in range(60):  # at once: the router's SUB reconnects only every 100 ms and misses these
            with new.lock:
                new_pub.publish(new.step())
        time.sleep(0.3)
        for _ in range(3):  # now seen live, with seq ~60 > 5
            with new.lock:
                new_pub.publish(new.step())
        assert wait_for(lambda: held(index, "p") == new.cached(), timeout=5), (
            f"stale old blocks {len(old_blocks & set(held(index, 'p')) - set(new.cached()))}, "
            f"missing new {len(set(new.cached()) - set(held(index, 'p')))}; {listener.health()[0]}"
        )
        index.check_invariants()
        health = listener.health()[0]
        print(f"\noutrun restart: restarts {health.restarts}, snapshots {health.snapshots}, lossy {health.lossy}")
        assert health.lossy == 0
    finally:
        listener.close()
        old_pub.close()
        if new_pub is not None:
            new_pub.close()
