"""KV event publisher over ZeroMQ, wire-compatible with vLLM's.

Sockets (both owned by one background thread; ZeroMQ sockets are not thread-safe)
- PUB: every batch as three frames ``[topic, seq, payload]``; ``seq`` is an
  8-byte big-endian counter starting at 0.
- ROUTER (replay): a DEALER sends ``[b"", start]`` and receives every
  buffered batch with ``seq >= start`` as ``[b"", topic, seq, payload]``,
  then the terminator ``[b"", b"", -1 (8 bytes, signed), b""]``. Beyond vLLM,
  ``[b"", b"snapshot"]`` returns the producer's whole cache as BlockStored
  batches, each tagged with the seq the snapshot already reflects, then the
  same terminator. Any other request is ignored (and counted).

With ``curve_secret_key``/``curve_public_key`` configured both sockets are
CURVE servers (encrypted; a subscriber must name this publisher's public key
as its server key, and a client without CURVE cannot connect). Without them
the sockets are plain TCP, which is why they bind to loopback by default.

Sequence numbers are assigned in :meth:`publish`, on the caller's thread,
so that (with the owner holding its own lock) "pool state" and "last seq"
can be read together for a consistent snapshot. If the queue to the thread is
full the batch is dropped and counted -- but its seq is still consumed, so
every subscriber sees a gap and resynchronises instead of silently diverging.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import zmq

from kvstore.config import EventsConfig
from kvstore.errors import ConfigError
from kvstore.events import BlockStored, EventBatch, EventEncoder, KVEvent

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"snapshot"
_IDLE_WAIT_S = 0.005


class Snapshot(NamedTuple):
    seq: int  # last published seq the events reflect; -1 when nothing was published
    events: list[BlockStored]


SnapshotSource = Callable[[], Snapshot]
"""Returns the producer's current cache and the seq it is consistent with.

Called on the publisher thread: the owner must make it safe against its own
mutations (e.g. take the lock it holds while mutating and publishing).
"""


class EventEndpoints(msgspec.Struct, frozen=True):
    """Where a producer's KV events are published (PUB) and replayed or snapshotted (ROUTER), as bound."""

    endpoint: str
    replay_endpoint: str


class PublisherStats(NamedTuple):
    published: int
    dropped: int
    replays_served: int
    snapshots_served: int
    bad_requests: int


class NullEventPublisher:
    """Publishes nothing; lets owners call publish() unconditionally."""

    endpoint: str | None = None
    replay_endpoint: str | None = None

    def __init__(self) -> None:
        self._seq = -1
        self._lock = threading.Lock()

    @property
    def last_seq(self) -> int:
        return self._seq

    def publish(self, events: list[KVEvent], *, ts: float | None = None) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    @property
    def endpoints(self) -> EventEndpoints | None:
        return None

    def close(self) -> None:
        return None


class ZmqEventPublisher:
    """Publishes event batches on PUB, serves replay and snapshots on ROUTER.

    ``endpoint``/``replay_endpoint`` hold the resolved addresses after bind
    (a ``*`` port becomes the real one). :meth:`close` stops the thread and
    closes both sockets; it is safe to call twice.
    """

    def __init__(
        self,
        config: EventsConfig,
        *,
        snapshot_source: SnapshotSource | None = None,
        data_parallel_rank: int | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self._config = config
        self._topic = config.topic.encode()
        self._dp_rank = data_parallel_rank
        self._snapshot_source = snapshot_source
        self._queue: queue.Queue[tuple[int, EventBatch] | None] = queue.Queue(maxsize=config.queue_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_batches)
        self._seq_lock = threading.Lock()
        self._next_seq = 0
        self._published = 0
        self._dropped = 0
        self._replays = 0
        self._snapshots = 0
        self._bad_requests = 0
        self._closed = False

        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        try:
            if config.curve_secret_key:
                for sock in (self._pub, self._replay):
                    _make_curve_server(sock, config.curve_secret_key, config.curve_public_key)
            self.endpoint = _attach(self._pub, config.endpoint, config.bind)
            self.replay_endpoint = _attach(self._replay, config.replay_endpoint, config.bind)
        except (zmq.ZMQError, ConfigError):
            self._pub.close()
            self._replay.close()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    @property
    def endpoints(self) -> EventEndpoints:
        """The bound PUB and ROUTER endpoints (a ``*`` port resolved to the real one)."""
        return EventEndpoints(self.endpoint, self.replay_endpoint)

    @property
    def last_seq(self) -> int:
        """The seq given to the most recent publish() (-1 before the first)."""
        return self._next_seq - 1

    @property
    def stats(self) -> PublisherStats:
        return PublisherStats(self._published, self._dropped, self._replays, self._snapshots, self._bad_requests)

    def publish(self, events: list[KVEvent], *, ts: float | None = None) -> int:
        """Queue one batch; returns its seq. Never blocks: a full queue drops (counted)."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        batch = EventBatch(time.time() if ts is None else ts, events, self._dp_rank)
        with self._seq_lock:
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._queue.put_nowait((seq, batch))
            except queue.Full:
                self._dropped += 1
                logger.warning("event queue full: dropped batch %d (subscribers will resync)", seq)
        return seq

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch has been sent; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)
        return not self._queue.unfinished_tasks

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        self._pub.close(linger=0)
        self._replay.close(linger=0)

    # ----------------------------------------------------------- thread side

    def _run(self) -> None:
        encoder = EventEncoder()
        while True:
            while self._replay.poll(0):
                self._serve_request(encoder)
            try:
                item = self._queue.get(timeout=_IDLE_WAIT_S)
            except queue.Empty:
                continue
            try:
                if item is None:
                    return
                seq, batch = item
                payload = encoder.encode(batch)
                self._buffer.append((seq, payload))
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
                self._published += 1
            except zmq.ZMQError:
                logger.exception("failed to publish a KV event batch")
            finally:
                self._queue.task_done()

    def _serve_request(self, encoder: EventEncoder) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            self._bad_requests += 1
            return
        client, _, body = frames
        if body == SNAPSHOT_REQUEST:
            self._send_snapshot(client, encoder)
        elif len(body) == 8:
            start = int.from_bytes(body, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replays += 1
        else:
            self._bad_requests += 1
            return
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _send_snapshot(self, client: bytes, encoder: EventEncoder) -> None:
        self._snapshots += 1
        if self._snapshot_source is None:
            return  # like vLLM: no snapshot support, only the terminator
        snapshot = self._snapshot_source()
        if snapshot.seq < 0:
            return
        seq_bytes = snapshot.seq.to_bytes(8, "big")
        chunk = self._config.snapshot_batch_blocks
        now = time.time()
        events = snapshot.events
        # Always at least one (possibly empty) batch, so the seq reaches the subscriber.
        for start in range(0, max(len(events), 1), chunk):
            batch = EventBatch(now, list(events[start : start + chunk]), self._dp_rank)
            self._replay.send_multipart((client, b"", self._topic, seq_bytes, encoder.encode(batch)))


def _make_curve_server(sock: zmq.Socket[bytes], secret_key: str, public_key: str) -> None:
    """Must run before bind/connect: the security mechanism is fixed when a connection starts."""
    if not zmq.has("curve"):
        raise ConfigError("events.curve_secret_key is set, but this libzmq was built without CURVE support")
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret_key.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public_key.encode())


def _attach(sock: zmq.Socket[bytes], endpoint: str, bind: bool) -> str:
    if bind:
        sock.bind(endpoint)
        resolved = sock.getsockopt(zmq.LAST_ENDPOINT)
        return resolved.decode() if isinstance(resolved, bytes) else str(resolved)
    sock.connect(endpoint)
    return endpoint
