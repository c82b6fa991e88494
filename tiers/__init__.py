"""Offload tiers: a shared-memory CPU arena and content-addressed disk files behind a per-node actor.

============================  =====================================================
module                        what it holds
============================  =====================================================
``tiers.identity``            CacheIdentity: what a block's bytes mean, and its digest
``tiers.blocks``              BlockMeta (hash, parent, tokens) and small results
``tiers.shared_memory``       SharedSlots: /dev/shm slots any process maps by name
``tiers.cpu_arena``           CpuArena: LRU index over the slots, leases
``tiers.disk_format``         the block file format (header, checksum)
``tiers.disk``                DiskTier: files, LRU in bytes, deadlines, restart scan
``tiers.copy_engine``         CopyEngine: batched pool <-> arena copies (threads / CUDA)
``tiers.store``               TierStore: the policy (write-back, admission, promote)
``tiers.actor``               TierActor: the store on Ray, one per node
``tiers.client``              sync clients (Ray actor, in-process store)
``tiers.link``                TierLink: a worker's spill / promote through the arena
============================  =====================================================

Imports point one way: tiers uses kvstore, never workers, router or deploy.
"""

from kvstore.publisher import EventEndpoints
from kvstore.tiers.blocks import BlockMeta, SlotGrant, TierGet, TierHit
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.shared_memory import ArenaInfo, SharedSlots
from kvstore.tiers.stats import TierStats
from kvstore.tiers.store import TierStore

__all__ = [
    "ArenaInfo",
    "BlockMeta",
    "CacheIdentity",
    "EventEndpoints",
    "SharedSlots",
    "SlotGrant",
    "TierGet",
    "TierHit",
    "TierStats",
    "TierStore",
]
