"""Our listener against a peer that speaks vLLM's own ZeroMQ protocol, byte for byte.

The peer here is not a mock: it is a real PUB + ROUTER pair on loopback that
frames exactly as vLLM's ZmqEventPublisher does -- batches as msgpack *maps*
(``{"ts", "events", "data_parallel_rank"}``), and replay replies with no topic
frame: ``[b"", seq, payload]``, ended by ``[b"", -1, b""]``. It drops some live
batches; the listener must recover every one of them by replay.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvstore.publisher import END_SEQ
from kvstore.subscriber import EventListener
from tests.kvstore.test_core_transport import CacheSink, wait_until


class VllmStylePeer:
    """PUB + ROUTER framed as vLLM frames them; live batches whose seq is in ``drop`` are never sent."""

    def __init__(self, ctx: zmq.Context, drop: set[int]) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.drop = drop
        self.buffer: list[tuple[int, bytes]] = []
        self.replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def publish_empty(self, seq: int) -> None:
        self._send(seq, msgspec.msgpack.encode({"ts": 1.0 + seq, "events": [], "data_parallel_rank": 0}))

    def publish(self, seq: int, hashes: list[int]) -> None:
        batch = {
            "ts": 1.0 + seq,
            "events": [
                {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                 "token_ids": list(range(16 * len(hashes))), "block_size": 16, "lora_id": None,
                 "medium": "GPU", "lora_name": None}
            ],
            "data_parallel_rank": 0,
        }  # fmt: skip
        self._send(seq, msgspec.msgpack.encode(batch))

    def _send(self, seq: int, payload: bytes) -> None:
        self.buffer.append((seq, payload))
        if seq not in self.drop:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(10):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays += 1
            for seq, payload in list(self.buffer):
                if seq >= first:
                    self.router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self.router.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(0)
        self.router.close(0)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context: zmq.Context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_gaps_from_a_vllm_style_producer_are_recovered_by_replay(ctx: zmq.Context) -> None:
    peer = VllmStylePeer(ctx, drop={3, 4, 7})
    sink = CacheSink()
    listener = EventListener(sink, context=ctx, sync_timeout_s=3.0, poll_interval_s=0.005)
    listener.add_producer("vllm-0", peer.endpoint, peer.replay_endpoint)
    listener.start()
    try:
        for seq in range(10):
            peer.publish(seq, [2**64 - 1] if seq == 0 else [1000 + seq])
        # Empty heartbeats (vLLM publishes every step) until converged: whatever the slow-joining
        # SUB missed at the start, and the dropped batches, must come back through replay.
        heartbeat = iter(range(10, 10_000))
        expected = {2**64 - 1: 1} | {1000 + s: 1 for s in range(1, 10)}
        assert wait_until(
            lambda: dict(sink.view("vllm-0")) == expected, tick=lambda: peer.publish_empty(next(heartbeat))
        )
        seqs = sink.seqs["vllm-0"]
        assert seqs == list(range(len(seqs))), "batches must be applied once each, in order, from 0"
        health = next(h for h in listener.health() if h.producer == "vllm-0")
        assert health.gaps + health.replays >= 1 and peer.replays >= 1
        assert health.decode_errors == 0 and health.lossy == 0 and health.restarts == 0
    finally:
        listener.close()
        peer.close()
