"""``GET /workers``: a replica's event stream with wall-clock times people can read."""

from __future__ import annotations

import datetime
import time

from kvstore.config import CacheConfig
from kvstore.router.config import RouterConfig
from kvstore.router.index import PrefixIndex
from kvstore.router.replicas import ReplicaSet, ReplicaSpec
from kvstore.router.streams import ProducerSpec
from kvstore.subscriber import LAG_BUCKETS_S, EventListener, ProducerHealth


class NoSink:
    def apply_batch(self, *args: object) -> None:
        pass

    def reset_producer(self, producer: str) -> None:
        pass


class IdleBackend:
    name = "w0"

    async def close(self) -> None:
        pass


def test_stream_times_are_utc_iso_8601_and_the_lag_histogram_stays_on_metrics() -> None:
    index = PrefixIndex(CacheConfig())
    replicas = ReplicaSet(index, EventListener(NoSink()), RouterConfig())
    events = ProducerSpec("w0/gpu", "tcp://127.0.0.1:1", None)
    replicas.add(ReplicaSpec("w0", "node-a", IdleBackend(), events))  # type: ignore[arg-type]
    subscribed = time.time() - 3600.25
    health = ProducerHealth(
        producer="w0/gpu", endpoint=events.endpoint, connected_since=subscribed, last_batch_at=subscribed + 60,
        lag_s=0.002, lag_counts=(1,) + (0,) * len(LAG_BUCKETS_S), lag_sum_s=0.002, staleness_s=3540.0,
        next_seq=1, batches=1, events=1, skipped_events=0, decode_errors=0, gaps=0, replays=0, snapshots=0,
        restarts=0, stale=0, lossy=0, syncing=None,
    )  # fmt: skip
    (summary,) = replicas.summary({"w0/gpu": health})
    stream = summary["events"]
    assert stream["connected_since"] == datetime.datetime.fromtimestamp(subscribed, datetime.UTC).isoformat(
        timespec="milliseconds"
    )
    assert stream["connected_since"].endswith("+00:00")
    parsed = datetime.datetime.fromisoformat(stream["last_batch_at"]).timestamp()
    assert abs(parsed - (subscribed + 60)) < 0.001
    assert stream["lag_s"] == 0.002 and stream["staleness_s"] == 3540.0
    assert "lag_counts" not in stream and "lag_sum_s" not in stream

    never = health._replace(last_batch_at=None, lag_s=None)
    (summary,) = replicas.summary({"w0/gpu": never})
    assert summary["events"]["last_batch_at"] is None


def test_a_batch_of_the_old_stream_delivered_after_a_replacement_is_dropped_with_it() -> None:
    """A replica re-added under its name (a restarted worker): a batch the listener was still delivering from
    the old subscription lands in the new registration before the listener unsubscribes. The listener then
    resets the producer, so the old block goes (before: it stayed, and the new stream's replay counted its
    blocks twice, so a later eviction left them in the index)."""
    from kvstore.events import BlockStored, EventBatch

    index = PrefixIndex(CacheConfig())
    listener = EventListener(index)
    replicas = ReplicaSet(index, listener, RouterConfig())
    events = ProducerSpec("w0/gpu", "tcp://127.0.0.1:1", None)
    spec = ReplicaSpec("w0", "node-a", IdleBackend(), events)  # type: ignore[arg-type]
    stored = BlockStored(
        block_hashes=[77],
        parent_block_hash=None,
        token_ids=[0] * 16,
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    try:
        replicas.add(spec)
        replicas.add(spec)  # replaced: the old subscription's removal is queued for the listener thread
        index.apply_batch("w0/gpu", 5, EventBatch(0.0, [stored]))  # what that thread delivers meanwhile
        assert index.lookup([77]) != {}
        listener.start()
        deadline = time.monotonic() + 10
        while index.lookup([77]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert index.lookup([77]) == {}
        assert [r.spec.name for r in replicas.healthy()] == ["w0"]
    finally:
        listener.close()
