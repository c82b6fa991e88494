"""Hostile and broken producers over real ZeroMQ sockets: one of them never stops the listener, costs bounded
memory, or keeps it asking forever, and the other producers' streams go on.

Each hostile producer is a plain PUB plus a ROUTER answering replay and snapshot requests however the case
needs (vLLM's framing for a replay reply: ``[b"", topic, seq, payload]``, ends with ``END_SEQ``); a good
producer is the real :class:`~kvstore.publisher.ZmqEventPublisher` beside it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import zmq
from faults_helpers import wait_for

import kvstore.producer_stream as producer_stream
from kvstore.config import EventsConfig
from kvstore.errors import ConfigError
from kvstore.events import BlockStored, EventBatch, EventEncoder
from kvstore.publisher import END_SEQ, SNAPSHOT_REQUEST, ZmqEventPublisher
from kvstore.subscriber import EventListener, ProducerHealth

LOOPBACK = "tcp://127.0.0.1:*"
ENCODER = EventEncoder()


def stored(*hashes: int) -> BlockStored:
    return BlockStored(list(hashes), None, [1, 2] * len(hashes), 2, None, "GPU", None)


def payload(*hashes: int) -> bytes:
    return ENCODER.encode(EventBatch(time.time(), [stored(*hashes)], None))


class Sink:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.blocks: dict[str, Counter[int]] = {}

    def apply_batch(self, producer: str, seq: int, batch: EventBatch) -> None:
        with self.lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self.blocks.setdefault(producer, Counter()).update(event.block_hashes)

    def reset_producer(self, producer: str) -> None:
        with self.lock:
            self.blocks[producer] = Counter()

    def view(self, producer: str) -> Counter[int]:
        with self.lock:
            return Counter(self.blocks.get(producer, Counter()))


Answer = Callable[[bytes, Callable[[list[bytes]], None], threading.Event], None]


class Hostile:
    """A PUB and a ROUTER whose answers ``answer(request_body, send)`` decides, run on a thread."""

    def __init__(self, ctx: zmq.Context, answer: Answer) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(LOOPBACK)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(LOOPBACK)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests: list[bytes] = []
        self._answer = answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(20):
                continue
            client, _, body = self.router.recv_multipart()
            self.requests.append(body)

            def send(frames: list[bytes], client: bytes = client) -> None:
                self.router.send_multipart([client, b"", *frames])

            self._answer(body, send, self._stop)

    def live(self, seq: int, data: bytes) -> None:
        self.pub.send_multipart([b"", seq.to_bytes(8, "big"), data])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context: zmq.Context = zmq.Context()
    yield context
    context.destroy(linger=0)


def health(listener: EventListener, name: str) -> ProducerHealth:
    """``name``'s health, once the listener thread has taken it up (within a poll of ``add_producer``)."""
    assert wait_for(lambda: any(h.producer == name for h in listener.health()), timeout=5), f"{name} not followed"
    return next(h for h in listener.health() if h.producer == name)


@pytest.fixture
def good(ctx: zmq.Context) -> Iterator[ZmqEventPublisher]:
    publisher = ZmqEventPublisher(EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK), context=ctx)
    yield publisher
    publisher.close()


def follow_good(listener: EventListener, good: ZmqEventPublisher, sink: Sink) -> Callable[[int], bool]:
    """Subscribe to the good producer; returns a check that a fresh batch of it (hash ``h``) reaches the sink."""
    endpoints = good.endpoints
    assert endpoints is not None
    listener.add_producer("good", endpoints.endpoint, endpoints.replay_endpoint)

    def flows(h: int) -> bool:
        return wait_for(lambda: sink.view("good")[h] >= 1, tick=lambda: good.publish([stored(h)]))

    return flows


def test_an_endpoint_zeromq_refuses_is_a_config_error_and_the_listener_goes_on(
    ctx: zmq.Context, good: ZmqEventPublisher
) -> None:
    sink = Sink()
    listener = EventListener(sink, context=ctx, poll_interval_s=0.005).start()
    try:
        flows = follow_good(listener, good, sink)
        assert flows(1)
        for endpoint, replay in [("udp://127.0.0.1:5557", None), ("ipc:///" + "x" * 200, None),
                                 ("tcp://127.0.0.1:5557", "udp://127.0.0.1:5558")]:  # fmt: skip
            with pytest.raises(ConfigError, match="cannot be subscribed to"):
                listener.add_producer("bad", endpoint, replay)
        assert flows(2)  # the listener thread lives on
        assert [h.producer for h in listener.health()] == ["good"]
    finally:
        listener.close()


def test_a_snapshot_reply_that_never_ends_is_abandoned_at_its_bound(
    ctx: zmq.Context, good: ZmqEventPublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reply to a snapshot request streams batches forever: held until its end marker, it would take the
    router's memory. Past the bound it is abandoned; the stream resumes from live batches, and others flow."""
    monkeypatch.setattr(producer_stream, "_MAX_SNAPSHOT_BYTES", 64 << 10)
    big = payload(*range(100, 140))

    def answer(body: bytes, send: Callable[[list[bytes]], None], stop: threading.Event) -> None:
        if body != SNAPSHOT_REQUEST:
            send([b"", END_SEQ, b""])  # a replay: nothing held
            return
        while not stop.is_set():
            try:
                send([b"", (7).to_bytes(8, "big"), big])
            except zmq.ZMQError:
                return
            time.sleep(0.0005)

    hostile = Hostile(ctx, answer)
    sink = Sink()
    listener = EventListener(sink, context=ctx, poll_interval_s=0.005, sync_timeout_s=5.0).start()
    try:
        flows = follow_good(listener, good, sink)
        listener.add_producer("flood", hostile.endpoint, hostile.replay)
        seq = iter(range(5, 10_000))
        assert wait_for(
            lambda: health(listener, "flood").oversized >= 1, tick=lambda: hostile.live(next(seq), payload(9))
        )
        h = health(listener, "flood")
        assert h.lossy >= 1 and h.syncing is None
        assert flows(3)
        assert sink.view("flood")[9] >= 1  # resumed from the live stream
    finally:
        listener.close()
        hostile.close()


def test_a_replay_reply_that_trickles_on_is_cut_off(ctx: zmq.Context, good: ZmqEventPublisher) -> None:
    """Each item of the reply comes before the per-item timeout, stale, and no end marker ever does: the request
    is cut off at its overall budget and counted, instead of holding the stream in a sync for good."""

    def answer(body: bytes, send: Callable[[list[bytes]], None], stop: threading.Event) -> None:
        if body == SNAPSHOT_REQUEST:
            send([b"", (0).to_bytes(8, "big"), payload(50)])
            send([b"", END_SEQ, b""])
            return
        while not stop.is_set() and not hostile.router.poll(0):  # a stale item, until another request comes
            send([b"", (0).to_bytes(8, "big"), payload(7)])
            if stop.wait(0.02):
                return

    hostile = Hostile(ctx, answer)
    sink = Sink()
    listener = EventListener(sink, context=ctx, poll_interval_s=0.005, sync_timeout_s=0.1).start()  # cutoff: 3 s
    try:
        flows = follow_good(listener, good, sink)
        listener.add_producer("trickle", hostile.endpoint, hostile.replay)
        assert wait_for(lambda: health(listener, "trickle").sync_timeouts >= 1, timeout=20)
        assert wait_for(lambda: sink.view("trickle")[50] >= 1)  # the snapshot asked for next was applied
        assert flows(4)
    finally:
        listener.close()
        hostile.close()


def test_a_live_seq_far_ahead_of_the_producer_does_not_start_a_resync_storm(
    ctx: zmq.Context, good: ZmqEventPublisher
) -> None:
    """A producer that answers replays and snapshots correctly (it holds seqs 0 and 1), and one live frame with
    seq 2**64 - 1: its replies never reach that seq and its snapshots never cover it. The listener drops the
    frame after a few requests instead of asking forever, and the producer's later batches are applied."""
    held = {0: payload(60), 1: payload(61)}

    def answer(body: bytes, send: Callable[[list[bytes]], None], stop: threading.Event) -> None:
        if body == SNAPSHOT_REQUEST:
            send([b"", (max(held)).to_bytes(8, "big"), payload(*(60 + s for s in held))])
        else:
            start = int.from_bytes(body, "big")
            for seq in sorted(held):
                if seq >= start:
                    send([b"", seq.to_bytes(8, "big"), held[seq]])
        send([b"", END_SEQ, b""])

    hostile = Hostile(ctx, answer)
    sink = Sink()
    listener = EventListener(sink, context=ctx, poll_interval_s=0.005).start()
    try:
        flows = follow_good(listener, good, sink)
        listener.add_producer("p", hostile.endpoint, hostile.replay)
        assert wait_for(lambda: sink.view("p")[61] >= 1 and health(listener, "p").syncing is None)
        hostile.live(2**64 - 1, payload(666))
        assert wait_for(lambda: health(listener, "p").dropped >= 1)
        asked = len(hostile.requests)
        time.sleep(1.0)
        h = health(listener, "p")
        assert len(hostile.requests) == asked and h.syncing is None, "still asking"
        assert sink.view("p")[666] == 0
        held[2] = payload(62)
        hostile.live(2, held[2])
        assert wait_for(lambda: sink.view("p")[62] >= 1)
        assert health(listener, "p").next_seq == 3
        assert flows(5)
    finally:
        listener.close()
        hostile.close()


def test_a_batch_that_cannot_be_encoded_costs_its_seq_not_the_publisher(ctx: zmq.Context) -> None:
    """An event no encoder can write (a caller's bug: an extra key beyond 64 bits) is dropped and counted; the
    publisher thread goes on, subscribers see a gap they replay, and close() returns."""
    publisher = ZmqEventPublisher(EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK), context=ctx)
    sink = Sink()
    listener = EventListener(sink, context=ctx, poll_interval_s=0.005).start()
    try:
        endpoints = publisher.endpoints
        assert endpoints is not None
        listener.add_producer("p", endpoints.endpoint, endpoints.replay_endpoint)
        assert wait_for(lambda: sink.view("p")[1] >= 1, tick=lambda: publisher.publish([stored(1)]))
        bad = BlockStored([2], None, [1, 2], 2, None, "GPU", None, extra_keys=[[2**70]])
        publisher.publish([bad])
        assert wait_for(lambda: sink.view("p")[3] >= 1, tick=lambda: publisher.publish([stored(3)]))
        assert publisher.flush() and publisher.stats.dropped == 1
        assert sink.view("p")[2] == 0
    finally:
        listener.close()
        started = time.monotonic()
        publisher.close()
        assert time.monotonic() - started < 6
