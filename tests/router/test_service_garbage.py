"""10,000 malformed frames on a producer's stream: counted, dropped, and the router keeps serving."""

from __future__ import annotations

import random
import struct

import msgspec
import zmq

from kvstore.events import BlockStored, EventBatch, EventEncoder
from kvstore.router.service import ProducerSpec
from tests.router.test_app_http import Fleet, complete, wait_for


def garbage_frames(rng: random.Random, count: int, first_seq: int) -> list[list[bytes]]:
    """Every kind of bad frame a stream can carry, in a deterministic mix."""
    encoder = EventEncoder()
    valid = encoder.encode(EventBatch(1.0, [BlockStored([1], None, [0] * 16, 16, None, "CPU", None)]))
    kinds = [
        lambda: [b"", rng.randbytes(rng.randrange(0, 64))],  # too few frames
        lambda: [b"", b"", b"", b"", rng.randbytes(8)],  # too many frames
        lambda: [b"", rng.randbytes(rng.choice([0, 3, 7, 9])), valid],  # seq of the wrong width
        lambda: [b"", b"SEQ", rng.randbytes(rng.randrange(1, 200))],  # random bytes as payload
        lambda: [b"", b"SEQ", msgspec.msgpack.encode({"ts": "yesterday", "events": 5})],  # wrong types
        lambda: [b"", b"SEQ", msgspec.msgpack.encode([1.0, [{"type": "BlockTeleported", "x": 1}], None])],
        lambda: [b"", b"SEQ", msgspec.msgpack.encode([1.0, [["BlockStored", "not-a-list"]], None])],
        lambda: [b"", b"SEQ", b"\xdd\xff\xff\xff\xff" + rng.randbytes(16)],  # array claiming 2**32 items
        lambda: [b"", b"SEQ", b"\xdb\x7f\xff\xff\xff" + b"x" * 8],  # string claiming 2 GiB
        lambda: [b"", b"SEQ", msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]])],
    ]
    frames = []
    seq = first_seq
    for _ in range(count):
        frame = rng.choice(kinds)()
        if frame[1] == b"SEQ":
            frame[1] = struct.pack(">Q", seq)
            seq += 1
        frames.append(frame)
    return frames


def test_ten_thousand_malformed_frames_are_counted_and_dropped() -> None:
    fleet = Fleet(["only"], vocab_size=512, max_context=1024)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop at the sender: every frame must reach the router
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    try:
        assert complete(fleet, [3] * 64).status_code == 200
        fleet.service.add_tier_producer("node-x", ProducerSpec("garbage", endpoint, None))

        def health():
            return next((h for h in fleet.service.listener.health() if h.producer == "garbage"), None)

        # Slow joiner: valid empty batches (seq 0, 1, ...) until the SUB is connected and in sync.
        ping = EventEncoder().encode(EventBatch(0.0, []))
        pings = iter(range(1_000_000))
        last_ping = [-1]

        def send_ping() -> None:
            last_ping[0] = next(pings)
            pub.send_multipart([b"", struct.pack(">Q", last_ping[0]), ping])

        def in_sync() -> bool:
            h = health()
            return h is not None and h.syncing is None and h.next_seq == last_ping[0] + 1

        send_ping()
        assert wait_for(lambda: in_sync() or (send_ping(), False)[1])
        before = health()
        assert before is not None
        frames = garbage_frames(random.Random(5), 10_000, first_seq=last_ping[0] + 1)
        for frame in frames:
            pub.send_multipart([b"", *frame[1:]] if len(frame) > 1 else frame)

        def dropped() -> int:
            h = health()
            return 0 if h is None else h.decode_errors + h.skipped_events - before.decode_errors - before.skipped_events

        # Each malformed frame is counted exactly once: a bad frame or payload as a decode error,
        # an event of unknown type or shape (or a hash that is not an integer) as a skipped event.
        assert wait_for(lambda: dropped() == 10_000, timeout=30), (dropped(), health())
        assert health().restarts == before.restarts and health().gaps == before.gaps
        metrics = fleet.client.get("/metrics").text
        assert 'kvstore_router_decode_errors_total{producer="garbage"}' in metrics

        # The router still routes and serves, and its index is intact.
        response = complete(fleet, [3] * 64)
        assert response.status_code == 200
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert fleet.client.get("/healthz").status_code == 200
    finally:
        pub.close(0)
        ctx.term()
        fleet.close()
