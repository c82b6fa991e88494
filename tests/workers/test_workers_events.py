"""A subscriber's view of each worker, rebuilt from KV events, equals the worker's pool.

Locally (a late subscriber that must recover through a snapshot while the
worker keeps serving) and on a local Ray cluster (two KVWorkerActor
actors, subscribed from the driver with kvstore.subscriber.EventListener).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import pytest
from workers_testlib import make_config, shared_prefix_requests

from kvstore.errors import InvalidRequestError
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvstore.subscriber import EventListener
from kvstore.worker_api import GenerateRequest, GenerateResult, WorkerLoad
from kvstore.workers.worker import KVWorker


class PoolView:
    """A BatchSink: producer -> multiset of the block hashes its events say it holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[str, Counter[int]] = {}
        self.errors: list[str] = []
        self.removed: Counter[str] = Counter()  # BlockRemoved hashes per producer

    def apply_batch(self, producer: str, seq: int, batch: EventBatch) -> None:
        with self._lock:
            blocks = self._blocks.setdefault(producer, Counter())
            for event in batch.events:
                if isinstance(event, BlockStored):
                    assert event.medium == "GPU"
                    blocks.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self.removed[producer] += len(event.block_hashes)
                    for block_hash in event.block_hashes:
                        if blocks[block_hash] <= 0:
                            self.errors.append(f"{producer} seq {seq}: removed {block_hash:#x}, which it did not hold")
                        blocks[block_hash] -= 1
                        if blocks[block_hash] <= 0:
                            del blocks[block_hash]
                elif isinstance(event, AllBlocksCleared):
                    blocks.clear()

    def reset_producer(self, producer: str) -> None:
        with self._lock:
            self._blocks[producer] = Counter()

    def view(self, producer: str) -> Counter[int]:
        with self._lock:
            return Counter(self._blocks.get(producer, Counter()))


def wait_until_equal(
    view: Callable[[], Counter[int]], actual: Callable[[], Counter[int]], timeout: float = 15.0
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        want = actual()
        if view() == want:
            return
        if time.monotonic() > deadline:
            got = view()
            raise AssertionError(f"subscriber view differs: missing {want - got}, extra {got - want}")
        time.sleep(0.05)


@pytest.fixture
def listener_view() -> Iterator[tuple[EventListener, PoolView]]:
    """A listener not yet started: tests start it after adding producers.

    (kvstore.subscriber.EventListener busy-spins while it has no producers --
    zmq polls an empty socket set without waiting -- which would starve
    everything else on a 2-core machine.)
    """
    view = PoolView()
    listener = EventListener(view, sync_timeout_s=2.0, poll_interval_s=0.01)
    yield listener, view
    listener.close()


def test_late_subscriber_recovers_by_snapshot_while_the_worker_serves(
    listener_view: tuple[EventListener, PoolView],
) -> None:
    listener, view = listener_view
    # A replay buffer of 4 batches cannot hold the history: the subscriber must take a snapshot.
    config = make_config(num_blocks=64, events=True)
    config = msgspec.structs.replace(config, events=msgspec.structs.replace(config.events, buffer_batches=4))
    small_buffer = KVWorker("w-snap", config)
    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(small_buffer.generate, shared_prefix_requests(21, 24)))
        endpoints = small_buffer.event_endpoints()
        listener.add_producer("w-snap", endpoints.endpoint, endpoints.replay_endpoint)
        listener.start()
        time.sleep(0.2)  # let the SUB socket connect before the next batch
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(small_buffer.generate, shared_prefix_requests(22, 24)))
        wait_until_equal(lambda: view.view("w-snap"), lambda: Counter(small_buffer.cached_hashes()))
        health = {h.producer: h for h in listener.health()}["w-snap"]
        assert health.snapshots >= 1 and health.lossy == 0
        assert not view.errors
    finally:
        small_buffer.shutdown()


@pytest.mark.ray
def test_two_ray_actors_subscriber_view_equals_pool_contents(
    ray_session: Any, listener_view: tuple[EventListener, PoolView]
) -> None:
    import ray

    from kvstore.workers.actor import KVWorkerActor, worker_actor_options

    listener, view = listener_view
    config = make_config(num_blocks=48, events=True)  # small: the workload evicts, so BlockRemoved flows too
    options = worker_actor_options(config)
    assert options["num_gpus"] == (1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0)
    actors = {name: KVWorkerActor.options(**options).remote(name, config) for name in ("ray-a", "ray-b")}
    try:
        for name, actor in actors.items():
            endpoints = ray.get(actor.event_endpoints.remote())
            assert endpoints.endpoint.startswith("tcp://127.0.0.1:")
            listener.add_producer(name, endpoints.endpoint, endpoints.replay_endpoint)
        listener.start()

        requests = shared_prefix_requests(31, 40)
        refs = [actors["ray-a" if i % 3 else "ray-b"].generate.remote(r) for i, r in enumerate(requests)]
        results: list[GenerateResult] = ray.get(refs)
        assert [len(r.output_token_ids) for r in results] == [r.max_tokens for r in requests]
        assert {r.replica for r in results} == {"ray-a", "ray-b"}
        assert sum(r.cached_tokens for r in results) > 0

        for name, actor in actors.items():
            wait_until_equal(lambda n=name: view.view(n), lambda a=actor: Counter(ray.get(a.cached_hashes.remote())))
            ray.get(actor.check_invariants.remote())
            load: WorkerLoad = ray.get(actor.load.remote())
            assert (load.running, load.waiting, load.num_free_blocks) == (0, 0, 48)
        assert not view.errors
        assert sum(view.removed.values()) > 0  # the pools were too small to keep everything

        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(actors["ray-a"].generate.remote(GenerateRequest([1, 99999], 2)))
        assert isinstance(info.value.as_instanceof_cause(), InvalidRequestError)
        assert "out of the vocabulary range" in str(info.value)
        assert len(ray.get(actors["ray-a"].generate.remote(GenerateRequest([1, 2], 2))).output_token_ids) == 2
        assert b"kvstore_gpu_cache_usage_perc" in ray.get(actors["ray-b"].metrics_text.remote())
    finally:
        for actor in actors.values():
            ray.get(actor.shutdown.remote())
            ray.kill(actor)
