"""The two halves of a simulated replica: its block cache and its work queue.

:class:`BlockCache` is a finite LRU cache of blocks -- a real
:class:`~kvstore.block_pool.BlockPool`, driven as a worker's KV cache manager
drives it -- that hands every store and eviction, as the pool's own
``BlockStored``/``BlockRemoved`` events, to a publish callback (the
simulator applies them to a real :class:`~router.index.PrefixIndex`).
Requests are not kept running in the cache: a prompt's blocks are looked up,
allocated, cached and freed at once, so the pool is a pure LRU of prompts
with vLLM's eviction order (a request's tail before its shared prefix).

:class:`WorkQueue` is a FIFO server draining work at a fixed rate (token
equivalents per second): the simplest load model where routing more work to
a replica makes its later requests wait.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.events import KVEvent
from kvstore.hashing import BlockHash

Publish = Callable[[list[KVEvent]], None]


class BlockCache:
    """An LRU cache of ``capacity_blocks`` blocks that publishes what it stores and evicts."""

    def __init__(self, capacity_blocks: int, block_size: int, publish: Publish | None = None) -> None:
        self.pool = BlockPool(capacity_blocks, block_size=block_size)
        self.block_size = block_size
        self._publish = publish

    @property
    def capacity_blocks(self) -> int:
        return self.pool.num_blocks

    def cached_prefix(self, digests: Sequence[BlockHash]) -> int:
        """Leading blocks of ``digests`` cached now (no side effect)."""
        count = 0
        for digest in digests:
            if self.pool.get_cached_block(digest) is None:
                break
            count += 1
        return count

    def serve(self, digests: Sequence[BlockHash], token_ids: Sequence[int]) -> int:
        """Serve one prompt: count its cached prefix, cache the rest, publish the events.

        ``token_ids`` covers the full blocks of ``digests``. A prompt longer
        than the cache is cached up to the cache's capacity. Returns the
        number of leading blocks that were cached before the call.
        """
        pool = self.pool
        hits: list[KVCacheBlock] = []
        for digest in digests:
            block = pool.get_cached_block(digest)
            if block is None:
                break
            hits.append(block)
        num_blocks = min(len(digests), pool.num_blocks)
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(max(0, num_blocks - len(hits)))
        pool.cache_full_blocks(blocks, digests, len(hits), num_blocks, token_ids)
        pool.free_blocks(reversed(blocks))
        events = pool.take_events()
        if events and self._publish is not None:
            self._publish(events)
        return len(hits)


class WorkQueue:
    """A FIFO server of fixed speed: work (token equivalents) queues, then drains at ``rate`` per second."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"drain rate must be > 0 tokens/s, got {rate}")
        self.rate = rate
        self.busy_until = 0.0  # when the work accepted so far is done (seconds)
        self.total_work = 0.0  # everything ever assigned
        self._finishing: deque[float] = deque()  # completion times of requests not yet done

    def add(self, work: float, now: float) -> float:
        """Queue a request's work at time ``now``; returns how long it waits before starting."""
        start = max(now, self.busy_until)
        self.busy_until = start + work / self.rate
        self.total_work += work
        self._finishing.append(self.busy_until)
        return start - now

    def outstanding(self, now: float) -> float:
        """Work not yet done at ``now``, in token equivalents."""
        return max(0.0, self.busy_until - now) * self.rate

    def in_flight(self, now: float) -> int:
        """Requests not finished at ``now`` (queued or being served)."""
        finishing = self._finishing
        while finishing and finishing[0] <= now:
            finishing.popleft()
        return len(finishing)
