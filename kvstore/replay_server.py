"""The publisher's replay side: the buffer of recent batches, and the thread that answers replay and snapshot requests.

Protocol (vLLM's, plus snapshots): a DEALER sends ``[b"", start]`` (8-byte
big-endian seq) and receives every batch buffered at that moment with
``seq >= start`` as ``[b"", topic, seq, payload]``, in order, then the end
marker ``[b"", b"", END_SEQ, b""]``; ``[b"", b"snapshot"]`` returns the
producer's whole cache as BlockStored batches, each tagged with the seq the
snapshot reflects, then the end marker. Any other request is ignored (and
counted).

Served on a thread of its own, off the publishing path, so that no amount of
requests holds up the live stream. Each request becomes a *session* sent a
slice at a time, never more than the ROUTER socket accepts
(``ROUTER_MANDATORY``: a full queue to a slow consumer says so instead of
dropping frames), so that a consumer that reads late still gets every batch.
A reply that cannot be completed -- its batches left the buffer before they
could be sent, the consumer stopped reading for :data:`STALL_S`, or it went
away -- is abandoned *without* its end marker: the consumer then knows it
got less than everything, and falls back to a snapshot. The end marker
always means "complete".

Limits, so that a flood of requests costs bounded work and memory: one
session per client (a request from a client that has one is dropped), at
most :data:`MAX_ACTIVE` sessions sending at once, :data:`MAX_WAITING` more
queued in arrival order (beyond, dropped); a dropped request gets no reply,
and its client times out and asks again.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from enum import Enum
from typing import NamedTuple

import zmq

from kvstore.config import EventsConfig
from kvstore.events import BlockStored, EventBatch, EventEncoder, KVEvent

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"snapshot"

MAX_ACTIVE = 4
MAX_WAITING = 64
STALL_S = 2.0
"""A session whose consumer accepts nothing for this long is abandoned: our subscribers give a reply that long
(``EventListener``'s default ``sync_timeout_s``) before they ask again on a new socket."""
_SLICE = 64  # messages one session sends before the next session's turn
_ACCEPT = 64  # requests read per round, so that reading a flood is bounded work too
_BLOCKED_POLL_MS = 2  # how long the thread sleeps while every reply waits for its consumer to read


class Snapshot(NamedTuple):
    seq: int  # last published seq the events reflect; -1 when nothing was published
    events: list[BlockStored]


SnapshotSource = Callable[[], Snapshot]
"""Returns the producer's current cache and the seq it is consistent with.

Called on the replay thread: the owner must make it safe against its own
mutations (e.g. take the lock it holds while mutating and publishing).
"""

Redact = Callable[[Sequence[KVEvent]], list[KVEvent]]
"""What the publisher takes out of every event before it leaves (the token ids, when so configured)."""


class ReplayBuffer:
    """The most recent encoded batches, bounded both in count and in bytes. Thread-safe.

    The publisher thread appends, the replay thread reads. A batch over the
    byte bound on its own is not kept at all (a replay reaching it falls back
    to a snapshot). ``evicted_through`` is the highest seq that left the
    buffer: a reader holding a position at or below it can no longer be
    served completely.
    """

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self._entries: deque[tuple[int, bytes]] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evicted_through = -1

    def append(self, seq: int, payload: bytes) -> None:
        """Keep ``payload`` (seqs only grow), then evict the oldest batches until both bounds hold."""
        with self._lock:
            assert not self._entries or seq > self._entries[-1][0], "seqs must grow"
            self._entries.append((seq, payload))
            self._bytes += len(payload)
            while len(self._entries) > self.max_batches or self._bytes > self.max_bytes:
                old_seq, old = self._entries.popleft()
                self._bytes -= len(old)
                self.evicted_through = old_seq

    def window(self, start: int) -> tuple[int, int]:
        """Where a replay from ``start`` begins and ends, read together: (``start``, or the oldest seq
        after every eviction when ``start`` is gone; the newest seq held, -1 when empty)."""
        with self._lock:
            return max(start, self.evicted_through + 1), self._entries[-1][0] if self._entries else -1

    def read(self, start: int, through: int, limit: int) -> list[tuple[int, bytes]] | None:
        """Up to ``limit`` batches with ``start <= seq <= through``, in order; None once one of them was evicted."""
        with self._lock:
            if self.evicted_through >= start:
                return None
            entries = self._entries
            index = bisect.bisect_left(entries, start, key=_seq_of)
            out: list[tuple[int, bytes]] = []
            while index < len(entries) and len(out) < limit:
                entry = entries[index]
                if entry[0] > through:
                    break
                out.append(entry)
                index += 1
            return out

    @property
    def batches(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def check_invariants(self) -> None:
        with self._lock:
            seqs = [seq for seq, _ in self._entries]
            assert seqs == sorted(set(seqs)), "seqs out of order"
            assert self._bytes == sum(len(p) for _, p in self._entries), "byte count drifted"
            assert len(seqs) <= self.max_batches and self._bytes <= self.max_bytes, "over a bound"
            assert not seqs or seqs[0] > self.evicted_through, "an evicted seq is still held"


_wake_ids = itertools.count()


def _seq_of(entry: tuple[int, bytes]) -> int:
    return entry[0]


class SyncStats(NamedTuple):
    replays_served: int  # complete replies (end marker sent)
    snapshots_served: int
    bad_requests: int
    rejected: int  # requests dropped by the limits (see the module docstring)
    abandoned: int  # replies given up without their end marker


class _Kind(Enum):
    REPLAY = 1
    SNAPSHOT = 2


class _Session:
    """One reply being sent: where a replay is in the buffer, or which batch of a snapshot is next."""

    __slots__ = ("batches", "client", "cursor", "events", "kind", "last_progress", "outbox", "seq_bytes", "through")

    def __init__(self, client: bytes, kind: _Kind) -> None:
        self.client = client
        self.kind = kind
        self.cursor = 0  # replay: the next seq to send; snapshot: the next of its batches
        self.through = -1  # replay: the last seq to send (the newest buffered when the request was taken)
        self.events: list[BlockStored] = []  # snapshot: the producer's cache
        self.batches = 0  # snapshot: how many batches carry it (0: no snapshot, only the end marker)
        self.seq_bytes = b""  # snapshot: the seq it reflects
        self.outbox: deque[tuple[bytes, ...]] = deque()  # messages taken, not yet accepted by the socket
        self.last_progress = time.monotonic()


class SyncServer:
    """Serves replay and snapshot requests on ``socket`` (a bound ROUTER) from its own thread.

    Owns ``socket`` from :meth:`start` until :meth:`close`, which stops the
    thread; the caller closes the socket. With nothing to send the thread
    sleeps until a request (or close) arrives: an idle server takes no turns
    from the publishing thread.
    """

    def __init__(
        self,
        socket: zmq.Socket[bytes],
        buffer: ReplayBuffer,
        config: EventsConfig,
        *,
        snapshot_source: SnapshotSource | None,
        data_parallel_rank: int | None,
        redact: Redact | None,
    ) -> None:
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket = socket
        self._buffer = buffer
        self._topic = config.topic.encode()
        self._chunk = config.snapshot_batch_blocks
        self._snapshot_source = snapshot_source
        self._dp_rank = data_parallel_rank
        self._redact = redact
        self._active: OrderedDict[bytes, _Session] = OrderedDict()
        self._waiting: OrderedDict[bytes, tuple[_Kind, int]] = OrderedDict()
        self._encoder = EventEncoder()
        self._replays = self._snapshots = self._bad = self._rejected = self._abandoned = 0
        # close() wakes the thread through an inproc pair, so that it can sleep without a timeout.
        wake = f"inproc://kvstore-replay-wake-{next(_wake_ids)}"
        self._wake_rx = socket.context.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx = socket.context.socket(zmq.PAIR)
        self._wake_tx.connect(wake)
        self._thread = threading.Thread(target=self._run, name="kv-event-replay", daemon=True)

    def start(self) -> SyncServer:
        self._thread.start()
        return self

    @property
    def stats(self) -> SyncStats:
        return SyncStats(self._replays, self._snapshots, self._bad, self._rejected, self._abandoned)

    def close(self) -> None:
        """Stop the thread (idempotent)."""
        if self._thread.is_alive():
            self._wake_tx.send(b"")
            self._thread.join(timeout=5.0)
        self._wake_tx.close(linger=0)
        self._wake_rx.close(linger=0)

    def check_invariants(self) -> None:
        """Call with the thread stopped (or not started)."""
        assert len(self._active) <= MAX_ACTIVE and len(self._waiting) <= MAX_WAITING, "over a limit"
        assert not self._active.keys() & self._waiting.keys(), "a client with two requests"
        assert not self._waiting or len(self._active) == MAX_ACTIVE, "a request waits while a slot is free"

    # ------------------------------------------------------------- thread side

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        timeout: int | None = None
        while True:
            ready = dict(poller.poll(timeout))
            if self._wake_rx in ready:
                return
            if self._socket in ready:
                self._accept()
            self._fill_slots()
            timeout = None
            if self._active:
                timeout = 0 if self._send_round() else _BLOCKED_POLL_MS
                self._fill_slots()  # the slots finished replies freed: each round ends with the limits' invariant

    def _accept(self) -> None:
        for _ in range(_ACCEPT):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            request = _parse(frames)
            if request is None:
                self._bad += 1
                continue
            client, kind, start = request
            if client in self._active or client in self._waiting or len(self._waiting) >= MAX_WAITING:
                self._rejected += 1
                continue
            self._waiting[client] = (kind, start)

    def _fill_slots(self) -> None:
        while self._waiting and len(self._active) < MAX_ACTIVE:
            client, (kind, start) = self._waiting.popitem(last=False)
            session = _Session(client, kind)
            if kind is _Kind.REPLAY:
                # From the oldest batch still held when the start is gone: the first seq tells the consumer.
                session.cursor, session.through = self._buffer.window(start)
            else:
                try:
                    snapshot = None if self._snapshot_source is None else self._snapshot_source()
                except Exception:  # the owner's bug: answer nothing rather than lose the thread
                    logger.exception("the snapshot source failed")
                    self._abandoned += 1
                    continue
                if snapshot is not None and snapshot.seq >= 0:  # else: no snapshots, or nothing published yet
                    session.seq_bytes = snapshot.seq.to_bytes(8, "big")
                    session.events = snapshot.events
                    # At least one (possibly empty) batch, so that the seq reaches the subscriber.
                    session.batches = max(1, -(-len(snapshot.events) // self._chunk))
            self._active[client] = session

    def _send_round(self) -> bool:
        """A slice of every active session; True when anything was sent."""
        progressed = False
        now = time.monotonic()
        for client, session in list(self._active.items()):
            try:
                done, sent = self._send_slice(session)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the client went away
                if exc.errno != zmq.EHOSTUNREACH:
                    logger.exception("a replay reply failed")
                done, sent = None, False
            if sent:
                session.last_progress = now
                progressed = True
            if done is None or (not done and now - session.last_progress > STALL_S):
                self._abandoned += 1
                del self._active[client]
            elif done:
                del self._active[client]
                if session.kind is _Kind.REPLAY:
                    self._replays += 1
                else:
                    self._snapshots += 1
        return progressed

    def _send_slice(self, session: _Session) -> tuple[bool | None, bool]:
        """Send up to a slice: (True: finished, False: the consumer's queue is full, None: cannot complete;
        whether anything was sent)."""
        outbox = session.outbox
        sent = 0
        while sent < _SLICE:
            if not outbox and not self._take(session):
                return None, sent > 0
            try:
                self._socket.send_multipart(outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return False, sent > 0
            sent += 1
            if outbox.popleft()[3] == END_SEQ:
                return True, True
        return False, True

    def _take(self, session: _Session) -> bool:
        """Queue the session's next messages (its end marker last); False when it can no longer be completed."""
        client = session.client
        if session.kind is _Kind.REPLAY:
            batches = (
                [] if session.cursor > session.through else self._buffer.read(session.cursor, session.through, _SLICE)
            )
            if batches is None:
                return False  # its batches left the buffer before they could be sent
            for seq, payload in batches:
                session.outbox.append((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            if batches:
                session.cursor = batches[-1][0] + 1
            else:
                session.outbox.append((client, b"", b"", END_SEQ, b""))
            return True
        if session.cursor >= session.batches:
            session.outbox.append((client, b"", b"", END_SEQ, b""))
            return True
        start = session.cursor * self._chunk
        chunk: Sequence[KVEvent] = session.events[start : start + self._chunk]
        if self._redact is not None:
            chunk = self._redact(chunk)
        payload = self._encoder.encode(EventBatch(time.time(), list(chunk), self._dp_rank))
        session.outbox.append((client, b"", self._topic, session.seq_bytes, payload))
        session.cursor += 1
        return True


def _parse(frames: list[bytes]) -> tuple[bytes, _Kind, int] | None:
    if len(frames) != 3 or frames[1] != b"":
        return None
    client, _, body = frames
    if body == SNAPSHOT_REQUEST:
        return client, _Kind.SNAPSHOT, 0
    if len(body) == 8:
        return client, _Kind.REPLAY, int.from_bytes(body, "big")
    return None
