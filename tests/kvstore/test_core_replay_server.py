"""The publisher's replay side: the replay buffer's two bounds, and the limits and outcomes of replies.

The buffer is tested directly; the server through a real ZmqEventPublisher
and raw DEALER sockets on loopback, so every reply is what a subscriber
would read.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from kvstore import replay_server
from kvstore.config import EventsConfig
from kvstore.events import BlockStored, EventDecoder
from kvstore.publisher import END_SEQ, SNAPSHOT_REQUEST, Snapshot, ZmqEventPublisher
from kvstore.replay_server import MAX_ACTIVE, ReplayBuffer


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


# --------------------------------------------------------------------------- the buffer


def test_the_buffer_keeps_the_newest_batches_within_both_bounds() -> None:
    buffer = ReplayBuffer(max_batches=4, max_bytes=100)
    for seq in range(6):
        buffer.append(seq, b"x" * 10)
    assert (buffer.batches, buffer.bytes, buffer.evicted_through) == (4, 40, 1)
    buffer.append(6, b"y" * 70)  # 4 * 10 + 70 > 100: the oldest go until it fits
    assert (buffer.batches, buffer.bytes, buffer.evicted_through) == (4, 100, 2)
    assert buffer.read(0, 99, 10) is None  # 0..2 were evicted: no complete reply from 0
    assert buffer.read(3, 99, 10) == [(3, b"x" * 10), (4, b"x" * 10), (5, b"x" * 10), (6, b"y" * 70)]
    assert buffer.read(4, 5, 10) == [(4, b"x" * 10), (5, b"x" * 10)]  # up to ``through``
    assert buffer.read(4, 99, 1) == [(4, b"x" * 10)]  # at most ``limit``
    assert buffer.window(0) == (3, 6) and buffer.window(5) == (5, 6)
    buffer.append(7, b"z" * 101)  # alone over the byte bound: not kept, and everything before it evicted
    assert (buffer.batches, buffer.bytes, buffer.evicted_through) == (0, 0, 7)
    assert buffer.window(0) == (8, -1)
    buffer.check_invariants()


def test_a_buffer_with_gaps_in_its_seqs_reads_what_it_holds() -> None:
    # A batch the queue turned away consumed its seq but was never buffered: that is no eviction.
    buffer = ReplayBuffer(max_batches=10, max_bytes=1000)
    for seq in (0, 1, 3, 4):
        buffer.append(seq, bytes([seq]))
    assert buffer.read(1, 4, 10) == [(1, b"\x01"), (3, b"\x03"), (4, b"\x04")]
    assert buffer.read(2, 4, 10) == [(3, b"\x03"), (4, b"\x04")]
    buffer.check_invariants()


def test_check_invariants_catches_a_drifted_byte_count() -> None:
    buffer = ReplayBuffer(max_batches=10, max_bytes=1000)
    buffer.append(0, b"abc")
    buffer._bytes += 1
    with pytest.raises(AssertionError, match="byte count"):
        buffer.check_invariants()


# --------------------------------------------------------------------------- the server


def stored(i: int, tokens: int = 1024) -> list[BlockStored]:
    return [BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=[1] * tokens, block_size=16,
                        lora_id=None, medium="GPU", lora_name=None)]  # fmt: skip


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 10)  # a consumer that does not read holds up its reply quickly
    sock.connect(endpoint)
    return sock


def read_all(sock: zmq.Socket[bytes], quiet_ms: int = 3000) -> tuple[list[int], bool]:
    seqs: list[int] = []
    while sock.poll(quiet_ms):
        frames = sock.recv_multipart()
        if frames[2] == END_SEQ:
            return seqs, True
        seqs.append(int.from_bytes(frames[2], "big"))
    return seqs, False


def wait(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_one_reply_per_client_and_at_most_max_active_at_once(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    publisher = ZmqEventPublisher(EventsConfig(buffer_batches=2_000), context=ctx)
    clients = [dealer(ctx, publisher.replay_endpoint) for _ in range(MAX_ACTIVE + 2)]
    try:
        for i in range(2_000):
            publisher.publish(stored(i))
        assert publisher.flush()
        for sock in clients:  # more clients than MAX_ACTIVE ask at once, none reading yet
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
        clients[0].send_multipart([b"", (5).to_bytes(8, "big")])  # a second request while its first is served
        assert wait(lambda: publisher.stats.sync_rejected == 1)
        for sock in clients:  # every client, read in turn, gets its whole reply, then the end marker
            assert read_all(sock) == (list(range(2_000)), True)
        assert wait(lambda: publisher.stats.replays_served == len(clients))
        assert publisher.stats.sync_abandoned == 0
    finally:
        for sock in clients:
            sock.close(linger=0)
        publisher.close()
    publisher.check_invariants()


def test_a_consumer_that_stops_reading_is_given_up_without_the_end_marker(
    ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replay_server, "STALL_S", 0.3)
    publisher = ZmqEventPublisher(EventsConfig(buffer_batches=5_000), context=ctx)
    sock = dealer(ctx, publisher.replay_endpoint)
    try:
        for i in range(5_000):  # 40 MB: more than the socket buffers on the way hold
            publisher.publish(stored(i, tokens=4096))
        assert publisher.flush()
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        assert wait(lambda: publisher.stats.sync_abandoned == 1)
        seqs, ended = read_all(sock, quiet_ms=500)
        assert seqs == list(range(len(seqs))) and len(seqs) < 5_000 and not ended
        # The slot is free again: the same client asks again and, reading, gets everything.
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        assert read_all(sock) == (list(range(5_000)), True)
        assert publisher.stats.replays_served == 1
    finally:
        sock.close(linger=0)
        publisher.close()


def test_snapshots_come_whole_and_hashes_only_when_configured(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    events = [e for i in range(5) for e in stored(i, tokens=16)]
    config = EventsConfig(snapshot_batch_blocks=2, include_token_ids=False)
    publisher = ZmqEventPublisher(config, context=ctx, snapshot_source=lambda: Snapshot(7, list(events)))
    sock = dealer(ctx, publisher.replay_endpoint)
    decoder = EventDecoder()
    try:
        sock.send_multipart([b"", SNAPSHOT_REQUEST])
        got: list[BlockStored] = []
        while True:
            assert sock.poll(5000)
            frames = sock.recv_multipart()
            if frames[2] == END_SEQ:
                break
            assert frames[2] == (7).to_bytes(8, "big")
            got += [e for e in decoder.decode(frames[3]).batch.events if isinstance(e, BlockStored)]
        assert [e.block_hashes for e in got] == [e.block_hashes for e in events]
        assert all(e.token_ids == [] for e in got) and all(e.token_ids for e in events)  # the source untouched
        assert publisher.stats.snapshots_served == 1
    finally:
        sock.close(linger=0)
        publisher.close()
