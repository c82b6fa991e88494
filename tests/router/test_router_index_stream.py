"""The index behind a real ZeroMQ subscription: lost frames and late joins still converge exactly.

Producers are real pools under a random workload, publishing through real
ZmqEventPublishers on 127.0.0.1; the index is the EventListener's sink.
Frame loss is injected by a lossy forwarder between a publisher's PUB socket
and the listener (the listener's replay requests go to the real publisher).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest
import zmq
from router_helpers import BLOCK_SIZE, WorkloadProducer, held

from kvstore.benchmarks.lossy_proxy import LossyProxy
from kvstore.config import CacheConfig, EventsConfig
from kvstore.publisher import ZmqEventPublisher
from kvstore.router.index import PrefixIndex
from kvstore.subscriber import EventListener

LOOPBACK = "tcp://127.0.0.1:*"


class Published:
    """A workload producer whose every step is published, with a consistent snapshot source."""

    def __init__(self, seed: int, buffer_batches: int) -> None:
        self.producer = WorkloadProducer(seed=seed)
        config = EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_batches=buffer_batches)
        self.publisher = ZmqEventPublisher(config, snapshot_source=lambda: self.producer.snapshot(self.publisher))

    def run(self, steps: int) -> None:
        for _ in range(steps):
            with self.producer.lock:
                self.publisher.publish(self.producer.step())
        assert self.publisher.flush()

    def close(self) -> None:
        self.publisher.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


def wait_converged(index: PrefixIndex, producers: dict[str, Published], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    want = {name: p.producer.cached() for name, p in producers.items()}
    got: dict[str, Counter[int]] = {}
    while time.monotonic() < deadline:
        got = {name: held(index, name) for name in producers}
        if got == want:
            index.check_invariants()
            return
        time.sleep(0.05)
    raise AssertionError(f"index did not converge: {[(n, len(got[n]), len(want[n])) for n in want]}")


def test_random_frame_loss_is_repaired_by_replay(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    index = PrefixIndex(CacheConfig(block_size=BLOCK_SIZE))
    producers = {f"w{i}": Published(seed=10 + i, buffer_batches=100_000) for i in range(2)}
    forwarders = {
        name: LossyProxy(ctx, published.publisher.endpoint, loss=0.1, seed=i)
        for i, (name, published) in enumerate(producers.items())
    }
    listener = EventListener(index, context=ctx, sync_timeout_s=2.0)
    try:
        for name, p in producers.items():
            index.add_producer(name, "gpu", [name], "node-a")
            listener.add_producer(name, forwarders[name].endpoint, p.publisher.replay_endpoint)
        listener.start()
        time.sleep(0.3)  # let the subscriptions reach the forwarders
        for _ in range(10):
            for p in producers.values():
                p.run(40)
        for forwarder in forwarders.values():
            forwarder.loss = 0.0  # a loss at the very end shows as a gap only when a later batch arrives
        for p in producers.values():
            p.run(3)
        wait_converged(index, producers)
        assert sum(f.dropped for f in forwarders.values()) > 10
        health = {h.producer: h for h in listener.health()}
        assert sum(h.gaps for h in health.values()) > 0
        assert sum(h.snapshots for h in health.values()) == 0, "a full replay buffer needs no snapshot"
    finally:
        listener.close()
        for forwarder in forwarders.values():
            forwarder.close()
        for p in producers.values():
            p.close()


def test_late_join_and_overflowed_replay_fall_back_to_snapshot(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    index = PrefixIndex(CacheConfig(block_size=BLOCK_SIZE))
    producers = {f"w{i}": Published(seed=20 + i, buffer_batches=4) for i in range(2)}
    listener = EventListener(index, context=ctx, sync_timeout_s=2.0)
    forwarder: LossyProxy | None = None
    try:
        for p in producers.values():
            p.run(300)  # long before the router starts: only a snapshot can tell it the state
        forwarder = LossyProxy(ctx, producers["w1"].publisher.endpoint, loss=0.2, seed=5)
        endpoints = {"w0": producers["w0"].publisher.endpoint, "w1": forwarder.endpoint}
        for name, p in producers.items():
            index.add_producer(name, "gpu", [name], "node-a")
            listener.add_producer(name, endpoints[name], p.publisher.replay_endpoint)
        listener.start()
        time.sleep(0.3)
        for _ in range(5):
            for p in producers.values():
                p.run(30)  # w1 keeps losing frames; a 4-batch buffer cannot replay them all
        forwarder.loss = 0.0
        for p in producers.values():
            p.run(3)
        wait_converged(index, producers)
        health = {h.producer: h for h in listener.health()}
        assert health["w0"].snapshots >= 1 and health["w1"].snapshots >= 1
        assert all(h.lossy == 0 for h in health.values())
    finally:
        listener.close()
        if forwarder is not None:
            forwarder.close()
        for p in producers.values():
            p.close()
