"""KV event publisher over ZeroMQ, wire-compatible with vLLM's.

Sockets
- PUB: every batch as three frames ``[topic, seq, payload]``; ``seq`` is an
  8-byte big-endian counter starting at 0. Owned by the publishing thread,
  which does nothing else: encode, keep for replay, send.
- ROUTER (replay): replay and snapshot requests, answered by a thread of its
  own (:class:`kvstore.replay_server.SyncServer`, where the protocol and its
  limits are described), so that no amount of requests delays the live
  stream.

With ``curve_secret_key``/``curve_public_key`` configured both sockets are
CURVE servers (encrypted; a subscriber must name this publisher's public key
as its server key, and a client without CURVE cannot connect); with
``curve_allowed_client_keys`` too, only the listed clients can connect
(:mod:`kvstore.curve_auth`). Without them the sockets are plain TCP, which is
why they bind to loopback by default.

Sequence numbers are assigned in :meth:`publish`, on the caller's thread,
so that (with the owner holding its own lock) "pool state" and "last seq"
can be read together for a consistent snapshot. If the queue to the thread is
full the batch is dropped and counted -- but its seq is still consumed, so
every subscriber sees a gap and resynchronises instead of silently diverging.
The replay buffer is bounded in batches and in bytes
(``buffer_batches``/``buffer_bytes``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import NamedTuple

import msgspec
import zmq

from kvstore.config import EventsConfig
from kvstore.curve_auth import ClientAllowList
from kvstore.errors import ConfigError
from kvstore.events import EventBatch, EventEncoder, KVEvent, without_token_ids
from kvstore.replay_server import (
    END_SEQ,
    SNAPSHOT_REQUEST,
    ReplayBuffer,
    Snapshot,
    SnapshotSource,
    SyncServer,
)

__all__ = [
    "END_SEQ",
    "SNAPSHOT_REQUEST",
    "EventEndpoints",
    "NullEventPublisher",
    "PublisherStats",
    "Snapshot",
    "SnapshotSource",
    "ZmqEventPublisher",
]

logger = logging.getLogger(__name__)


class EventEndpoints(msgspec.Struct, frozen=True):
    """Where a producer's KV events are published (PUB) and replayed or snapshotted (ROUTER), as bound."""

    endpoint: str
    replay_endpoint: str


class PublisherStats(NamedTuple):
    published: int
    dropped: int  # batches the full queue turned away, or that could not be encoded (their seqs consumed: a gap)
    replays_served: int  # complete replies: every batch asked for, then the end marker
    snapshots_served: int
    bad_requests: int
    sync_rejected: int  # replay/snapshot requests dropped by the per-client and concurrency limits
    sync_abandoned: int  # replies given up without their end marker (batches evicted, consumer stalled or gone)
    buffered_batches: int  # held for replay now
    buffered_bytes: int


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
    (a ``*`` port becomes the real one). :meth:`close` stops both threads and
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
        self._buffer = ReplayBuffer(config.buffer_batches, config.buffer_bytes)
        self._seq_lock = threading.Lock()
        self._next_seq = 0
        self._published = 0
        self._dropped = 0
        self._closed = False

        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._allow_list: ClientAllowList | None = None
        try:
            if config.curve_secret_key:
                if config.curve_allowed_client_keys:
                    self._allow_list = ClientAllowList(self._ctx, config.curve_allowed_client_keys)
                for sock in (self._pub, self._replay):
                    _make_curve_server(sock, config.curve_secret_key, config.curve_public_key)
                    if self._allow_list is not None:
                        self._allow_list.secure(sock)
            self.endpoint = _attach(self._pub, config.endpoint, config.bind)
            self.replay_endpoint = _attach(self._replay, config.replay_endpoint, config.bind)
        except (zmq.ZMQError, ConfigError):
            self._pub.close()
            self._replay.close()
            if self._allow_list is not None:
                self._allow_list.close()
            raise
        redact = None if config.include_token_ids else without_token_ids
        self._redact = redact
        self._server = SyncServer(
            self._replay, self._buffer, config,
            snapshot_source=snapshot_source, data_parallel_rank=data_parallel_rank, redact=redact,
        ).start()  # fmt: skip
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
        sync = self._server.stats
        return PublisherStats(
            self._published, self._dropped, sync.replays_served, sync.snapshots_served, sync.bad_requests,
            sync.rejected, sync.abandoned, self._buffer.batches, self._buffer.bytes,
        )  # fmt: skip

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
        try:
            self._queue.put(None, timeout=5.0)
        except queue.Full:  # the thread is stuck on a send (or gone): do not wait on it twice
            logger.warning("event publisher: queue still full at close; batches left in it are dropped")
        self._thread.join(timeout=5.0)
        self._server.close()
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        if self._allow_list is not None:
            self._allow_list.close()

    def check_invariants(self) -> None:
        """The replay buffer's bounds and order, and the replay server's limits (call after :meth:`close`)."""
        self._buffer.check_invariants()
        self._server.check_invariants()

    # ----------------------------------------------------------- thread side

    def _run(self) -> None:
        encoder = EventEncoder()
        redact = self._redact
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                seq, batch = item
                if redact is not None:
                    batch = EventBatch(batch.ts, redact(batch.events), batch.data_parallel_rank)
                payload = encoder.encode(batch)
                self._buffer.append(seq, payload)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
                self._published += 1
            except zmq.ZMQError:
                logger.exception("failed to publish a KV event batch")
            except Exception:  # an event that cannot be encoded (a caller's bug): its seq is skipped, not the stream
                self._dropped += 1
                logger.exception("KV event batch %s could not be encoded: dropped (subscribers will resync)",
                                 item[0] if item is not None else "?")  # fmt: skip
            finally:
                self._queue.task_done()


def _make_curve_server(sock: zmq.Socket[bytes], secret_key: str, public_key: str) -> None:
    """Must run before bind/connect: the security mechanism is fixed when a connection starts."""
    if not zmq.has("curve"):
        raise ConfigError("events.curve_secret_key is set, but this libzmq was built without CURVE support")
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret_key.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public_key.encode())


class EventBindError(ConfigError, zmq.ZMQError):
    """An event endpoint this publisher cannot bind: a ConfigError (the command line prints it in one line), and
    still the ZMQError, with its errno, that a caller retrying on a fixed port (a restart) waits out."""

    def __init__(self, errno: int | None, message: str) -> None:
        zmq.ZMQError.__init__(self, errno, message)
        Exception.__init__(self, message)


def _attach(sock: zmq.Socket[bytes], endpoint: str, bind: bool) -> str:
    if bind:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:  # a port in use, an address not on this host: the config's to fix, in a line
            raise EventBindError(
                exc.errno,
                f"cannot bind KV events to {endpoint}: {exc.strerror} (events.endpoint / events.replay_endpoint; "
                "a port of * takes a free one)",
            ) from None
        resolved = sock.getsockopt(zmq.LAST_ENDPOINT)
        return resolved.decode() if isinstance(resolved, bytes) else str(resolved)
    sock.connect(endpoint)
    return endpoint
