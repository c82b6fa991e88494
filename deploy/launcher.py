"""Places a kvstore deployment on Ray and tears it down.

:func:`launch` connects to (or starts) Ray, places the KV workers, waits until
each answers, and builds the router service over them: one replica per
worker, one event stream per worker (and per node tier, when tiers are
enabled). :meth:`Deployment.stop` undoes all of it: actors killed, sockets
closed, and an embedded Ray shut down.

Why uvicorn and not Ray Serve for the HTTP front: the router is one
asyncio app whose index is fed by an in-process listener thread; Ray Serve
would add a proxy hop and replicate the index per Serve replica, each
subscribing to every stream. One router process is enough for the request
rates a prefix router sees (the decision costs tens of microseconds); run
several behind a load balancer for availability.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, NamedTuple

import ray

from kvstore.config import Config
from kvstore.errors import ConfigError
from router.backends import RayActorBackend
from router.protocol import ModelLimits
from router.service import ProducerSpec, ReplicaSpec, RouterService
from router.tokenizer import load_tokenizer
from workers.actor import KVWorkerActor, worker_actor_options
from workers.api import GenerateRequest

logger = logging.getLogger(__name__)

NAMESPACE = "kvstore"


class PlacedWorker(NamedTuple):
    name: str
    handle: Any
    node: str
    endpoint: str
    replay_endpoint: str


def default_num_workers(config: Config) -> int:
    """``worker.num_workers``, or (0) one per GPU in the cluster, else one per two CPUs, 1..8."""
    if config.worker.num_workers:
        return config.worker.num_workers
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    if gpus:
        return gpus
    return max(1, min(8, int(resources.get("CPU", os.cpu_count() or 2)) // 2))


class PlacedTier(NamedTuple):
    node: str
    handle: Any
    endpoint: str
    replay_endpoint: str


class Deployment:
    """A running deployment: tiers, workers, the router service, and whether we own Ray."""

    def __init__(self, config: Config, workers: list[PlacedWorker], service: RouterService, owns_ray: bool) -> None:
        self.config = config
        self.tiers: list[PlacedTier] = []
        self.workers = workers
        self.service = service
        self.owns_ray = owns_ray

    def stop(self) -> None:
        """Kill the actors (their sockets and shared memory go with them) and shut an embedded Ray down."""
        for worker in self.workers:
            try:
                ray.get(worker.handle.shutdown.remote(), timeout=10)
            except Exception as exc:  # a dead actor cannot shut down; killing it below is enough
                logger.info("worker %s did not shut down cleanly: %s", worker.name, exc)
            ray.kill(worker.handle, no_restart=True)
        self.workers = []
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


def launch(config: Config, *, address: str | None = None, num_workers: int | None = None) -> Deployment:
    """Start workers on Ray (embedded when ``address`` is None) and a router service over them."""
    owns_ray = not ray.is_initialized() and address is None
    if not ray.is_initialized():
        ray.init(
            address=address,
            namespace=NAMESPACE,
            include_dashboard=False,
            configure_logging=False,
            log_to_driver=False,
        )
    try:
        count = num_workers or default_num_workers(config)
        workers = place_workers(config, count)
        service = build_service(config, workers)
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
    return Deployment(config, workers, service, owns_ray)


def place_workers(config: Config, count: int, *, start_index: int = 0, timeout_s: float = 120.0) -> list[PlacedWorker]:
    """Create ``count`` worker actors spread over the cluster and wait until each answers."""
    if count < 1:
        raise ConfigError(f"need at least one worker, got {count}")
    options = worker_actor_options(config)
    handles = []
    names = [f"worker-{start_index + i}" for i in range(count)]
    for name in names:
        handle = KVWorkerActor.options(  # type: ignore[attr-defined]
            name=f"kvstore-{name}", namespace=NAMESPACE, scheduling_strategy="SPREAD", **options
        ).remote(name, config)
        handles.append(handle)
    deadline = time.monotonic() + timeout_s
    placed = []
    for name, handle in zip(names, handles, strict=True):
        remaining = max(1.0, deadline - time.monotonic())
        endpoints, health = ray.get([handle.event_endpoints.remote(), handle.health.remote()], timeout=remaining)
        placed.append(PlacedWorker(name, handle, health["node_ip"], endpoints.endpoint, endpoints.replay_endpoint))
    return placed


def build_service(config: Config, workers: list[PlacedWorker]) -> RouterService:
    info = ray.get(workers[0].handle.info.remote(), timeout=60)
    limits = ModelLimits(info.vocab_size, info.max_context)
    service = RouterService(config, load_tokenizer(config.router.tokenizer), limits)
    for worker in workers:
        service.add_replica(replica_spec(worker))
    return service


def replica_spec(worker: PlacedWorker) -> ReplicaSpec:
    backend = RayActorBackend(worker.name, worker.handle, GenerateRequest)
    producer = ProducerSpec(f"{worker.name}/gpu", worker.endpoint, worker.replay_endpoint)
    return ReplicaSpec(worker.name, worker.node, backend, producer)


async def wait_until_subscribed(service: RouterService, timeout_s: float = 10.0) -> bool:
    """True once every producer has applied at least its first sync (or nothing was published yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = service.listener.health()
        if health and all(h.syncing is None for h in health):
            return True
        await asyncio.sleep(0.05)
    return False
