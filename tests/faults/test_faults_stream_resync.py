"""A producer that stalls or restarts in the middle of a resync: the subscriber never forgets what it holds.

The producer here is a real PUB + ROUTER pair on loopback speaking our
replay/snapshot protocol (:class:`StallingPeer`), whose answers can be cut
short on purpose: a reply that stops halfway and never ends, as a worker
whose publisher stalls does. The subscriber is the router's real
EventListener (short sync timeout) feeding a :class:`PoolView`. What it
believes the producer holds must never be emptied by a resync that did not
complete -- it keeps the old state, asks again, and converges once the
producer answers; and a producer that restarts during the very first replay
must not leave the stream stuck.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import zmq
from faults_helpers import PoolView, wait_for

from kvstore.events import BlockStored, EventBatch, EventEncoder
from kvstore.publisher import END_SEQ, SNAPSHOT_REQUEST
from kvstore.subscriber import EventListener

SYNC_TIMEOUT_S = 0.5


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def stored(block: int) -> BlockStored:
    return BlockStored(block_hashes=[block], parent_block_hash=None, token_ids=list(range(4)), block_size=4,
                       lora_id=None, medium="GPU", lora_name=None)  # fmt: skip


class StallingPeer:
    """PUB + ROUTER framed as kvstore.publisher frames them, with replies that can be cut short.

    ``blocks`` is the producer's true state (what a snapshot returns, one
    block per batch). ``cut`` maps a request number (0 = the first request
    the ROUTER receives) to how many items of its reply are sent before the
    reply stops for good: no more items, no end marker. While
    ``cut_snapshots`` is set, every snapshot reply stops after that many.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], cut: dict[int, int], ports: tuple[int, int] = (0, 0)):
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self.pub, ports[0])
        self.replay_endpoint = _bind(self.router, ports[1])
        self.cut = cut
        self.cut_snapshots: int | None = None
        self.requests = 0
        self.buffer: list[tuple[int, bytes]] = []  # what a replay returns
        self.blocks: Counter[int] = Counter()
        self.next_seq = 0
        self._encoder = EventEncoder()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def ports(self) -> tuple[int, int]:
        return int(self.endpoint.rsplit(":", 1)[1]), int(self.replay_endpoint.rsplit(":", 1)[1])

    def publish(self, blocks: list[int], *, live: bool = True, buffered: bool = True) -> int:
        """Publish one batch storing ``blocks``; ``live=False`` loses it on the wire, ``buffered=False``
        keeps it out of the replay buffer (it aged out)."""
        with self._lock:
            seq = self.next_seq
            self.next_seq += 1
            self.blocks.update(blocks)
            payload = self._encoder.encode(EventBatch(float(seq), [stored(b) for b in blocks]))
            if buffered:
                self.buffer.append((seq, payload))
            if live:
                self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        return seq

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(10):
                continue
            client, _, body = self.router.recv_multipart()
            with self._lock:
                number, self.requests = self.requests, self.requests + 1
                if body == SNAPSHOT_REQUEST:
                    seq = self.next_seq - 1
                    items = [
                        (seq, self._encoder.encode(EventBatch(0.0, [stored(b)])))
                        for b in sorted(self.blocks.elements())
                    ]
                else:
                    start = int.from_bytes(body, "big")
                    items = [(s, p) for s, p in self.buffer if s >= start]
            limit = self.cut_snapshots if body == SNAPSHOT_REQUEST and self.cut_snapshots is not None else None
            limit = self.cut.get(number, limit)
            for seq, payload in items[:limit]:
                self.router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
            if limit is None:
                self.router.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.pub.close(linger=0)
        self.router.close(linger=0)


def _bind(sock: zmq.Socket[bytes], port: int) -> str:
    sock.bind(f"tcp://127.0.0.1:{port or '*'}")
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


class LoggingView(PoolView):
    """A PoolView that also counts how often the subscriber reset the producer's state."""

    def __init__(self) -> None:
        super().__init__()
        self.resets = 0

    def reset_producer(self, producer: str) -> None:
        self.resets += 1
        super().reset_producer(producer)


def subscribe(ctx: zmq.Context[zmq.Socket[bytes]], peer: StallingPeer) -> tuple[EventListener, LoggingView]:
    view = LoggingView()
    listener = EventListener(view, context=ctx, sync_timeout_s=SYNC_TIMEOUT_S, poll_interval_s=0.005)
    listener.add_producer("p", peer.endpoint, peer.replay_endpoint)
    return listener.start(), view


def test_a_snapshot_cut_short_keeps_the_old_state_and_is_asked_again(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    # The replay asked for on subscribing is answered in full; the replay for a gap, with nothing (those
    # batches aged out); the snapshot that follows stops after one of its 11 batches, and so does every
    # snapshot asked for again, until the producer recovers.
    peer = StallingPeer(ctx, cut={})
    for block in range(10):
        peer.publish([1000 + block])
    listener, view = subscribe(ctx, peer)
    try:
        assert wait_for(lambda: view.view("p") == peer.blocks, timeout=5)
        held = view.view("p")
        peer.cut_snapshots = 1
        peer.publish([1010], live=False, buffered=False)  # lost, and no longer in the buffer
        peer.publish([], buffered=False)  # the next batch (empty) shows the gap
        time.sleep(5 * SYNC_TIMEOUT_S)  # snapshots are cut short and time out, again and again
        during = view.view("p")
        stalled_requests = peer.requests
        peer.cut_snapshots = None  # the producer recovers
        converged = wait_for(lambda: view.view("p") == peer.blocks, timeout=5)
        health = listener.health()[0]
        print(f"\nsnapshot cut short: {sum(held.values())} blocks held before, {sum(during.values())} after "
              f"{stalled_requests - 2} cut-short snapshots timed out; resets {view.resets}; converged: {converged} "
              f"once the producer answered")  # fmt: skip
        assert during == held, "a resync that did not complete changed what the subscriber holds"
        assert converged and view.resets == 1  # one complete snapshot replaced the state, once
        assert health.lossy == 0 and health.sync_timeouts >= 2 and health.snapshots == health.sync_timeouts + 1
    finally:
        listener.close()
        peer.close()


def test_a_first_replay_cut_short_keeps_what_it_applied_and_recovers(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    # Request 0, the replay asked for on subscribing, stops after 4 of its 10 batches; the producer stays quiet.
    peer = StallingPeer(ctx, cut={0: 4})
    for block in range(10):
        peer.publish([1000 + block])
    listener, view = subscribe(ctx, peer)
    try:
        time.sleep(3 * SYNC_TIMEOUT_S)
        during = sum(view.view("p").values())
        converged = wait_for(lambda: view.view("p") == peer.blocks, timeout=5)
        print(f"\nfirst replay cut short: {during} of 10 blocks held after the timeout; converged: {converged}")
        assert during >= 4, "the blocks the replay applied were thrown away"
        assert converged
        assert listener.health()[0].lossy == 0
    finally:
        listener.close()
        peer.close()


def test_a_producer_restarted_during_the_first_replay_does_not_leave_the_stream_stuck(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    # The first incarnation never answers the replay asked for on subscribing; it dies while that replay
    # is in flight, and a new incarnation comes back on the same ports and publishes.
    old = StallingPeer(ctx, cut={0: 0})
    listener, view = subscribe(ctx, old)
    new = None
    try:
        assert wait_for(lambda: old.requests == 1, timeout=5)
        ports = old.ports
        old.close()
        time.sleep(0.3)  # the subscriber sees the connection drop
        new = StallingPeer(ctx, cut={}, ports=ports)
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and (view.view("p") != new.blocks or not new.blocks):
            new.publish([2000 + new.next_seq])
            time.sleep(0.05)
        health = listener.health()[0]
        print(f"\nrestart during the first replay: {sum(view.view('p').values())} of {sum(new.blocks.values())} "
              f"blocks; syncing {health.syncing}")  # fmt: skip
        assert view.view("p") == new.blocks, f"the stream is stuck ({health.syncing}): live batches never applied"
    finally:
        listener.close()
        if new is not None:
            new.close()
