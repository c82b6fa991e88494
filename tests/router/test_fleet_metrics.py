"""The router's one /metrics page: two nodes' tiers and two replicas merged, every series exactly once.

The two nodes are built in process -- two real tier stores, each rendering
its page with :class:`TierCollector` as its tier actor does, beside two
replicas' pool pages -- and merged by the router's own collectors
(:class:`RouterMetrics`). A real two-node Ray cluster
(tests/deploy/test_two_node.py) would add only Ray carrying the same text
to the router, at minutes per run; what collides or not is the labels of
these pages and the merge, which this exercises exactly.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.block_pool import BlockPool
from kvstore.hashing import BlockHasher
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.metrics import CacheCollector, render
from kvstore.router.dispatch import public_reason
from kvstore.router.fleet_metrics import PageSources
from kvstore.router.metrics import RouterMetrics
from kvstore.subscriber import EventListener
from kvstore.tiers.client import LocalTierClient
from kvstore.tiers.metrics import TierCollector
from tests.tiers.tiers_helpers import linked_tier, make_blocks, spill_all, tier_config

NODES = {"node-a": 3, "node-b": 1}  # node -> blocks spilled to its tier


class NoSink:
    def apply_batch(self, *args: object) -> None:
        pass

    def reset_producer(self, producer: str) -> None:
        pass


def tier_page(client: LocalTierClient, node: str) -> str:
    registry = CollectorRegistry()
    registry.register(TierCollector(client.stats, node))
    return render(registry).decode()


def replica_page(name: str) -> str:
    manager = KVCacheManager(BlockPool(8, block_size=4), BlockHasher("sha256_cbor", "kvstore", 4), watermark=0.0)
    registry = CollectorRegistry()
    registry.register(CacheCollector(lambda: [(name, manager)]))
    return render(registry).decode()


def router_page(pages: list[str]) -> str:
    registry = CollectorRegistry()
    RouterMetrics(registry, EventListener(NoSink()), lambda: 2.0, lambda: pages)
    return generate_latest(registry).decode()


def series(page: str) -> list[tuple[str, frozenset[tuple[str, str]], float]]:
    return [
        (sample.name, frozenset(sample.labels.items()), sample.value)
        for family in text_string_to_metric_families(page)
        for sample in family.samples
    ]


def dropped(merged: list[tuple[str, frozenset[tuple[str, str]], float]]) -> dict[str, float]:
    return {
        dict(labels)["reason"]: value for name, labels, value in merged if name == "kvstore_router_merge_dropped_total"
    }


def test_two_nodes_tiers_and_two_replicas_merge_without_a_collision(tmp_path: Path) -> None:
    pages = [replica_page("w-a"), replica_page("w-b")]
    for node, spilled in NODES.items():
        with linked_tier(tier_config(tmp_path / node, cpu_blocks=4)) as (client, link):
            metas, data = make_blocks(spilled, seed=spilled)
            spill_all(link, metas, data)
            pages.append(tier_page(client, node))

    merged = series(router_page(pages))
    keys = Counter((name, labels) for name, labels, _ in merged)
    assert [key for key, n in keys.items() if n > 1] == []
    # Every node's tier series is there, with its own value.
    blocks = {dict(labels)["node"]: value for name, labels, value in merged if name == "kvstore_tier_blocks"}
    assert blocks == {node: float(spilled) for node, spilled in NODES.items()}
    for name, labels, _ in merged:
        if name.startswith(("kvstore_tier_", "kvstore_offload_")):
            assert dict(labels)["node"] in NODES, (name, labels)
        elif name.startswith(("kvstore_gpu_", "kvstore_prefix_cache_")):
            assert dict(labels)["replica"] in {"w-a", "w-b"}, (name, labels)
    dropped = {
        dict(labels)["reason"]: value for name, labels, value in merged if name.startswith("kvstore_router_merge")
    }
    assert dropped == {"duplicate_series": 0.0, "unparsable_page": 0.0}


def test_a_series_on_two_pages_is_kept_once_and_counted(tmp_path: Path) -> None:
    with linked_tier(tier_config(tmp_path, cpu_blocks=4)) as (client, link):
        metas, data = make_blocks(2)
        spill_all(link, metas, data)
        page = tier_page(client, "node-a")  # e.g. two tier actors that both name themselves node-a
    samples = len(series(page))
    merged = series(router_page([page, page, "not a { page"]))
    tier = [(name, labels) for name, labels, _ in merged if name.startswith(("kvstore_tier_", "kvstore_offload_"))]
    assert len(tier) == len(set(tier)) == samples
    dropped = {
        dict(labels)["reason"]: value for name, labels, value in merged if name.startswith("kvstore_router_merge")
    }
    assert dropped == {"duplicate_series": float(samples), "unparsable_page": 1.0}


def test_a_silent_metrics_source_is_logged_once_per_outage(caplog: pytest.LogCaptureFixture) -> None:
    """A tier actor gone for good was one WARNING per health poll, forever: now one when it stops answering,
    one when it answers again."""
    answers = iter([RuntimeError("gone"), RuntimeError("gone"), RuntimeError("gone"), "page", RuntimeError("again")])

    async def fetch() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    sources = PageSources()
    sources.add("tier-x", fetch)
    with caplog.at_level(logging.WARNING, logger="kvstore.router.fleet_metrics"):
        for _ in range(5):
            asyncio.run(sources.poll())
    said = [record.getMessage() for record in caplog.records]
    assert said == [
        "metrics source tier-x did not answer: gone (said once until it answers)",
        "metrics source tier-x answers again",
        "metrics source tier-x did not answer: again (said once until it answers)",
    ]
    assert sources.pages() == []


def test_a_client_is_told_a_replicas_failure_in_one_line() -> None:
    ray_like = RuntimeError("worker-0: ActorDiedError: The actor died.\n\tactor_id: 5f3a\n\tpid: 4242\n\tip: 10.0.0.5")
    assert public_reason(ray_like) == "worker-0: ActorDiedError: The actor died."
    assert public_reason(RuntimeError("x" * 400)).endswith("...") and len(public_reason(RuntimeError("x" * 400))) == 300
    assert public_reason(RuntimeError("")) == "RuntimeError"
