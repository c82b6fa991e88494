"""A tier actor whose process dies is restarted by Ray, and the router follows it.

The deployment of ``kvstore serve`` (launcher: place_tiers, place_workers,
build_service) with the router's HTTP app on 127.0.0.1. A prompt's blocks
are spilled through the node's tier to disk, and the router credits them
(STORAGE) to the worker. The tier actor's process is then killed the way a
crash kills it (``ray.kill(no_restart=False)``): nobody calls place_tiers
again. Ray restarts it on the same node with the same disk directory; it
publishes on new ports; the router must find them, credit the surviving
disk blocks again, and the worker must serve them with exact output.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import ray
from faults_helpers import BLOCK, tokens, wait_for
from test_faults_tier_death import MAX_TOKENS, PROMPT_BLOCKS, stop, tier_config

from kvstore.deploy.launcher import build_service, place_tiers, place_workers
from kvstore.router.app import create_app
from kvstore.tiers.actor import TIER_NAMESPACE, tier_actor_name
from tests.ground_truth import reference_outputs
from tests.http_servers import ServerThread


@pytest.mark.ray
def test_a_crashed_tier_actor_is_restarted_and_the_router_follows_it(ray_session: Any, tmp_path: Path) -> None:
    base = tier_config(tmp_path)
    config = msgspec.structs.replace(base, router=msgspec.structs.replace(base.router, health_interval_s=0.2))
    rng = random.Random(17)
    prompts = [tokens(rng, PROMPT_BLOCKS * BLOCK + 3) for _ in range(8)]
    expected = reference_outputs(prompts, MAX_TOKENS)
    target, fillers = prompts[0], prompts[1:]

    tiers = place_tiers(config)
    (node, tier), *_ = tiers.items()
    workers = place_workers(config, 1, tiers=tiers, start_index=700)
    service = build_service(config, workers, tiers)
    server = ServerThread(create_app(service)).start()
    client = httpx.Client(base_url=server.url, timeout=60)
    (producer,) = service.tier_producers()

    def complete(prompt: list[int]) -> dict[str, Any]:
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS})
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    def storage_credit() -> int:
        probe = {"prompt": [*target[:-1], (target[-1] + 1) % 512], "max_tokens": 1}
        matched = client.post("/route", json=probe).json()["matched_blocks"]
        return int(matched[workers[0].name]["STORAGE"])

    try:
        # 1. target computed, then evicted by the fillers: its blocks go through the 4-slot arena on to disk
        #    (blocks still in the arena at a crash are lost: spill is write-back).
        assert complete(target)["choices"][0]["token_ids"] == expected[0]
        for i, prompt in enumerate(fillers[:5], start=1):
            assert complete(prompt)["choices"][0]["token_ids"] == expected[i]
        assert wait_for(lambda: storage_credit() == PROMPT_BLOCKS, timeout=20)

        # 2. The tier's process dies; Ray restarts it (same name, same disk, new ports).
        old_endpoint = service.tier_producers()[producer].endpoint
        crashed_at = time.monotonic()
        ray.kill(tier.handle, no_restart=False)
        assert wait_for(lambda: service.tier_producers()[producer].endpoint != old_endpoint, timeout=30)
        followed_s = time.monotonic() - crashed_at
        restarted = ray.get_actor(tier_actor_name(node), namespace=TIER_NAMESPACE)
        assert (
            ray.get(restarted.event_endpoints.remote(), timeout=30).endpoint.rsplit(":", 1)[1]
            == (service.tier_producers()[producer].endpoint.rsplit(":", 1)[1])
        )

        # 3. Its next publication syncs the router: the disk blocks that survived are credited again...
        assert complete(fillers[5])["choices"][0]["token_ids"] == expected[6]
        assert wait_for(lambda: storage_credit() == PROMPT_BLOCKS, timeout=30), (
            client.post("/route", json={"prompt": target, "max_tokens": 1}).json()["matched_blocks"],
            [h for h in service.listener.health() if h.producer == producer],
            ray.get(restarted.stats.remote(), timeout=30).blocks,
        )
        credited_s = time.monotonic() - crashed_at
        # ...and served: the worker reconnected to the restarted actor and promotes them, exactly.
        assert wait_for(lambda: ray.get(workers[0].handle.health.remote(), timeout=30)["tier_connected"], timeout=30)
        # The filler's blocks are stored after its answer, through the same 4-slot arena: let those stores land,
        # or the target's promotion finds the arena's slots taken and brings back only part of its prefix.
        assert ray.get(workers[0].handle.drain_offload.remote(), timeout=60)
        result = complete(target)
        assert result["choices"][0]["token_ids"] == expected[0]
        assert result["kvstore"]["cached_tokens"]["STORAGE"] == PROMPT_BLOCKS * BLOCK, result["kvstore"]
        print(
            f"\ntier crash: Ray restarted it and the router followed to its new ports {followed_s:.2f} s after the "
            f"kill; its disk blocks were credited again {credited_s:.2f} s after; "
            f"{result['kvstore']['cached_tokens']['STORAGE']} tokens promoted from STORAGE, output exact"
        )
    finally:
        client.close()
        server.stop()
        try:  # the tier as Ray knows it now: the restarted incarnation answers to the same name
            current = tier._replace(handle=ray.get_actor(tier_actor_name(node), namespace=TIER_NAMESPACE))
        except ValueError:
            current = tier
        stop(workers, [current])
