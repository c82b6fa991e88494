"""Real components for the fault tests (a uniquely named module: tests/ is not a package).

- :class:`HttpFleet`: KV workers (real model, real paged pool, real ZeroMQ
  publishers) behind the OpenAI-compatible app of ``kvstore worker``, and a
  :class:`RouterService` over them behind the router app -- every socket on
  127.0.0.1, free ports. The service is built here rather than from a
  ``[[router.replicas]]`` config so a test can give a replica's stream a
  CURVE key or point it at a lossy proxy
  (:class:`kvstore.benchmarks.lossy_proxy.LossyProxy`).
- :class:`PoolView`: an independent event subscriber's sink (what
  ``kvstore events tail`` sees), to check the events themselves.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import psutil

from kvstore.deploy.config import Config, config_from_dict
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvstore.openai.protocol import ModelLimits
from kvstore.openai.tokenizer import load_tokenizer
from kvstore.router.app import create_app
from kvstore.router.backends import HttpBackend
from kvstore.router.index import PrefixIndex
from kvstore.router.service import ProducerSpec, ReplicaSpec, RouterService
from kvstore.worker_api import GenerateRequest
from kvstore.workers.http import create_worker_app
from kvstore.workers.worker import KVWorker
from tests.http_servers import ServerThread

BLOCK = 16
VOCAB = 512


def wait_for(
    predicate: Callable[[], bool],
    timeout: float = 20.0,
    interval: float = 0.02,
    tick: Callable[[], object] | None = None,
) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass (bounded: never hangs); ``tick`` runs
    between polls (a producer's next batch, say)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if tick is not None:
            tick()
        time.sleep(interval)
    return predicate()


def fault_config(**sections: dict[str, Any]) -> Config:
    """The toy model on the CPU, a fast health loop; ``sections`` override per section."""
    tree: dict[str, dict[str, Any]] = {
        "cache": {"block_size": BLOCK},
        "pool": {"num_blocks": 256},
        "worker": {"device": "cpu", "max_context": 1024},
        "router": {"health_interval_s": 0.2, "unhealthy_after": 1, "vocab_size": VOCAB, "max_context": 1024},
    }
    for section, values in sections.items():
        tree[section] = {**tree.get(section, {}), **values}
    return config_from_dict(tree)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


class HttpFleet:
    """Workers behind HTTP, a RouterService over them, the router app; all on 127.0.0.1."""

    def __init__(
        self,
        names: list[str],
        config: Config | None = None,
        *,
        curve_server_key: str | None = None,
        events_via: Callable[[str, str], str] | None = None,
    ) -> None:
        """``events_via(name, endpoint)`` may return another endpoint for the router to subscribe to."""
        self.config = config or fault_config()
        self.workers = {name: KVWorker(name, self.config) for name in names}
        self.servers = {name: ServerThread(create_worker_app(w)).start() for name, w in self.workers.items()}
        info = next(iter(self.workers.values())).info()
        self.service = RouterService(
            self.config, load_tokenizer(""), ModelLimits(info.vocab_size, info.max_context), seed=0
        )
        for name, worker in self.workers.items():
            ep = worker.event_endpoints()
            endpoint = ep.endpoint if events_via is None else events_via(name, ep.endpoint)
            backend = HttpBackend(name, self.servers[name].url, timeout_s=self.config.router.request_timeout_s)
            events = ProducerSpec(f"{name}/events", endpoint, ep.replay_endpoint, curve_server_key=curve_server_key)
            self.service.add_replica(ReplicaSpec(name, None, backend, events))
        self.router = ServerThread(create_app(self.service)).start()
        self.client = httpx.Client(base_url=self.router.url, timeout=30)

    def complete(self, prompt: Any, max_tokens: int = 2, **extra: Any) -> httpx.Response:
        return self.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **extra})

    def route(self, prompt: Any, **extra: Any) -> dict[str, Any]:
        response = self.client.post("/route", json={"prompt": prompt, "max_tokens": 1, **extra})
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def close(self) -> None:
        self.client.close()
        self.router.stop()
        for name, server in self.servers.items():
            server.stop()
            self.workers[name].shutdown()


class PoolView:
    """A BatchSink: per producer, the multiset of block hashes its events say it holds, and every stored hash."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[str, Counter[int]] = {}
        self.stored: dict[str, set[int]] = {}
        self.batches = 0

    def apply_batch(self, producer: str, seq: int, batch: EventBatch) -> None:
        with self._lock:
            self.batches += 1
            blocks = self._blocks.setdefault(producer, Counter())
            for event in batch.events:
                if isinstance(event, BlockStored):
                    blocks.update(event.block_hashes)
                    self.stored.setdefault(producer, set()).update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    blocks.subtract(event.block_hashes)
                    blocks += Counter()  # drop the zeros
                elif isinstance(event, AllBlocksCleared):
                    blocks.clear()

    def reset_producer(self, producer: str) -> None:
        with self._lock:
            self._blocks[producer] = Counter()

    def view(self, producer: str) -> Counter[int]:
        with self._lock:
            return Counter(self._blocks.get(producer, Counter()))


def held(index: PrefixIndex, producer: str) -> Counter[int]:
    """What the index believes ``producer`` holds on GPU."""
    return index.dump().get(producer, {}).get("GPU", Counter())


def pool_state(worker: KVWorker) -> Counter[int]:
    """The worker's true cache: external hash -> number of cached blocks holding it."""
    return Counter(worker.cached_hashes())


class Traffic:
    """Keeps a worker busy from a background thread: ``concurrency`` requests in flight, until stopped.

    Prompts draw on a few shared prefixes (hits, duplicates) plus random tails
    (new blocks), so every step changes the pool and publishes a batch. Bounded:
    stops by itself after ``max_requests``.
    """

    def __init__(
        self, worker: KVWorker, seed: int, *, concurrency: int = 8, max_requests: int = 20_000, block: int = 4
    ) -> None:
        self.worker = worker
        self.completed = 0
        self.failed = 0
        self._rng = random.Random(seed)
        self._prefixes = [tokens(self._rng, 3 * block) for _ in range(6)]
        self._concurrency = concurrency
        self._max = max_requests
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"traffic-{worker.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng = self._rng
        sent = 0
        while not self._stop.is_set() and sent < self._max:
            batch = [
                GenerateRequest(rng.choice(self._prefixes) + tokens(rng, rng.randint(1, 9)), rng.randint(1, 6))
                for _ in range(self._concurrency)
            ]
            futures = [self.worker.submit(request) for request in batch]
            sent += len(futures)
            for future in futures:
                try:
                    future.result(timeout=30)
                    self.completed += 1
                except Exception:
                    self.failed += 1

    def stop(self) -> None:
        """Stop sending; returns once every request sent has finished (the pool is then quiet)."""
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "traffic did not drain"


_PUBLISHER_PROCESS = """
import json, sys, threading, time
from kvstore.config import EventsConfig
from kvstore.events import BlockStored
from kvstore.publisher import ZmqEventPublisher

prefill, interval_s, tokens = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
publisher = ZmqEventPublisher(EventsConfig())

def batch(i):
    return [BlockStored(block_hashes=list(range(i * 16, i * 16 + 16)), parent_block_hash=None,
                        token_ids=list(range(tokens)), block_size=16, lora_id=None, medium="GPU", lora_name=None)]

for i in range(prefill):
    publisher.publish(batch(i))
assert publisher.flush(60)
print(json.dumps([publisher.endpoint, publisher.replay_endpoint]), flush=True)
deadline = time.monotonic() + 120  # bounded even if the parent never says stop
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
i = prefill
while not stop.is_set() and time.monotonic() < deadline:
    publisher.publish(batch(i))
    i += 1
    time.sleep(interval_s)
"""


class PublisherProcess:
    """A ZmqEventPublisher with the default EventsConfig in its own process, as a worker runs it.

    It first publishes ``prefill`` batches (so its replay buffer is full and
    every replay is long), then one batch every ``interval_s`` until
    :meth:`stop` (or 120 s). Batch ``i`` stores 16 blocks with ``tokens``
    token ids. Its own process, so a flood that starves or bloats it can be
    measured (``rss``) and ended by killing it.
    """

    def __init__(self, *, prefill: int = 10_000, interval_s: float = 0.01, tokens: int = 256) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _PUBLISHER_PROCESS, str(prefill), str(interval_s), str(tokens)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.stop()
            raise RuntimeError("the publisher process did not start")
        self.endpoint, self.replay_endpoint = json.loads(line)
        self.interval_s = interval_s

    def rss(self) -> int:
        """Resident memory of the publisher process, bytes."""
        return int(psutil.Process(self.process.pid).memory_info().rss)

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
