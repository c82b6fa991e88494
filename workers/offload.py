"""The seam where a lower tier (CPU arena, disk) plugs into a worker.

The worker calls an :class:`OffloadConnector` at exactly two points, both
on its step-loop thread while it holds its lock, and wires it in exactly
one place (:meth:`kvstore.workers.worker.KVWorker.attach_offload`):

1. **Spill** -- the block pool's eviction hook. ``on_evict(blocks, kv_pool)``
   receives cached blocks about to be reused, hashes and tokens still set;
   their KV is ``kv_pool.read_blocks([b.block_id ...])``. The memory goes to
   its new owner as soon as the call returns, so copy out (or decide to
   drop) before returning. Must not call back into the pool or the worker.
2. **Promote** -- admission, right after the GPU prefix lookup.
   ``promote(request, gpu_hit, block_pool, kv_pool)`` may extend the hit
   with the request's next blocks found in a lower tier: hold
   ``gpu_hit.blocks`` (``block_pool.touch``; allocating evicts from the free
   queue, where hit blocks may sit), allocate pool blocks
   (``block_pool.get_new_blocks``; mind the admission watermark), copy the KV in
   (``kv_pool.write_blocks``), register them in the prefix cache
   (``block_pool.cache_full_blocks``, which emits ``BlockStored`` medium
   GPU), release them and the held hit blocks (``block_pool.free_blocks``) so the
   admission's ``allocate_slots`` takes them like any other hit, and return
   the extended hit. The extended hit must remain a prefix of the request's
   blocks (``gpu_hit.blocks`` first) of at most ``request.num_tokens - 1``
   tokens; when nothing is promoted, return ``gpu_hit`` unchanged.

:class:`NoOffload` is the null connector every worker starts with. A
connector that is also a :class:`LinkedOffload` (``workers.tier_offload``)
gets its link's state exported in the worker's metrics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.events import Medium
from kvstore.kv_cache_manager import CacheRequest, PrefixHit
from kvstore.workers.kv_tensor_pool import KVTensorPool
from kvstore.workers.metrics import TierLinkCounters


class Promotion(NamedTuple):
    hit: PrefixHit  # the GPU hit extended by the promoted blocks (all now cached in the pool)
    promoted_tokens: Mapping[Medium, int]  # tokens promoted, by source medium (CPU, STORAGE)


class OffloadConnector(Protocol):
    """What a tier implements to spill evicted blocks and promote hits (contracts in the module docstring)."""

    def on_evict(self, blocks: Sequence[KVCacheBlock], kv_pool: KVTensorPool) -> None: ...

    def promote(
        self, request: CacheRequest, gpu_hit: PrefixHit, block_pool: BlockPool, kv_pool: KVTensorPool
    ) -> Promotion: ...


@runtime_checkable
class LinkedOffload(Protocol):
    """A connector linked to a tier that can go away: the worker exports its link's metrics."""

    counters: TierLinkCounters

    @property
    def connected(self) -> bool: ...


class NoOffload:
    """No lower tier: evicted KV is dropped, nothing is promoted."""

    def on_evict(self, blocks: Sequence[KVCacheBlock], kv_pool: KVTensorPool) -> None:
        return None

    def promote(
        self, request: CacheRequest, gpu_hit: PrefixHit, block_pool: BlockPool, kv_pool: KVTensorPool
    ) -> Promotion:
        return Promotion(gpu_hit, {})
