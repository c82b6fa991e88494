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
