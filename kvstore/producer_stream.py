"""The ordering state machine for one producer's KV event stream, free of sockets.

A producer numbers its batches 0, 1, 2, ... on a lossy PUB stream and can
answer a replay (every batch from a seq on, while its buffer still holds them)
or a snapshot (its whole state, tagged with the seq it reflects).
:class:`ProducerStream` turns what arrives -- live batches, replay/snapshot
replies, disconnects, timeouts -- into actions (apply a batch, reset the
producer's state, request a replay or a snapshot) that keep the consumer's
view equal to the producer's. It owns no socket and no clock, so every path
is driven directly by tests; :class:`kvstore.subscriber.EventListener` runs
it over ZeroMQ.

On subscribing, the stream asks for a replay from 0 at once (so a producer
that stays quiet is still known; a snapshot when the replay no longer reaches
back to 0); if nothing was published yet, the first live batch decides.
Recovery rules (``next`` is the next seq we expect):

=================================  ==============================================
live seq                           action
=================================  ==============================================
``== next``                        apply
``> next`` (gap)                   buffer it; replay from ``next``
``< next`` (went backwards)        producer restarted: reset, replay from 0
first message, seq 0               apply (we saw the producer start)
first message, seq > 0 (late)      buffer it; replay from 0
after a disconnect, ``> next``     buffer it; snapshot (see below)
=================================  ==============================================

A producer that restarts publishes from seq 0 again, and usually the
subscriber sees the sequence go backwards. But if the new incarnation has
already published more batches than the old one had by the time the
subscriber reconnects, its seq jumps *ahead*: a replay would graft the new
incarnation's batches onto the old one's state. So when the live connection
drops, whatever was buffered or being fetched is dropped, and the next live
batch decides: below ``next`` is a restart, ``next`` itself continues the
stream, above ``next`` (or any batch after a sync was cut off) is resolved by
a snapshot, which replaces the producer's state whichever incarnation it is.
``next`` itself is checked first, when the batch before it is known: a
replay from ``next - 1`` must return that batch as it was applied (same
payload). A different one is a new incarnation that happened to reach our
seq: reset, replay from 0. No answer, or one that starts later (no replay
socket, a buffer that moved on), proves nothing: the stream continues. When
the batch before ``next`` is not known (the last sync was a snapshot, whose
batches all carry its seq), a snapshot decides instead.

A replay that does not start at ``next`` (the producer's buffer no longer
holds it, or the reply is empty) falls back to a snapshot: reset, apply the
snapshot (tagged with the seq S it reflects), then every buffered live batch
with seq > S. Live batches with seq <= S that were already in flight are
stale and skipped. Likewise, a live batch that a replay already applied
(same seq, same payload) can arrive after the replay, on the other
connection: it is stale, not a restart.
A replay that applied something and then skipped a seq (a hole inside the
reply) is asked again from ``next``: a producer's buffer only ever loses its
oldest batches, so a hole after a reply's start is a batch the transport
dropped (vLLM's ROUTER drops what passes its send high-water mark), not one
the producer lost. The batches after the hole are kept, so a reply that
cannot be completed still counts. Only a replay that applies nothing falls
back to a snapshot.

A producer that answers a snapshot with nothing (plain vLLM) cannot be
recovered exactly: we resume at the oldest buffered batch and mark it lossy.
Unless that snapshot was asked for after a disconnect: then the producer
has most likely restarted, and the old incarnation's blocks would stay in
the consumer's view for good (the new one never removes what it never
held). So the state is reset and the history replayed from 0 -- exact
while the new incarnation's replay buffer still holds its first batch;
otherwise the next snapshot comes back empty too and we resume lossy, from
the reset state: blocks missing from the view cost a hit, blocks it holds
wrongly draw requests to a replica that lacks them.

Bounds, so that one producer -- broken or hostile -- costs bounded memory
and time: at most ``_MAX_PENDING`` live batches wait for a sync (past it a
new one is dropped, counted in ``dropped``: the hole it leaves is asked for
again); a snapshot larger than ``_MAX_SNAPSHOT_BYTES`` or ``_MAX_SNAPSHOT_BATCHES``
is abandoned (:class:`CancelSync`, counted in ``oversized``) and the stream
resumes lossy; and buffered batches that the producer's own replies keep
contradicting (a seq far ahead of anything it holds, which a replay never
reaches and a snapshot never covers) are dropped after
``_MAX_STUCK_SYNCS`` resync requests that did not move ``next``, instead of
asking again forever. A live batch below ``next`` that repeats one applied
lately (same seq, same payload: at-least-once delivery) is stale, not a
restart.

A resync that does not complete never throws away what the consumer holds.
A snapshot is held back until its end marker and then replaces the state in
one step (reset, then every batch of it), so one that is cut short -- a
producer that stalls, or that cannot send everything and so sends no end
marker -- changes nothing; it is asked for again (``sync_timeouts`` counts
these). A replay applies each batch as it comes, in order, so what it
applied before it was cut short is a true past state of the producer: it is
kept, and a snapshot brings the rest.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class SyncState(StrEnum):
    """What a stream is fetching to close a hole (``None`` when it is not fetching anything).

    A StrEnum so health reports and their JSON keep carrying the plain strings.
    """

    REPLAY = "replay"
    SNAPSHOT = "snapshot"


class Apply(NamedTuple):
    """Hand this batch to the sink: it is the next one in order."""

    seq: int
    payload: bytes


class Reset(NamedTuple):
    """Forget everything the producer's batches said so far (a restart, or a snapshot follows)."""


class RequestReplay(NamedTuple):
    """Ask the producer for every batch from ``start`` on; answered through on_sync_item/on_sync_end."""

    start: int


class RequestSnapshot(NamedTuple):
    """Ask the producer for its whole state; answered through on_sync_item/on_sync_end."""


class CancelSync(NamedTuple):
    """Stop reading the reply in flight (the rest of it must not be taken for the next request's)."""


Action = Apply | Reset | RequestReplay | RequestSnapshot | CancelSync

_MAX_PENDING = 100_000
_MAX_SNAPSHOT_BYTES = 512 << 20  # a snapshot is held whole until its end marker
_MAX_SNAPSHOT_BATCHES = 1_000_000
_MAX_STUCK_SYNCS = 6  # resync requests in a row at one next_seq before contradicted batches are dropped
_RECENT = 64  # applied batches remembered (seq -> payload hash) to tell a duplicate from a restart


class ProducerStream:
    """Ordering state machine for one producer's stream (see the module table)."""

    def __init__(self) -> None:
        self.next_seq = 0
        self.started = False  # have we applied or synced anything yet
        self.syncing: SyncState | None = None
        self._pending: dict[int, bytes] = {}
        self._replay_ok = True
        self._replay_progress = False  # the current replay applied at least one batch
        self._snapshot_seq: int | None = None  # the seq the snapshot being received reflects
        self._snapshot: list[bytes] = []  # its batches, held back until its end marker
        self._snapshot_bytes = 0
        self._recent: dict[int, int] = {}  # seq -> hash(payload) of the last _RECENT batches applied live or replayed
        self._stuck_at = -1  # the next_seq of the last resync request, and how many in a row were made there
        self._stuck = 0
        self._stale_through: int | None = None
        # hash(payload) of each batch a replay applied, until the live stream passes them: their
        # live copies may still be in flight (another connection), and must not look like a restart.
        self._replayed: dict[int, int] = {}
        self._disconnected = False  # the live connection dropped since the last live batch
        self._sync_cut = False  # ... while a replay or snapshot was in flight
        self._initial = False  # the replay asked for on subscribing is in flight
        self._maybe_restarted = False  # the snapshot in flight was asked for after a disconnect
        self._tail: tuple[int, int] | None = None  # (seq, hash of payload) of the batch at next - 1, when known
        self._verify: tuple[int, int] | None = None  # the replay in flight checks this batch first
        self._mismatch = False  # ... and found another one there: a new incarnation
        self.gaps = 0
        self.restarts = 0
        self.replays = 0
        self.snapshots = 0
        self.stale = 0
        self.lossy = 0
        self.sync_timeouts = 0
        self.dropped = 0  # live batches not kept: the buffer was full, or the producer's replies contradict them
        self.oversized = 0  # snapshots abandoned for their size

    def check_invariants(self) -> None:
        """Assert what every ``on_*`` call keeps (tests call it; a failure is a bug here)."""
        # Batches wait only for a sync in flight: the end of each sync drains or re-buffers them.
        assert self.syncing is not None or not self._pending, "buffered batches with no sync to wait for"
        assert self._snapshot_seq is None or self.syncing is SyncState.SNAPSHOT, "a snapshot seq outside a snapshot"
        assert not self._maybe_restarted or self.syncing is SyncState.SNAPSHOT, "a restart guess with no snapshot"
        assert self._verify is None or self.syncing is SyncState.REPLAY, "a continuity check with no replay"
        assert not self._mismatch or self.syncing is SyncState.REPLAY, "a restart found with no replay"
        assert (self._snapshot_seq is None) == (not self._snapshot), "snapshot batches without their seq, or vice versa"
        assert self._snapshot_bytes == sum(map(len, self._snapshot)), "the snapshot's size is miscounted"
        assert len(self._recent) <= _RECENT, "the duplicate window outgrew its bound"
        assert not self._initial or self.syncing is SyncState.REPLAY, "the initial replay is not in flight"
        assert not self._disconnected or self.started, "a disconnect counted before the stream started"
        assert not self._sync_cut or self._disconnected, "a cut-off sync without a disconnect"
        assert len(self._pending) <= _MAX_PENDING, "the buffer outgrew its bound"

    def on_subscribe(self) -> list[Action]:
        """A new subscription: ask for the producer's history now, not at its next batch.

        A quiet producer (a tier whose workers are idle, a replica with no
        traffic) may publish nothing for a long time, and until it does the
        subscriber would know nothing of what it holds. The replay from 0
        applies what it returns, as a late join does; one that no longer
        reaches back to 0 falls back to a snapshot. An empty answer (nothing
        published yet) is no loss: the live batches that came meanwhile are
        then taken as if they had just arrived, and the first of them decides
        (module table). Counted in ``replays``, like every replay request.
        """
        if self.started or self.syncing is not None:
            return []
        self._initial = True
        return self._start_replay()

    def on_live(self, seq: int, payload: bytes) -> list[Action]:
        if self.syncing is not None:
            self._buffer(seq, payload)
            return []
        if not self.started:
            self.started = True
            if seq == 0:
                self.next_seq = 1
                return [self._apply(seq, payload)]
            self._buffer(seq, payload)
            return self._start_replay()
        if self._disconnected:
            self._disconnected = False
            cut, self._sync_cut = self._sync_cut, False
            checkable = self._tail is not None and self._tail[0] == seq - 1  # the batch before it is known
            if seq > self.next_seq or (seq == self.next_seq and (cut or not checkable)):
                # Maybe a new incarnation that outran (or reached) our seq, with nothing to tell it by: only a
                # snapshot tells its state exactly (after a snapshot sync no batch at next - 1 is known: its
                # batches all carry its seq).
                self.gaps += seq > self.next_seq
                self._buffer(seq, payload)
                actions = self._start_snapshot()
                self._maybe_restarted = True
                return actions
            if seq == self.next_seq:
                # Most likely the same stream, nothing missed -- unless a restarted producer reached our seq:
                # its batch before this one tells (module docstring).
                self._buffer(seq, payload)
                self._verify = self._tail
                return self._start_replay(seq - 1)
            # seq < next: a restart (below).
        if self._stale_through is not None:
            if seq <= self._stale_through:
                self.stale += 1
                return []
            self._stale_through = None
        if seq < self.next_seq and hash(payload) in (self._replayed.get(seq), self._recent.get(seq)):
            self.stale += 1  # a copy of a batch applied already (a replay's, or a live one delivered twice)
            return []
        if self._replayed:
            self._replayed.clear()  # live seqs only grow: older in-flight copies have all arrived
        if seq == self.next_seq:
            self.next_seq += 1
            return [self._apply(seq, payload)]
        if seq > self.next_seq:
            self.gaps += 1
            self._buffer(seq, payload)
            return self._start_replay()
        # The sequence went backwards: a new incarnation of the producer.
        self.restarts += 1
        self.next_seq = 0
        self._pending.clear()
        self._recent.clear()
        if seq == 0:
            self.next_seq = 1
            return [Reset(), self._apply(seq, payload)]
        self._buffer(seq, payload)
        return [Reset(), *self._start_replay()]

    def on_disconnect(self) -> None:
        """The live connection dropped: the producer died, restarted, or the network failed.

        What is buffered or being fetched may belong to an incarnation that is
        gone, so it is dropped (the caller discards replies to a request in
        flight); the next live batch decides how to resync (module table).
        """
        if not self.started:
            if not self._replay_progress:
                # The replay asked for on subscribing applied nothing: forget it (its answer, if any, is
                # discarded with the request); the next live batch decides, as for a new subscription.
                self._pending.clear()
                self.syncing = None
                self._initial = False
                return
            self.started = True  # it applied a true prefix of the history: handled as a cut-off sync below
            self._initial = False
        self._disconnected = True
        self._maybe_restarted = False
        self._verify = None
        self._mismatch = False
        self._pending.clear()
        self._stale_through = None
        self._replayed.clear()
        if self.syncing is not None:
            self.syncing = None
            self._drop_snapshot()
            self._sync_cut = True

    def on_sync_item(self, seq: int, payload: bytes) -> list[Action]:
        """One reply (not the terminator) to our replay or snapshot request."""
        if self.syncing is SyncState.REPLAY:
            if self._verify is not None:
                checked, self._verify = self._verify, None
                if seq == checked[0]:
                    if hash(payload) != checked[1]:  # another batch where ours was: a new incarnation
                        self._mismatch = True
                        self._replay_ok = False
                    return []
                # it starts later: nothing to check against; an ordinary replay from here
            if self._mismatch or seq < self.next_seq:
                return []
            if seq > self.next_seq or not self._replay_ok:
                # A hole: the producer no longer holds what we miss, or (after progress) the transport dropped
                # it. What follows is real history: kept for once the hole is filled, or given up on.
                self._replay_ok = False
                self._buffer(seq, payload)
                return []
            self.next_seq += 1
            self._replay_progress = True
            self._replayed[seq] = hash(payload)
            return [self._apply(seq, payload)]
        if self.syncing is SyncState.SNAPSHOT:
            if self._snapshot_seq is None:
                self._snapshot_seq = seq
            self._snapshot.append(payload)
            self._snapshot_bytes += len(payload)
            if self._snapshot_bytes > _MAX_SNAPSHOT_BYTES or len(self._snapshot) > _MAX_SNAPSHOT_BATCHES:
                self.oversized += 1  # too large to hold until its end: no exact recovery from this producer
                self.syncing = None
                self._maybe_restarted = False
                self._drop_snapshot()
                return [CancelSync(), *self._give_up()]
        return []

    def on_sync_end(self) -> list[Action]:
        """The terminator of our replay or snapshot request arrived (a request with no answer: on_sync_failed)."""
        if self.syncing is SyncState.REPLAY:
            self.syncing = None
            self._verify = None
            if self._mismatch:  # the batch before ours differs: a new incarnation reached our seq
                self._mismatch = False
                self.restarts += 1
                self.next_seq = 0
                self._tail = None
                return [Reset(), *self._start_replay()]
            initial, self._initial = self._initial, False
            if initial:
                if self._replay_ok and not self._replay_progress:
                    return self._refeed()  # nothing published yet: the first live batch decides
                self.started = True
            if not self._replay_progress and (not self._replay_ok or self.next_seq not in self._pending):
                # The producer no longer holds (or never held) what we miss; asking
                # again would loop forever, so only a snapshot can recover exactly.
                return self._start_snapshot()
            return self._drain()  # after progress, a hole is asked for again from next (module docstring)
        if self.syncing is SyncState.SNAPSHOT:
            self.syncing = None
            seq, batches = self._snapshot_seq, self._snapshot
            self._drop_snapshot()
            maybe_restarted, self._maybe_restarted = self._maybe_restarted, False
            if seq is None and maybe_restarted:  # no snapshot to tell (plain vLLM): rebuild from 0 (module doc)
                self.restarts += 1
                self.next_seq = 0
                self._stale_through = None
                return [Reset(), *self._start_replay()]
            if seq is None:
                return self._give_up()
            self.next_seq = seq + 1
            self._stale_through = seq
            self._tail = None  # a snapshot's batches all carry its seq: none is the batch at that seq
            return [Reset(), *(Apply(seq, payload) for payload in batches), *self._drain()]
        return []

    def on_sync_failed(self) -> list[Action]:
        """The replay or snapshot request got no terminator in time (the producer stalled, or gave up on it).

        Nothing the consumer holds is undone: what a replay applied stays
        (a true past state) and a snapshot follows; a snapshot is asked for
        again, its partial answer never having been applied.
        """
        if self.syncing is None:
            return []
        self.sync_timeouts += 1
        self._verify, self._mismatch = None, False  # a continuity check cut short: the snapshot below settles it
        if self.syncing is SyncState.REPLAY:
            self.syncing = None
            if self._initial:
                self._initial = False
                if not self._replay_progress:  # no answer at all: the live batches decide, as if just arrived
                    return self._refeed()
                self.started = True
        return self._start_snapshot()

    # ------------------------------------------------------------ internals

    def _buffer(self, seq: int, payload: bytes) -> None:
        if seq not in self._pending and len(self._pending) >= _MAX_PENDING:
            self.dropped += 1  # the newest goes (O(1)); its hole is asked for again once the buffer drains
            return
        self._pending[seq] = payload

    def _start_replay(self, start: int | None = None) -> list[Action]:
        self._count_resync()
        self.syncing = SyncState.REPLAY
        self._replay_ok = True
        self._replay_progress = False
        self.replays += 1
        return [RequestReplay(self.next_seq if start is None else start)]

    def _apply(self, seq: int, payload: bytes) -> Apply:
        """Apply the batch at ``seq`` (the one before ``next_seq`` from now on), remembering it for the check
        after a disconnect and to tell a duplicate of it from a restart."""
        digest = hash(payload)
        self._tail = (seq, digest)
        recent = self._recent
        recent[seq] = digest
        if len(recent) > _RECENT:
            del recent[next(iter(recent))]
        return Apply(seq, payload)

    def _start_snapshot(self) -> list[Action]:
        self._count_resync()
        self.syncing = SyncState.SNAPSHOT
        self._maybe_restarted = False
        self._drop_snapshot()
        self._replayed.clear()  # the snapshot's seq decides what is stale from now on
        self._recent.clear()
        self.snapshots += 1
        return [RequestSnapshot()]

    def _count_resync(self) -> None:
        if self.next_seq == self._stuck_at:
            self._stuck += 1
        else:
            self._stuck_at, self._stuck = self.next_seq, 1

    def _drop_snapshot(self) -> None:
        self._snapshot_seq = None
        self._snapshot = []
        self._snapshot_bytes = 0

    def _refeed(self) -> list[Action]:
        """After an initial sync that told nothing: the buffered live batches, as if they had just arrived."""
        pending = sorted(self._pending.items())
        self._pending.clear()
        actions: list[Action] = []
        for seq, payload in pending:
            actions.extend(self.on_live(seq, payload))
        return actions

    def _give_up(self) -> list[Action]:
        """No exact recovery possible: resume at the oldest batch we still hold."""
        self.lossy += 1
        if self._pending:
            self.next_seq = min(self._pending)
        return self._drain(allow_gap=False)

    def _drain(self, allow_gap: bool = True) -> list[Action]:
        actions: list[Action] = []
        for seq in sorted(self._pending):
            if seq < self.next_seq:
                continue
            if seq > self.next_seq:
                # Still a hole: keep the rest buffered and ask again.
                self._pending = {s: p for s, p in self._pending.items() if s >= seq}
                if allow_gap and self.next_seq == self._stuck_at and self._stuck >= _MAX_STUCK_SYNCS:
                    # The producer's replies keep contradicting these batches (nothing it holds reaches them):
                    # drop them rather than ask forever; the live stream goes on from next.
                    self.dropped += len(self._pending)
                    self._pending.clear()
                    return actions
                if allow_gap:
                    return actions + self._start_replay()
                self.lossy += 1
                self.next_seq = seq
            actions.append(self._apply(seq, self._pending[seq]))
            self.next_seq = seq + 1
        self._pending.clear()
        return actions
