"""TierActor: one node's TierStore as a Ray actor, one per node and cache identity.

Thin on purpose: every method delegates to :class:`~kvstore.tiers.store.TierStore`
(the logic, tested without Ray). The actor is async, so its methods run on
one event loop -- the store's single-owner contract.

Placement: :func:`get_or_create_tier_actor` pins the actor to a node with
``NodeAffinitySchedulingStrategy(node_id, soft=False)`` under the
deterministic name ``kvstore-tier-<node_id>`` (in namespace ``kvstore``),
with ``get_if_exists`` so concurrent creators end up with the same actor. It
asks for no CPU: the tier must fit on every node, even one whose CPUs the
workers hold. Its arena is named after the identity and the node, so a
restarted actor reclaims its predecessor's shared memory.

Workers on the node map the arena named by :meth:`TierActor.arena_info`
(see :class:`kvstore.tiers.link.TierLink`), and make their hot calls over the
Unix socket :meth:`TierActor.control_endpoint` names (:mod:`~kvstore.tiers.control`),
served on the actor's event loop like its Ray methods.
"""

from __future__ import annotations

from typing import Any

import ray
from prometheus_client import CollectorRegistry
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstore.config import EventsConfig
from kvstore.metrics import render
from kvstore.publisher import EventEndpoints
from kvstore.tiers.blocks import BlockMeta, SlotGrant, TierHit, decode_metas, encode_grants
from kvstore.tiers.config import TierConfig
from kvstore.tiers.control import ControlServer, remove_socket_files
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.metrics import TierCollector
from kvstore.tiers.shared_memory import ArenaInfo
from kvstore.tiers.stats import TierStats
from kvstore.tiers.store import TierStore, default_arena_name

TIER_NAMESPACE = "kvstore"


def tier_actor_name(node_id: str) -> str:
    return f"kvstore-tier-{node_id}"


def tier_arena_name(identity: CacheIdentity, node_id: str) -> str:
    return default_arena_name(identity, owner=node_id[:16])


@ray.remote
class TierActor:
    """The node's tier store: the lease protocol and queries of :class:`TierStore`, nothing else.

    Only block metas and lease ids cross Ray: the KV itself moves between a
    worker's pool and the shared arena, copied by the worker (``TierLink``).
    Reserves and acquires travel packed (``reserve_packed`` / ``acquire_packed``,
    one msgpack buffer each way: see :mod:`~kvstore.tiers.blocks`); ``reserve`` /
    ``acquire`` take and give Python objects, for callers other than the client.
    """

    def __init__(
        self, config: TierConfig, identity: CacheIdentity, events: EventsConfig | None, arena_name: str | None
    ) -> None:
        self._store = TierStore(config, identity, events=events, arena_name=arena_name)
        info = self._store.arena_info
        remove_socket_files(info.shm_dir, info.name)  # a killed predecessor's (a restart)
        self._control_on = config.control_socket
        self._control: ControlServer | None = None

    async def lookup(self, block_hashes: list[int], start: int = 0) -> TierHit:
        return self._store.lookup(block_hashes, start)

    async def reserve(self, blocks: list[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]:
        return await self._store.reserve(blocks, arena)

    async def reserve_packed(self, packed: bytes, arena: int | None = None) -> bytes:
        """:meth:`reserve` in the wire form (:func:`~kvstore.tiers.blocks.encode_metas` in,
        :func:`~kvstore.tiers.blocks.encode_grants` out): what RayTierClient calls."""
        return encode_grants(await self._store.reserve(decode_metas(packed), arena))

    async def commit(self, lease_ids: list[int]) -> int:
        return await self._store.commit(lease_ids)

    async def acquire(self, blocks: list[BlockMeta], arena: int | None = None) -> list[SlotGrant]:
        return await self._store.acquire(blocks, arena)

    async def acquire_packed(self, packed: bytes, arena: int | None = None) -> bytes:
        """:meth:`acquire` in the wire form, as :meth:`reserve_packed`."""
        return encode_grants(await self._store.acquire(decode_metas(packed), arena))

    async def release(self, lease_ids: list[int]) -> None:
        self._store.release(lease_ids)

    async def stats(self) -> TierStats:
        return self._store.stats()

    async def metrics_text(self) -> bytes:
        """The store's metrics in Prometheus text format."""
        registry = CollectorRegistry()
        registry.register(TierCollector(self._store.stats, ray.get_runtime_context().get_node_id()))
        return render(registry)

    async def event_endpoints(self) -> EventEndpoints | None:
        return self._store.event_endpoints

    async def flush_events(self, timeout_s: float = 5.0) -> bool:
        return self._store.flush_events(timeout_s)

    async def arena_info(self) -> ArenaInfo:
        return self._store.arena_info

    async def check_invariants(self) -> None:
        self._store.check_invariants()

    async def control_endpoint(self) -> str | None:
        """The ``ipc://`` endpoint of the hot calls' socket (started on the first ask); None when
        ``tiers.control_socket`` is off. Its calls run the methods above on this actor's event loop."""
        if not self._control_on:
            return None
        if self._control is None:
            info = self._store.arena_info
            self._control = ControlServer(
                {
                    "lookup": self.lookup,
                    "reserve": self.reserve_packed,
                    "commit": self.commit,
                    "acquire": self.acquire_packed,
                    "release": self.release,
                },
                info.shm_dir,
                info.name,
            )
            self._control.start()
        return self._control.endpoint

    async def shutdown(self) -> None:
        """Close the control socket, settle disk I/O, close the event sockets and unlink the arena; the actor
        can then be killed."""
        if self._control is not None:
            await self._control.aclose()  # unlinks its socket file (a predecessor's went in __init__)
        await self._store.aclose()


def tier_actor_options(node_id: str, *, namespace: str = TIER_NAMESPACE) -> dict[str, Any]:
    """Ray ``.options(...)`` placing the tier actor on ``node_id`` (hard affinity) under its name.

    A tier actor whose process dies is restarted by Ray on the same node with
    the same arguments, so its disk tier's scan serves what survived; an
    exception in its constructor (a bad config, too little /dev/shm) is not
    retried by Ray, it leaves the actor dead. Workers skip a tier that does
    not answer and reconnect by name; the router follows its new endpoints.
    """
    return {
        "name": tier_actor_name(node_id),
        "namespace": namespace,
        "get_if_exists": True,
        "max_restarts": -1,
        "num_cpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
    }


def get_or_create_tier_actor(
    config: TierConfig,
    identity: CacheIdentity,
    *,
    events: EventsConfig | None = None,
    node_id: str | None = None,
    namespace: str = TIER_NAMESPACE,
) -> Any:
    """The tier actor of ``node_id`` (default: this process's node), created if absent.

    Returns its Ray actor handle. Call from a process connected to Ray.
    """
    node = node_id or ray.get_runtime_context().get_node_id()
    options = tier_actor_options(node, namespace=namespace)
    return TierActor.options(**options).remote(  # type: ignore[attr-defined]
        config, identity, events, tier_arena_name(identity, node)
    )
