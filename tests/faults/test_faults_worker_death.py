"""A Ray worker killed in the middle of a burst of requests, behind the real router over HTTP.

Two KVWorkerActor replicas on the session's local Ray cluster, placed and
wired by the launcher's own code (place_workers, build_service), the router
app under uvicorn on 127.0.0.1. One worker is killed (``ray.kill``) while it
runs requests. Every request must end -- no client waits forever -- and,
since a healthy replica remains, every one must succeed: the ones the dead
worker held are retried once on the other. The dead worker's blocks leave
the index within 2 s, and a replacement worker rejoins and is routed to.
"""

from __future__ import annotations

import functools
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import ray
from faults_helpers import BLOCK, HttpFleet, Traffic, fault_config, held, pool_state, tokens, wait_for

from kvstore.deploy.launcher import build_service, place_workers, replica_spec
from kvstore.hashing import to_external
from kvstore.router.app import create_app
from kvstore.workers.http import create_worker_app
from tests.http_servers import ServerThread

CONCURRENT = 40
CLIENT_TIMEOUT_S = 30.0


def post(client: httpx.Client, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = client.post("/v1/completions", json=body)
    return response.status_code, response.json()


def idle(handle: Any) -> bool:
    """No request holds a block: every block is free or cached."""
    load = ray.get(handle.load.remote(), timeout=5)
    return bool(load.running == 0 and load.waiting == 0 and load.kv_usage == 0.0)


@pytest.mark.ray
def test_worker_killed_mid_load_loses_no_request(ray_session: Any) -> None:
    config = fault_config(router={"health_interval_s": 0.25, "unhealthy_after": 2})
    workers = place_workers(config, 2, start_index=300)
    service = build_service(config, workers)
    server = ServerThread(create_app(service)).start()
    client = httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S, limits=httpx.Limits(max_connections=64))
    replacement = None
    try:
        rng = random.Random(17)
        prefix = tokens(rng, 8 * BLOCK)
        status, first = post(client, {"prompt": [*prefix, 1, 2], "max_tokens": 2})
        assert status == 200, first
        victim = next(w for w in workers if w.name == first["kvstore"]["replica"])
        survivor = next(w for w in workers if w is not victim)
        hashes = [to_external(h) for h in service.hasher.hash_blocks(prefix)]
        assert wait_for(lambda: service.index.lookup(hashes).get(victim.name, (0,))[0] == 8, timeout=10)

        # Half the burst shares the victim's cached prefix (routed to it), half is fresh (spread).
        bodies = [
            {"prompt": [*prefix, *tokens(rng, 8)] if i % 2 else tokens(rng, 6 * BLOCK), "max_tokens": 24}
            for i in range(CONCURRENT)
        ]
        with ThreadPoolExecutor(CONCURRENT) as pool:
            futures = [pool.submit(post, client, body) for body in bodies]
            assert wait_for(lambda: ray.get(victim.handle.load.remote(), timeout=5).running > 0, timeout=20)
            killed_at = time.monotonic()
            ray.kill(victim.handle, no_restart=True)
            # The router drops the dead worker's blocks: no prefix is routed to it any more.
            assert wait_for(lambda: victim.name not in service.index.lookup(hashes), timeout=5, interval=0.005)
            removed_s = time.monotonic() - killed_at
            # Bounded: a request that hangs fails the test instead of hanging it.
            results = [f.result(timeout=CLIENT_TIMEOUT_S + 10) for f in futures]
        burst_s = time.monotonic() - killed_at

        failed = [(status, body) for status, body in results if status != 200]
        for status, body in failed:  # any failure must be a clear error, never a hang or a bare 500
            assert status in (500, 503) and body["error"]["message"], (status, body)
        ok = [body for status, body in results if status == 200]
        retried = [body for body in ok if body["kvstore"]["retried"]]
        print(
            f"\nworker death: {len(ok)}/{CONCURRENT} ok, {len(retried)} retried on {survivor.name}, "
            f"{len(failed)} failed; blocks gone from the index {removed_s:.3f} s after the kill; "
            f"burst done {burst_s:.2f} s after it"
        )
        assert not failed, f"{len(failed)} requests were lost though {survivor.name} was healthy: {failed[:2]}"
        assert retried, "the victim was killed while running requests: some must have been retried"
        assert all(body["kvstore"]["replica"] == survivor.name for body in retried)
        assert removed_s <= 2.0
        assert wait_for(lambda: client.get("/healthz").json()["healthy_replicas"] == 1, timeout=5)
        assert set(client.post("/route", json={"prompt": prefix, "max_tokens": 1}).json()["scores"]) == {survivor.name}

        # A replacement joins (launcher code again) and takes traffic: concurrent requests spread over both.
        (replacement,) = place_workers(config, 1, start_index=310)
        service.add_replica(replica_spec(replacement, config))
        assert wait_for(lambda: client.get("/healthz").json()["healthy_replicas"] == 2, timeout=10)
        fresh = [tokens(rng, 4 * BLOCK) for _ in range(8)]
        with ThreadPoolExecutor(len(fresh)) as pool:
            answers = list(pool.map(lambda p: post(client, {"prompt": p, "max_tokens": 16}), fresh))
        assert all(status == 200 for status, _ in answers), answers
        served = [(p, body) for p, (_, body) in zip(fresh, answers, strict=True)]
        on_new = [p for p, body in served if body["kvstore"]["replica"] == replacement.name]
        assert on_new, "the replacement worker took none of the requests"
        # ...and its events reach the index: its cached prefix is routed back to it.
        probe = {"prompt": [*on_new[0], 5], "max_tokens": 1}
        assert wait_for(lambda: client.post("/route", json=probe).json()["replica"] == replacement.name, timeout=5)

        for worker in (survivor, replacement):
            assert wait_for(functools.partial(idle, worker.handle), timeout=10)
            ray.get(worker.handle.check_invariants.remote(), timeout=30)
    finally:
        client.close()
        server.stop()
        for w in [*workers, *([replacement] if replacement is not None else [])]:
            ray.kill(w.handle, no_restart=True)


def test_worker_whose_engine_died_behind_a_live_http_front_stays_out_of_routing() -> None:
    """The engine stops but the process (and its HTTP front) lives on, as when a step loop dies.

    The router's health poll must see it as down -- not mark it healthy again
    on every poll, resubscribe to it and send it requests that fail.
    """
    fleet = HttpFleet(["engine-ok", "engine-dead"])
    try:
        rng = random.Random(23)
        assert all(fleet.complete(tokens(rng, 2 * BLOCK)).status_code == 200 for _ in range(4))
        fleet.workers["engine-dead"].shutdown()  # its uvicorn front keeps answering, 503
        # Until the next health poll a request it gets is answered 503 and tried on the other replica (a 503 alone
        # does not mark a replica: a draining server says it too); the poll then takes it out of routing.
        assert wait_for(lambda: fleet.client.get("/healthz").json()["healthy_replicas"] == 1, timeout=5)
        seen_healthy: set[int] = set()
        retried = 0
        deadline = time.monotonic() + 2.0  # ten health polls
        while time.monotonic() < deadline:
            response = fleet.complete(tokens(rng, 2 * BLOCK))
            assert response.status_code == 200, response.text
            assert response.headers["x-kvstore-replica"] == "engine-ok"
            retried += response.headers["x-kvstore-retried"] == "true"
            seen_healthy.add(fleet.client.get("/healthz").json()["healthy_replicas"])
            time.sleep(0.05)
        assert seen_healthy == {1}, f"the dead engine flapped back into routing: {seen_healthy}"
        assert retried == 0, f"{retried} requests were sent to the dead engine after it left routing"
    finally:
        fleet.close()


def test_replica_marked_unhealthy_while_publishing_leaves_no_block_and_resyncs_exactly() -> None:
    """Its HTTP front goes away (health polls fail) while the worker keeps serving and publishing.

    Batches still in flight to the router when it marks the replica unhealthy
    must not put blocks back into the index afterwards; when the front comes
    back, the resubscription must rebuild exactly the worker's pool.
    """
    config = fault_config(cache={"block_size": 4}, pool={"num_blocks": 64}, worker={"max_context": 256})
    fleet = HttpFleet(["busy", "idle"], config)
    busy = fleet.workers["busy"]
    traffic = Traffic(busy, seed=5)  # straight into the worker: it publishes a batch nearly every step
    try:
        assert wait_for(lambda: len(held(fleet.service.index, "busy/events")) > 0, timeout=10)
        port = fleet.servers["busy"].port
        fleet.servers["busy"].stop()
        assert wait_for(lambda: fleet.client.get("/healthz").json()["healthy_replicas"] == 1, timeout=5)
        stale = []
        for _ in range(25):  # half a second of the worker publishing as fast as it can
            stale.append(sum(held(fleet.service.index, "busy/events").values()))
            time.sleep(0.02)
        assert not any(stale[5:]), f"blocks of an unhealthy replica came back into the index: {stale}"

        front = ServerThread(create_worker_app(busy))
        front.server.config.port = port  # the router knows the replica by this URL
        fleet.servers["busy"] = front.start()
        assert wait_for(lambda: fleet.client.get("/healthz").json()["healthy_replicas"] == 2, timeout=5)
        time.sleep(0.3)
        traffic.stop()
        assert wait_for(lambda: held(fleet.service.index, "busy/events") == pool_state(busy), timeout=5), (
            len(held(fleet.service.index, "busy/events")), len(pool_state(busy))
        )  # fmt: skip
        fleet.service.index.check_invariants()
    finally:
        traffic.stop()
        fleet.close()
