"""The router over our Ray workers, end to end through a real HTTP server.

Two KVWorkerActor replicas on the session's local Ray cluster, placed by the
same launcher code as ``kvstore serve``, and the router app on 127.0.0.1.
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
import ray

from kvstore.deploy.config import config_from_dict
from kvstore.deploy.launcher import build_service, place_workers
from kvstore.router.app import create_app
from tests.http_servers import ServerThread
from tests.router.router_helpers import wait_for

BLOCK = 16


@pytest.mark.ray
def test_two_ray_workers_shared_prefix_and_a_killed_worker(ray_session: Any) -> None:
    config = config_from_dict(
        {
            "cache": {"block_size": BLOCK},
            "pool": {"num_blocks": 256},
            "worker": {"device": "cpu", "max_context": 1024},
            "router": {"health_interval_s": 0.2, "unhealthy_after": 1},
        }
    )
    workers = place_workers(config, 2, start_index=100)
    service = build_service(config, workers)
    server = ServerThread(create_app(service)).start()
    client = httpx.Client(base_url=server.url, timeout=60)
    try:
        rng = random.Random(3)
        prefix = [rng.randrange(512) for _ in range(12 * BLOCK)]

        def complete(tail: list[int]) -> dict[str, Any]:
            response = client.post("/v1/completions", json={"prompt": [*prefix, *tail], "max_tokens": 4})
            assert response.status_code == 200, response.text
            return response.json()

        first = complete([1, 2, 3])
        owner = first["kvstore"]["replica"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        probe = {"prompt": [*prefix, 7], "max_tokens": 4}
        assert wait_for(lambda: client.post("/route", json=probe).json()["matched_blocks"][owner]["GPU"] == 12)

        second = complete([4, 5, 6, 7])
        assert second["kvstore"]["replica"] == owner
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 12 * BLOCK
        assert second["choices"][0]["token_ids"] != []

        # A batch of two prompts on that prefix: what the router predicted is summed over the prompts, each
        # for the replica that served it (the batch's replica names are joined; no one replica has that name).
        batch = client.post("/v1/completions", json={"prompt": [[*prefix, 10, 11], [*prefix, 12]], "max_tokens": 2})
        assert batch.status_code == 200, batch.text
        extras = batch.json()["kvstore"]
        assert extras["replica"] == owner and extras["predicted_cached_blocks"] == {"GPU": 24, "CPU": 0, "STORAGE": 0}
        assert extras["prompt_blocks"] == 26 and extras["cached_tokens"]["GPU"] == 24 * BLOCK
        assert batch.headers["x-kvstore-predicted-cached-blocks"] == "24"

        # Kill the owner: the next request for its prefix is served by the other worker.
        handle = next(w.handle for w in workers if w.name == owner)
        ray.kill(handle, no_restart=True)
        third = complete([8, 9])
        other = next(w.name for w in workers if w.name != owner)
        assert third["kvstore"]["replica"] == other
        assert wait_for(lambda: client.get("/healthz").json()["healthy_replicas"] == 1, timeout=5)
        assert set(client.post("/route", json=probe).json()["scores"]) == {other}
    finally:
        client.close()
        server.stop()
        for w in workers:
            ray.kill(w.handle, no_restart=True)


@pytest.mark.ray
def test_more_workers_than_a_node_can_hold_is_refused_before_any_starts(ray_session: Any) -> None:
    """Workers are pinned to their node: five one-CPU workers on this 4-CPU cluster would leave one pending
    forever (before: two minutes of waiting, then Ray's traceback)."""
    from kvstore.errors import ConfigError

    config = config_from_dict({"worker": {"device": "cpu"}})
    with pytest.raises(ConfigError, match=r"5 workers on node \w+ need 5 CPU \(1 each\), and the node has 4"):
        place_workers(config, 5, start_index=950)
    with pytest.raises(ValueError):  # nothing was started under those names
        ray.get_actor("kvstore-worker-950", namespace="kvstore")
