"""The node's tier actor killed while its workers serve, then restarted on the same disk directory.

Two KVWorkerActor replicas and the node's TierActor on the session's local
Ray cluster, placed and wired by the launcher (place_tiers, place_workers).
The tier actor is ``ray.kill``ed while both workers run requests. Every
request must still finish with the output of a run with no cache at all:
the workers notice the dead tier on their next tier call, stop spilling
(the evicted KV is dropped, and counted) and stop asking it for hits, and
``kvstore_tier_unavailable_total`` says so. A new tier actor is then started
under the same name on the same disk directory: the workers find it by name
and map its new arena, and a prefix that was on the old tier's disk before
the kill is promoted again (medium STORAGE), still exactly right.
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path
from typing import Any

import pytest
import ray
from faults_helpers import BLOCK, tokens, wait_for
from prometheus_client.parser import text_string_to_metric_families

from kvstore.deploy.config import Config, config_from_dict
from kvstore.deploy.launcher import PlacedTier, PlacedWorker, place_tiers, place_workers
from kvstore.hashing import BlockHasher, to_external
from kvstore.worker_api import GenerateRequest, GenerateResult
from kvstore.workers.config import cache_identity
from tests.ground_truth import reference_outputs

MAX_TOKENS = 4
PROMPT_BLOCKS = 12  # full blocks of a prompt (+ 3 tokens: all 12 can be a hit, the last token is beyond them)


def tier_config(tmp_path: Path) -> Config:
    """The toy model on the CPU; a 40-block pool, a 4-slot CPU arena: evicted blocks reach the disk fast."""
    base = config_from_dict({"cache": {"block_size": BLOCK}, "worker": {"device": "cpu"}})
    block_bytes = cache_identity(base).block_bytes
    return config_from_dict(
        {
            "cache": {"block_size": BLOCK},
            "pool": {"num_blocks": 40},
            "worker": {"device": "cpu"},
            "tiers": {"cpu_capacity_bytes": 4 * block_bytes, "disk_dir": str(tmp_path / "disk"), "io_deadline_s": 2.0},
        }
    )


def metrics(handle: Any) -> dict[str, float]:
    """The worker's Prometheus page as {sample: value}, ``name`` or ``name{label=value}`` (replica left out)."""
    text = ray.get(handle.metrics_text.remote(), timeout=30).decode()
    page = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "replica")
            page[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return page


def health(handle: Any) -> dict[str, Any]:
    return ray.get(handle.health.remote(), timeout=30)  # type: ignore[no-any-return]


def submit(worker: PlacedWorker, prompt: list[int]) -> Any:
    return worker.handle.generate.remote(GenerateRequest(prompt, MAX_TOKENS))


def stop(workers: list[PlacedWorker], tiers: list[PlacedTier]) -> None:
    stop_actors([*(w.handle for w in workers), *(t.handle for t in tiers)])


def stop_actors(handles: list[Any]) -> None:
    for actor in handles:
        with contextlib.suppress(Exception):  # a killed actor cannot shut down; the kill below is enough
            ray.get(actor.shutdown.remote(), timeout=30)
        ray.kill(actor, no_restart=True)


@pytest.mark.ray
def test_tier_actor_killed_while_serving_then_restarted_on_the_same_disk(ray_session: Any, tmp_path: Path) -> None:
    config = tier_config(tmp_path)
    hasher = BlockHasher.from_config(config.cache)
    rng = random.Random(41)
    prompts = [tokens(rng, PROMPT_BLOCKS * BLOCK + 3) for _ in range(23)]
    expected = reference_outputs(prompts, MAX_TOKENS)
    spilled, burst, after = prompts[:5], prompts[5:17], prompts[17:]  # never shared: no GPU hit across prompts

    tiers = place_tiers(config)
    (node, tier), *_ = tiers.items()
    workers = place_workers(config, 2, tiers=tiers, start_index=500)
    first, second = workers
    restarted: list[PlacedTier] = []
    try:
        assert all(health(w.handle)["tier_connected"] for w in workers)

        # 1. The first worker computes 5 prompts; its 40-block pool spills the oldest, through the 4-slot arena to disk.
        for prompt in spilled:
            assert ray.get(submit(first, prompt), timeout=60).output_token_ids == expected[prompts.index(prompt)]
        hashes = [to_external(h) for h in hasher.hash_blocks(spilled[0])]

        # Stores run on the worker's offload thread, after the requests that freed the blocks returned.
        def on_disk() -> bool:
            return ray.get(tier.handle.lookup.remote(hashes), timeout=30).media == ("STORAGE",) * PROMPT_BLOCKS

        assert wait_for(on_disk, timeout=20), ray.get(tier.handle.lookup.remote(hashes), timeout=30)

        # 2. Both workers take a burst; the tier actor is killed while they run it.
        refs = [(i, submit(workers[i % 2], prompt)) for i, prompt in enumerate(burst, start=5)]
        assert wait_for(lambda: len(ray.wait([r for _, r in refs], num_returns=2, timeout=0)[0]) >= 2, timeout=60)
        in_flight = len(refs) - len(ray.wait([r for _, r in refs], num_returns=len(refs), timeout=0)[0])
        killed_at = time.monotonic()
        ray.kill(tier.handle, no_restart=True)
        burst_results: list[tuple[int, GenerateResult]] = [(i, ray.get(r, timeout=60)) for i, r in refs]
        # ...and more requests with the tier gone (each evicts: spills would be needed).
        after_results = [(i, ray.get(submit(workers[i % 2], p), timeout=60)) for i, p in enumerate(after, start=17)]
        outage_s = time.monotonic() - killed_at
        wrong = [i for i, r in [*burst_results, *after_results] if r.output_token_ids != expected[i]]
        assert not wrong, f"prompts {wrong} got other tokens than the uncached model"

        down = [metrics(w.handle) for w in workers]
        for page, w in zip(down, workers, strict=True):
            assert health(w.handle)["tier_connected"] is False
            assert page["kvstore_tier_connected"] == 0.0
            assert page["kvstore_tier_unavailable_total"] == 1.0, page  # noticed once, then no call until reconnected
            assert page["kvstore_tier_reconnects_total"] == 0.0
            assert page["kvstore_tier_spill_skipped_blocks_total"] > 0, page  # evictions while down: dropped, counted
            assert page["kvstore_tier_promote_skipped_total"] > 0, page
            assert page["kvstore_requests_total{outcome=failed}"] == 0.0

        # 3. A new tier actor on the same node and disk directory: the workers find it by name.
        restarted_at = time.monotonic()
        new_tiers = place_tiers(config)
        restarted = list(new_tiers.values())
        new_tier = new_tiers[node]
        assert new_tier.handle._actor_id != tier.handle._actor_id
        assert wait_for(lambda: all(health(w.handle)["tier_connected"] for w in workers), timeout=20)
        reconnect_s = time.monotonic() - restarted_at
        stats = ray.get(new_tier.handle.stats.remote(), timeout=30)
        on_disk_after = ray.get(new_tier.handle.lookup.remote(hashes), timeout=30)
        assert on_disk_after.media == ("STORAGE",) * PROMPT_BLOCKS, on_disk_after  # the restart kept the disk

        # The second worker never saw spilled[0]: its prefix comes back from the restarted tier's disk.
        result = ray.get(submit(second, spilled[0]), timeout=60)
        assert result.output_token_ids == expected[0]
        assert result.cached_tokens_by_medium["GPU"] == 0
        assert result.cached_tokens_by_medium["STORAGE"] == PROMPT_BLOCKS * BLOCK, result.cached_tokens_by_medium
        # Spilling works again: the first worker's evictions reach the new tier.
        for i, prompt in enumerate(spilled[1:], start=1):
            assert ray.get(submit(first, prompt), timeout=60).output_token_ids == expected[i]
        up = [metrics(w.handle) for w in workers]
        for page, before in zip(up, down, strict=True):
            assert page["kvstore_tier_connected"] == 1.0 and page["kvstore_tier_reconnects_total"] == 1.0
            assert page["kvstore_tier_unavailable_total"] == 1.0
            assert page["kvstore_tier_spill_skipped_blocks_total"] == before["kvstore_tier_spill_skipped_blocks_total"]
        new_stats = ray.get(new_tier.handle.stats.remote(), timeout=30)
        assert new_stats.hits["STORAGE"] >= PROMPT_BLOCKS
        assert new_stats.offload_bytes.get("spill", 0) > 0, "no spill reached the restarted tier"
        for w in workers:
            ray.get(w.handle.check_invariants.remote(), timeout=30)
        ray.get(new_tier.handle.check_invariants.remote(), timeout=30)
        print(
            f"\ntier death: {in_flight} of {len(burst)} burst requests in flight at the kill; "
            f"{len(burst) + len(after)} requests served during the outage ({outage_s:.2f} s), 0 wrong, 0 failed; "
            f"unavailable_total 1 per worker; spills skipped "
            f"{[int(p['kvstore_tier_spill_skipped_blocks_total']) for p in down]} blocks, promotions skipped "
            f"{[int(p['kvstore_tier_promote_skipped_total']) for p in down]}; restarted tier indexed "
            f"{stats.blocks.get('STORAGE', 0)} disk blocks (scan removed {dict(stats.scan_removed)}); both workers "
            f"reconnected {reconnect_s:.2f} s after the restart began; {PROMPT_BLOCKS} blocks promoted from "
            f"STORAGE after it"
        )
    finally:
        stop(workers, [tier, *restarted])


@pytest.mark.ray
def test_a_worker_started_before_its_tier_serves_then_connects_when_the_tier_comes(
    ray_session: Any, tmp_path: Path
) -> None:
    """The worker is handed its tier by name (a handle among an actor's constructor arguments is an object
    reference a Ray restart may not get back): a name nobody holds yet means serving without a tier, exactly, and
    connecting once the tier actor starts under it -- then the worker spills to it."""
    from kvstore.tiers.actor import get_or_create_tier_actor, tier_actor_name
    from kvstore.workers.actor import KVWorkerActor, worker_actor_options

    config = tier_config(tmp_path)
    node = ray.get_runtime_context().get_node_id()
    options = worker_actor_options(config)
    worker = KVWorkerActor.options(**options).remote("late-tier", config, tier_actor_name(node))  # type: ignore[attr-defined]
    tier = None
    try:
        rng = random.Random(7)
        prompts = [tokens(rng, PROMPT_BLOCKS * BLOCK + 3) for _ in range(3)]
        outputs = [ray.get(worker.generate.remote(GenerateRequest(p, MAX_TOKENS)), timeout=60) for p in prompts]
        assert [list(o.output_token_ids) for o in outputs] == reference_outputs(prompts, MAX_TOKENS)
        assert health(worker)["tier_connected"] is False
        tier = get_or_create_tier_actor(config.tiers, cache_identity(config), events=config.events, node_id=node)
        assert wait_for(lambda: health(worker)["tier_connected"] is True, timeout=20)
        more = [tokens(rng, PROMPT_BLOCKS * BLOCK + 3) for _ in range(4)]  # evict the pool's blocks into the tier
        outputs = [ray.get(worker.generate.remote(GenerateRequest(p, MAX_TOKENS)), timeout=60) for p in more]
        assert [list(o.output_token_ids) for o in outputs] == reference_outputs(more, MAX_TOKENS)
        assert wait_for(lambda: metrics(worker)["kvstore_worker_offload_stored_blocks_total"] > 0, timeout=20)
        assert metrics(worker)["kvstore_tier_reconnects_total"] == 1.0
    finally:
        stop_actors([actor for actor in (worker, tier) if actor is not None])
