"""ZmqEventPublisher + EventListener over real loopback ZeroMQ.

A producer here is a real BlockPool driven by a KVCacheManager with random
traffic; it mutates the pool and publishes the pool's events under one lock,
which is also what its snapshot source takes. A sink replays the delivered
batches into a multiset of cached hashes per producer; the tests assert it
converges exactly to the pool's own multiset after loss, late joins and
restarts. Every wait polls against a monotonic deadline.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvstore.benchmarks.lossy_proxy import LossyProxy
from kvstore.block_pool import BlockPool
from kvstore.config import EventsConfig
from kvstore.errors import EventDecodeError
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventDecoder, EventEncoder
from kvstore.hashing import BlockHasher
from kvstore.kv_cache_manager import CacheRequest, KVCacheManager
from kvstore.publisher import END_SEQ, Snapshot, ZmqEventPublisher
from kvstore.subscriber import EventListener, ProducerHealth

LOOPBACK = "tcp://127.0.0.1:*"
DEADLINE_S = 15.0


def wait_until(
    predicate: Callable[[], bool], timeout: float = DEADLINE_S, tick: Callable[[], object] | None = None
) -> bool:
    """Poll ``predicate`` until true or the deadline; ``tick`` runs between polls (e.g. a heartbeat)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if tick is not None:
            tick()
        time.sleep(0.005)
    return predicate()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context: zmq.Context = zmq.Context()
    yield context
    context.destroy(linger=0)


class CacheSink:
    """BatchSink: producer -> multiset of cached external hashes, rebuilt from events only."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state: dict[str, Counter[int]] = defaultdict(Counter)
        self.seqs: dict[str, list[int]] = defaultdict(list)
        self.resets: Counter[str] = Counter()

    def apply_batch(self, producer: str, seq: int, batch: EventBatch) -> None:
        with self.lock:
            cached = self.state[producer]
            self.seqs[producer].append(seq)
            for event in batch.events:
                if isinstance(event, BlockStored):
                    cached.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        cached[h] -= 1  # may go negative: that would be a delivery bug, and never converge
                        if cached[h] == 0:
                            del cached[h]
                else:
                    assert isinstance(event, AllBlocksCleared)
                    cached.clear()

    def reset_producer(self, producer: str) -> None:
        with self.lock:
            self.state[producer] = Counter()
            self.resets[producer] += 1

    def view(self, producer: str) -> Counter[int]:
        with self.lock:
            return Counter(self.state[producer])


class Producer:
    """A worker-like producer: a real pool, random traffic, events published under one lock."""

    def __init__(self, config: EventsConfig, ctx: zmq.Context, *, seed: int, num_blocks: int = 32) -> None:
        self.lock = threading.Lock()
        self.pool = BlockPool(num_blocks, block_size=2)
        self.manager = KVCacheManager(self.pool, BlockHasher("xxh3_128", "kvstore", 2), watermark=0.0)
        self.rng = random.Random(seed)
        self.running: list[CacheRequest] = []
        self.steps = 0
        self.published: list[list] = []  # events of each batch, by seq
        self.publisher = ZmqEventPublisher(config, snapshot_source=self.snapshot, context=ctx)

    def snapshot(self) -> Snapshot:
        with self.lock:
            return Snapshot(self.publisher.last_seq, self.pool.snapshot_events())

    def _publish(self) -> int:
        events = self.pool.take_events()
        self.published.append(events)
        seq = self.publisher.publish(events)
        assert seq == len(self.published) - 1
        return seq

    def step(self) -> int:
        """One scheduler step: admit, finish, or (every 50 steps) drain and reset the cache."""
        with self.lock:
            self.steps += 1
            rng = self.rng
            if self.steps % 50 == 0:
                while self.running:
                    self.manager.free(self.running.pop())
                assert self.pool.reset_prefix_cache()
            elif self.running and (len(self.running) >= 4 or rng.random() < 0.3):
                self.manager.free(self.running.pop(rng.randrange(len(self.running))))
            else:
                request = CacheRequest(f"r{self.steps}", [rng.randrange(3) for _ in range(rng.randint(2, 12))])
                hit = self.manager.get_computed_blocks(request)
                if self.manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit) is not None:
                    self.running.append(request)
            return self._publish()

    def heartbeat(self) -> int:
        """An empty step, as a worker publishes every step: lets a subscriber notice a lost tail."""
        with self.lock:
            return self._publish()

    def truth(self) -> tuple[int, Counter[int]]:
        with self.lock:
            return self.publisher.last_seq, Counter(b.external_hash for b in self.pool.cached_blocks())

    def close(self) -> None:
        self.publisher.close()


def health(listener: EventListener, name: str) -> ProducerHealth | None:
    return next((h for h in listener.health() if h.producer == name), None)


def converged(listener: EventListener, sink: CacheSink, name: str, producer: Producer) -> bool:
    last_seq, cached = producer.truth()
    h = health(listener, name)
    return h is not None and h.syncing is None and h.next_seq == last_seq + 1 and sink.view(name) == cached


def assert_converges(listener: EventListener, sink: CacheSink, name: str, producer: Producer) -> ProducerHealth:
    ok = wait_until(lambda: converged(listener, sink, name, producer), tick=producer.heartbeat)
    h = health(listener, name)
    assert ok, f"did not converge: {h}; sink={sink.view(name)} truth={producer.truth()}"
    assert h is not None
    return h


def new_listener(sink: CacheSink, ctx: zmq.Context, **kw) -> EventListener:
    return EventListener(sink, context=ctx, sync_timeout_s=3.0, poll_interval_s=0.005, **kw).start()


# --------------------------------------------------------------------------- (a) normal flow


def test_normal_flow_converges(ctx: zmq.Context) -> None:
    producer = Producer(EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK), ctx, seed=1)
    sink = CacheSink()
    listener = new_listener(sink, ctx)
    try:
        assert producer.publisher.endpoint.startswith("tcp://127.0.0.1:")
        listener.add_producer("w0", producer.publisher.endpoint, producer.publisher.replay_endpoint)
        # Until the subscription is up, batches are lost; the listener then joins late, by replay.
        assert wait_until(lambda: bool(sink.seqs["w0"]), tick=producer.heartbeat)
        for _ in range(200):
            producer.step()
        assert producer.publisher.flush()
        h = assert_converges(listener, sink, "w0", producer)
        assert (h.gaps, h.snapshots, h.restarts, h.lossy, h.decode_errors, h.skipped_events) == (0, 0, 0, 0, 0, 0)
        # The replay asked for on subscribing, and one more if the first batches went out before the SUB joined.
        assert h.replays <= 2
        # Every batch was applied exactly once, in order, from seq 0.
        assert sink.seqs["w0"] == list(range(producer.publisher.last_seq + 1))
        assert producer.publisher.stats.dropped == 0
    finally:
        listener.close()
        producer.close()


# --------------------------------------------------------------------------- (b) lost messages -> replay


def test_subscriber_that_misses_messages_converges_by_replay(
    ctx: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvstore.subscriber")
    producer = Producer(EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK), ctx, seed=2)
    forwarder = LossyProxy(ctx, producer.publisher.endpoint, drop_every=7)
    sink = CacheSink()
    listener = new_listener(sink, ctx)
    try:
        # Live stream through the lossy forwarder; replay straight from the producer.
        listener.add_producer("w0", forwarder.endpoint, producer.publisher.replay_endpoint)
        assert wait_until(lambda: bool(sink.seqs["w0"]), tick=producer.heartbeat)
        for i in range(300):
            producer.step()
            if i % 20 == 0:
                time.sleep(0.002)  # let replays interleave with live traffic
        assert producer.publisher.flush()
        h = assert_converges(listener, sink, "w0", producer)
        assert forwarder.dropped >= 30
        assert h.gaps >= 1 and h.replays >= h.gaps  # losses during a replay are covered by it or the next
        assert (h.snapshots, h.restarts, h.lossy, h.decode_errors) == (0, 0, 0, 0)
        assert sink.seqs["w0"] == list(range(producer.publisher.last_seq + 1))  # each batch once, in order
        assert producer.publisher.stats.replays_served == h.replays
        assert "producer w0: batches missing; asking for a replay from seq" in caplog.text  # an operator sees why
    finally:
        listener.close()
        forwarder.close()
        producer.close()


# --------------------------------------------------------------------------- (c) late join -> snapshot


def test_late_subscriber_converges_by_snapshot(ctx: zmq.Context) -> None:
    config = EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_batches=4, snapshot_batch_blocks=5)
    producer = Producer(config, ctx, seed=3)
    for _ in range(120):  # nobody listens yet; the replay buffer keeps only the last 4
        producer.step()
    assert producer.publisher.flush()
    sink = CacheSink()
    listener = new_listener(sink, ctx)
    try:
        listener.add_producer("w0", producer.publisher.endpoint, producer.publisher.replay_endpoint)

        def synced() -> bool:
            h = health(listener, "w0")
            return h is not None and h.snapshots >= 1 and h.syncing is None

        # Keep the producer busy while the subscriber joins, replays (too short) and snapshots.
        assert wait_until(synced, tick=producer.step)
        for _ in range(30):
            producer.step()
        assert producer.publisher.flush()
        h = assert_converges(listener, sink, "w0", producer)
        assert h.snapshots >= 1 and h.replays >= 1
        assert h.lossy == 0 and h.restarts == 0 and h.decode_errors == 0
        assert sink.resets["w0"] >= 1  # the snapshot replaced whatever had been applied
        assert producer.publisher.stats.snapshots_served == h.snapshots
        assert sink.seqs["w0"][0] > 100  # it never saw the early batches: the snapshot stood in for them
    finally:
        listener.close()
        producer.close()


# --------------------------------------------------------------------------- (d) restarted producer


def start_on(endpoint: str, replay_endpoint: str, ctx: zmq.Context, seed: int) -> Producer:
    """A producer bound to fixed ports, retrying while the previous incarnation's sockets close."""
    config = EventsConfig(endpoint=endpoint, replay_endpoint=replay_endpoint)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            return Producer(config, ctx, seed=seed)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_restarted_publisher_is_detected_and_state_converges(ctx: zmq.Context) -> None:
    first = Producer(EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK), ctx, seed=4)
    endpoint, replay_endpoint = first.publisher.endpoint, first.publisher.replay_endpoint
    assert not endpoint.endswith(":*")  # the ephemeral port, resolved
    sink = CacheSink()
    listener = new_listener(sink, ctx)
    second: Producer | None = None
    try:
        listener.add_producer("w0", endpoint, replay_endpoint)
        assert wait_until(lambda: bool(sink.seqs["w0"]), tick=first.heartbeat)
        for _ in range(120):
            first.step()
        assert_converges(listener, sink, "w0", first)
        old = sink.view("w0")
        assert old

        first.close()
        second = start_on(endpoint, replay_endpoint, ctx, seed=5)  # same ports, fresh pool, seq from 0
        assert second.publisher.endpoint == endpoint
        for _ in range(5):
            second.step()
        h = assert_converges(listener, sink, "w0", second)
        assert h.restarts >= 1
        assert sink.resets["w0"] >= 1
        assert sink.view("w0") == second.truth()[1] != old
    finally:
        listener.close()
        first.close()
        if second is not None:
            second.close()


# --------------------------------------------------------------------------- (e) the replay protocol on the wire


def recv_reply(dealer: zmq.Socket) -> list[list[bytes]]:
    """Messages up to and including the terminator."""
    messages = []
    while True:
        assert dealer.poll(int(DEADLINE_S * 1000)), "no reply"
        frames = dealer.recv_multipart()
        messages.append(frames)
        if frames[2:3] == [END_SEQ]:
            return messages


def test_replay_and_snapshot_protocol_frames(ctx: zmq.Context) -> None:
    config = EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, topic="kv", snapshot_batch_blocks=2)
    producer = Producer(config, ctx, seed=6)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    decoder = EventDecoder()
    try:
        dealer.connect(producer.publisher.replay_endpoint)
        assert END_SEQ == b"\xff" * 8 == (-1).to_bytes(8, "big", signed=True)

        # Nothing published: a snapshot is just the terminator.
        dealer.send_multipart([b"", b"snapshot"])
        assert recv_reply(dealer) == [[b"", b"", END_SEQ, b""]]

        for _ in range(6):
            producer.step()
        assert producer.publisher.flush()
        assert producer.publisher.last_seq == 5

        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        reply = recv_reply(dealer)
        assert [len(m) for m in reply] == [4, 4, 4, 4, 4]
        assert [m[:3] for m in reply[:-1]] == [[b"", b"kv", seq.to_bytes(8, "big")] for seq in (2, 3, 4, 5)]
        for seq, message in zip((2, 3, 4, 5), reply, strict=False):
            assert decoder.decode(message[3]).batch.events == producer.published[seq]
        assert reply[-1] == [b"", b"", END_SEQ, b""]

        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert [m[2] for m in recv_reply(dealer)] == [s.to_bytes(8, "big") for s in range(6)] + [END_SEQ]
        dealer.send_multipart([b"", (99).to_bytes(8, "big")])
        assert recv_reply(dealer) == [[b"", b"", END_SEQ, b""]]

        # Malformed requests are ignored (no reply at all) and counted.
        dealer.send_multipart([b"", b"abc"])
        dealer.send_multipart([b"x", b"y", b"z"])
        dealer.send_multipart([b"", (5).to_bytes(8, "big")])
        reply = recv_reply(dealer)  # the first thing back answers the valid request
        assert [m[2] for m in reply] == [(5).to_bytes(8, "big"), END_SEQ]

        # Snapshot: the whole cache as BlockStored batches, every one tagged with the seq it reflects.
        dealer.send_multipart([b"", b"snapshot"])
        reply = recv_reply(dealer)
        with producer.lock:
            expected = producer.pool.snapshot_events()
            last_seq = producer.publisher.last_seq
        assert len(expected) >= 3
        assert len(reply) == -(-len(expected) // 2) + 1
        got = []
        for message in reply[:-1]:
            assert message[:3] == [b"", b"kv", last_seq.to_bytes(8, "big")]
            events = decoder.decode(message[3]).batch.events
            assert 1 <= len(events) <= 2 and all(isinstance(e, BlockStored) for e in events)
            got += events
        assert got == expected
        assert reply[-1] == [b"", b"", END_SEQ, b""]

        # The server counts a reply once its last frame is sent, which may be just after the client read it.
        def counts() -> tuple[int, int, int, int]:
            stats = producer.publisher.stats
            return stats.published, stats.replays_served, stats.snapshots_served, stats.bad_requests

        deadline = time.monotonic() + 5
        while counts() != (6, 4, 2, 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counts() == (6, 4, 2, 2)
    finally:
        dealer.close(linger=0)
        producer.close()


def test_live_frames_are_topic_seq_payload(ctx: zmq.Context) -> None:
    producer = Producer(EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, topic="kv"), ctx, seed=7)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        sub.connect(producer.publisher.endpoint)
        assert wait_until(lambda: sub.poll(0) != 0, tick=producer.heartbeat)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        first = int.from_bytes(seq, "big")
        for _ in range(3):
            producer.step()
        for expected in range(first + 1, first + 4):
            assert sub.poll(int(DEADLINE_S * 1000))
            topic, seq, payload = sub.recv_multipart()
            assert (topic, seq) == (b"kv", expected.to_bytes(8, "big"))
            assert EventDecoder().decode(payload).batch.events == producer.published[expected]
    finally:
        sub.close(linger=0)
        producer.close()


# --------------------------------------------------------------------------- (f) garbage on the stream


def test_garbage_frames_are_counted_not_fatal(ctx: zmq.Context) -> None:
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(LOOPBACK)
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    errors: list[tuple[str, EventDecodeError]] = []
    sink = CacheSink()
    listener = new_listener(sink, ctx, on_decode_error=lambda name, exc: errors.append((name, exc)))
    encoder = EventEncoder()

    def batch(seq: int, *hashes: int) -> list[bytes]:
        events = [BlockStored(list(hashes), None, [1, 2] * len(hashes), 2, None, "GPU", None)]
        return [b"", seq.to_bytes(8, "big"), encoder.encode(EventBatch(1.0, list(events), None))]

    def errors_now() -> int:
        h = health(listener, "g")
        return -1 if h is None else h.decode_errors

    try:
        listener.add_producer("g", endpoint, None)  # a bare PUB: no replay endpoint at all
        # Until the subscription is up, frames are lost: send one-frame junk until one is counted.
        assert wait_until(lambda: errors_now() >= 1, tick=lambda: pub.send(b"junk"))
        base = errors_now()
        pub.send_multipart([b"x"])
        pub.send_multipart([b"", b"12345678"])  # two frames
        pub.send_multipart([b"", b"123", b"payload"])  # seq is not 8 bytes
        pub.send_multipart([b"", b"", b"", b""])  # four frames
        pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])  # in order, undecodable
        pub.send_multipart(batch(1, 42))
        assert wait_until(lambda: sink.view("g") == Counter({42: 1}))
        h = health(listener, "g")
        assert h is not None
        assert h.decode_errors == base + 5
        assert (h.batches, h.next_seq, h.gaps) == (1, 2, 0)
        assert len(errors) == 1 and errors[0][0] == "g"  # the callback sees payload errors

        # A gap on a producer with no replay endpoint: recovered lossy, not a crash (nor a replay loop).
        pub.send_multipart(batch(3, 43))
        assert wait_until(lambda: sink.view("g") == Counter({42: 1, 43: 1}))
        pub.send_multipart(batch(4, 44))
        assert wait_until(lambda: sink.view("g") == Counter({42: 1, 43: 1, 44: 1}))
        h = health(listener, "g")
        assert h is not None and h.gaps == 1 and h.lossy >= 1 and h.next_seq == 5 and h.syncing is None
    finally:
        listener.close()
        pub.close(linger=0)


# --------------------------------------------------------------------------- a sink that fails on one batch


class FailsOnce(CacheSink):
    """Raises on the first batch it is given from ``victim`` (a bug in a sink, an event it cannot take)."""

    def __init__(self, victim: str) -> None:
        super().__init__()
        self.victim = victim
        self.raised = False

    def apply_batch(self, producer: str, seq: int, batch: EventBatch) -> None:
        if producer == self.victim and not self.raised and batch.events:
            self.raised = True
            raise ValueError("cannot take this batch")
        super().apply_batch(producer, seq, batch)


def test_a_batch_the_sink_cannot_apply_is_counted_and_every_stream_goes_on(ctx: zmq.Context) -> None:
    """Before: the exception ended the listener's thread, and with it every producer's stream."""
    good = Producer(EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK), ctx, seed=8)
    bad = Producer(EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK), ctx, seed=9)
    sink = FailsOnce("bad")
    errors: list[tuple[str, Exception]] = []
    listener = new_listener(sink, ctx, on_decode_error=lambda name, exc: errors.append((name, exc)))
    try:
        listener.add_producer("good", good.publisher.endpoint, good.publisher.replay_endpoint)
        listener.add_producer("bad", bad.publisher.endpoint, bad.publisher.replay_endpoint)
        assert wait_until(lambda: (bool(sink.seqs["good"]) and bool(sink.seqs["bad"])) or sink.raised,
                          tick=lambda: (good.heartbeat(), bad.heartbeat()))  # fmt: skip
        for _ in range(50):
            good.step()
            bad.step()
        # Until the listener has called back (it logs the traceback first): the sink raising is not enough.
        assert wait_until(lambda: bool(errors), tick=bad.heartbeat)
        assert_converges(listener, sink, "good", good)
        h = health(listener, "bad")
        assert h is not None and h.decode_errors == 1 and [name for name, _ in errors] == ["bad"]
        assert "could not be applied: cannot take this batch" in str(errors[0][1])
        # The bad producer's later batches still arrive (what the dropped batch stored is not in its view).
        before = len(sink.seqs["bad"])
        bad.step()
        assert wait_until(lambda: len(sink.seqs["bad"]) > before, tick=bad.heartbeat)
    finally:
        listener.close()
        good.close()
        bad.close()
