"""Workers with their node's tiers, on the session Ray cluster, placed by the launcher.

A block one worker spills is promoted into another worker of the node, and
a prompt whose prefix comes back from the CPU arena or from disk produces
exactly the output computed with no cache at all.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from kvstore.deploy.config import Config, config_from_dict
from kvstore.deploy.launcher import place_tiers, place_workers
from kvstore.worker_api import GenerateRequest
from kvstore.workers.config import cache_identity
from tests.ground_truth import reference_outputs

BLOCK = 16


def tiered_config(tmp_path: Path, *, cpu_slots: int) -> Config:
    base = config_from_dict({"cache": {"block_size": BLOCK}, "worker": {"device": "cpu"}})
    block_bytes = cache_identity(base).block_bytes
    return config_from_dict(
        {
            "cache": {"block_size": BLOCK},
            "pool": {"num_blocks": 48},
            # The test is about what a promotion brings, not how fast: an admission that gives up on a slow
            # tier (the default 2 s, which a busy virtual disk has exceeded here) would recompute instead.
            "worker": {"device": "cpu", "offload_wait_s": 30.0},
            "tiers": {
                "cpu_capacity_bytes": cpu_slots * block_bytes,
                "disk_dir": str(tmp_path / "disk"),
                "copy_threads": 3,
            },
        }
    )


def run(handle: Any, prompt: list[int], max_tokens: int) -> Any:
    return ray.get(handle.generate.remote(GenerateRequest(prompt, max_tokens)), timeout=120)


@pytest.mark.ray
@pytest.mark.parametrize(("cpu_slots", "medium"), [(256, "CPU"), (4, "STORAGE")])
def test_spilled_prefix_is_promoted_into_another_worker_exactly(
    ray_session: Any, tmp_path: Path, cpu_slots: int, medium: str
) -> None:
    config = tiered_config(tmp_path, cpu_slots=cpu_slots)
    rng = random.Random(cpu_slots)
    prompts = [[rng.randrange(512) for _ in range(20 * BLOCK + 5)] for _ in range(4)]  # 21 blocks each
    expected = reference_outputs(prompts, 6)
    tiers = place_tiers(config)
    workers = place_workers(config, 2, tiers=tiers, start_index=200)
    try:
        first, second = (w.handle for w in workers)
        assert all(ray.get(w.handle.health.remote())["tiered"] for w in workers)
        # The actor's link copies with tiers.copy_threads threads (it once ignored the setting).
        threads = ray.get(first.__ray_call__.remote(lambda actor: actor._offload.link.engine._threads))
        assert threads == 3
        # The first worker computes every prompt; its 48-block pool evicts (spills) the older ones.
        for prompt, want in zip(prompts, expected, strict=True):
            assert run(first, prompt, 6).output_token_ids == want
        assert ray.get(first.drain_offload.remote())  # its stores run after the requests returned
        ray.get(next(iter(tiers.values())).handle.flush_events.remote())
        # The second worker has never seen prompt 0: its prefix comes from the node's tiers.
        result = run(second, prompts[0], 6)
        assert result.output_token_ids == expected[0]
        assert result.cached_tokens_by_medium["GPU"] == 0
        offload = [
            line
            for line in ray.get(second.metrics_text.remote()).decode().splitlines()
            if line.startswith(("kvstore_worker_offload_", "kvstore_tier_")) and not line.startswith("#")
        ]
        # A miss shows, in full (a string is not shortened as a repr is), what both sides counted.
        tier_stats = ray.get(next(iter(tiers.values())).handle.stats.remote())
        why = f"{result.cached_tokens_by_medium}\n{tier_stats}\n" + "\n".join(offload)
        assert result.cached_tokens_by_medium[medium] > 0, why
        assert result.cached_tokens == sum(result.cached_tokens_by_medium.values())
        for w in workers:
            ray.get(w.handle.check_invariants.remote())
    finally:
        for actor in [*(w.handle for w in workers), *(t.handle for t in tiers.values())]:
            ray.get(actor.shutdown.remote(), timeout=30)
            ray.kill(actor, no_restart=True)


@pytest.mark.ray
def test_a_worker_that_cannot_start_is_one_line_not_rays_trace(ray_session: Any) -> None:
    """A worker actor whose constructor fails (a model that does not load, no memory for its pool) is reported
    in one line naming it and the cause (a review saw a 61-line Ray traceback)."""
    from kvstore.deploy.launcher import placed_worker
    from kvstore.errors import ConfigError

    @ray.remote(num_cpus=0)
    class Broken:
        def __init__(self) -> None:
            raise MemoryError("cannot allocate 12 GiB for the KV pool")

        def event_endpoints(self) -> None: ...

        def health(self) -> None: ...

    handle = Broken.remote()  # type: ignore[attr-defined]
    with pytest.raises(ConfigError) as info:
        placed_worker("worker-x", handle, 60.0)
    message = str(info.value)
    assert message.startswith("worker worker-x could not start: ") and "cannot allocate 12 GiB" in message
    assert "\n" not in message


@pytest.mark.ray
def test_a_second_deployment_on_the_cluster_is_refused_before_it_touches_the_first(ray_session: Any) -> None:
    """A kvstore deployment's workers exist by name: a second launch on the same cluster is refused in one
    line before it places anything (it used to adopt the first one's tier actors, fail on the workers'
    names, and shut those tiers down as it tore itself down)."""
    from kvstore.deploy.launcher import NAMESPACE, check_no_deployment
    from kvstore.errors import ConfigError

    @ray.remote(num_cpus=0)
    class Running:
        def ready(self) -> bool:
            return True

    check_no_deployment(2)
    handle = Running.options(name="kvstore-worker-1", namespace=NAMESPACE).remote()  # type: ignore[attr-defined]
    try:
        assert ray.get(handle.ready.remote(), timeout=60)
        with pytest.raises(ConfigError, match=r"already runs on this Ray cluster \(its workers kvstore-worker-1\)"):
            check_no_deployment(2)
        check_no_deployment(1)  # a launch of one worker names only worker-0
    finally:
        ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            check_no_deployment(2)
            break
        except ConfigError:
            time.sleep(0.1)
    check_no_deployment(2)
