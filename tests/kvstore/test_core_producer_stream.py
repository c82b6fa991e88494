"""ProducerStream, the subscriber's pure ordering state machine: one test per row of its recovery table,
then the replay-miss -> snapshot, stale, timeout, lossy and disconnect paths, and its invariants."""

from __future__ import annotations

import random

import pytest

from kvstore.producer_stream import (
    Apply,
    CancelSync,
    ProducerStream,
    RequestReplay,
    RequestSnapshot,
    Reset,
    SyncState,
)


def p(seq: int) -> bytes:
    return f"live-{seq}".encode()


def q(seq: int) -> bytes:
    """A restarted producer's batch: never the same bytes as the old incarnation's (a batch carries its time)."""
    return f"new-{seq}".encode()


def streaming_at(next_seq: int) -> ProducerStream:
    """A stream that has applied 0 .. next_seq-1 in order."""
    s = ProducerStream()
    for seq in range(next_seq):
        assert s.on_live(seq, p(seq)) == [Apply(seq, p(seq))]
    return s


def counters(s: ProducerStream) -> dict[str, int]:
    return {k: getattr(s, k) for k in ("gaps", "restarts", "replays", "snapshots", "stale", "lossy")}


ZERO = {"gaps": 0, "restarts": 0, "replays": 0, "snapshots": 0, "stale": 0, "lossy": 0}


# --------------------------------------------------------------------------- the table, row by row


def test_row_live_seq_equal_next_applies() -> None:
    s = streaming_at(3)
    assert s.on_live(3, p(3)) == [Apply(3, p(3))]
    assert s.next_seq == 4 and s.syncing is None
    assert counters(s) == ZERO


def test_row_gap_buffers_and_replays_from_next() -> None:
    s = streaming_at(3)
    assert s.on_live(6, p(6)) == [RequestReplay(3)]
    assert s.syncing is SyncState.REPLAY and s.gaps == 1 and s.replays == 1
    assert s.on_live(7, p(7)) == []  # buffered while syncing
    assert s.on_sync_item(2, b"old") == []  # already applied: ignored
    assert s.on_sync_item(3, b"r3") == [Apply(3, b"r3")]
    assert s.on_sync_item(4, b"r4") == [Apply(4, b"r4")]
    assert s.on_sync_item(5, b"r5") == [Apply(5, b"r5")]
    assert s.on_sync_item(6, b"r6") == [Apply(6, b"r6")]  # replay covers it; the live copy is dropped
    assert s.on_sync_end() == [Apply(7, p(7))]
    assert s.next_seq == 8 and s.syncing is None
    assert counters(s) == {**ZERO, "gaps": 1, "replays": 1}


def test_row_seq_went_backwards_is_a_restart_replayed_from_zero() -> None:
    s = streaming_at(10)
    assert s.on_live(3, q(3)) == [Reset(), RequestReplay(0)]
    assert s.restarts == 1 and s.next_seq == 0 and s.syncing is SyncState.REPLAY
    assert s.on_sync_item(0, b"n0") == [Apply(0, b"n0")]
    assert s.on_sync_item(1, b"n1") == [Apply(1, b"n1")]
    assert s.on_sync_item(2, b"n2") == [Apply(2, b"n2")]
    assert s.on_sync_end() == [Apply(3, q(3))]
    assert s.next_seq == 4
    assert counters(s) == {**ZERO, "restarts": 1, "replays": 1}


def test_row_seq_back_to_zero_is_a_restart_applied_at_once() -> None:
    s = streaming_at(5)
    assert s.on_live(0, q(0)) == [Reset(), Apply(0, q(0))]
    assert s.next_seq == 1 and s.syncing is None
    assert counters(s) == {**ZERO, "restarts": 1}


def test_row_first_message_seq_zero_applies() -> None:
    s = ProducerStream()
    assert s.on_live(0, p(0)) == [Apply(0, p(0))]
    assert s.started and s.next_seq == 1
    assert counters(s) == ZERO


def test_row_first_message_late_buffers_and_replays_from_zero() -> None:
    s = ProducerStream()
    assert s.on_live(4, p(4)) == [RequestReplay(0)]
    assert s.gaps == 0 and s.replays == 1  # joining late is not a gap
    assert [a for i in range(4) for a in s.on_sync_item(i, b"r%d" % i)] == [Apply(i, b"r%d" % i) for i in range(4)]
    assert s.on_sync_end() == [Apply(4, p(4))]
    assert s.next_seq == 5


def test_row_after_a_disconnect_a_seq_ahead_takes_a_snapshot() -> None:
    s = streaming_at(3)
    s.on_disconnect()
    assert s.on_live(7, p(7)) == [RequestSnapshot()]  # maybe a new incarnation that outran seq 3
    assert s.syncing is SyncState.SNAPSHOT
    assert s.on_sync_item(9, b"snap") == []  # held back until the end marker
    assert s.on_sync_end() == [Reset(), Apply(9, b"snap")]  # the buffered 7 is covered by the snapshot of 9
    assert s.next_seq == 10 and s.syncing is None
    assert counters(s) == {**ZERO, "gaps": 1, "snapshots": 1}


def test_after_a_disconnect_seq_next_continues_and_seq_below_next_is_a_restart() -> None:
    s = streaming_at(3)
    s.on_disconnect()
    assert s.on_live(3, p(3)) == [RequestReplay(2)]  # the batch before it is checked first
    assert s.on_sync_item(2, p(2)) == []  # the one we applied: the same stream
    assert s.on_sync_item(3, p(3)) == [Apply(3, p(3))]
    assert s.on_sync_end() == []
    assert s.next_seq == 4 and counters(s) == {**ZERO, "replays": 1}
    quiet = streaming_at(3)  # a producer with no replay socket answers with nothing: the stream continues
    quiet.on_disconnect()
    assert quiet.on_live(3, p(3)) == [RequestReplay(2)]
    assert quiet.on_sync_end() == [Apply(3, p(3))]
    assert quiet.next_seq == 4 and quiet.restarts == 0
    t = streaming_at(3)
    t.on_disconnect()
    assert t.on_live(0, q(0)) == [Reset(), Apply(0, q(0))]
    assert t.next_seq == 1 and counters(t) == {**ZERO, "restarts": 1}


def test_a_restarted_producer_that_reached_our_seq_is_found_by_the_batch_before_it() -> None:
    """A new incarnation whose first batch we see is exactly ours to expect: its batch at next - 1 is not the
    one we applied, so the stream is reset and replayed from 0 (before: grafted onto the old state)."""
    s = streaming_at(3)
    s.on_disconnect()
    assert s.on_live(3, b"new-3") == [RequestReplay(2)]
    assert s.on_sync_item(2, b"new-2") == []  # another batch at seq 2
    assert s.on_sync_item(3, b"new-3") == []
    assert s.on_sync_end() == [Reset(), RequestReplay(0)]
    assert [a for i in range(4) for a in s.on_sync_item(i, b"new-%d" % i)] == [
        Apply(i, b"new-%d" % i) for i in range(4)
    ]
    assert s.on_sync_end() == []
    assert s.next_seq == 4 and s.restarts == 1 and s.lossy == 0
    s.check_invariants()


def test_a_disconnect_during_a_replay_drops_it_and_the_next_batch_takes_a_snapshot() -> None:
    s = streaming_at(3)
    assert s.on_live(5, p(5)) == [RequestReplay(3)]
    s.on_disconnect()
    assert s.syncing is None
    assert s.on_sync_item(3, b"late") == []  # a reply to the dropped request: ignored
    # Even seq == next: the cut-off replay may have mixed two incarnations.
    assert s.on_live(3, p(3)) == [RequestSnapshot()]
    assert s.on_sync_item(3, b"snap") == []
    assert s.on_sync_end() == [Reset(), Apply(3, b"snap")]
    assert s.next_seq == 4
    assert counters(s) == {**ZERO, "gaps": 1, "replays": 1, "snapshots": 1}


# --------------------------------------------------------------------------- snapshot, stale, lossy


def test_replay_that_misses_next_falls_back_to_snapshot_and_skips_stale() -> None:
    s = streaming_at(2)
    assert s.on_live(9, p(9)) == [RequestReplay(2)]
    # The producer's buffer starts at 5: it no longer holds 2..4.
    assert s.on_sync_item(5, b"r5") == []
    assert s.on_sync_item(6, b"r6") == []
    assert s.on_sync_end() == [RequestSnapshot()]
    assert s.syncing is SyncState.SNAPSHOT and s.snapshots == 1
    assert s.on_live(10, p(10)) == []
    assert s.on_live(11, p(11)) == []
    # The snapshot reflects seq 10; it arrives as several batches, all tagged 10, applied at its end.
    assert s.on_sync_item(10, b"snap-a") == []
    assert s.on_sync_item(10, b"snap-b") == []
    # 9 and 10 are covered by the snapshot
    assert s.on_sync_end() == [Reset(), Apply(10, b"snap-a"), Apply(10, b"snap-b"), Apply(11, p(11))]
    assert s.next_seq == 12 and s.syncing is None
    # A live batch the snapshot already reflects, still in flight: stale, skipped.
    s2 = streaming_at(2)
    s2.on_live(9, p(9))
    s2.on_sync_item(5, b"r5")
    s2.on_sync_end()
    s2.on_sync_item(12, b"snap")
    assert s2.on_sync_end() == [Reset(), Apply(12, b"snap")]
    assert s2.next_seq == 13
    assert s2.on_live(11, p(11)) == []
    assert s2.on_live(12, p(12)) == []
    assert s2.stale == 2
    assert s2.on_live(13, p(13)) == [Apply(13, p(13))]
    assert counters(s2) == {**ZERO, "gaps": 1, "replays": 1, "snapshots": 1, "stale": 2}


def test_a_hole_inside_a_replay_is_asked_for_again_and_only_a_fruitless_replay_takes_a_snapshot() -> None:
    """A producer's buffer loses only its oldest batches, so a reply that skips a seq after its start lost it in
    transit (vLLM's ROUTER drops past its send high-water mark): ask again from there, keeping what followed."""
    s = streaming_at(1)
    assert s.on_live(5, p(5)) == [RequestReplay(1)]
    assert s.on_sync_item(1, b"r1") == [Apply(1, b"r1")]
    assert s.on_sync_item(3, b"r3") == []  # 2 was dropped on the way
    assert s.on_sync_item(4, b"r4") == []
    assert s.on_sync_end() == [RequestReplay(2)]
    assert s.on_sync_item(2, b"r2") == [Apply(2, b"r2")]
    assert s.on_sync_end() == [Apply(3, b"r3"), Apply(4, b"r4"), Apply(5, p(5))]  # nothing fetched twice
    assert s.next_seq == 6 and s.snapshots == 0 and s.lossy == 0
    t = streaming_at(1)  # the second reply does not reach 2 either: the producer lacks it, a snapshot decides
    assert t.on_live(5, p(5)) == [RequestReplay(1)]
    assert t.on_sync_item(1, b"r1") == [Apply(1, b"r1")]
    assert t.on_sync_item(3, b"r3") == []
    assert t.on_sync_end() == [RequestReplay(2)]
    assert t.on_sync_item(3, b"r3") == []
    assert t.on_sync_end() == [RequestSnapshot()]
    assert t.on_sync_item(5, b"snap") == []
    assert t.on_sync_end() == [Reset(), Apply(5, b"snap")]  # the buffered 3 and live 5 are covered
    assert t.next_seq == 6
    t.check_invariants()


def test_a_live_batch_delivered_twice_is_stale_not_a_restart() -> None:
    """vLLM's publisher promises at-least-once delivery: a repeat of a batch applied lately is not a restart."""
    s = streaming_at(20)
    assert s.on_live(19, p(19)) == [] and s.on_live(12, p(12)) == []
    assert s.stale == 2 and s.restarts == 0 and s.next_seq == 20
    assert s.on_live(19, q(19)) == [Reset(), RequestReplay(0)]  # another batch at that seq: a new incarnation


def test_a_buffered_seq_the_producer_keeps_contradicting_is_dropped_not_asked_for_forever() -> None:
    """One live frame with a seq far ahead of anything the producer holds: its replies never reach it and its
    snapshots never cover it. After a few resync requests that did not move next, the batch is dropped."""
    s = streaming_at(2)
    actions = s.on_live(2**64 - 1, b"bogus")
    rounds = 0
    while actions:
        assert actions in ([RequestReplay(2)], [RequestSnapshot()]), actions
        rounds += 1
        assert rounds < 20, "still asking"
        if actions == [RequestSnapshot()]:
            assert s.on_sync_item(1, b"snap-at-1") == []
        actions = [a for a in s.on_sync_end() if not isinstance(a, (Reset, Apply))]
        s.check_invariants()
    assert s.dropped == 1 and s.syncing is None and s.next_seq == 2
    assert s.on_live(2, p(2)) == [Apply(2, p(2))]  # the live stream goes on


def test_bounds_a_full_buffer_drops_the_newest_and_an_oversized_snapshot_is_abandoned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvstore.producer_stream as module

    monkeypatch.setattr(module, "_MAX_PENDING", 3)
    s = streaming_at(1)
    assert s.on_live(5, p(5)) == [RequestReplay(1)]
    for seq in (6, 7, 8, 9):
        s.on_live(seq, p(seq))
    assert s.dropped == 2 and sorted(s._pending) == [5, 6, 7]  # the newest went; the oldest are what comes next
    monkeypatch.setattr(module, "_MAX_SNAPSHOT_BYTES", 10)
    t = streaming_at(1)
    assert t.on_live(5, p(5)) == [RequestReplay(1)]
    assert t.on_sync_end() == [RequestSnapshot()]
    assert t.on_sync_item(9, b"12345") == []
    assert t.on_sync_item(9, b"123456") == [CancelSync(), Apply(5, p(5))]  # too large to hold: lossy from live
    assert t.oversized == 1 and t.lossy == 1 and t.syncing is None and t.next_seq == 6
    t.check_invariants()


def test_empty_replay_falls_back_to_snapshot_instead_of_looping() -> None:
    s = streaming_at(1)
    assert s.on_live(2, p(2)) == [RequestReplay(1)]
    assert s.on_sync_end() == [RequestSnapshot()]  # not RequestReplay(1) again, forever
    assert s.replays == 1 and s.snapshots == 1
    assert s.on_sync_item(2, b"snap") == []
    assert s.on_sync_end() == [Reset(), Apply(2, b"snap")]
    assert s.next_seq == 3


def test_replay_that_made_progress_may_replay_again_for_a_newer_hole() -> None:
    s = streaming_at(1)
    assert s.on_live(3, p(3)) == [RequestReplay(1)]
    assert s.on_live(5, p(5)) == []  # 4 is lost while we sync
    assert s.on_sync_item(1, b"r1") == [Apply(1, b"r1")]
    assert s.on_sync_item(2, b"r2") == [Apply(2, b"r2")]
    assert s.on_sync_end() == [Apply(3, p(3)), RequestReplay(4)]
    assert s.on_sync_item(4, b"r4") == [Apply(4, b"r4")]
    assert s.on_sync_item(5, b"r5") == [Apply(5, b"r5")]
    assert s.on_sync_end() == []
    assert s.next_seq == 6 and s.replays == 2 and s.snapshots == 0


def test_snapshot_answered_with_nothing_resumes_lossy_at_oldest_buffered() -> None:
    s = streaming_at(1)
    assert s.on_live(5, p(5)) == [RequestReplay(1)]
    assert s.on_live(6, p(6)) == []
    assert s.on_live(8, p(8)) == []
    assert s.on_sync_item(4, b"r4") == []  # the replay starts past next: kept, it is the producer's history
    assert s.on_sync_end() == [RequestSnapshot()]
    # plain vLLM: no snapshot; resumed at the oldest batch held, the replay's first
    assert s.on_sync_end() == [Apply(4, b"r4"), Apply(5, p(5)), Apply(6, p(6)), Apply(8, p(8))]
    assert s.lossy == 2  # once for giving up, once for the hole at 7
    assert s.next_seq == 9 and s.syncing is None


def test_an_empty_snapshot_after_a_disconnect_resets_and_replays_from_zero() -> None:
    """After a disconnect a seq ahead may be a restarted producer; one that answers the snapshot with nothing
    (plain vLLM) has its state reset and its history replayed from 0 -- not the new batches grafted onto the
    old incarnation's blocks, which it would never remove."""
    s = streaming_at(3)
    s.on_disconnect()
    assert s.on_live(5, p(5)) == [RequestSnapshot()]
    assert s.on_sync_end() == [Reset(), RequestReplay(0)]  # nothing came: rebuild from the start
    for seq in range(5):
        assert s.on_sync_item(seq, b"new-%d" % seq) == [Apply(seq, b"new-%d" % seq)]
    assert s.on_sync_end() == [Apply(5, p(5))]  # then the buffered live batch
    assert s.next_seq == 6 and s.lossy == 0 and s.restarts == 1
    s.check_invariants()
    # A new incarnation whose buffer no longer reaches 0: reset all the same, then resumed lossy.
    t = streaming_at(3)
    t.on_disconnect()
    assert t.on_live(9, p(9)) == [RequestSnapshot()]
    assert t.on_sync_end() == [Reset(), RequestReplay(0)]
    assert t.on_sync_item(4, b"r4") == []  # the replay starts past 0: kept
    assert t.on_sync_end() == [RequestSnapshot()]
    assert t.on_sync_end() == [Apply(4, b"r4"), Apply(9, p(9))]  # empty again: lossy, from the reset state
    assert t.lossy == 2 and t.next_seq == 10  # giving up, and the hole from 5 to 8
    t.check_invariants()


def test_live_copies_of_replayed_batches_are_stale_not_a_restart() -> None:
    # The replay (ROUTER/DEALER) can overtake the live stream (PUB/SUB): live copies of batches
    # the replay applied then arrive with seq < next.
    s = streaming_at(1)
    assert s.on_live(4, p(4)) == [RequestReplay(1)]
    for seq in (1, 2, 3, 4, 5):
        assert s.on_sync_item(seq, p(seq)) == [Apply(seq, p(seq))]
    assert s.on_sync_end() == []
    assert s.next_seq == 6
    assert s.on_live(5, p(5)) == []  # in flight during the replay
    assert s.on_live(6, p(6)) == [Apply(6, p(6))]
    assert counters(s) == {**ZERO, "gaps": 1, "replays": 1, "stale": 1}
    assert s.on_live(7, p(7)) == [Apply(7, p(7))]


def test_restart_right_after_a_replay_is_still_detected() -> None:
    s = streaming_at(1)
    s.on_live(3, p(3))
    for seq in (1, 2, 3):
        s.on_sync_item(seq, p(seq))
    assert s.on_sync_end() == []
    # A new incarnation: same seqs, different payloads.
    assert s.on_live(0, b"new-0") == [Reset(), Apply(0, b"new-0")]
    assert s.restarts == 1 and s.stale == 0
    t = streaming_at(1)
    t.on_live(3, p(3))
    for seq in (1, 2, 3):
        t.on_sync_item(seq, p(seq))
    t.on_sync_end()
    assert t.on_live(2, b"new-2") == [Reset(), RequestReplay(0)]
    assert t.restarts == 1


def test_sync_timeouts_keep_the_state_and_ask_for_a_snapshot() -> None:
    # A replay that times out escalates to a snapshot; what it applied stays applied.
    s = streaming_at(1)
    s.on_live(3, p(3))
    assert s.on_sync_item(1, b"r1") == [Apply(1, b"r1")]
    assert s.on_sync_failed() == [RequestSnapshot()]
    assert s.next_seq == 2 and s.sync_timeouts == 1
    # A snapshot cut short applied nothing: it is asked for again, the state untouched (no Reset).
    assert s.on_sync_item(2, b"part") == []
    assert s.on_sync_failed() == [RequestSnapshot()]
    assert s.syncing is SyncState.SNAPSHOT and s.sync_timeouts == 2 and s.snapshots == 2 and s.lossy == 0
    assert s.on_live(4, p(4)) == []
    # The complete answer replaces the state in one step; the live batches after it follow.
    assert s.on_sync_item(3, b"whole-a") == []
    assert s.on_sync_item(3, b"whole-b") == []
    assert s.on_sync_end() == [Reset(), Apply(3, b"whole-a"), Apply(3, b"whole-b"), Apply(4, p(4))]
    assert s.next_seq == 5 and s.syncing is None and s.lossy == 0
    # Nothing in flight: no-ops.
    assert streaming_at(1).on_sync_failed() == []
    assert streaming_at(1).on_sync_end() == []
    assert streaming_at(1).on_sync_item(0, b"x") == []


# --------------------------------------------------------------------------- the sync asked for on subscribing


def test_subscribe_replays_the_history_of_a_quiet_producer() -> None:
    s = ProducerStream()
    assert s.on_subscribe() == [RequestReplay(0)]
    assert s.on_subscribe() == []  # already syncing
    assert s.on_sync_item(0, b"r0") == [Apply(0, b"r0")]
    assert s.on_sync_item(1, b"r1") == [Apply(1, b"r1")]
    assert s.on_sync_end() == []
    assert s.started and s.next_seq == 2 and s.syncing is None
    assert counters(s) == {**ZERO, "replays": 1}
    assert s.on_live(2, p(2)) == [Apply(2, p(2))]
    assert s.on_subscribe() == []  # a started stream needs no initial sync


def test_subscribe_to_a_producer_that_published_nothing_lets_the_first_live_batch_decide() -> None:
    s = ProducerStream()
    assert s.on_subscribe() == [RequestReplay(0)]
    assert s.on_live(0, p(0)) == []  # published while the replay was in flight: buffered
    assert s.on_sync_end() == [Apply(0, p(0))]  # empty replay: no loss, seq 0 starts the stream
    assert s.started and s.next_seq == 1 and counters(s) == {**ZERO, "replays": 1}

    late = ProducerStream()
    assert late.on_subscribe() == [RequestReplay(0)]
    assert late.on_live(3, p(3)) == []
    assert late.on_sync_end() == [RequestReplay(0)]  # the first live batch is seq 3: a late join, as ever
    assert late.on_sync_item(0, b"r0") == [Apply(0, b"r0")]
    assert late.on_sync_item(1, b"r1") == [Apply(1, b"r1")]
    assert late.on_sync_item(2, b"r2") == [Apply(2, b"r2")]
    assert late.on_sync_end() == [Apply(3, p(3))]
    assert late.next_seq == 4 and late.lossy == 0 and late.replays == 2


def test_subscribe_when_the_replay_no_longer_reaches_seq_0_takes_a_snapshot() -> None:
    s = ProducerStream()
    assert s.on_subscribe() == [RequestReplay(0)]
    assert s.on_sync_item(40, b"r40") == []  # the buffer starts at 40: 0..39 are gone
    assert s.on_sync_end() == [RequestSnapshot()]
    assert s.started and s.syncing is SyncState.SNAPSHOT
    assert s.on_sync_item(41, b"snap") == []
    assert s.on_sync_end() == [Reset(), Apply(41, b"snap")]
    assert s.next_seq == 42 and counters(s) == {**ZERO, "replays": 1, "snapshots": 1}


def test_subscribe_replay_timeout_keeps_a_partial_history_and_takes_a_snapshot() -> None:
    s = ProducerStream()
    assert s.on_subscribe() == [RequestReplay(0)]
    assert s.on_sync_item(0, b"r0") == [Apply(0, b"r0")]
    assert s.on_live(5, p(5)) == []
    assert s.on_sync_failed() == [RequestSnapshot()]  # r0 stays: a true past state, never 0 blocks meanwhile
    assert s.started and s.next_seq == 1 and s.lossy == 0
    assert s.on_sync_item(5, b"snap") == []
    assert s.on_sync_end() == [Reset(), Apply(5, b"snap")]
    assert s.next_seq == 6
    silent = ProducerStream()
    assert silent.on_subscribe() == [RequestReplay(0)]
    assert silent.on_sync_failed() == []  # no answer, nothing received: wait
    assert not silent.started and silent.syncing is None and silent.lossy == 0


def test_a_disconnect_during_the_first_replay_lets_the_next_live_batch_decide() -> None:
    # The replay asked for on subscribing is in flight (its reply discarded with its socket) when the
    # connection drops: the stream must not wait for it forever, buffering every live batch.
    s = ProducerStream()
    assert s.on_subscribe() == [RequestReplay(0)]
    s.on_disconnect()
    assert s.syncing is None and not s.started
    assert s.on_live(0, b"x") == [Apply(0, b"x")]
    assert s.next_seq == 1
    late = ProducerStream()
    late.on_subscribe()
    late.on_disconnect()
    assert late.on_live(4, p(4)) == [RequestReplay(0)]  # a late first batch, as on any new subscription
    assert [a for i in range(4) for a in late.on_sync_item(i, b"r%d" % i)] == [Apply(i, b"r%d" % i) for i in range(4)]
    assert late.on_sync_end() == [Apply(4, p(4))]


def test_a_disconnect_after_the_first_replay_applied_some_history_resyncs_by_snapshot() -> None:
    s = ProducerStream()
    s.on_subscribe()
    assert s.on_sync_item(0, b"r0") == [Apply(0, b"r0")]
    s.on_disconnect()  # r0 stays applied; the next batch may come from a new incarnation
    assert s.started and s.syncing is None
    assert s.on_live(1, p(1)) == [RequestSnapshot()]
    assert s.on_sync_item(1, b"snap") == []
    assert s.on_sync_end() == [Reset(), Apply(1, b"snap")]
    assert s.next_seq == 2


# --------------------------------------------------------------------------- invariants


def test_invariants_hold_after_any_sequence_of_inputs() -> None:
    rng = random.Random(20241125)
    for _ in range(200):
        s = ProducerStream()
        if rng.random() < 0.5:
            s.on_subscribe()
        s.check_invariants()
        for _ in range(200):
            seq = max(0, s.next_seq + rng.randrange(-3, 5))
            kind = rng.random()
            if kind < 0.5:
                s.on_live(seq, p(seq))
            elif kind < 0.75:
                s.on_sync_item(seq, p(seq))
            elif kind < 0.85:
                s.on_sync_end()
            elif kind < 0.93:
                s.on_sync_failed()
            else:
                s.on_disconnect()
            s.check_invariants()


def test_check_invariants_catches_a_batch_buffered_with_no_sync_in_flight() -> None:
    s = streaming_at(2)
    s._pending[5] = p(5)
    with pytest.raises(AssertionError, match="no sync"):
        s.check_invariants()


def test_after_a_snapshot_a_disconnect_and_seq_next_is_settled_by_another_snapshot() -> None:
    """Synced by a snapshot, the stream knows no batch at next - 1 to check the next one against: a producer
    that restarted and reached our seq would be taken for the same stream. A snapshot settles it."""
    s = streaming_at(1)
    assert s.on_live(5, p(5)) == [RequestReplay(1)]
    assert s.on_sync_end() == [RequestSnapshot()]
    assert s.on_sync_item(6, b"snap") == []
    assert s.on_sync_end() == [Reset(), Apply(6, b"snap")]
    s.on_disconnect()
    assert s.on_live(7, q(7)) == [RequestSnapshot()]  # not applied on trust
    assert s.on_sync_item(8, b"snap-of-the-new-one") == []
    assert s.on_sync_end() == [Reset(), Apply(8, b"snap-of-the-new-one")]  # the buffered 7 is covered
    assert s.next_seq == 9
    s.check_invariants()
