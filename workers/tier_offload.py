"""The worker's connector to its node's tiers: an :class:`OffloadConnector` over a TierLink.

- ``on_evict``: the evicted blocks' KV is copied into the node's shared CPU
  arena (write-back) before the pool reuses their memory; the tier actor
  then owns them (CPU, later disk) and publishes them as medium CPU/STORAGE.
- ``promote``: after the GPU prefix hit, the request's next blocks that the
  node's tiers hold are copied into freshly allocated pool blocks, registered
  in the prefix cache, and returned as an extended hit -- the request skips
  their prefill. A block spilled by another worker of the node is promoted
  the same way: the arena is shared.

Failure: a tier that cannot take a block (full, or the actor is gone) makes
the spill a no-op for that block -- the KV is simply not kept; a promotion
that fails leaves the GPU hit as it was. Neither ever fails the request.
Both run on the worker's step-loop thread under its lock (workers/offload.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.events import MEDIUM_CPU, MEDIUM_STORAGE
from kvstore.kv_cache_manager import CacheRequest, PrefixHit
from tiers.blocks import BlockMeta
from tiers.link import TierLink
from workers.kv_tensor_pool import KVTensorPool
from workers.offload import Promotion

logger = logging.getLogger(__name__)


class TierOffload:
    """Spills to and promotes from one node's tier actor through a mapped arena.

    ``reserve_blocks`` pool blocks are never taken for promotion, so the
    request itself (and the running ones) still find room to compute.
    """

    def __init__(self, link: TierLink, *, reserve_blocks: int = 4) -> None:
        self.link = link
        self.reserve_blocks = reserve_blocks
        self.spill_failures = 0
        self.promote_failures = 0

    def on_evict(self, blocks: Sequence[KVCacheBlock], kv_pool: KVTensorPool) -> None:
        try:
            self.link.spill([BlockMeta.from_pool_block(b) for b in blocks], kv_pool.kv, [b.block_id for b in blocks])
        except Exception as exc:  # a tier outage must not stop the GPU pool from reusing its memory
            self.spill_failures += 1
            logger.warning("spill of %d blocks failed, their KV is dropped: %s", len(blocks), exc)

    def promote(
        self, request: CacheRequest, gpu_hit: PrefixHit, block_pool: BlockPool, kv_pool: KVTensorPool
    ) -> Promotion:
        size = block_pool.block_size
        first = len(gpu_hit.blocks)
        limit = (request.num_tokens - 1) // size  # a hit never covers the last token
        spare = block_pool.num_free_blocks - sum(1 for b in gpu_hit.blocks if b.ref_cnt == 0) - self.reserve_blocks
        limit = min(limit, first + max(0, spare))
        if limit <= first:
            return Promotion(gpu_hit, {})
        hashes = request.block_hashes
        metas = BlockMeta.chain(hashes[:limit], request.token_ids, size, start=first)
        try:
            if self.link.lookup([m.block_hash for m in metas]).num_blocks == 0:
                return Promotion(gpu_hit, {})
        except Exception as exc:
            self.promote_failures += 1
            logger.warning("tier lookup failed: %s", exc)
            return Promotion(gpu_hit, {})

        block_pool.touch(gpu_hit.blocks)  # allocating below must not evict the GPU hit
        allocated: list[KVCacheBlock] = []

        def allocate(n: int) -> list[int]:
            blocks = block_pool.get_new_blocks(n)
            allocated.extend(blocks)
            return [b.block_id for b in blocks]

        try:
            promoted = self.link.promote(metas, kv_pool.kv, allocate)
        except Exception as exc:
            self.promote_failures += 1
            logger.warning("promotion failed, serving from the GPU hit only: %s", exc)
            promoted = None
        filled = [] if promoted is None else allocated[: len(promoted.block_ids)]
        unfilled = allocated[len(filled) :]
        blocks = [*gpu_hit.blocks, *filled]
        if filled:
            block_pool.cache_full_blocks(
                blocks, hashes, first, len(blocks), request.token_ids, lora_name=request.lora_name
            )
        # Release everything: allocate_slots takes the extended hit like any other hit.
        block_pool.free_blocks([*unfilled, *reversed(filled), *reversed(gpu_hit.blocks)])
        if not filled or promoted is None:
            return Promotion(gpu_hit, {})
        by_medium = {MEDIUM_CPU: 0, MEDIUM_STORAGE: 0}
        for medium in promoted.media:
            by_medium[medium] = by_medium.get(medium, 0) + size
        return Promotion(PrefixHit(tuple(blocks), len(blocks) * size), by_medium)

    def close(self) -> None:
        self.link.close()
