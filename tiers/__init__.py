"""Offload tiers: a shared-memory CPU arena and content-addressed disk files behind a per-node actor.

============================  =====================================================
module                        what it holds
============================  =====================================================
``tiers.config``              TierConfig: the ``[tiers]`` section
``tiers.errors``              the typed errors callers see
``tiers.identity``            CacheIdentity: what a block's bytes mean, and its digest
``tiers.blocks``              BlockMeta (hash, parent, tokens) and small results
``tiers.shared_memory``       SharedSlots: /dev/shm slots any process maps by name
``tiers.arena``               the Arena protocol, Lease, LeaseKind, the slot states
``tiers.cpu_arena``           CpuArena: LRU index over the slots, leases, books in C
``tiers.cpu_arena_py``        PyCpuArena: the same books in Python (no C compiler)
``tiers.tier_events``         MediumEvents: a medium's BlockStored / BlockRemoved
``tiers.disk_format``         the block file format (header, checksum)
``tiers.disk_files``          one block file's system calls (O_DIRECT, rename)
``tiers.disk_runner``         I/O batches on threads, each I/O by its deadline
``tiers.disk_capacity``       DiskIndex: LRU in bytes, the limit ENOSPC lowers
``tiers.disk_scan``           the start-up scan that rebuilds the disk index
``tiers.disk``                DiskTier: owns the four above, counts outcomes
``tiers.copy_engine``         CopyEngine: batched pool <-> arena copies (threads / CUDA)
``tiers._copyrows``           the copy kernel and the arena's SlotTable, in C (built at install)
``tiers.admission``           AdmissionFilter: admit a block on its N-th spill
``tiers.leases``              LeaseBook: grants, their incarnation check and end
``tiers.stats``               counters and the TierStats snapshot
``tiers.store``               TierStore: the policy (write-back, admission, promote)
``tiers.metrics``             TierCollector: TierStats as Prometheus metrics
``tiers.actor``               TierActor: the store on Ray, one per node
``tiers.client``              sync clients (Ray actor, in-process store)
``tiers.link``                TierLink: a worker's spill / promote through the arena
============================  =====================================================

Imports point one way: tiers uses kvstore, never workers, router or deploy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from kvstore.publisher import EventEndpoints
    from kvstore.tiers.blocks import BlockMeta, SlotGrant, TierHit
    from kvstore.tiers.identity import CacheIdentity
    from kvstore.tiers.shared_memory import ArenaInfo, SharedSlots
    from kvstore.tiers.stats import TierStats
    from kvstore.tiers.store import TierStore

# The names below load on first use (PEP 562), so a process that needs only ``tiers.config`` -- the
# router reading its config file -- does not import torch (the store, the copy engine) to get it.
_EXPORTS = {
    "ArenaInfo": "kvstore.tiers.shared_memory",
    "BlockMeta": "kvstore.tiers.blocks",
    "CacheIdentity": "kvstore.tiers.identity",
    "EventEndpoints": "kvstore.publisher",
    "SharedSlots": "kvstore.tiers.shared_memory",
    "SlotGrant": "kvstore.tiers.blocks",
    "TierHit": "kvstore.tiers.blocks",
    "TierStats": "kvstore.tiers.stats",
    "TierStore": "kvstore.tiers.store",
}

__all__ = [  # (each loaded by __getattr__ below)
    "ArenaInfo",
    "BlockMeta",
    "CacheIdentity",
    "EventEndpoints",
    "SharedSlots",
    "SlotGrant",
    "TierHit",
    "TierStats",
    "TierStore",
]


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
