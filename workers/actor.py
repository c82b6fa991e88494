"""The KV worker as a Ray actor: a thin async wrapper around :class:`kvstore.workers.worker.KVWorker`.

Many requests run at once on one actor: it is an async actor, and
``generate`` awaits the worker's future (``asyncio.wrap_future``), so the
event loop only queues requests while the worker's own step loop batches
them. Methods that may wait for a step (``check_invariants``,
``shutdown``) run in a thread so they never stall the event loop.

Placement: :func:`worker_actor_options` asks Ray for one GPU when the
configuration wants CUDA or (``device = "auto"``) when the cluster has a
GPU, else for CPU only -- the same code on a laptop and a GPU cluster. An
``auto`` actor that Ray gave no GPU runs on the CPU even on a GPU node.

Event endpoints are what the worker's publisher bound (loopback by
default); a wildcard bind (``tcp://*:port``, ``0.0.0.0``) is reported with
this node's IP address, so subscribers on other nodes can connect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import ray
from ray.util import get_node_ip_address

from kvstore.heap import freeze_startup_heap
from kvstore.publisher import EventEndpoints
from kvstore.tiers.actor import TIER_NAMESPACE
from kvstore.tiers.client import RayTierClient
from kvstore.tiers.link import TierLink
from kvstore.worker_api import (
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    StreamChunk,
    WorkerLoad,
    WorkerShutdownError,
)
from kvstore.workers.config import WorkerSettings, cache_identity, replace_sections
from kvstore.workers.tier_offload import TierOffload
from kvstore.workers.worker import KVWorker

logger = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::")


def worker_actor_options(
    config: WorkerSettings, *, cluster_gpus: float | None = None, num_cpus: float = 1.0
) -> dict[str, Any]:
    """Ray ``.options(...)`` for one worker actor.

    ``cluster_gpus`` defaults to the connected cluster's GPU count
    (``ray.cluster_resources()``); pass it to decide without a cluster.
    """
    device = config.worker.device
    if device == "cuda":
        num_gpus = 1
    elif device == "cpu":
        num_gpus = 0
    else:
        gpus = ray.cluster_resources().get("GPU", 0.0) if cluster_gpus is None else cluster_gpus
        num_gpus = 1 if gpus >= 1 else 0
    return {"num_cpus": num_cpus, "num_gpus": num_gpus}


def routable_endpoint(endpoint: str, node_ip: str) -> str:
    """``endpoint`` with a wildcard host replaced by ``node_ip`` (other endpoints unchanged)."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if sep and colon and host in _WILDCARD_HOSTS:
        return f"{scheme}://{node_ip}:{port}"
    return endpoint


@ray.remote
class KVWorkerActor:
    """One KV worker replica on a Ray node; the same methods as :class:`KVWorker`."""

    def __init__(self, name: str, config: WorkerSettings, tier: str | None = None) -> None:
        """``tier``: the name of this node's TierActor (in ``TIER_NAMESPACE``); when given, evicted blocks spill to
        it and hits promote from it.

        The worker looks the tier up by that name, here and whenever it reconnects: a name, not a handle, is passed
        because Ray keeps a handle among an actor's constructor arguments as an object reference, which a restart
        of this actor (``max_restarts``) may fail to get back (ray-project/ray#53727). A tier that is not there
        yet, or dies later, costs spills and promotions only: the worker serves without it (spills dropped and
        counted) and reconnects once one runs again.
        """
        if config.worker.device == "auto" and not ray.get_gpu_ids():
            config = replace_sections(config, worker=msgspec.structs.replace(config.worker, device="cpu"))
        self._node_ip = get_node_ip_address()
        self._node_id = ray.get_runtime_context().get_node_id()
        self._offload: TierOffload | None = None
        if tier is not None:
            identity = cache_identity(config)
            timeout_s = 2 * config.tiers.io_deadline_s
            copy_threads = config.tiers.copy_threads

            def reconnect() -> TierLink:
                """The node's tier actor as it is now (a restarted one has a new arena): looked up by name."""
                actor = ray.get_actor(tier, namespace=TIER_NAMESPACE)
                client = RayTierClient(actor, timeout_s=timeout_s)
                try:
                    return TierLink(client, identity, copy_threads=copy_threads, close_client=True)
                except BaseException:
                    client.close()
                    raise

            link: TierLink | None = None
            try:
                link = reconnect()
            except Exception as exc:  # not up (yet): serve without it; TierOffload keeps trying in the background
                logger.warning("worker %s: the node's tier %r is not reachable yet (%s): reconnecting", name, tier, exc)
            self._offload = TierOffload(link, reconnect=reconnect)
        self._worker = KVWorker(name, config, offload=self._offload)
        freeze_startup_heap()  # the model and the libraries: never garbage, no longer walked by each collection

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Raises InvalidRequestError (before queuing) or the error that stopped the request.

        Cancelling the call (``ray.cancel``) cancels the request on the worker: its blocks are freed.
        """
        stream = await self._worker.asubmit(request)
        try:
            return await stream.aresult()
        finally:
            stream.cancel()  # a no-op once the request finished

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """The request's chunks as they are produced (call with ``num_returns="streaming"``).

        Cancelling the generator, or the caller dropping it, cancels the request on the worker.
        """
        stream = await self._worker.asubmit(request)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.cancel()

    async def load(self) -> WorkerLoad:
        """Raises WorkerShutdownError once the step loop is gone, so that the router's health poll fails: a
        process that answers while its engine is dead must not be routed to (the supervisor restarts it)."""
        if not self._worker.alive:
            raise WorkerShutdownError(
                f"worker {self._worker.name} is not serving: {self._worker.health()['last_error']}"
            )
        return self._worker.load()

    async def info(self) -> ModelInfo:
        return self._worker.info()

    async def event_endpoints(self) -> EventEndpoints:
        bound = self._worker.event_endpoints()
        return EventEndpoints(
            endpoint=routable_endpoint(bound.endpoint, self._node_ip),
            replay_endpoint=routable_endpoint(bound.replay_endpoint, self._node_ip),
        )

    async def health(self) -> dict[str, Any]:
        tiered = self._offload is not None
        connected = self._offload is not None and self._offload.connected
        return {
            **self._worker.health(),
            "node_ip": self._node_ip,
            "node_id": self._node_id,
            "tiered": tiered,
            "tier_connected": connected,
        }

    async def cached_hashes(self) -> list[int]:
        return self._worker.cached_hashes()

    async def check_invariants(self) -> None:
        await asyncio.to_thread(self._worker.check_invariants)

    async def drain_offload(self, timeout_s: float = 30.0) -> bool:
        """Wait until the tier jobs queued so far have run (stores land after the request that freed the blocks)."""
        return await asyncio.to_thread(self._worker.drain_offload, timeout_s)

    async def metrics_text(self) -> bytes:
        return self._worker.metrics_text()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._worker.shutdown)
        if self._offload is not None:
            self._offload.close()  # unmap the node's arena (the tier actor owns and unlinks it)
