"""The offloader's store path: cached blocks copied to a lower tier *before* the pool evicts them.

Why ahead of eviction
---------------------
The pool's eviction hook fires when a block's memory is about to be handed
to a new owner; there is no time left to copy then without the step loop
waiting. So after each step (and right after a step freed blocks)
:meth:`StorePath.launch` walks the free queue from its head (the next to be
evicted), holds (pool reference) every cached block not yet stored -- by
default no cap, so a freed block is held in the same locked section that
freed it, while it is still at the queue's tail -- and queues one ``store``
job. A held block cannot be reused: allocations that need it wait (the
scheduler does not preempt while stores hold blocks; they come back in
milliseconds). When its job is collected (:meth:`StorePath.done`) the
block is released to the free queue's tail -- where it was, give or take
the blocks freed during the copy.

Data structures
    - ``settled``: block id -> the hash it held when it was stored (or
      refused by the tier, or skipped while the tier was down). A block is
      not stored again while it keeps that content; the entry goes when the
      pool evicts the block (:meth:`StorePath.on_evict`).
    - ``held``: how many pool blocks store jobs hold now.

Invariants
    - A store job's blocks are held from its submission to its collection,
      so they are still cached under the same hash when the job ends; the
      hold is dropped exactly once, at collection (cancelled or not).
    - A failed job (the backend raised) stores nothing; its blocks are
      settled all the same (not retried while they keep their content).

Failure modes
    A block evicted before it was settled (past ``scan_limit``, or a slow
    tier: while a job has waited past ``wait_s`` no new blocks are held)
    has its KV dropped, as with no tier, and counted
    (``store_missed_blocks``); the step loop never waits for a copy. While
    the tier is down the blocks found are settled unstored and counted on
    the tier link (``spill_skipped_blocks``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.hashing import BlockHash
from kvstore.tiers.blocks import BlockMeta
from kvstore.workers.metrics import OffloadCounters
from kvstore.workers.offload_backend import LinkedOffload, OffloadBackend
from kvstore.workers.offload_jobs import Job, JobKind, OffloadThread


class StorePath:
    """Stores ahead of eviction (see the module docstring); runs on the step loop, under the worker's lock."""

    def __init__(
        self,
        backend: OffloadBackend,
        block_pool: BlockPool,
        jobs: OffloadThread,
        counters: OffloadCounters,
        *,
        max_store_blocks: int,
        scan_limit: int,
        wait_s: float,
    ) -> None:
        self.backend = backend
        self.block_pool = block_pool
        self.max_store_blocks = max_store_blocks
        self.scan_limit = scan_limit
        self.wait_s = wait_s
        self.counters = counters
        self._jobs = jobs
        self.settled: dict[int, BlockHash] = {}  # block id -> the hash it held when stored (or given up)
        self.held = 0  # blocks held by store jobs

    def launch(self, now: float) -> None:
        """Hold cached free blocks not yet stored, from the free queue's head, and queue one store job."""
        room = self.max_store_blocks - self.held
        if room <= 0 or self._jobs.slow(now, self.wait_s):  # a slow tier: hold no more blocks for it
            return
        chosen: list[KVCacheBlock] = []
        settled = self.settled
        for scanned, block in enumerate(self.block_pool.iter_free()):
            if scanned >= self.scan_limit or len(chosen) >= room:
                break
            if block.block_hash is not None and settled.get(block.block_id) != block.block_hash:
                chosen.append(block)
        if not chosen:
            return
        backend = self.backend
        if not backend.connected:  # the tier is down: these blocks' KV goes when they are evicted
            for block in chosen:
                settled[block.block_id] = block.block_hash  # type: ignore[assignment]
            if isinstance(backend, LinkedOffload):
                backend.counters.spill_skipped_blocks += len(chosen)
            return
        self.block_pool.touch(chosen)
        self.held += len(chosen)
        self.counters.stores_started += 1
        self._jobs.submit(Job(JobKind.STORE, [BlockMeta.from_pool_block(b) for b in chosen], chosen, None))

    def done(self, job: Job) -> None:
        """A store job was collected: settle its blocks and release them to the free queue."""
        if isinstance(job.result, int):
            self.counters.blocks_stored += job.result
        settled = self.settled
        for block in job.blocks:  # held all along: still cached under the same hash
            assert block.block_hash is not None
            settled[block.block_id] = block.block_hash  # stored, or refused by the tier: either way not again
        self.held -= len(job.blocks)
        self.counters.stores_done += 1
        self.block_pool.free_blocks(job.blocks)

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        """The pool's eviction hook: never copies. A block evicted before it was stored loses its KV (counted)."""
        settled = self.settled
        missed = 0
        for block in blocks:
            if settled.pop(block.block_id, None) != block.block_hash:
                missed += 1
        self.counters.store_missed_blocks += missed

    def count_held(self, refs: Counter[int]) -> None:
        """Add the pool references store jobs hold, by block id, to ``refs``."""
        for job in self._jobs.outstanding:
            if job.kind is JobKind.STORE:
                refs.update(b.block_id for b in job.blocks)
