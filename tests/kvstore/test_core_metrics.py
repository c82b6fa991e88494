"""Metrics: the collectors render vLLM-style names with the pool's and manager's live values."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry

from kvstore.block_pool import BlockPool
from kvstore.hashing import BlockHasher
from kvstore.kv_cache_manager import CacheRequest, KVCacheManager
from kvstore.metrics import CacheCollector, EventStreamCollector, render
from kvstore.producer_stream import SyncState
from kvstore.subscriber import LAG_BUCKETS_S, ProducerHealth


def make_manager(num_blocks: int) -> KVCacheManager:
    pool = BlockPool(num_blocks, block_size=4)
    return KVCacheManager(pool, BlockHasher("sha256_cbor", "kvstore", 4), watermark=0.0)


def run(manager: KVCacheManager, request: CacheRequest) -> None:
    hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit) is not None


def test_cache_collector_renders_usage_queries_and_hits() -> None:
    a, b = make_manager(10), make_manager(4)
    run(a, CacheRequest("r1", list(range(10))))  # 3 blocks, no hit
    run(a, CacheRequest("r2", [*range(8), 50, 51, 52, 53, 54]))  # hit 8 tokens, 2 new blocks
    a.free("r1")  # block 2 becomes free; r2 still holds 0, 1 and its own 2 blocks
    run(b, CacheRequest("s1", [1, 2, 3]))

    registry = CollectorRegistry()
    registry.register(CacheCollector(lambda: [("a", a), ("b", b)]))

    def value(name: str, replica: str) -> float | None:
        return registry.get_sample_value(name, {"replica": replica})

    assert value("kvstore_gpu_cache_usage_perc", "a") == 1 - 6 / 10
    assert value("kvstore_gpu_cache_usage_perc", "b") == 1 - 3 / 4
    assert value("kvstore_prefix_cache_queries_total", "a") == 10 + 13
    assert value("kvstore_prefix_cache_hits_total", "a") == 8
    assert value("kvstore_prefix_cache_queries_total", "b") == 3
    assert value("kvstore_prefix_cache_hits_total", "b") == 0
    assert value("kvstore_evicted_blocks_total", "a") == 0
    assert value("kvstore_hash_collisions_total", "a") == 0

    text = render(registry).decode()
    assert "# TYPE kvstore_gpu_cache_usage_perc gauge" in text
    assert "# TYPE kvstore_prefix_cache_queries_total counter" in text
    assert 'kvstore_prefix_cache_queries_total{replica="a"} 23.0' in text
    assert 'kvstore_prefix_cache_hits_total{replica="a"} 8.0' in text
    assert 'kvstore_gpu_cache_usage_perc{replica="b"} 0.25' in text

    # Values are read at scrape time, not frozen at registration.
    run(b, CacheRequest("s2", [9, 9, 9, 9, 9]))
    assert value("kvstore_gpu_cache_usage_perc", "b") == 1 - 1 / 4
    assert value("kvstore_prefix_cache_queries_total", "b") == 8


def test_event_stream_collector_renders_listener_health() -> None:
    # 12 batches: 10 of them under 1 ms, 1 at 0.5 s, 1 past the last bound (a replay two minutes late).
    counts = [0] * (len(LAG_BUCKETS_S) + 1)
    counts[0], counts[LAG_BUCKETS_S.index(0.5)], counts[-1] = 10, 1, 1
    health = ProducerHealth(
        producer="w0", endpoint="tcp://127.0.0.1:1", connected_since=1.7e9, last_batch_at=1.7e9 + 9, lag_s=0.5,
        lag_counts=tuple(counts), lag_sum_s=120.5, staleness_s=7.25,
        next_seq=12, batches=12, events=40, skipped_events=1, decode_errors=2, gaps=3, replays=4,
        snapshots=5, restarts=0, stale=0, lossy=6, syncing=None, dropped=7, oversized=8,
    )  # fmt: skip

    class Listener:
        def health(self) -> list[ProducerHealth]:
            return [health]

    registry = CollectorRegistry()
    registry.register(EventStreamCollector(Listener()))  # type: ignore[arg-type]
    get = registry.get_sample_value
    assert get("kvstore_router_events_total", {"producer": "w0"}) == 40
    assert get("kvstore_router_event_gaps_total", {"producer": "w0"}) == 3
    assert get("kvstore_router_decode_errors_total", {"producer": "w0"}) == 3
    assert get("kvstore_router_resyncs_total", {"producer": "w0", "kind": "replay"}) == 4
    assert get("kvstore_router_resyncs_total", {"producer": "w0", "kind": "snapshot"}) == 5
    losses = [
        get("kvstore_router_event_losses_total", {"producer": "w0", "kind": k})
        for k in ("lossy", "dropped", "oversized")
    ]
    assert losses == [6, 7, 8]
    # Lag is a histogram of applied batches (cumulative buckets); an idle producer's silence is its staleness.
    assert get("kvstore_router_event_lag_seconds_bucket", {"producer": "w0", "le": "0.001"}) == 10
    assert get("kvstore_router_event_lag_seconds_bucket", {"producer": "w0", "le": "0.25"}) == 10
    assert get("kvstore_router_event_lag_seconds_bucket", {"producer": "w0", "le": "0.5"}) == 11
    assert get("kvstore_router_event_lag_seconds_bucket", {"producer": "w0", "le": "60.0"}) == 11
    assert get("kvstore_router_event_lag_seconds_bucket", {"producer": "w0", "le": "+Inf"}) == 12
    assert get("kvstore_router_event_lag_seconds_count", {"producer": "w0"}) == 12
    assert get("kvstore_router_event_lag_seconds_sum", {"producer": "w0"}) == 120.5
    assert get("kvstore_router_event_staleness_seconds", {"producer": "w0"}) == 7.25


def test_producer_health_reports_the_sync_state_as_its_plain_string() -> None:
    health = ProducerHealth(
        producer="w0", endpoint="tcp://127.0.0.1:1", connected_since=0.0, last_batch_at=None, lag_s=None,
        lag_counts=(0,) * (len(LAG_BUCKETS_S) + 1), lag_sum_s=0.0, staleness_s=0.0,
        next_seq=3, batches=3, events=3, skipped_events=0, decode_errors=0, gaps=1, replays=1,
        snapshots=0, restarts=0, stale=0, lossy=0, syncing=SyncState.REPLAY,
    )  # fmt: skip
    assert json.loads(health.as_json())["syncing"] == "replay"
    assert json.loads(health._replace(syncing=None).as_json())["syncing"] is None
