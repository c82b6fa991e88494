"""Places a kvstore deployment on Ray and tears it down.

:func:`launch` connects to (or starts) Ray, places the KV workers, waits until
each answers, and builds the router service over them: one replica per
worker, one event stream per worker (and per node tier, when tiers are
enabled). :meth:`Deployment.stop` undoes all of it: actors killed, sockets
closed, and an embedded Ray shut down. So does a launch that fails or is
interrupted (SIGINT, SIGTERM) at any point, Ray's own start included.

An embedded Ray listens on loopback only (:func:`start_ray`). Workers are
restarted by Ray when their process dies (``max_restarts``), like the tier
actors; :mod:`kvstore.deploy.supervisor` points the router at the restarted
ones and re-places those that died for good.

Why uvicorn and not Ray Serve for the HTTP front: the router is one
asyncio app whose index is fed by an in-process listener thread; Ray Serve
would add a proxy hop and replicate the index per Serve replica, each
subscribing to every stream. One router process is enough for the request
rates a prefix router sees (the decision costs tens of microseconds); run
several behind a load balancer for availability.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstore.deploy.config import Config
from kvstore.errors import ConfigError
from kvstore.openai.protocol import ModelLimits
from kvstore.openai.tokenizer import load_tokenizer
from kvstore.router.backends import RayActorBackend
from kvstore.router.service import ProducerSpec, ReplicaSpec, RouterService
from kvstore.subscriber import CurveKeyPair
from kvstore.tiers.actor import TIER_NAMESPACE, get_or_create_tier_actor, tier_actor_name, tier_arena_name
from kvstore.tiers.control import remove_socket_files
from kvstore.tiers.shared_memory import reclaim_dead_arenas
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
    """A running deployment: tiers, workers, the router service, and whether we own Ray.

    ``workers`` changes while it runs: :mod:`kvstore.deploy.supervisor` swaps in the workers it re-places.
    """

    def __init__(
        self,
        config: Config,
        workers: list[PlacedWorker],
        service: RouterService,
        owns_ray: bool,
        *,
        local_node: str | None = None,
    ) -> None:
        """``local_node``: the id of this process's Ray node when it owns Ray (its arena is unlinked at stop)."""
        self.config = config
        self.tiers: list[PlacedTier] = []
        self.workers = workers
        self.service = service
        self.owns_ray = owns_ray
        self.local_node = local_node

    def stop(self) -> None:
        """Shut workers then tiers down (sockets closed, arenas unlinked), kill them, stop an embedded Ray."""
        teardown(
            self.config,
            [w.handle for w in self.workers] + [t.handle for t in self.tiers],
            owns_ray=self.owns_ray,
            local_node=self.local_node,
        )
        self.workers = []
        self.tiers = []


_SHUTDOWN_S = 10.0  # how long actors get, all together, to close their sockets and unlink their arenas


def teardown(config: Config, handles: list[Any], *, owns_ray: bool, local_node: str | None) -> None:
    """Shut ``handles`` down (each closes its sockets; a tier unlinks its arena), kill them, stop an owned Ray.

    Bounded: the actors get :data:`_SHUTDOWN_S` together (one still starting finishes first); a dead one
    is only killed. With an owned Ray, the local node's arena is unlinked even if its tier never shut down.
    """
    refs = []
    for handle in handles:
        try:
            refs.append(handle.shutdown.remote())
        except Exception as exc:  # a dead actor cannot shut down; killing it below is enough
            logger.info("actor did not shut down cleanly: %s", exc)
    if refs:
        _ready, late = ray.wait(refs, num_returns=len(refs), timeout=_SHUTDOWN_S)
        if late:
            logger.info("%d actors did not shut down within %.0f s; killing them", len(late), _SHUTDOWN_S)
    _kill(handles)
    if owns_ray and ray.is_initialized():
        ray.shutdown()
    if owns_ray and local_node is not None and config.tiers.enabled:
        _unlink_local_arena(config, local_node)


def _unlink_local_arena(config: Config, node: str, timeout_s: float = 10.0) -> None:
    """Unlink the local tier's arena once its owner process is gone (its actor may have been killed mid-start)."""
    arena = Path(config.tiers.shm_dir) / tier_arena_name(cache_identity(config), node)
    deadline = time.monotonic() + timeout_s
    while arena.exists() and time.monotonic() < deadline:
        reclaim_dead_arenas(arena.parent)  # only arenas whose owner process has exited
        if arena.exists():
            time.sleep(0.1)
    if arena.exists():
        logger.warning("arena %s is still held by a live process; it was left in place", arena)
        return
    # Its owner is gone (a tier killed before it shut down, e.g. by a signal to the process group): so is the
    # server of its control socket, whose file it could not remove.
    remove_socket_files(str(arena.parent), arena.name)


def launch(config: Config, *, address: str | None = None, num_workers: int | None = None) -> Deployment:
    """Start tiers (one per node) and workers on Ray (embedded when ``address`` is None) and a router over them.

    Whatever fails or is interrupted (KeyboardInterrupt, or any exception a signal handler raises) is torn
    down before the exception leaves: the actors placed so far, and Ray itself when this call started it.
    """
    router_curve(config)  # a router that could not hear its publishers is refused before anything starts
    owns_ray = start_ray(address)  # cleans up after itself if it fails
    local_node: str | None = None
    tiers: dict[str, PlacedTier] = {}
    workers: list[PlacedWorker] = []
    try:
        local_node = ray.get_runtime_context().get_node_id() if owns_ray else None
        count = num_workers or default_num_workers(config)
        if not owns_ray:
            check_no_deployment(count)
        if config.tiers.enabled:
            tiers = place_tiers(config)
        workers = place_workers(config, count, tiers=tiers)
        service = build_service(config, workers, tiers)
    except BaseException:
        handles = [w.handle for w in workers] + [t.handle for t in tiers.values()]
        if owns_ray and config.tiers.enabled and not tiers:  # interrupted while placing them: find those started
            handles += _named_tier_actors()
        teardown(config, handles, owns_ray=owns_ray, local_node=local_node)
        raise
    deployment = Deployment(config, workers, service, owns_ray, local_node=local_node)
    deployment.tiers = list(tiers.values())
    return deployment


def check_no_deployment(count: int) -> None:
    """ConfigError when the workers a launch of ``count`` would name (worker-0 ...) already run on the cluster:
    another deployment's.

    Such a launch would be handed the running deployment's tier actors (one per node, found by name), fail
    on its workers' names, and in tearing itself down shut those tiers down: the running deployment's
    arenas would go with them (a review saw it). So it is refused before it places anything.
    """
    names = {f"kvstore-worker-{index}" for index in range(count)}
    running = sorted(
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == NAMESPACE and actor["name"] in names
    )
    if running:
        raise ConfigError(
            f"a kvstore deployment already runs on this Ray cluster (its workers {', '.join(running[:3])}"
            f"{', ...' if len(running) > 3 else ''}): stop it before starting another"
        )


def start_ray(address: str | None) -> bool:
    """Connect to Ray at ``address``, or start an embedded one (None); True when this call started it.

    An embedded Ray is one node, so it listens on loopback only (:func:`_loopback_ray`). Ray installs its
    own SIGTERM handler while it starts (one that kills its processes and exits); the caller's handler is
    put back afterwards, so a deployer's orderly shutdown applies from then on. If the start fails or is
    interrupted, whatever Ray had started is shut down before the exception leaves.
    """
    if ray.is_initialized():
        return False
    owns = address is None
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        with _loopback_ray() if owns else contextlib.nullcontext():
            ray.init(
                address=address,
                namespace=NAMESPACE,
                include_dashboard=False,
                configure_logging=False,
                log_to_driver=False,
            )
    except ConnectionError as exc:
        if owns:
            ray.shutdown()
            raise
        raise ConfigError(cluster_connection_hint(address or "", exc)) from None
    except BaseException:
        if owns:
            ray.shutdown()
        raise
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return owns


def cluster_connection_hint(address: str, exc: BaseException) -> str:
    """One line for a failed connection to a Ray cluster, naming the usual cause since Ray 2.59: a cluster
    started with token authentication (``ray start`` turns it on) joined from an environment without it."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    mode = os.environ.get("RAY_AUTH_MODE", "unset")
    return (
        f"cannot connect to the Ray cluster at {address}: {reason}. If the cluster runs with token "
        f"authentication (Ray 2.59+ turns it on for `ray start`), set RAY_AUTH_MODE=token here too (now {mode}); "
        "Ray reads the token from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or its default file (`ray get-auth-token`)"
    )


@contextlib.contextmanager
def _loopback_ray() -> Iterator[None]:
    """Start Ray with loopback as the node's address, so every server it starts binds loopback.

    Ray binds its gRPC servers (GCS, raylet, each worker's), its agents and its metrics exporters to the
    node's address, and to loopback only when that address is loopback. It takes the host's routable
    address instead of 127.0.0.1 unless multi-node clusters are off -- the switch its
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` environment variable sets, read once at import. An embedded Ray
    is a single node: the switch is turned off while it starts (and only then: joining a cluster needs it).
    """
    from ray._private import ray_constants  # the one place Ray reads the switch, at call time

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _named_tier_actors() -> list[Any]:
    """The tier actors of the live nodes that exist by name (a launch interrupted while it placed them)."""
    found = []
    for node in alive_nodes(gpu_first=False):
        with contextlib.suppress(Exception):
            found.append(ray.get_actor(tier_actor_name(node), namespace=TIER_NAMESPACE))
    return found


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
    try:
        endpoints = ray.get([h.event_endpoints.remote() for h in handles.values()], timeout=timeout_s)
    except ray.exceptions.RayActorError as exc:  # its constructor failed: say why in one line, not Ray's trace
        raise ConfigError(f"a tier actor could not start: {_last_line(exc)}") from None
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
    nodes = worker_nodes(config)
    check_room(config, [nodes[i % len(nodes)] for i in range(count)])
    names = [f"worker-{start_index + i}" for i in range(count)]
    handles = [start_worker(config, name, nodes[i % len(nodes)], tiers) for i, name in enumerate(names)]
    deadline = time.monotonic() + timeout_s
    return [
        placed_worker(name, handle, max(1.0, deadline - time.monotonic()))
        for name, handle in zip(names, handles, strict=True)
    ]


def check_room(config: Config, placement: list[str]) -> None:
    """ConfigError, before anything starts, when a node cannot hold the workers ``placement`` pins to it.

    Workers are pinned to their node (no other node, and no autoscaler, can take one), so a node with fewer
    CPUs or GPUs than its workers ask for leaves the rest pending forever: without this, a deployment of
    more workers than CPUs waited out the placement timeout and ended in Ray's traceback.
    """
    options = worker_actor_options(config)
    resources = {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
    for node, workers in Counter(placement).items():
        for kind, each in (("CPU", options["num_cpus"]), ("GPU", options["num_gpus"])):
            need, have = workers * each, resources.get(node, {}).get(kind, 0.0)
            if need > have:
                raise ConfigError(
                    f"{workers} workers on node {node[:12]} need {need:g} {kind} ({each:g} each), and the node "
                    f"has {have:g}: start fewer workers, or add nodes to the Ray cluster"
                )


def worker_nodes(config: Config) -> list[str]:
    """The live nodes workers go to, in placement order (GPU nodes first when workers take a GPU)."""
    return alive_nodes(gpu_first=worker_actor_options(config).get("num_gpus", 0) > 0)


def start_worker(config: Config, name: str, node: str, tiers: dict[str, PlacedTier] | None = None) -> Any:
    """Create worker ``name`` pinned to ``node`` (with that node's tier, if any); returns its handle at once.

    Ray restarts it, with the same arguments, whenever its process dies (``max_restarts=-1``): a restarted
    worker has an empty pool and new event ports, which the supervisor tells the router.
    """
    tier = tier_actor_name(node) if tiers and node in tiers else None  # a name: the worker looks the tier up
    return KVWorkerActor.options(  # type: ignore[attr-defined]
        name=f"kvstore-{name}",
        namespace=NAMESPACE,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        max_restarts=-1,
        **worker_actor_options(config),
    ).remote(name, config, tier)


def placed_worker(name: str, handle: Any, timeout_s: float) -> PlacedWorker:
    """Worker ``name`` once it answers: where it runs and publishes. Raises a Ray error past ``timeout_s``, and
    ConfigError, in one line, when the worker could not start (its model, its memory: not Ray's trace)."""
    try:
        endpoints, health = ray.get([handle.event_endpoints.remote(), handle.health.remote()], timeout=timeout_s)
    except ray.exceptions.RayActorError as exc:  # its constructor failed
        raise ConfigError(f"worker {name} could not start: {_last_line(exc)}") from None
    return PlacedWorker(name, handle, health["node_id"], endpoints.endpoint, endpoints.replay_endpoint)


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
    limits = ModelLimits(info.vocab_size, info.max_context, info.max_new_tokens)
    # The workers' own tokenizer unless the router is given one: a checkpoint's directory, else bytes.
    tokenizer = load_tokenizer(config.router.tokenizer or config.worker.model)
    service = RouterService(config, tokenizer, limits, model_name=info.model_name)
    for tier in (tiers or {}).values():
        producer = _producer(f"tier-{tier.node[:12]}", tier.endpoint, tier.replay_endpoint, config)
        service.add_tier_producer(tier.node, producer, locate=_tier_locator(tier))
        service.add_metrics_source(producer.name, _tier_text_fetcher(tier.node))
    for worker in workers:
        service.add_replica(replica_spec(worker, config))
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


class RouterCurve(NamedTuple):
    """How the router subscribes to the deployment's publishers (they all run with ``config.events``)."""

    server_key: str | None
    client_keys: CurveKeyPair | None


def router_curve(config: Config) -> RouterCurve:
    """The publishers' key and the router's own key pair (``router.curve_client_cert``).

    With an allow-list (``events.curve_allowed_client_keys``) the router is one of the subscribers it must
    list: without a listed certificate it would hear nothing and route blind, so that is a ConfigError.
    """
    server_key = config.events.curve_public_key or None
    keys = config.router.curve_client_keys()
    if keys is not None and server_key is None:
        raise ConfigError("router.curve_client_cert is set but the events run without CURVE (events.curve_public_key)")
    allowed = config.events.curve_allowed_client_keys
    if allowed and (keys is None or keys.public not in allowed):
        raise ConfigError(
            "events.curve_allowed_client_keys admits only the listed subscribers, and the router is one: set "
            "router.curve_client_cert to a certificate whose public key is listed, or it would route blind"
        )
    return RouterCurve(server_key, keys)


def _producer(name: str, endpoint: str, replay: str | None, config: Config) -> ProducerSpec:
    curve = router_curve(config)
    return ProducerSpec(name, endpoint, replay, curve_server_key=curve.server_key, curve_client_keys=curve.client_keys)


def replica_spec(worker: PlacedWorker, config: Config) -> ReplicaSpec:
    """The router's view of a placed worker: waits bounded by ``router.request_timeout_s``, CURVE as configured."""
    backend = RayActorBackend(worker.name, worker.handle, timeout_s=config.router.request_timeout_s)
    producer = _producer(f"{worker.name}/gpu", worker.endpoint, worker.replay_endpoint, config)
    return ReplicaSpec(worker.name, worker.node, backend, producer)


def _last_line(exc: BaseException) -> str:
    """The last non-empty line of an error's text: where Ray puts the cause of an actor's death."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
