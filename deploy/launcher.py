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
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstore.deploy.config import Config
from kvstore.errors import ConfigError
from kvstore.openai.protocol import ModelLimits
from kvstore.openai.tokenizer import load_tokenizer
from kvstore.router.backends import RayActorBackend
from kvstore.router.service import ProducerSpec, ReplicaSpec, RouterService
from kvstore.tiers.actor import TIER_NAMESPACE, get_or_create_tier_actor, tier_actor_name
from kvstore.workers.actor import KVWorkerActor, routable_endpoint, worker_actor_options
from kvstore.workers.config import cache_identity

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
    ip: str  # the node's address: where its "0.0.0.0" endpoints are reached from other nodes


class Deployment:
    """A running deployment: tiers, workers, the router service, and whether we own Ray."""

    def __init__(self, config: Config, workers: list[PlacedWorker], service: RouterService, owns_ray: bool) -> None:
        self.config = config
        self.tiers: list[PlacedTier] = []
        self.workers = workers
        self.service = service
        self.owns_ray = owns_ray

    def stop(self) -> None:
        """Shut workers then tiers down (sockets closed, arenas unlinked), kill them, stop an embedded Ray."""
        for actor in [*(w.handle for w in self.workers), *(t.handle for t in self.tiers)]:
            try:
                ray.get(actor.shutdown.remote(), timeout=10)
            except Exception as exc:  # a dead actor cannot shut down; killing it below is enough
                logger.info("actor did not shut down cleanly: %s", exc)
        _kill([w.handle for w in self.workers] + [t.handle for t in self.tiers])
        self.workers = []
        self.tiers = []
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


def launch(config: Config, *, address: str | None = None, num_workers: int | None = None) -> Deployment:
    """Start tiers (one per node) and workers on Ray (embedded when ``address`` is None) and a router over them."""
    owns_ray = not ray.is_initialized() and address is None
    if not ray.is_initialized():
        ray.init(
            address=address,
            namespace=NAMESPACE,
            include_dashboard=False,
            configure_logging=False,
            log_to_driver=False,
        )
    tiers: dict[str, PlacedTier] = {}
    workers: list[PlacedWorker] = []
    try:
        if config.tiers.enabled:
            tiers = place_tiers(config)
        count = num_workers or default_num_workers(config)
        workers = place_workers(config, count, tiers=tiers)
        service = build_service(config, workers, tiers)
    except BaseException:
        _kill([w.handle for w in workers] + [t.handle for t in tiers.values()])
        if owns_ray:
            ray.shutdown()
        raise
    deployment = Deployment(config, workers, service, owns_ray)
    deployment.tiers = list(tiers.values())
    return deployment


def alive_nodes(*, gpu_first: bool) -> list[str]:
    """Node ids of the live Ray nodes, GPU nodes first when asked, then in a stable order."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    nodes.sort(key=lambda n: (-(n.get("Resources", {}).get("GPU", 0) > 0) if gpu_first else 0, n["NodeID"]))
    return [n["NodeID"] for n in nodes]


def place_tiers(config: Config, *, timeout_s: float = 120.0) -> dict[str, PlacedTier]:
    """One tier actor per live node (created, or found by name), keyed by node id."""
    identity = cache_identity(config)
    handles = {
        node: get_or_create_tier_actor(config.tiers, identity, events=config.events, node_id=node)
        for node in alive_nodes(gpu_first=False)
    }
    endpoints = ray.get([h.event_endpoints.remote() for h in handles.values()], timeout=timeout_s)
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    ips = [address[node] for node in handles]
    return {
        node: PlacedTier(
            node,
            handle,
            routable_endpoint(ep.endpoint, ip),
            routable_endpoint(ep.replay_endpoint, ip),
            ip,
        )
        for (node, handle), ep, ip in zip(handles.items(), endpoints, ips, strict=True)
    }


def place_workers(
    config: Config,
    count: int,
    *,
    tiers: dict[str, PlacedTier] | None = None,
    start_index: int = 0,
    timeout_s: float = 120.0,
) -> list[PlacedWorker]:
    """Create ``count`` worker actors, pinned round robin over the live nodes (GPU nodes first).

    With ``tiers`` each worker spills to and promotes from its node's tier actor.
    """
    if count < 1:
        raise ConfigError(f"need at least one worker, got {count}")
    options = worker_actor_options(config)
    nodes = alive_nodes(gpu_first=options.get("num_gpus", 0) > 0)
    handles = []
    names = [f"worker-{start_index + i}" for i in range(count)]
    for index, name in enumerate(names):
        node = nodes[index % len(nodes)]
        tier = tiers[node].handle if tiers and node in tiers else None
        handle = KVWorkerActor.options(  # type: ignore[attr-defined]
            name=f"kvstore-{name}",
            namespace=NAMESPACE,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            **options,
        ).remote(name, config, tier)
        handles.append(handle)
    deadline = time.monotonic() + timeout_s
    placed = []
    for name, handle in zip(names, handles, strict=True):
        remaining = max(1.0, deadline - time.monotonic())
        endpoints, health = ray.get([handle.event_endpoints.remote(), handle.health.remote()], timeout=remaining)
        placed.append(PlacedWorker(name, handle, health["node_id"], endpoints.endpoint, endpoints.replay_endpoint))
    return placed


def _kill(handles: list[Any]) -> None:
    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception as exc:  # already dead: nothing left to release
            logger.info("kill failed: %s", exc)


def build_service(
    config: Config, workers: list[PlacedWorker], tiers: dict[str, PlacedTier] | None = None
) -> RouterService:
    """A router over the workers; each node's tier stream counts for that node's workers."""
    info = ray.get(workers[0].handle.info.remote(), timeout=60)
    limits = ModelLimits(info.vocab_size, info.max_context)
    # The workers' own tokenizer unless the router is given one: a checkpoint's directory, else bytes.
    tokenizer = load_tokenizer(config.router.tokenizer or config.worker.model)
    service = RouterService(config, tokenizer, limits, model_name=info.model_name)
    for tier in (tiers or {}).values():
        producer = ProducerSpec(
            f"tier-{tier.node[:12]}", tier.endpoint, tier.replay_endpoint, curve_server_key=curve_server_key(config)
        )
        service.add_tier_producer(tier.node, producer, locate=_tier_locator(tier))
        service.add_metrics_source(producer.name, _tier_text_fetcher(tier.node))
    for worker in workers:
        service.add_replica(replica_spec(worker, curve_server_key=curve_server_key(config)))
    return service


_TIER_CALL_S = 5.0  # deadline of one call to a tier actor from the router's health poll


async def _tier_actor(node: str) -> Any:
    """The node's tier actor as Ray knows it now (restarted or re-created ones included)."""
    return await asyncio.to_thread(ray.get_actor, tier_actor_name(node), namespace=TIER_NAMESPACE)


def _tier_locator(tier: PlacedTier) -> Callable[[], Awaitable[tuple[str, str | None]]]:
    """Where the node's tier publishes now, as the router reaches it (RouterService.poll_tiers)."""

    async def locate() -> tuple[str, str | None]:
        handle = await _tier_actor(tier.node)
        endpoints = await asyncio.wait_for(handle.event_endpoints.remote(), _TIER_CALL_S)
        if endpoints is None:
            raise RuntimeError(f"the tier of node {tier.node} publishes no KV events")
        return (
            routable_endpoint(endpoints.endpoint, tier.ip),
            routable_endpoint(endpoints.replay_endpoint, tier.ip),
        )

    return locate


def _tier_text_fetcher(node: str) -> Callable[[], Awaitable[str]]:
    async def fetch() -> str:
        handle = await _tier_actor(node)
        page = await asyncio.wait_for(handle.metrics_text.remote(), _TIER_CALL_S)
        return page.decode() if isinstance(page, bytes) else str(page)

    return fetch


def curve_server_key(config: Config) -> str | None:
    """The key the router must present to the deployment's publishers: they all run with ``config.events``."""
    return config.events.curve_public_key or None


def replica_spec(worker: PlacedWorker, *, curve_server_key: str | None = None) -> ReplicaSpec:
    """The router's view of a placed worker; ``curve_server_key`` when its publisher runs with CURVE."""
    backend = RayActorBackend(worker.name, worker.handle)
    producer = ProducerSpec(
        f"{worker.name}/gpu", worker.endpoint, worker.replay_endpoint, curve_server_key=curve_server_key
    )
    return ReplicaSpec(worker.name, worker.node, backend, producer)
