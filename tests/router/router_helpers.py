"""Real producers for index tests: a KVCacheManager driven by a random workload.

A :class:`WorkloadProducer` owns a real BlockPool and KVCacheManager and runs
a scheduler-like random workload on them: requests from a few shared prefix
groups (so blocks are shared, hit, duplicated and evicted), decoding some
tokens, finishing at random. After every step it drains the pool's events,
exactly as a worker publishes them once per step.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable

from kvstore.block_pool import BlockPool
from kvstore.events import KVEvent
from kvstore.hashing import BlockHash, BlockHasher, to_external
from kvstore.kv_cache_manager import CacheRequest, KVCacheManager
from kvstore.publisher import Snapshot, ZmqEventPublisher
from kvstore.router.index import PrefixIndex

BLOCK_SIZE = 4


class WorkloadProducer:
    """A real pool + manager under a random workload; ``step()`` returns that step's events."""

    def __init__(
        self,
        seed: int,
        *,
        num_blocks: int = 64,
        hash_seed: str = "kvstore",
        medium: str = "GPU",
        groups: int = 4,
        lora_names: tuple[str | None, ...] = (None,),
    ) -> None:
        self.rng = random.Random(seed)
        self.hasher = BlockHasher("sha256_cbor", hash_seed, BLOCK_SIZE)
        self.pool = BlockPool(num_blocks, block_size=BLOCK_SIZE, medium=medium)
        self.manager = KVCacheManager(self.pool, self.hasher, watermark=0.0)
        self.prefixes = [[self.rng.randrange(1000) for _ in range(BLOCK_SIZE * 3)] for _ in range(groups)]
        self.lora_names = lora_names
        self.running: list[CacheRequest] = []
        self.lock = threading.Lock()  # held while stepping and while snapshotting
        self._next_id = 0
        self.all_requests: list[CacheRequest] = []

    def step(self) -> list[KVEvent]:
        rng = self.rng
        action = rng.random()
        if action < 0.45 or not self.running:
            self._admit()
        elif action < 0.75:
            request = rng.choice(self.running)
            request.append_tokens([rng.randrange(1000) for _ in range(rng.randint(1, BLOCK_SIZE + 1))])
            missing = request.num_tokens - self.manager.num_tokens_reserved(request.request_id)
            if self.manager.allocate_slots(request, missing) is None:
                self._finish(request)
        else:
            self._finish(rng.choice(self.running))
        if rng.random() < 0.01 and not self.running:
            self.pool.reset_prefix_cache()
        return self.pool.take_events()

    def _admit(self) -> None:
        rng = self.rng
        prefix = rng.choice(self.prefixes)
        if rng.random() < 0.3:
            # A block-aligned prompt equal to a cached one recomputes its last block: a duplicate hash.
            tokens = list(prefix)
        else:
            tokens = prefix[: rng.randint(0, len(prefix))] + [rng.randrange(1000) for _ in range(rng.randint(1, 12))]
        request = CacheRequest(f"r{self._next_id}", tokens, lora_name=rng.choice(self.lora_names))
        self._next_id += 1
        hit = self.manager.get_computed_blocks(request)
        if self.manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit) is None:
            if self.running:  # make room for later admissions, as a scheduler preempts
                self._finish(self.running[0])
            return
        self.running.append(request)
        self.all_requests.append(request)

    def _finish(self, request: CacheRequest) -> None:
        self.manager.free(request)
        self.running.remove(request)

    def cached(self) -> Counter[int]:
        """The pool's cache right now: external hash -> number of blocks holding it."""
        return Counter(block.external_hash for block in self.pool.cached_blocks() if block.external_hash is not None)

    def cached_rekeyed(self, ours: BlockHasher) -> Counter[int]:
        """The cache under OUR hashes: each request's chain hashed by both hashers, then mapped."""
        translate: dict[BlockHash, int] = {}
        for request in self.all_requests:
            mine = ours.hash_blocks(request.token_ids, lora_name=request.lora_name)
            for theirs, our in zip(request.block_hashes, mine, strict=False):
                translate[theirs] = to_external(our)
        return Counter(translate[b.block_hash] for b in self.pool.cached_blocks() if b.block_hash is not None)

    def snapshot(self, publisher: ZmqEventPublisher) -> Snapshot:
        with self.lock:
            return Snapshot(publisher.last_seq, self.pool.snapshot_events())


def held(index: PrefixIndex, producer: str, medium: str = "GPU") -> Counter[int]:
    """What the index believes ``producer`` holds on ``medium``."""
    return index.dump().get(producer, {}).get(medium, Counter())


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
