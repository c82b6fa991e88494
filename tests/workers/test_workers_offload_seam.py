"""The tier seam, exercised by a real (in-process, dict-backed) lower tier.

``DictTier`` keeps every evicted block's KV keyed by its hash and promotes
it back at admission, following the contracts in ``workers.offload``. The
worker's pool is far smaller than the workload, so blocks really are
spilled and promoted -- and greedy output must still equal the uncached
model's.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from workers_testlib import Reference, make_config, random_tokens

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.events import Medium
from kvstore.hashing import BlockHash
from kvstore.kv_cache_manager import CacheRequest, PrefixHit
from kvstore.worker_api import GenerateRequest
from kvstore.workers.kv_tensor_pool import KVTensorPool
from kvstore.workers.offload import Promotion
from kvstore.workers.worker import KVWorker


class DictTier:
    """Spilled KV in a dict: block hash -> (tokens, KV of the block)."""

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, tuple[tuple[int, ...], torch.Tensor]] = {}
        self.spilled = 0
        self.promoted = 0

    def on_evict(self, blocks: Sequence[KVCacheBlock], kv_pool: KVTensorPool) -> None:
        data = kv_pool.read_blocks([b.block_id for b in blocks])
        for block, kv in zip(blocks, data, strict=True):
            assert block.block_hash is not None
            self.blocks[block.block_hash] = (block.token_ids, kv.clone())
        self.spilled += len(blocks)

    def promote(
        self, request: CacheRequest, gpu_hit: PrefixHit, block_pool: BlockPool, kv_pool: KVTensorPool
    ) -> Promotion:
        size = block_pool.block_size
        first = len(gpu_hit.blocks)
        limit = (request.num_tokens - 1) // size
        found: list[tuple[BlockHash, torch.Tensor]] = []
        for index in range(first, limit):
            block_hash = request.block_hashes[index]
            entry = self.blocks.get(block_hash)
            if entry is None or entry[0] != tuple(request.token_ids[index * size : (index + 1) * size]):
                break
            found.append((block_hash, entry[1]))
        found = found[: max(0, block_pool.num_free_blocks - len(gpu_hit.blocks) - 4)]  # leave room to compute
        if not found:
            return Promotion(gpu_hit, {})
        block_pool.touch(gpu_hit.blocks)  # allocating below must not evict the GPU hit
        new_blocks = block_pool.get_new_blocks(len(found))
        kv_pool.write_blocks([b.block_id for b in new_blocks], torch.stack([kv for _, kv in found]))
        blocks = [*gpu_hit.blocks, *new_blocks]
        block_pool.cache_full_blocks(blocks, request.block_hashes, first, len(blocks), request.token_ids,
                                     lora_name=request.lora_name)  # fmt: skip
        block_pool.free_blocks([*reversed(new_blocks), *reversed(gpu_hit.blocks)])
        self.promoted += len(found)
        return Promotion(PrefixHit(tuple(blocks), len(blocks) * size), {Medium.CPU: len(found) * size})


def test_spilled_blocks_promoted_back_give_the_uncached_output(reference: Reference) -> None:
    tier = DictTier()
    worker = KVWorker("tiered", make_config(num_blocks=24, events=False), offload=tier)
    try:
        rng = random.Random(12)
        documents = [random_tokens(rng, 96) for _ in range(4)]  # 6 blocks each: they cannot all stay on GPU
        for _ in range(3):
            for doc in documents:
                request = GenerateRequest(doc + random_tokens(rng, 5), 6)
                result = worker.generate(request)
                assert result.output_token_ids == reference(request)
                assert result.cached_tokens == sum(result.cached_tokens_by_medium.values())
                worker.check_invariants()
        assert tier.spilled > 0 and tier.promoted > 0
        last = worker.generate(GenerateRequest(documents[0] + [1, 2, 3], 2))
        assert last.cached_tokens_by_medium["CPU"] > 0
    finally:
        worker.shutdown()


def test_attach_offload_replaces_the_connector(reference: Reference) -> None:
    worker = KVWorker("late", make_config(num_blocks=12, events=False))
    try:
        tier = DictTier()
        worker.attach_offload(tier)
        rng = random.Random(13)
        for _ in range(4):
            request = GenerateRequest(random_tokens(rng, 100), 4)
            assert worker.generate(request).output_token_ids == reference(request)
        assert tier.spilled > 0
    finally:
        worker.shutdown()
