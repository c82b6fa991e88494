"""The tier seam, exercised by a real (in-process, dict-backed) lower tier.

``DictTier`` is an OffloadBackend: it keeps every stored block's KV keyed by
its hash and loads it back at admission, following the contracts in
``workers.offload``. The worker's pool is far smaller than the workload, so
blocks really are stored, evicted and loaded -- and greedy output must still
equal the uncached model's. Every tier call runs on the offload thread.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import torch
from workers_testlib import Reference, make_config, random_tokens

from kvstore.events import Medium
from kvstore.tiers.blocks import BlockMeta
from kvstore.worker_api import GenerateRequest
from kvstore.workers.worker import KVWorker


class DictTier:
    """An OffloadBackend whose tier is a dict: block hash -> (parent, tokens, KV of the block).

    Its calls run on the worker's offload thread; the dict is its own.
    """

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...], torch.Tensor]] = {}
        self.stored = 0
        self.loaded = 0
        self.connected = True
        self.threads: set[str] = set()

    def lookup(self, blocks: Sequence[BlockMeta]) -> int:
        self.threads.add(threading.current_thread().name)
        return len(self._held(blocks))

    def store(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> int:
        self.threads.add(threading.current_thread().name)
        new = 0
        for meta, block_id in zip(blocks, block_ids, strict=True):
            if meta.block_hash not in self.blocks:
                self.blocks[meta.block_hash] = (meta.parent_hash, meta.token_ids, kv[block_id].clone())
                new += 1
        self.stored += new
        return new

    def load(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> tuple[Medium, ...]:
        self.threads.add(threading.current_thread().name)
        found = self._held(blocks)[: len(block_ids)]
        for (_, _, data), block_id in zip(found, block_ids, strict=False):
            kv[block_id].copy_(data)
        self.loaded += len(found)
        return (Medium.CPU,) * len(found)

    def _held(self, blocks: Sequence[BlockMeta]) -> list[tuple[int | None, tuple[int, ...], torch.Tensor]]:
        found = []
        for meta in blocks:
            entry = self.blocks.get(meta.block_hash)
            if entry is None or entry[:2] != (meta.parent_hash, meta.token_ids):  # the collision guard
                break
            found.append(entry)
        return found


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
        assert tier.stored > 0 and tier.loaded > 0
        last = worker.generate(GenerateRequest(documents[0] + [1, 2, 3], 2))
        assert last.cached_tokens_by_medium["CPU"] > 0
        assert tier.threads == {"kv-offload"}, tier.threads  # never the step loop, never a caller
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
        assert worker.drain_offload()
        assert tier.stored > 0
    finally:
        worker.shutdown()
