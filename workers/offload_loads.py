"""The offloader's load path: a waiting request's blocks promoted from a lower tier at admission.

Shape
-----
Each waiting request the scheduler considers goes through an
:class:`Admission` (one per request id, in ``LoadPath.admissions``)::

    LOOKUP --answer 0 / given up--> PLAIN
       |answer n
    LOOKED_UP --no room / tier down--> PLAIN
       |blocks allocated, load job queued
    LOADING --copy failed / nothing filled / given up--> PLAIN
       |filled blocks registered
    READY  --admitted: holds dropped-->  (gone)

1. The first time the scheduler considers a waiting request, a ``lookup``
   job is queued for its blocks past the GPU prefix hit and the request is
   *skipped* (others are admitted behind it).
2. When the answer is back (``n`` blocks held), the pool blocks are
   allocated once (at most the free blocks less ``reserve_blocks``), the
   GPU hit blocks are held (a pool reference) so nothing evicts them, and a
   ``load`` job fills the new blocks. The request is LOADING: still
   skipped, other requests keep stepping.
3. When the load is back, the filled blocks (a prefix of the new ones) are
   registered in the prefix cache -- only now, after their copy succeeded,
   so no request can hit a block that is not filled -- and the rest are
   freed. The request is READY: the scheduler admits it with the extended
   hit (:meth:`LoadPath.admitted` then drops the holds, which the admission
   has taken over).

Invariants
    - An admission's pool references (``held``: its GPU hit and new
      blocks) are dropped exactly once: when its load is collected
      (unfilled ones, or all of them when given up), or, READY, in
      :meth:`~LoadPath.admitted` or :meth:`~LoadPath.abort`.
    - A block is registered in the prefix cache only after the load
      reported it filled. A failed job (the backend raised) fills nothing.

Failure modes
    A lookup or load that has not answered after ``wait_s`` is given up:
    the request is admitted with its GPU hit and recomputes the rest; the
    blocks of a load still copying stay held until the copy ends, and are
    then freed. A failed or partial load fills fewer blocks; a request
    dropped while loading leaves its blocks to be freed the same way. While
    any job has waited past ``wait_s``, or the tier is down, no lookup is
    queued: requests are admitted with their GPU hit.

    A READY request waits for its admission with its blocks held; a load is
    sized to the blocks free when it starts, so the request may need more
    than are free by then. If the request at the head of the queue cannot be
    allocated and nothing is running (so nothing else will free a block),
    the scheduler gives up the other requests' READY holds
    (:meth:`LoadPath.release_ready`): their loaded blocks stay cached (a
    later GPU hit still finds them unless they are evicted first), and the
    head gets the room. Without that, such holds could keep the head out,
    and so every request behind it, forever.
"""

from __future__ import annotations

import enum
from collections import Counter

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.events import Medium
from kvstore.kv_cache_manager import CacheRequest, PrefixHit
from kvstore.tiers.blocks import BlockMeta
from kvstore.workers.metrics import OffloadCounters
from kvstore.workers.offload_backend import LinkedOffload, OffloadBackend, Promotion
from kvstore.workers.offload_jobs import Job, JobKind, OffloadThread


class Phase(enum.Enum):
    LOOKUP = "lookup"  # a lookup job is queued or running
    LOOKED_UP = "looked_up"  # the answer is in: the next admit allocates and starts the load
    LOADING = "loading"  # a load job fills the new blocks
    READY = "ready"  # loaded: admit with ``promotion`` (its blocks held)
    PLAIN = "plain"  # nothing to load, or gave up: admit with the GPU hit


class Admission:
    """One waiting request's way through lookup and load."""

    __slots__ = ("first", "gpu_blocks", "held", "new_blocks", "phase", "promotion", "request", "started", "tier_blocks")

    def __init__(self, request: CacheRequest, first: int, now: float) -> None:
        self.request = request
        self.phase = Phase.LOOKUP
        self.started = now
        self.first = first  # the GPU hit's length (blocks) when the lookup was made
        self.tier_blocks = 0  # the lookup's answer: blocks held from ``first`` on
        self.gpu_blocks: tuple[KVCacheBlock, ...] = ()
        self.new_blocks: list[KVCacheBlock] = []
        self.held = False  # the step loop still holds gpu_blocks and new_blocks for this admission
        self.promotion: Promotion | None = None


class LoadPath:
    """Lookups and loads at admission (see the module docstring); runs on the step loop, under the worker's lock."""

    def __init__(
        self,
        backend: OffloadBackend,
        block_pool: BlockPool,
        jobs: OffloadThread,
        counters: OffloadCounters,
        *,
        reserve_blocks: int,
        wait_s: float,
    ) -> None:
        self.backend = backend
        self.block_pool = block_pool
        self.reserve_blocks = reserve_blocks
        self.wait_s = wait_s
        self.counters = counters
        self._jobs = jobs
        self.admissions: dict[str, Admission] = {}  # request id -> its lookup/load

    def admit(self, request: CacheRequest, gpu_hit: PrefixHit, now: float) -> Promotion | None:
        """The hit to admit ``request`` with, or None while its lookup or load runs (skip it for now)."""
        key = request.request_id
        admission = self.admissions.get(key)
        if admission is not None:
            phase = admission.phase
            if phase is Phase.READY:
                return admission.promotion
            if phase is Phase.PLAIN:
                return Promotion(gpu_hit, {})
            if phase is Phase.LOOKED_UP:
                return self._start_load(admission, gpu_hit, now)
            if now - admission.started > self.wait_s:  # the tier is slow: recompute instead of waiting
                self.counters.gave_up += 1
                self._give_up(admission)
                return Promotion(gpu_hit, {})
            return None
        backend = self.backend
        if not backend.connected:
            if isinstance(backend, LinkedOffload):
                backend.counters.promote_skipped += 1
            return Promotion(gpu_hit, {})
        if self._jobs.slow(now, self.wait_s):  # a job has waited on the tier past wait_s: queue none behind it
            self.counters.slow_skipped += 1
            return Promotion(gpu_hit, {})
        first = len(gpu_hit.blocks)
        limit = (request.num_tokens - 1) // self.block_pool.block_size  # a hit never covers the last token
        if limit <= first:
            return Promotion(gpu_hit, {})
        metas = BlockMeta.chain(
            request.block_hashes[:limit], request.token_ids, self.block_pool.block_size, start=first
        )
        admission = Admission(request, first, now)
        self.admissions[key] = admission
        self.counters.lookups += 1
        self._jobs.submit(Job(JobKind.LOOKUP, metas, [], admission))
        return None

    def admitted(self, request: CacheRequest) -> None:
        """``request`` was admitted (``allocate_slots`` took its hit): drop the holds on it."""
        admission = self.admissions.pop(request.request_id, None)
        if admission is not None and admission.phase is Phase.READY:
            self._release_admission(admission)

    def abort(self, request: CacheRequest) -> None:
        """A waiting ``request`` is dropped: forget its lookup/load (a running job's blocks are freed when it ends)."""
        admission = self.admissions.pop(request.request_id, None)
        if admission is not None:
            self._give_up(admission)

    def release_ready(self, keep: CacheRequest) -> int:
        """Give up every READY admission but ``keep``'s, dropping its holds (it is admitted with its GPU hit
        later). Returns how many pool references were dropped."""
        dropped = 0
        for key, admission in self.admissions.items():
            if key != keep.request_id and admission.phase is Phase.READY and admission.held:
                dropped += len(admission.gpu_blocks) + len(admission.new_blocks)
                self._give_up(admission)
        return dropped

    def give_up_all(self) -> None:
        """Forget every admission: READY ones' holds go now, LOADING ones' when their jobs are collected."""
        for admission in list(self.admissions.values()):
            self._give_up(admission)
        self.admissions.clear()

    def count_held(self, refs: Counter[int]) -> None:
        """Add the pool references this path holds, by block id, to ``refs``."""
        for admission in self._holding():
            refs.update(b.block_id for b in (*admission.gpu_blocks, *admission.new_blocks))

    def lookup_done(self, job: Job) -> None:
        admission = job.admission
        assert admission is not None
        if job.cancelled or admission.phase is not Phase.LOOKUP:
            return
        found = job.result if isinstance(job.result, int) else 0
        if found <= 0:
            admission.phase = Phase.PLAIN
            return
        admission.tier_blocks = found
        admission.phase = Phase.LOOKED_UP

    def load_done(self, job: Job) -> None:
        admission = job.admission
        assert admission is not None
        media = job.result if isinstance(job.result, tuple) else ()
        pool, request = self.block_pool, admission.request
        filled = admission.new_blocks[: len(media)]
        blocks = [*admission.gpu_blocks, *filled]
        if filled:  # their copy succeeded: only now may anything hit them
            first = len(admission.gpu_blocks)
            pool.cache_full_blocks(
                blocks, request.block_hashes, first, len(blocks), request.token_ids,
                lora_name=request.lora_name, cache_salt=request.cache_salt,
            )  # fmt: skip
            self.counters.blocks_loaded += len(filled)
        pool.free_blocks(admission.new_blocks[len(filled) :])
        self.counters.loads_done += 1
        if admission.phase is not Phase.LOADING or job.cancelled or not filled:
            # given up or dropped while loading, or nothing came: free the rest (the filled blocks stay cached)
            pool.free_blocks([*reversed(filled), *reversed(admission.gpu_blocks)])
            admission.held = False
            admission.gpu_blocks, admission.new_blocks = (), []
            if admission.phase is Phase.LOADING:
                admission.phase = Phase.PLAIN
            return
        admission.new_blocks = filled
        size = pool.block_size
        by_medium = {Medium.CPU: 0, Medium.STORAGE: 0}
        for medium in media:
            by_medium[medium] = by_medium.get(medium, 0) + size
        admission.promotion = Promotion(PrefixHit(tuple(blocks), len(blocks) * size), by_medium)
        admission.phase = Phase.READY

    # ------------------------------------------------------------ internals

    def _start_load(self, admission: Admission, gpu_hit: PrefixHit, now: float) -> Promotion | None:
        request, pool, size = admission.request, self.block_pool, self.block_pool.block_size
        first = len(gpu_hit.blocks)
        limit = (request.num_tokens - 1) // size
        end = min(limit, admission.first + admission.tier_blocks)
        spare = pool.num_free_blocks - sum(1 for b in gpu_hit.blocks if b.ref_cnt == 0) - self.reserve_blocks
        count = min(end - first, spare)
        if count <= 0 or not self.backend.connected:
            admission.phase = Phase.PLAIN
            return Promotion(gpu_hit, {})
        pool.touch(gpu_hit.blocks)  # allocating below must not evict the GPU hit; held until admitted
        new_blocks = pool.get_new_blocks(count)
        admission.gpu_blocks = gpu_hit.blocks
        admission.new_blocks = new_blocks
        admission.held = True
        admission.first = first
        admission.phase = Phase.LOADING
        admission.started = now
        metas = BlockMeta.chain(request.block_hashes[: first + count], request.token_ids, size, start=first)
        self.counters.loads_started += 1
        self._jobs.submit(Job(JobKind.LOAD, metas, new_blocks, admission))
        return None

    def _release_admission(self, admission: Admission) -> None:
        if admission.held:
            self.block_pool.free_blocks([*reversed(admission.new_blocks), *reversed(admission.gpu_blocks)])
            admission.held = False
            admission.gpu_blocks, admission.new_blocks = (), []

    def _give_up(self, admission: Admission) -> None:
        """Stop waiting for ``admission``: a READY one's holds go now, a LOADING one's when its job is collected."""
        if admission.phase is Phase.READY:
            self._release_admission(admission)
        else:
            for job in self._jobs.outstanding:
                if job.admission is admission:
                    job.cancelled = True  # not run if not started; if running, its blocks are freed when collected
        admission.phase = Phase.PLAIN
        admission.promotion = None

    def _holding(self) -> list[Admission]:
        """Admissions whose blocks the path holds (waiting requests', and given-up loads still copying)."""
        seen = {id(a): a for a in self.admissions.values() if a.held}
        for job in self._jobs.outstanding:
            if job.admission is not None and job.admission.held:
                seen[id(job.admission)] = job.admission
        return list(seen.values())
