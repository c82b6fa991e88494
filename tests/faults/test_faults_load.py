"""200 concurrent clients against the router over two workers, for a bounded time.

Real HTTP end to end (clients -> router app -> ``kvstore worker`` fronts ->
KV workers), all on 127.0.0.1. Every request sent must get a response, and
a successful one (the fleet is healthy throughout); the workers must have
finished exactly the requests the router answered; afterwards no block is
leaked: every block is free or cached (``kv_usage == 0``) and the pools'
invariants hold. The router's decision time p50/p99 is printed (measured,
not asserted: benchmarks are programs, see ``kvstore bench chaos``).
"""

from __future__ import annotations

import functools
import http.client
import json
import random
import statistics
import threading
import time
from typing import Any

from faults_helpers import BLOCK, HttpFleet, fault_config, tokens, wait_for
from prometheus_client.parser import text_string_to_metric_families

from kvstore.workers.worker import KVWorker

CLIENTS = 200
DURATION_S = 8.0
MAX_PER_CLIENT = 40  # bounded count too: a fast machine does not turn this into a benchmark


def finished_requests(worker: KVWorker) -> int:
    for family in text_string_to_metric_families(worker.metrics_text().decode()):
        for sample in family.samples:
            if sample.name == "kvstore_requests_total" and sample.labels.get("outcome") == "finished":
                return int(sample.value)
    raise AssertionError("kvstore_requests_total{outcome=finished} missing")


def idle(worker: KVWorker) -> bool:
    load = worker.load()
    return load.running == 0 and load.waiting == 0 and load.kv_usage == 0.0


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


class Client(threading.Thread):
    """One user: requests back to back on one keep-alive connection until the deadline."""

    def __init__(self, port: int, seed: int, prefixes: list[list[int]], deadline: float) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.rng = random.Random(seed)
        self.prefixes = prefixes
        self.deadline = deadline
        self.sent = 0
        self.answers: list[tuple[int, dict[str, Any] | str]] = []

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        rng = self.rng
        while time.monotonic() < self.deadline and self.sent < MAX_PER_CLIENT:
            prompt = rng.choice(self.prefixes) + tokens(rng, rng.randint(1, 2 * BLOCK))
            body = json.dumps({"prompt": prompt, "max_tokens": rng.randint(1, 8)})
            self.sent += 1
            try:
                conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
                response = conn.getresponse()
                payload = response.read()
                answer = json.loads(payload)
                if isinstance(answer, dict):  # the router's own facts travel in headers (the body is the replica's)
                    answer["route_s"] = float(response.getheader("x-kvstore-route-s") or "nan")
                self.answers.append((response.status, answer))
            except (OSError, http.client.HTTPException, ValueError) as exc:
                conn.close()
                self.answers.append((-1, f"{type(exc).__name__}: {exc}"))
        conn.close()


def test_200_concurrent_clients_lose_nothing_and_leak_no_block() -> None:
    fleet = HttpFleet(["load-a", "load-b"], fault_config(worker={"max_context": 1024, "max_num_seqs": 64}))
    try:
        rng = random.Random(99)
        prefixes = [tokens(rng, rng.choice([0, 2, 4, 8]) * BLOCK) for _ in range(12)]
        deadline = time.monotonic() + DURATION_S
        clients = [Client(fleet.router.port, seed, prefixes, deadline) for seed in range(CLIENTS)]
        started = time.monotonic()
        for client in clients:
            client.start()
        for client in clients:
            client.join(timeout=DURATION_S + 120)
        elapsed = time.monotonic() - started
        assert not any(c.is_alive() for c in clients), "a client is still waiting for an answer"

        answers = [answer for c in clients for answer in c.answers]
        sent = sum(c.sent for c in clients)
        ok = [body for status, body in answers if status == 200 and isinstance(body, dict)]
        bad = [(status, body) for status, body in answers if status != 200]
        route_s = [body["route_s"] for body in ok]
        ttft_s = [body["kvstore"]["ttft_s"] for body in ok if body["kvstore"]["ttft_s"] is not None]
        cached = sum(body["usage"]["prompt_tokens_details"]["cached_tokens"] for body in ok)
        prompt = sum(body["usage"]["prompt_tokens"] for body in ok)
        per_replica = {name: sum(b["kvstore"]["replica"] == name for b in ok) for name in fleet.workers}
        print(
            f"\nload: {CLIENTS} clients, {sent} requests in {elapsed:.1f} s ({sent / elapsed:.0f}/s), "
            f"{len(ok)} ok, {len(bad)} failed; per replica {per_replica}; cached {cached}/{prompt} prompt tokens; "
            f"decision p50 {1e6 * percentile(route_s, 50):.0f} us, p99 {1e6 * percentile(route_s, 99):.0f} us; "
            f"worker TTFT p50 {percentile(ttft_s, 50):.3f} s, p99 {percentile(ttft_s, 99):.3f} s"
        )
        assert len(answers) == sent, "a request got no answer"
        assert not bad, bad[:3]
        assert all(n > 0 for n in per_replica.values()), per_replica
        # Exactly once: the workers finished as many requests as the router answered.
        assert sum(finished_requests(w) for w in fleet.workers.values()) == len(ok)

        # Nothing leaked: once idle, every block is free or cached, and the bookkeeping holds.
        for worker in fleet.workers.values():
            assert wait_for(functools.partial(idle, worker), timeout=10)
            worker.check_invariants()
            pool = worker.block_pool
            assert all(block.ref_cnt == 0 for block in pool.blocks)
            assert pool.num_free_blocks == pool.num_blocks
            health = worker.health()
            assert (health["running"], health["waiting"]) == (0, 0)
    finally:
        fleet.close()
