"""A replay is complete, or it says it is not: never a silent hole before the end marker.

A real ZmqEventPublisher holds thousands of batches (more bytes than the
socket buffers between it and a consumer hold), and a raw DEALER asks for
all of them, as a subscriber that fell behind does. A consumer that reads
late, or slower than the producer sends, must still get every buffered
batch, in order, then the end marker. A consumer that stops reading while
the producer keeps publishing (so the batches it has not received yet leave
the replay buffer) must never get the end marker after a hole: it gets a
complete replay, or no end marker and falls back to a snapshot.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import zmq

from kvstore.config import EventsConfig
from kvstore.events import BlockStored
from kvstore.publisher import END_SEQ, ZmqEventPublisher

PAYLOAD_TOKENS = 2048  # ~8 KiB of msgpack per batch


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def batch(i: int, tokens: int = PAYLOAD_TOKENS) -> list[BlockStored]:
    return [
        BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=[i % 1000] * tokens, block_size=16,
                    lora_id=None, medium="GPU", lora_name=None)
    ]  # fmt: skip


def ask_replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> zmq.Socket[bytes]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    return dealer


def read_reply(
    dealer: zmq.Socket[bytes], quiet_s: float, limit: int | None = None, pace_s: float = 0.0
) -> tuple[list[int], bool]:
    """The seqs received until the end marker (True) or ``quiet_s`` of silence (False); at most ``limit``,
    one every ``pace_s`` at most (a consumer slower than the producer's sending)."""
    seqs: list[int] = []
    while limit is None or len(seqs) < limit:
        if not dealer.poll(int(quiet_s * 1000)):
            return seqs, False
        frames = dealer.recv_multipart()
        if frames[2] == END_SEQ:
            return seqs, True
        seqs.append(int.from_bytes(frames[2], "big"))
        if pace_s:
            time.sleep(pace_s)
    return seqs, False


@contextlib.contextmanager
def replay_asked(
    ctx: zmq.Context[zmq.Socket[bytes]], batches: int, tokens: int = PAYLOAD_TOKENS
) -> Iterator[tuple[ZmqEventPublisher, zmq.Socket[bytes]]]:
    """A publisher holding ``batches`` batches (its whole buffer), and a DEALER that has asked for all of them."""
    publisher = ZmqEventPublisher(EventsConfig(buffer_batches=batches), context=ctx)
    dealer = None
    try:
        for i in range(batches):
            publisher.publish(batch(i, tokens))
        assert publisher.flush(30)
        dealer = ask_replay(ctx, publisher.replay_endpoint, 0)
        yield publisher, dealer
    finally:
        if dealer is not None:
            dealer.close(linger=0)
        publisher.close()


def missing(seqs: list[int]) -> int:
    """Batches missing before the last one received."""
    return len(set(range(seqs[-1] + 1)) - set(seqs)) if seqs else 0


def test_a_consumer_that_reads_late_gets_every_buffered_batch_then_the_end(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with replay_asked(ctx, 5_000) as (_, dealer):
        time.sleep(1.0)  # reads late: the reply piles up against the socket's high-water mark
        seqs, ended = read_reply(dealer, quiet_s=3.0)
        print(f"\nlate reader: {len(seqs)} of 5,000 batches, end marker {'received' if ended else 'missing'}")
        assert seqs == list(range(5_000)), f"{len(seqs)} of 5,000, first missing {min(set(range(5_000)) - set(seqs))}"
        assert ended


def test_a_consumer_slower_than_the_replay_gets_no_silent_hole(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with replay_asked(ctx, 20_000, tokens=64) as (_, dealer):
        seqs, ended = read_reply(dealer, quiet_s=3.0, pace_s=0.00005)
        print(f"\nslow reader: {len(seqs)} of 20,000 batches, {missing(seqs)} missing before the last one received, "
              f"end marker {'received' if ended else 'missing'}")  # fmt: skip
        assert seqs == list(range(len(seqs))), f"a hole in the replay: {missing(seqs)} batches missing"
        assert ended and len(seqs) == 20_000


def test_a_replay_that_cannot_be_completed_sends_no_end_marker(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with replay_asked(ctx, 5_000) as (publisher, dealer):
        head, _ = read_reply(dealer, quiet_s=3.0, limit=5)
        assert head == [0, 1, 2, 3, 4]
        # The consumer stalls while the producer publishes a whole buffer's worth more: the batches
        # of the replay still waiting to be sent leave the buffer.
        for i in range(5_000, 10_500):
            publisher.publish(batch(i))
        assert publisher.flush(30)
        time.sleep(0.5)
        rest, ended = read_reply(dealer, quiet_s=3.0)
        seqs = head + rest
        print(f"\nstalled reader: {len(seqs)} of 5,000 batches, {missing(seqs)} missing before the last one "
              f"received, end marker {'received' if ended else 'missing'}")  # fmt: skip
        assert seqs == list(range(len(seqs))), f"a hole in the replay: {missing(seqs)} batches missing"
        assert not ended or len(seqs) == 5_000, "the end marker after an incomplete replay"
