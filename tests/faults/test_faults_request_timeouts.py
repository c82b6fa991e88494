"""Clients that hang up and workers that hang, through the router to Ray workers (the ``kvstore serve`` path).

Two KVWorkerActor replicas placed and wired by the launcher on the session's
Ray cluster, the router app under uvicorn on 127.0.0.1.

- 64 requests for 2,000 tokens each, abandoned at once (half plain, their
  clients timing out; half streamed, closed after the first event): a
  1-token probe sent right after must be answered promptly, and the workers
  must be idle within seconds -- the abandoned work is cancelled, not run.
- A worker that hangs (its process stopped with SIGSTOP) while it holds a
  request: ``router.request_timeout_s`` must reach the Ray backend, so the
  router gives it up after that long and retries on the other worker,
  instead of waiting for the Ray backend's old hard-coded 300 s.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import httpx
import pytest
import ray
from faults_helpers import BLOCK, fault_config, tokens, wait_for
from prometheus_client.parser import text_string_to_metric_families

from kvstore.deploy.launcher import PlacedWorker, build_service, place_workers
from kvstore.hashing import to_external
from kvstore.router.app import create_app
from kvstore.router.service import RouterService
from tests.http_servers import ServerThread

ABANDONED = 64
LONG = 2000
REQUEST_TIMEOUT_S = 2.0


class Fleet(NamedTuple):
    workers: list[PlacedWorker]
    service: RouterService
    url: str
    port: int


@pytest.fixture(scope="module")
def fleet(ray_session: Any) -> Iterator[Fleet]:
    config = fault_config(
        pool={"num_blocks": 512},
        worker={"max_context": 4096, "max_num_seqs": 64},
        router={"max_context": 4096, "request_timeout_s": REQUEST_TIMEOUT_S, "health_interval_s": 0.5},
    )
    workers = place_workers(config, 2, start_index=600)
    service = build_service(config, workers)
    server = ServerThread(create_app(service)).start()
    try:
        yield Fleet(workers, service, server.url, server.port)
    finally:
        server.stop()
        for worker in workers:
            ray.kill(worker.handle, no_restart=True)


def _abandon_plain(url: str, body: dict[str, Any]) -> None:
    with pytest.raises(httpx.ReadTimeout):  # the client gives up: its connection closes
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(30.0, read=1.0))


def _abandon_stream(port: int, body: dict[str, Any]) -> None:
    data = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode() + data
        )  # fmt: skip
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(65536)
            assert chunk, "the stream ended before its first event"
            received += chunk


def _idle(workers: list[PlacedWorker]) -> bool:
    loads = ray.get([w.handle.load.remote() for w in workers], timeout=30)
    return all(load.running == 0 and load.waiting == 0 for load in loads)


@pytest.mark.ray
@pytest.mark.timeout(150)
def test_64_abandoned_long_requests_do_not_delay_a_probe(fleet: Fleet) -> None:
    rng = random.Random(64)
    bodies = [{"prompt": tokens(rng, 2 * BLOCK), "max_tokens": LONG, "ignore_eos": True} for _ in range(ABANDONED)]
    started = time.monotonic()
    with ThreadPoolExecutor(ABANDONED) as pool:
        jobs = [
            pool.submit(_abandon_plain, fleet.url, body) if i % 2 else pool.submit(_abandon_stream, fleet.port, body)
            for i, body in enumerate(bodies)
        ]
        for job in jobs:
            job.result(timeout=60)
    abandoned_s = time.monotonic() - started

    sent = time.monotonic()
    probe = httpx.post(f"{fleet.url}/v1/completions", json={"prompt": tokens(rng, BLOCK), "max_tokens": 1}, timeout=60)
    probe_s = time.monotonic() - sent
    assert probe.status_code == 200, probe.text
    idle_at = time.monotonic()
    assert wait_for(lambda: _idle(fleet.workers), timeout=20), "abandoned requests are still running"
    idle_s = time.monotonic() - idle_at + probe_s
    generated = sum(
        sample.value
        for page in ray.get([w.handle.metrics_text.remote() for w in fleet.workers], timeout=30)
        for family in text_string_to_metric_families(page.decode())
        for sample in family.samples
        if sample.name == "kvstore_generation_tokens_total"
    )
    print(
        f"\n{ABANDONED} requests for {LONG} tokens abandoned within {abandoned_s:.1f} s; a 1-token probe answered "
        f"{probe_s:.3f} s later; workers idle {idle_s:.2f} s after the abandonment; {generated:.0f} tokens generated "
        f"(of {ABANDONED * LONG} asked)"
    )
    assert probe_s < 5.0, f"the probe waited {probe_s:.1f} s behind abandoned work"
    # Uncancelled, all 128,000 tokens run. Cancelled, what runs is what the workers generate while the 64
    # clients are still hanging up: about 1,300 tokens on a quiet 2-core machine, ~14,000 under a full suite's load.
    assert generated < ABANDONED * LONG * 0.25
    ray.get([w.handle.check_invariants.remote() for w in fleet.workers], timeout=60)


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_hung_worker_is_given_up_after_the_configured_request_timeout(fleet: Fleet) -> None:
    rng = random.Random(7)
    prefix = tokens(rng, 6 * BLOCK)
    client = httpx.Client(base_url=fleet.url, timeout=20.0)  # far below the old 300 s, far above the timeout
    first = client.post("/v1/completions", json={"prompt": [*prefix, 1], "max_tokens": 1})
    assert first.status_code == 200, first.text
    victim = next(w for w in fleet.workers if w.name == first.json()["kvstore"]["replica"])
    hashes = [to_external(h) for h in fleet.service.hasher.hash_blocks(prefix)]
    assert wait_for(lambda: fleet.service.index.lookup(hashes).get(victim.name, (0,))[0] == 6, timeout=10)
    pid = ray.get(victim.handle.__ray_call__.remote(lambda actor: os.getpid()), timeout=10)
    os.kill(pid, signal.SIGSTOP)  # hung: alive to Ray and to the kernel, answering nothing
    try:
        sent = time.monotonic()
        response = client.post("/v1/completions", json={"prompt": [*prefix, 2], "max_tokens": 4})
        answered_s = time.monotonic() - sent
        print(f"\nhung worker: answered {answered_s:.2f} s after sending (request_timeout_s {REQUEST_TIMEOUT_S})")
        assert response.status_code == 200, response.text
        assert response.json()["kvstore"]["retried"] is True
        assert response.json()["kvstore"]["replica"] != victim.name
        assert REQUEST_TIMEOUT_S <= answered_s < REQUEST_TIMEOUT_S + 5.0
    finally:
        os.kill(pid, signal.SIGCONT)
        client.close()
    assert wait_for(lambda: fleet.service.healthy_count() == 2, timeout=20), "the worker did not come back"
