"""100 concurrent streams through the router to Ray workers, half of whose clients hang up mid-stream.

Two KVWorkerActor replicas placed by ``kvstore serve``'s launcher on the
session's Ray cluster, the router app on 127.0.0.1. Each client opens a
streamed completion over a raw socket; half read it to ``data: [DONE]``,
half close the connection after the first event. Nothing may leak: every
cancelled request leaves its worker within a few steps (blocks freed,
counted), no request is left running or waiting, the pools' invariants hold,
and every completed stream is whole.
"""

from __future__ import annotations

import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import ray
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.deploy.config import config_from_dict
from kvstore.deploy.launcher import build_service, place_workers
from kvstore.router.app import create_app
from tests.http_servers import ServerThread
from tests.router.router_helpers import wait_for

STREAMS = 100
BLOCK = 16


def _stream(port: int, prompt: list[int], max_tokens: int, hang_up: bool) -> tuple[bool, int]:
    """(whole, events): read to [DONE], or close after the first event when ``hang_up``."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )  # fmt: skip
        received = b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                break
            received += data
            if hang_up and b"data: " in received:
                return False, received.count(b"data: ")
            if b"data: [DONE]" in received:
                break
    return b"data: [DONE]" in received, received.count(b"data: ")


def _counter(page: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_100_streams_half_abandoned_leak_nothing(ray_session: Any) -> None:
    config = config_from_dict(
        {
            "cache": {"block_size": BLOCK},
            "pool": {"num_blocks": 512},
            "worker": {"device": "cpu", "max_context": 1024, "max_num_seqs": 64},
            "router": {"health_interval_s": 0.5},
        }
    )
    workers = place_workers(config, 2, start_index=400)
    service = build_service(config, workers)
    server = ServerThread(create_app(service)).start()
    try:
        rng = random.Random(5)
        prefixes = [[rng.randrange(512) for _ in range(4 * BLOCK)] for _ in range(4)]
        jobs = []
        for i in range(STREAMS):
            prompt = [*prefixes[i % 4], *(rng.randrange(512) for _ in range(rng.randint(1, 20)))]
            hang_up = i % 2 == 0
            jobs.append((prompt, 600 if hang_up else 6, hang_up))
        with ThreadPoolExecutor(STREAMS) as pool:
            results = list(pool.map(lambda job: _stream(server.port, *job), jobs))
        whole = [r for (_, _, hang_up), r in zip(jobs, results, strict=True) if not hang_up]
        assert all(done and events >= 2 for done, events in whole), whole  # held-back text can merge events
        abandoned = sum(hang_up for _, _, hang_up in jobs)

        def idle() -> bool:
            loads = ray.get([w.handle.load.remote() for w in workers], timeout=30)
            return all(load.running == 0 and load.waiting == 0 for load in loads)

        # Each abandoned request asked for 600 tokens: only cancellation can empty the workers this fast.
        assert wait_for(idle, timeout=20), "abandoned requests are still running"
        ray.get([w.handle.check_invariants.remote() for w in workers], timeout=60)
        pages = ray.get([w.handle.metrics_text.remote() for w in workers], timeout=30)
        aborted = sum(_counter(p.decode(), "kvstore_requests_total", outcome="aborted") for p in pages)
        finished = sum(_counter(p.decode(), "kvstore_requests_total", outcome="finished") for p in pages)
        generated = sum(_counter(p.decode(), "kvstore_generation_tokens_total") for p in pages)
        # A request that finished before its client's close arrived is not cancelled; the rest are.
        assert aborted + finished == STREAMS and aborted >= abandoned * 0.9, (aborted, finished)
        assert generated < abandoned * 600 * 0.2, f"{generated} tokens generated for abandoned streams"
        router_page = generate_latest(service.registry).decode()
        assert _counter(router_page, "kvstore_router_requests_total", outcome="cancelled") == aborted
        usage = ray.get([w.handle.load.remote() for w in workers], timeout=30)
        print(
            f"\n{STREAMS} streams: {abandoned} abandoned ({aborted:.0f} cancelled on the workers), "
            f"{generated:.0f} tokens generated in all; pools at {[round(u.kv_usage, 3) for u in usage]} usage"
        )
    finally:
        server.stop()
        for worker in workers:
            ray.kill(worker.handle, no_restart=True)
