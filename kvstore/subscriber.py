"""KV event subscriber: one background thread that follows many producers over ZeroMQ.

:class:`EventListener` owns, per producer, a SUB socket (the live stream),
a monitor on it (its disconnects), and a DEALER socket (replay and snapshot
requests), all polled by one poller on one thread so a fleet of producers
costs one thread. What the sockets deliver feeds the producer's
:class:`~kvstore.producer_stream.ProducerStream`, which decides the order;
the listener executes the actions it returns, decodes payloads and hands
batches to a :class:`BatchSink`. Keeping the sockets here and the ordering
there lets every recovery path be tested without a socket.

A producer added with ``curve_server_key`` (its publisher's CURVE public
key) is reached over CURVE on both sockets, with the client key pair given
as ``curve_client_keys`` -- needed when the publisher admits only listed
clients (``events.curve_allowed_client_keys``) -- or else one the listener
makes once (``zmq.curve_keypair()``); a wrong key, an unlisted client, or a
CURVE publisher subscribed without one, delivers nothing.

A replay or snapshot whose reply pauses for ``sync_timeout_s`` (the producer
stalled, or gave the reply up without its end marker), or that has not ended
``_SYNC_BUDGET`` timeouts after it was asked for (a reply that trickles on),
is asked for again, as :class:`~kvstore.producer_stream.ProducerStream`
says; what the consumer holds meanwhile is never reset. Each request goes
out on a fresh DEALER, so what is left of an earlier reply (a late end
marker, the rest of an abandoned one) can never be taken for its answer.

One producer cannot stop the others: an endpoint ZeroMQ refuses (a
transport a SUB or DEALER cannot use, an ``ipc://`` path too long) is a
ConfigError from :meth:`EventListener.add_producer`, on the caller's
thread; a socket error on the listener thread is logged, counted in that
producer's ``decode_errors`` and leaves it without a replay (its live
stream goes on); the per-producer bounds are ProducerStream's.

Two clocks per producer, kept apart because they answer different
questions. Lag is per applied batch: from the batch's ``ts`` (the
producer's wall clock when it published) to the moment the sink has applied
it -- network, queueing, a replay's wait and the apply itself. It compares
two machines' wall clocks, so it is as exact as they agree (NTP: a few
milliseconds); skew that would make it negative counts as 0. Staleness is
how long the producer has been silent: time since its last batch was
applied. An idle producer has growing staleness and no new lag, so an alert
on lag stays quiet while the fleet is.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from kvstore.errors import ConfigError, EventDecodeError
from kvstore.events import EventBatch, EventDecoder
from kvstore.producer_stream import Action, Apply, CancelSync, ProducerStream, RequestReplay, Reset, SyncState
from kvstore.publisher import END_SEQ, SNAPSHOT_REQUEST

logger = logging.getLogger(__name__)

_SYNC_BUDGET = 30  # a reply must end within this many sync timeouts of its request, however steadily it trickles

# fmt: off
LAG_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0
)
# fmt: on
"""Upper bounds of the lag histogram: live batches land in milliseconds; replayed ones can be a minute old."""


_MAX_CERT_BYTES = 64 << 10  # a certificate is a few hundred bytes


class CurveKeyPair(NamedTuple):
    """A CURVE client's key pair, Z85 text (``zmq.curve_keypair()``, or ``zmq.auth.load_certificate``)."""

    public: str
    secret: str


def load_client_cert(path: str, *, field: str) -> CurveKeyPair:
    """The key pair in a secret certificate file (``zmq.auth.create_certificates``'s ``*.key_secret``).

    ``field`` names where the path came from (a flag, a config field), for the ConfigError a bad file gets.
    """
    if not os.path.exists(path):
        raise ConfigError(f"{field}: no file {path}")
    if not os.path.isfile(path):  # a directory, a FIFO (whose read would wait for a writer), a device
        raise ConfigError(f"{field}: {path} is not a regular file")
    if os.path.getsize(path) > _MAX_CERT_BYTES:
        raise ConfigError(f"{field}: {path} is larger than a CURVE certificate ({_MAX_CERT_BYTES} bytes at most)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except ValueError as exc:
        raise ConfigError(f"{field}: {path} is not a CURVE certificate: {exc}") from None
    if secret is None:
        raise ConfigError(f"{field}: {path} holds no secret key (give the .key_secret file)")
    return CurveKeyPair(public.decode(), secret.decode())


def _is_z85_key(key: str) -> bool:
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError):
        return False


def _check_curve_keys(producer: str, server_key: str | None, client_keys: CurveKeyPair | None) -> None:
    """Raise ConfigError here, on the caller's thread: a bad key would fail setsockopt on the listener's."""
    if server_key is None:
        if client_keys is not None:
            raise ConfigError(f"producer {producer}: curve_client_keys need the publisher's curve_server_key")
        return
    if not zmq.has("curve"):
        raise ConfigError(f"producer {producer}: a curve_server_key was given, but this libzmq has no CURVE support")
    if not _is_z85_key(server_key):
        raise ConfigError(f"producer {producer}: curve_server_key must be a 40-character Z85 public key")
    if client_keys is None:
        return
    if not (_is_z85_key(client_keys.public) and _is_z85_key(client_keys.secret)):
        raise ConfigError(f"producer {producer}: curve_client_keys must be two 40-character Z85 keys")
    if zmq.curve_public(client_keys.secret.encode()).decode() != client_keys.public:
        raise ConfigError(f"producer {producer}: the client's secret key is not the one of its public key")


class BatchSink(Protocol):
    """Receives ordered batches. Called on the listener thread."""

    def apply_batch(self, producer: str, seq: int, batch: EventBatch) -> None: ...

    def reset_producer(self, producer: str) -> None: ...


class ProducerHealth(NamedTuple):
    """One producer's stream as the listener sees it: what metrics and ``/workers`` report."""

    producer: str
    endpoint: str
    connected_since: float  # wall clock (Unix seconds) when it was subscribed
    last_batch_at: float | None  # wall clock when its last batch was applied
    lag_s: float | None  # of its last applied batch: applied at - the batch's ts (>= 0)
    lag_counts: tuple[int, ...]  # applied batches per lag bucket (LAG_BUCKETS_S, then +Inf), not cumulative
    lag_sum_s: float  # the lags of all applied batches, summed
    staleness_s: float  # seconds since its last batch was applied (since it was subscribed, before any)
    next_seq: int
    batches: int
    events: int
    skipped_events: int
    decode_errors: int
    gaps: int
    replays: int
    snapshots: int
    restarts: int
    stale: int
    lossy: int
    syncing: SyncState | None  # a StrEnum: the JSON carries "replay" / "snapshot"
    sync_timeouts: int = 0  # replies that stopped before their end marker for sync_timeout_s (asked again)
    dropped: int = 0  # live batches not kept (the wait buffer full, or seqs the producer's replies contradict)
    oversized: int = 0  # snapshots too large to hold, abandoned (the stream resumed lossy)

    def as_json(self) -> str:
        return json.dumps(self._asdict())


class _Producer:
    def __init__(
        self,
        name: str,
        endpoint: str,
        replay_endpoint: str | None,
        topic: bytes,
        curve_server_key: str | None,
        curve_client_keys: CurveKeyPair | None,
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.curve_server_key = curve_server_key
        self.curve_client_keys = curve_client_keys
        self.stream = ProducerStream()
        self.sub: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None  # the SUB's connection events (disconnects)
        self.dealer: zmq.Socket[bytes] | None = None
        self.sync_deadline: float | None = None  # the reply's next item is due by then
        self.sync_cutoff: float | None = None  # ... and its end, however steadily it comes
        self.connected_since = time.time()
        self.connected_mono = time.monotonic()
        self.last_batch_at: float | None = None  # wall clock, for people (/workers)
        self.last_batch_mono: float | None = None  # for staleness: immune to the wall clock's steps
        self.last_lag_s: float | None = None
        self.lag_counts = [0] * (len(LAG_BUCKETS_S) + 1)
        self.lag_sum_s = 0.0
        self.batches = 0
        self.events = 0
        self.skipped_events = 0
        self.decode_errors = 0

    def applied(self, ts: float) -> None:
        """Time a batch the sink has just applied; ``ts``: its timestamp (the producer's wall clock)."""
        now = time.time()
        self.last_batch_at = now
        self.last_batch_mono = time.monotonic()
        lag = max(0.0, now - ts)
        self.last_lag_s = lag
        self.lag_counts[bisect.bisect_left(LAG_BUCKETS_S, lag)] += 1
        self.lag_sum_s += lag

    def staleness_s(self, now_mono: float) -> float:
        return max(0.0, now_mono - (self.connected_mono if self.last_batch_mono is None else self.last_batch_mono))


class EventListener:
    """Subscribes to many producers from one thread and feeds a sink in seq order.

    ``add_producer``/``remove_producer`` are thread-safe and take effect on
    the listener thread within one poll interval. ``close`` stops the thread
    and closes every socket.
    """

    def __init__(
        self,
        sink: BatchSink,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        sync_timeout_s: float = 2.0,
        poll_interval_s: float = 0.02,
        on_decode_error: Callable[[str, EventDecodeError], None] | None = None,
    ) -> None:
        self._sink = sink
        self._ctx = context or zmq.Context.instance()
        self._sync_timeout = sync_timeout_s
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._on_decode_error = on_decode_error
        self._producers: dict[str, _Producer] = {}
        self._commands: list[tuple[str, _Producer | str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._decoder = EventDecoder()
        self._curve_client: tuple[bytes, bytes] | None = None  # (public, secret), made on first use

    # -------------------------------------------------------------- control

    def add_producer(
        self,
        name: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        curve_server_key: str | None = None,
        curve_client_keys: CurveKeyPair | None = None,
    ) -> None:
        """Subscribe to a producer (replacing one of the same name).

        ``curve_server_key``: the producer's CURVE public key (Z85) when its
        publisher has CURVE on; None for a plain publisher.
        ``curve_client_keys``: the key pair to present, for a publisher that
        admits only listed clients; None: the listener's own (unlisted) pair.
        Raises ConfigError for a malformed key or a pair that does not match.
        """
        _check_curve_keys(name, curve_server_key, curve_client_keys)
        self._check_endpoint(name, zmq.SUB, endpoint, "endpoint")
        if replay_endpoint is not None:
            self._check_endpoint(name, zmq.DEALER, replay_endpoint, "replay endpoint")
        producer = _Producer(name, endpoint, replay_endpoint, topic.encode(), curve_server_key, curve_client_keys)
        with self._lock:
            self._commands.append(("add", producer))

    def _check_endpoint(self, producer: str, kind: int, endpoint: str, what: str) -> None:
        """ConfigError, here, for an endpoint ZeroMQ will not connect a socket of ``kind`` to (on the listener's
        thread the error would stop every producer's stream). A connect only starts: nothing is sent."""
        probe = self._ctx.socket(kind)
        try:
            probe.setsockopt(zmq.LINGER, 0)
            probe.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ConfigError(f"producer {producer}: {what} {endpoint!r} cannot be subscribed to: {exc}") from None
        finally:
            probe.close(linger=0)

    def remove_producer(self, name: str, *, reset: bool = False) -> None:
        """Unsubscribe. With ``reset`` the sink's ``reset_producer(name)`` follows on the listener thread,
        once the sockets are closed: no batch of the producer can reach the sink after the reset (a reset
        made from another thread could be overtaken by batches still being delivered)."""
        with self._lock:
            self._commands.append(("remove+reset" if reset else "remove", name))

    def start(self) -> EventListener:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-event-listener", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for producer in list(self._producers.values()):
            self._close_sockets(producer)
        self._producers.clear()

    def health(self) -> list[ProducerHealth]:
        """Every producer's stream now; read from another thread, so counters may be a batch apart."""
        now = time.monotonic()
        out = []
        for p in list(self._producers.values()):
            s = p.stream
            out.append(
                ProducerHealth(
                    p.name, p.endpoint, p.connected_since, p.last_batch_at, p.last_lag_s, tuple(p.lag_counts),
                    p.lag_sum_s, p.staleness_s(now), s.next_seq, p.batches, p.events, p.skipped_events,
                    p.decode_errors, s.gaps, s.replays, s.snapshots, s.restarts, s.stale, s.lossy, s.syncing,
                    s.sync_timeouts, s.dropped, s.oversized,
                )
            )  # fmt: skip
        return out

    # ---------------------------------------------------------- thread side

    def _run(self) -> None:
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self._apply_commands(poller)
                if not self._producers:
                    # zmq's poll returns at once with no sockets registered: wait instead of spinning.
                    self._stop.wait(self._poll_ms / 1000)
                    continue
                events = dict(poller.poll(self._poll_ms))
                for producer in list(self._producers.values()):
                    drained = True
                    if producer.sub is not None and producer.sub in events:
                        drained = self._drain_live(producer, poller)
                    # Only once every batch the old connection delivered has been handled.
                    if drained and producer.monitor is not None and producer.monitor in events:
                        self._drain_monitor(producer, poller)
                    if producer.dealer is not None and producer.dealer in events:
                        self._drain_sync(producer, poller)
                    deadline = producer.sync_deadline
                    if deadline is not None and time.monotonic() > min(deadline, producer.sync_cutoff or deadline):
                        logger.warning("producer %s: replay/snapshot timed out", producer.name)
                        self._reset_dealer(producer, poller)
                        self._execute(producer, producer.stream.on_sync_failed(), poller)
        except Exception:  # pragma: no cover - a bug; log it loudly rather than die silently
            logger.exception("event listener crashed")
            raise

    def _apply_commands(self, poller: zmq.Poller) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for verb, arg in commands:
            if verb == "add":
                assert isinstance(arg, _Producer)
                old = self._producers.pop(arg.name, None)
                if old is not None:
                    self._unregister(old, poller)
                sub = self._ctx.socket(zmq.SUB)
                arg.sub = sub
                try:
                    sub.setsockopt(zmq.LINGER, 0)
                    self._secure(sub, arg)
                    sub.setsockopt(zmq.RCVHWM, 100_000)
                    sub.setsockopt(zmq.SUBSCRIBE, arg.topic)
                    arg.monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                    sub.connect(arg.endpoint)
                except zmq.ZMQError:  # checked in add_producer: only what changed since (a file system, say)
                    logger.exception("producer %s: cannot subscribe to %s; not followed", arg.name, arg.endpoint)
                    self._close_sockets(arg)
                    continue
                poller.register(sub, zmq.POLLIN)
                poller.register(arg.monitor, zmq.POLLIN)
                self._producers[arg.name] = arg
                self._execute(arg, arg.stream.on_subscribe(), poller)
            else:
                assert isinstance(arg, str)
                gone = self._producers.pop(arg, None)
                if gone is not None:
                    self._unregister(gone, poller)
                if verb == "remove+reset":
                    self._sink.reset_producer(arg)

    def _unregister(self, producer: _Producer, poller: zmq.Poller) -> None:
        for sock in (producer.sub, producer.monitor, producer.dealer):
            if sock is not None:
                poller.unregister(sock)
        self._close_sockets(producer)

    @staticmethod
    def _close_sockets(producer: _Producer) -> None:
        if producer.sub is not None and producer.monitor is not None:
            producer.sub.disable_monitor()
        for sock in (producer.monitor, producer.sub, producer.dealer):
            if sock is not None:
                sock.close(linger=0)
        producer.sub = producer.monitor = producer.dealer = None

    def _drain_live(self, producer: _Producer, poller: zmq.Poller) -> bool:
        """Handle queued live batches; True when the queue is empty."""
        assert producer.sub is not None
        for _ in range(1000):  # bounded so one busy producer cannot starve the others
            try:
                frames = producer.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if len(frames) != 3 or len(frames[1]) != 8:
                producer.decode_errors += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            self._execute(producer, producer.stream.on_live(seq, frames[2]), poller)
        return False

    def _drain_monitor(self, producer: _Producer, poller: zmq.Poller) -> None:
        assert producer.monitor is not None
        while True:
            try:
                event = recv_monitor_message(producer.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                if producer.stream.syncing is not None:
                    self._reset_dealer(producer, poller)  # its reply may come from either incarnation
                producer.stream.on_disconnect()

    def _drain_sync(self, producer: _Producer, poller: zmq.Poller) -> None:
        assert producer.dealer is not None
        while producer.dealer is not None:
            try:
                frames = producer.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # Ours (kvstore.publisher): [b"", topic, seq, payload], terminator [b"", b"", END_SEQ, b""].
            # vLLM's own ROUTER sends no topic frame: [b"", seq, payload], terminator [b"", END_SEQ, b""].
            if len(frames) == 4 and not frames[0] and len(frames[2]) == 8:
                seq_bytes, payload = frames[2], frames[3]
            elif len(frames) == 3 and not frames[0] and len(frames[1]) == 8:
                seq_bytes, payload = frames[1], frames[2]
            else:
                producer.decode_errors += 1
                continue
            if seq_bytes == END_SEQ:
                self._reset_dealer(producer, poller)  # one reply per socket: whatever follows is not ours
                self._execute(producer, producer.stream.on_sync_end(), poller)
                return
            seq = int.from_bytes(seq_bytes, "big")
            # The timeout is for a producer that stopped answering, not for a long answer still coming.
            producer.sync_deadline = time.monotonic() + self._sync_timeout
            self._execute(producer, producer.stream.on_sync_item(seq, payload), poller)

    def _execute(self, producer: _Producer, actions: list[Action], poller: zmq.Poller) -> None:
        for action in actions:
            if isinstance(action, Apply):
                self._deliver(producer, action.seq, action.payload)
            elif isinstance(action, Reset):
                logger.info("producer %s: its stream started over; its blocks are dropped until it resends them",
                            producer.name)  # fmt: skip
                self._sink.reset_producer(producer.name)
            elif isinstance(action, CancelSync):
                logger.warning("producer %s: its snapshot is too large to hold; resuming without it", producer.name)
                self._reset_dealer(producer, poller)
            elif isinstance(action, RequestReplay):
                logger.info("producer %s: batches missing; asking for a replay from seq %d", producer.name,
                            action.start)  # fmt: skip
                self._request(producer, action.start.to_bytes(8, "big"), poller)
            else:
                logger.info("producer %s: asking for a snapshot of its cache", producer.name)
                self._request(producer, SNAPSHOT_REQUEST, poller)

    def _request(self, producer: _Producer, body: bytes, poller: zmq.Poller) -> None:
        if producer.replay_endpoint is None:
            # No replay socket: behave as a producer that holds nothing.
            self._execute(producer, producer.stream.on_sync_end(), poller)
            return
        self._reset_dealer(producer, poller)  # a fresh socket: nothing of an earlier reply can reach this one
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            self._secure(dealer, producer)
            dealer.connect(producer.replay_endpoint)
            try:
                dealer.send_multipart((b"", body), zmq.NOBLOCK)
            except zmq.Again:  # no room to queue it (never seen on a fresh socket): it times out and is asked again
                logger.warning("producer %s: a replay/snapshot request could not be queued", producer.name)
        except zmq.ZMQError as exc:
            dealer.close(linger=0)
            producer.decode_errors += 1
            logger.warning("producer %s: cannot ask %s for a replay (%s); it is followed live only",
                           producer.name, producer.replay_endpoint, exc)  # fmt: skip
            producer.replay_endpoint = None
            self._execute(producer, producer.stream.on_sync_end(), poller)
            return
        producer.dealer = dealer
        poller.register(dealer, zmq.POLLIN)
        now = time.monotonic()
        producer.sync_deadline = now + self._sync_timeout
        producer.sync_cutoff = now + self._sync_timeout * _SYNC_BUDGET

    def _secure(self, sock: zmq.Socket[bytes], producer: _Producer) -> None:
        """CURVE client options, before connect (no-op for a plain producer)."""
        if producer.curve_server_key is None:
            return
        if producer.curve_client_keys is not None:
            public, secret = producer.curve_client_keys.public.encode(), producer.curve_client_keys.secret.encode()
        else:
            if self._curve_client is None:
                self._curve_client = zmq.curve_keypair()
            public, secret = self._curve_client
        sock.setsockopt(zmq.CURVE_SERVERKEY, producer.curve_server_key.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)

    def _reset_dealer(self, producer: _Producer, poller: zmq.Poller) -> None:
        # Replies to a timed-out request must not be mistaken for the next one's.
        producer.sync_deadline = producer.sync_cutoff = None
        if producer.dealer is not None:
            poller.unregister(producer.dealer)
            producer.dealer.close(linger=0)
            producer.dealer = None

    def _deliver(self, producer: _Producer, seq: int, payload: bytes) -> None:
        try:
            decoded = self._decoder.decode(payload)
        except EventDecodeError as exc:
            producer.decode_errors += 1
            if producer.decode_errors in (1, 10, 100) or producer.decode_errors % 1000 == 0:  # not one line each
                logger.warning("producer %s: %d undecodable batches so far (this one: %s)", producer.name,
                               producer.decode_errors, exc)  # fmt: skip
            if self._on_decode_error is not None:
                self._on_decode_error(producer.name, exc)
            return
        producer.batches += 1
        producer.events += len(decoded.batch.events)
        producer.skipped_events += decoded.skipped
        try:
            self._sink.apply_batch(producer.name, seq, decoded.batch)
        except Exception as exc:  # a sink's bug on one producer's batch must not stop every producer's stream
            producer.decode_errors += 1
            logger.exception("producer %s: batch %d could not be applied; dropped", producer.name, seq)
            if self._on_decode_error is not None:
                self._on_decode_error(producer.name, EventDecodeError(f"batch {seq} could not be applied: {exc}"))
            return
        producer.applied(decoded.batch.ts)
