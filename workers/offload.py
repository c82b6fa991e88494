"""The seam where a lower tier (CPU arena, disk) plugs into a worker, kept off the step loop.

Shape
-----
A lower tier is an :class:`OffloadBackend`: three *blocking* calls --
``lookup`` (how many of these blocks do you hold, from the first),
``store`` (copy these pool rows out) and ``load`` (copy the blocks you
hold into these pool rows). The worker never makes them on its step loop.
An :class:`Offloader` (one per worker, wired in one place:
:meth:`kvstore.workers.worker.KVWorker.attach_offload`) runs them on ONE
offload thread, one at a time, and the step loop only does bookkeeping:
it hands jobs over and, at the start of each step, collects the finished
ones. Lookups are taken before queued loads and stores (an admission waits
on them). The split follows vLLM's offloading connector (a scheduler-side
manager that decides, a worker-side handler that copies); here both halves
live in the worker process.

Loads (at admission, :meth:`Offloader.admit`)
    1. The first time the scheduler considers a waiting request, a
       ``lookup`` job is queued for its blocks past the GPU prefix hit and
       the request is *skipped* (others are admitted behind it).
    2. When the answer is back (``n`` blocks held), the pool blocks are
       allocated once (at most the free blocks less ``reserve_blocks``),
       the GPU hit blocks are held (a pool reference) so nothing evicts
       them, and a ``load`` job fills the new blocks. The request is
       LOADING: still skipped, other requests keep stepping.
    3. When the load is back, the filled blocks (a prefix of the new ones)
       are registered in the prefix cache -- only now, after their copy
       succeeded, so no request can hit a block that is not filled -- and
       the rest are freed. The request is READY: the scheduler admits it
       with the extended hit (:meth:`Offloader.admitted` then drops the
       holds, which the admission has taken over).
    A lookup or load that has not answered after ``wait_s`` is given up:
    the request is admitted with its GPU hit and recomputes the rest; the
    blocks of a load still copying stay held until the copy ends, and are
    then freed. A failed or partial load fills fewer blocks; a request
    dropped while loading leaves its blocks to be freed the same way.

Stores (:meth:`Offloader.launch_stores`, ahead of eviction)
    The pool's eviction hook fires when a block's memory is about to be
    handed to a new owner; there is no time left to copy then without the
    step loop waiting. So blocks are stored *before* they are evicted:
    after each step (and right after a step freed blocks) the offloader
    walks the free queue from its head (the next to be evicted), holds
    (pool reference) every cached block not yet stored -- by default no
    cap, so a freed block is held in the same locked section that freed
    it, while it is still at the queue's tail -- and queues one ``store``
    job. A held block cannot be reused: allocations that need it wait (the
    scheduler does not preempt while stores hold blocks; they come back in
    milliseconds). When its job ends it is released to the free queue's
    tail -- where it was, give or take the blocks freed during the copy --
    *settled*: ``_settled[block_id]`` is the hash it held, so it is not
    stored again while it keeps that content. A block evicted before it
    was settled (the scan limit, or a slow tier: no new holds then) has
    its KV dropped, as with no tier, and counted (``store_missed_blocks``);
    the step loop never waits for a copy.

Invariants
    - Every pool reference the offloader takes is dropped exactly once: a
      store hold when its job is collected, a load's blocks when the load
      is collected (unfilled ones, or all of them when given up), a READY
      request's hit in :meth:`admitted` or :meth:`abort`.
    - A block is registered in the prefix cache by a load only after the
      load reported it filled. A failed job (the backend raised) fills
      nothing and stores nothing.
    - The offload thread touches only the backend and the KV tensor rows
      of jobs it was given (held blocks); never the pool or the worker.
      Everything else runs on the step loop, under the worker's lock.

Time the step loop spends inside the offloader is counted
(``counters.step_loop_seconds``), so "the step loop never waits on a
copy" is measured, not assumed.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.events import Medium
from kvstore.hashing import BlockHash
from kvstore.kv_cache_manager import CacheRequest, PrefixHit
from kvstore.tiers.blocks import BlockMeta
from kvstore.workers.kv_tensor_pool import KVTensorPool
from kvstore.workers.metrics import OffloadCounters, OffloadState, TierLinkCounters

logger = logging.getLogger(__name__)


class Promotion(NamedTuple):
    hit: PrefixHit  # the GPU hit extended by the loaded blocks (all now cached in the pool)
    promoted_tokens: Mapping[Medium, int]  # tokens loaded, by source medium (CPU, STORAGE)


class OffloadBackend(Protocol):
    """A lower tier's blocking calls; the worker makes them only on its offload thread, one at a time.

    ``kv`` is the worker's whole KV tensor (block rows first). Outages are
    the backend's to absorb (answer 0 / nothing, and report ``connected``
    False); anything it raises is logged as a fault and the job treated as
    having done nothing.
    """

    @property
    def connected(self) -> bool:
        """Whether the tier is reachable now; read on the step loop, so it must be cheap."""
        ...

    def lookup(self, blocks: Sequence[BlockMeta]) -> int:
        """How many of ``blocks``, counting from the first, the tier holds."""
        ...

    def store(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> int:
        """Copy pool rows ``block_ids`` out as ``blocks``; returns how many the tier newly stored."""
        ...

    def load(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> tuple[Medium, ...]:
        """Fill pool rows ``block_ids`` with the longest prefix of ``blocks`` held; the media of those filled."""
        ...


@runtime_checkable
class LinkedOffload(Protocol):
    """A backend linked to a tier that can go away: the worker exports its link's metrics."""

    counters: TierLinkCounters

    @property
    def connected(self) -> bool: ...


class NoOffload:
    """No lower tier: evicted KV is dropped, nothing is loaded (the worker runs no offload thread)."""

    connected = False

    def lookup(self, blocks: Sequence[BlockMeta]) -> int:
        return 0

    def store(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> int:
        return 0

    def load(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> tuple[Medium, ...]:
        return ()


# ---------------------------------------------------------------------- jobs


class _Kind(enum.Enum):
    LOOKUP = "lookup"
    STORE = "store"
    LOAD = "load"


class _Job:
    __slots__ = ("admission", "blocks", "cancelled", "error", "finished", "kind", "metas", "result", "submitted")

    def __init__(
        self, kind: _Kind, metas: list[BlockMeta], blocks: list[KVCacheBlock], admission: _Admission | None
    ) -> None:
        self.kind = kind
        self.metas = metas
        self.blocks = blocks  # pool blocks the job copies to or from (held by the offloader)
        self.admission = admission
        self.cancelled = False  # set on the step loop: a lookup/load nobody waits for is not run
        self.result: int | tuple[Medium, ...] | None = None
        self.error: BaseException | None = None
        self.submitted = time.monotonic()
        self.finished = False  # set by the offload thread when the backend call returned


class _Phase(enum.Enum):
    LOOKUP = "lookup"  # a lookup job is queued or running
    LOOKED_UP = "looked_up"  # the answer is in: the next admit allocates and starts the load
    LOADING = "loading"  # a load job fills the new blocks
    READY = "ready"  # loaded: admit with ``promotion`` (its blocks held)
    PLAIN = "plain"  # nothing to load, or gave up: admit with the GPU hit


class _Admission:
    """One waiting request's way through lookup and load."""

    __slots__ = ("first", "gpu_blocks", "held", "new_blocks", "phase", "promotion", "request", "started", "tier_blocks")

    def __init__(self, request: CacheRequest, first: int, now: float) -> None:
        self.request = request
        self.phase = _Phase.LOOKUP
        self.started = now
        self.first = first  # the GPU hit's length (blocks) when the lookup was made
        self.tier_blocks = 0  # the lookup's answer: blocks held from ``first`` on
        self.gpu_blocks: tuple[KVCacheBlock, ...] = ()
        self.new_blocks: list[KVCacheBlock] = []
        self.held = False  # the step loop still holds gpu_blocks and new_blocks for this admission
        self.promotion: Promotion | None = None


# ------------------------------------------------------------------ offloader


class Offloader:
    """The step loop's side of the seam (see the module docstring); every method but the thread's runs under the
    worker's lock.

    ``wake`` is called (on the offload thread) whenever a job finishes, so
    an idle step loop collects it promptly.
    """

    def __init__(
        self,
        backend: OffloadBackend,
        block_pool: BlockPool,
        kv_pool: KVTensorPool,
        *,
        reserve_blocks: int = 4,
        max_store_blocks: int | None = None,
        wait_s: float = 2.0,
        scan_limit: int = 1024,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.backend = backend
        self.block_pool = block_pool
        self.kv_pool = kv_pool
        self.reserve_blocks = reserve_blocks
        self.max_store_blocks = max_store_blocks or block_pool.num_blocks
        self.wait_s = wait_s
        self.scan_limit = scan_limit
        self.counters = OffloadCounters()
        self._wake = wake or (lambda: None)
        # Queued jobs; lookups go first (an admission waits on them), then loads and stores in order.
        self._queue = threading.Condition(threading.Lock())  # never held while a job runs
        self._lookups: deque[_Job] = deque()
        self._others: deque[_Job] = deque()
        self._stopping = False
        self._done: deque[_Job] = deque()  # appended by the offload thread, drained by the step loop
        self._settled: dict[int, BlockHash] = {}  # block id -> the hash it held when stored (or given up)
        self._admissions: dict[str, _Admission] = {}  # request id -> its lookup/load
        self._store_held = 0  # blocks held by store jobs
        self._submitted = 0  # jobs handed to the thread and not collected yet
        self._outstanding: set[_Job] = set()  # those jobs (for cancellation and the invariant check)
        self._in_flight = dict.fromkeys(_Kind, 0)  # those jobs by kind, for scrapes (plain ints: read racily)
        self._idle = threading.Condition(threading.Lock())  # the thread's "no job running" for drain()
        self._running = False
        self._thread = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ step loop

    @property
    def busy(self) -> bool:
        """Jobs are queued, running, or finished and not collected."""
        return self._submitted > 0

    @property
    def store_held_blocks(self) -> int:
        """Pool blocks held by store jobs that are not stuck: they return to the free queue within milliseconds.

        0 while a job has waited on the tier past ``wait_s``: the scheduler then preempts as usual
        rather than wait for blocks that may be held until the tier's deadline.
        """
        return 0 if self._slow(time.monotonic()) else self._store_held

    @property
    def has_done(self) -> bool:
        return bool(self._done)

    def state(self) -> OffloadState:
        """For scrapes, from any thread: plain ints and the counters, no lock."""
        n = self._in_flight
        return OffloadState(self.counters, n[_Kind.LOOKUP], n[_Kind.LOAD], n[_Kind.STORE], self._store_held)

    def poll(self) -> None:
        """Collect finished jobs: release store holds, register loaded blocks, record lookup answers."""
        started = time.perf_counter()
        while self._done:
            job = self._done.popleft()
            self._submitted -= 1
            self._outstanding.discard(job)
            self._in_flight[job.kind] -= 1
            if job.kind is _Kind.STORE:
                self._store_done(job)
            elif job.kind is _Kind.LOOKUP:
                self._lookup_done(job)
            else:
                self._load_done(job)
        self._spent(started)

    def admit(self, request: CacheRequest, gpu_hit: PrefixHit) -> Promotion | None:
        """The hit to admit ``request`` with, or None while its lookup or load runs (skip it for now)."""
        started = time.perf_counter()
        try:
            return self._admit(request, gpu_hit, time.monotonic())
        finally:
            self._spent(started)

    def admitted(self, request: CacheRequest) -> None:
        """``request`` was admitted (``allocate_slots`` took its hit): drop the holds on it."""
        admission = self._admissions.pop(request.request_id, None)
        if admission is not None and admission.phase is _Phase.READY:
            self._release_admission(admission)

    def abort(self, request: CacheRequest) -> None:
        """A waiting ``request`` is dropped: forget its lookup/load (a running job's blocks are freed when it ends)."""
        admission = self._admissions.pop(request.request_id, None)
        if admission is not None:
            self._give_up(admission)

    def launch_stores(self) -> None:
        """Hold cached free blocks not yet stored, from the free queue's head, and queue one store job."""
        started = time.perf_counter()
        try:
            room = self.max_store_blocks - self._store_held
            if room <= 0 or self._slow(time.monotonic()):  # a slow tier: hold no more blocks for it
                return
            chosen: list[KVCacheBlock] = []
            settled = self._settled
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
            self._store_held += len(chosen)
            self.counters.stores_started += 1
            self._submit(_Job(_Kind.STORE, [BlockMeta.from_pool_block(b) for b in chosen], chosen, None))
        finally:
            self._spent(started)

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        """The pool's eviction hook: never copies. A block evicted before it was stored loses its KV (counted)."""
        settled = self._settled
        missed = 0
        for block in blocks:
            if settled.pop(block.block_id, None) != block.block_hash:
                missed += 1
        self.counters.store_missed_blocks += missed

    def held_refs(self) -> Counter[int]:
        """Pool references the offloader holds, by block id (for the scheduler's invariant check)."""
        refs: Counter[int] = Counter()
        for job in self._outstanding:
            if job.kind is _Kind.STORE:
                refs.update(b.block_id for b in job.blocks)
        for admission in self._holding:
            refs.update(b.block_id for b in (*admission.gpu_blocks, *admission.new_blocks))
        return refs

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued job has run, then collect them; False on timeout.

        Waits on copies: for tests, invariant checks and failure recovery only, never on a step.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._submitted > len(self._done) or self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        self.poll()
        return True

    def release_all(self, timeout: float | None = None) -> bool:
        """Cancel the jobs not started, drain, drop every hold (READY requests fall back to their GPU hit).

        Waits for the job running, if any (False if it outlives ``timeout``).
        """
        for job in self._outstanding:
            job.cancelled = True  # a cancelled store releases its blocks unstored
        drained = self.drain(timeout)
        for admission in list(self._admissions.values()):
            self._give_up(admission)
        self._admissions.clear()
        return drained and not self.held_refs()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the offload thread after the job it is running (queued jobs are dropped). Idempotent."""
        with self._queue:
            self._stopping = True
            self._queue.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------ internals

    def _admit(self, request: CacheRequest, gpu_hit: PrefixHit, now: float) -> Promotion | None:
        key = request.request_id
        admission = self._admissions.get(key)
        if admission is not None:
            phase = admission.phase
            if phase is _Phase.READY:
                return admission.promotion
            if phase is _Phase.PLAIN:
                return Promotion(gpu_hit, {})
            if phase is _Phase.LOOKED_UP:
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
        if self._slow(now):  # a job has waited on the tier past wait_s: do not queue another behind it
            self.counters.slow_skipped += 1
            return Promotion(gpu_hit, {})
        first = len(gpu_hit.blocks)
        limit = (request.num_tokens - 1) // self.block_pool.block_size  # a hit never covers the last token
        if limit <= first:
            return Promotion(gpu_hit, {})
        metas = BlockMeta.chain(
            request.block_hashes[:limit], request.token_ids, self.block_pool.block_size, start=first
        )
        admission = _Admission(request, first, now)
        self._admissions[key] = admission
        self.counters.lookups += 1
        self._submit(_Job(_Kind.LOOKUP, metas, [], admission))
        return None

    def _start_load(self, admission: _Admission, gpu_hit: PrefixHit, now: float) -> Promotion | None:
        request, pool, size = admission.request, self.block_pool, self.block_pool.block_size
        first = len(gpu_hit.blocks)
        limit = (request.num_tokens - 1) // size
        end = min(limit, admission.first + admission.tier_blocks)
        spare = pool.num_free_blocks - sum(1 for b in gpu_hit.blocks if b.ref_cnt == 0) - self.reserve_blocks
        count = min(end - first, spare)
        if count <= 0 or not self.backend.connected:
            admission.phase = _Phase.PLAIN
            return Promotion(gpu_hit, {})
        pool.touch(gpu_hit.blocks)  # allocating below must not evict the GPU hit; held until admitted
        new_blocks = pool.get_new_blocks(count)
        admission.gpu_blocks = gpu_hit.blocks
        admission.new_blocks = new_blocks
        admission.held = True
        admission.first = first
        admission.phase = _Phase.LOADING
        admission.started = now
        metas = BlockMeta.chain(request.block_hashes[: first + count], request.token_ids, size, start=first)
        self.counters.loads_started += 1
        self._submit(_Job(_Kind.LOAD, metas, new_blocks, admission))
        return None

    def _lookup_done(self, job: _Job) -> None:
        admission = job.admission
        assert admission is not None
        if job.cancelled or admission.phase is not _Phase.LOOKUP:
            return
        found = job.result if isinstance(job.result, int) else 0
        if found <= 0:
            admission.phase = _Phase.PLAIN
            return
        admission.tier_blocks = found
        admission.phase = _Phase.LOOKED_UP

    def _load_done(self, job: _Job) -> None:
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
        if admission.phase is not _Phase.LOADING or job.cancelled or not filled:
            # given up or dropped while loading, or nothing came: free the rest (the filled blocks stay cached)
            pool.free_blocks([*reversed(filled), *reversed(admission.gpu_blocks)])
            admission.held = False
            admission.gpu_blocks, admission.new_blocks = (), []
            if admission.phase is _Phase.LOADING:
                admission.phase = _Phase.PLAIN
            return
        admission.new_blocks = filled
        size = pool.block_size
        by_medium = {Medium.CPU: 0, Medium.STORAGE: 0}
        for medium in media:
            by_medium[medium] = by_medium.get(medium, 0) + size
        admission.promotion = Promotion(PrefixHit(tuple(blocks), len(blocks) * size), by_medium)
        admission.phase = _Phase.READY

    def _store_done(self, job: _Job) -> None:
        if isinstance(job.result, int):
            self.counters.blocks_stored += job.result
        settled = self._settled
        for block in job.blocks:  # held all along: still cached under the same hash
            assert block.block_hash is not None
            settled[block.block_id] = block.block_hash  # stored, or refused by the tier: either way not again
        self._store_held -= len(job.blocks)
        self.counters.stores_done += 1
        self.block_pool.free_blocks(job.blocks)

    def _release_admission(self, admission: _Admission) -> None:
        if admission.held:
            self.block_pool.free_blocks([*reversed(admission.new_blocks), *reversed(admission.gpu_blocks)])
            admission.held = False
            admission.gpu_blocks, admission.new_blocks = (), []

    def _give_up(self, admission: _Admission) -> None:
        """Stop waiting for ``admission``: a READY one's holds go now, a LOADING one's when its job is collected."""
        if admission.phase is _Phase.READY:
            self._release_admission(admission)
        else:
            for job in self._outstanding:
                if job.admission is admission:
                    job.cancelled = True  # not run if not started; if running, its blocks are freed when collected
        admission.phase = _Phase.PLAIN
        admission.promotion = None

    @property
    def _holding(self) -> list[_Admission]:
        """Admissions whose blocks the offloader holds (waiting requests', and given-up loads still copying)."""
        seen = {id(a): a for a in self._admissions.values() if a.held}
        for job in self._outstanding:
            if job.admission is not None and job.admission.held:
                seen[id(job.admission)] = job.admission
        return list(seen.values())

    def _submit(self, job: _Job) -> None:
        self._submitted += 1
        self._outstanding.add(job)
        self._in_flight[job.kind] += 1
        with self._queue:
            (self._lookups if job.kind is _Kind.LOOKUP else self._others).append(job)
            self._queue.notify()

    def _slow(self, now: float) -> bool:
        """Some job has waited on the tier longer than ``wait_s`` (the outstanding set is small: bounded jobs)."""
        return any(not job.finished and now - job.submitted > self.wait_s for job in self._outstanding)

    def _spent(self, started: float) -> None:
        self.counters.step_loop_seconds += time.perf_counter() - started

    # ------------------------------------------------------- offload thread

    def _next_job(self) -> _Job | None:
        with self._queue:
            while not (self._stopping or self._lookups or self._others):
                self._queue.wait()
            if self._stopping:
                return None
            return self._lookups.popleft() if self._lookups else self._others.popleft()

    def _run(self) -> None:
        kv = self.kv_pool.kv
        backend = self.backend
        while True:
            job = self._next_job()
            if job is None:
                return
            with self._idle:
                self._running = True
            started = time.perf_counter()
            try:
                if job.cancelled:
                    pass
                elif job.kind is _Kind.LOOKUP:
                    job.result = backend.lookup(job.metas)
                elif job.kind is _Kind.STORE:
                    job.result = backend.store(job.metas, kv, [b.block_id for b in job.blocks])
                else:
                    job.result = tuple(backend.load(job.metas, kv, [b.block_id for b in job.blocks]))
            except BaseException as exc:  # not an outage (the backend absorbs those): a fault, logged in full
                job.error = exc
                job.result = None
                logger.exception(
                    "offload %s of %d blocks failed; treated as done nothing", job.kind.value, len(job.metas)
                )
            self.counters.busy_seconds += time.perf_counter() - started  # this thread is its only writer
            job.finished = True
            self._done.append(job)
            with self._idle:
                self._running = False
                self._idle.notify_all()
            self._wake()
