"""The seam where a lower tier (CPU arena, disk) plugs into a worker, kept off the step loop.

Shape
-----
A lower tier is an :class:`OffloadBackend` (:mod:`kvstore.workers.offload_backend`):
three *blocking* calls -- ``lookup``, ``store`` and ``load``. The worker
never makes them on its step loop. An :class:`Offloader` (one per worker,
wired in one place: :meth:`kvstore.workers.worker.KVWorker.attach_offload`)
runs them on ONE offload thread, one at a time, and the step loop only
does bookkeeping: it hands jobs over and, at the start of each step,
collects the finished ones. The split follows vLLM's offloading connector
(a scheduler-side manager that decides, a worker-side handler that
copies); here both halves live in the worker process.

The Offloader is the step loop's one handle on the seam; each job is
done by its own module:

- :mod:`~kvstore.workers.offload_backend` -- the backend contract,
  :class:`NoOffload`, :class:`Promotion`;
- :mod:`~kvstore.workers.offload_jobs` -- the offload thread: its job
  queues (lookups first) and the collection of finished jobs;
- :mod:`~kvstore.workers.offload_loads` -- loads at admission: lookup,
  LOADING, READY, giving up on a slow tier;
- :mod:`~kvstore.workers.offload_stores` -- stores ahead of eviction: held
  blocks and the ``settled`` map.

Invariants (each kept by the module named)
    - Every pool reference the offloader takes is dropped exactly once: a
      store hold when its job is collected (stores), a load's blocks when
      the load is collected -- unfilled ones, or all of them when given up
      -- and a READY request's hit in :meth:`Offloader.admitted` or
      :meth:`Offloader.abort` (loads). :meth:`Offloader.held_refs` counts
      them for the scheduler's invariant check.
    - A block is registered in the prefix cache by a load only after the
      load reported it filled. A failed job (the backend raised) fills
      nothing and stores nothing.
    - The offload thread touches only the backend and the KV tensor rows
      of jobs it was given (held blocks); never the pool or the worker.
      Everything else runs on the step loop, under the worker's lock.

Failure modes
    A slow tier is given up on after ``wait_s`` (the request recomputes;
    no new lookups or store holds while a job is stuck); a dead tier
    (``connected`` False) is skipped; a backend that raises is logged and
    its job does nothing. Time the step loop spends inside the offloader
    is counted (``counters.step_loop_seconds``), so "the step loop never
    waits on a copy" is measured, not assumed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.kv_cache_manager import CacheRequest, PrefixHit
from kvstore.workers.kv_tensor_pool import KVTensorPool
from kvstore.workers.metrics import OffloadCounters, OffloadState
from kvstore.workers.offload_backend import LinkedOffload, NoOffload, OffloadBackend, Promotion
from kvstore.workers.offload_jobs import JobKind, OffloadThread
from kvstore.workers.offload_loads import LoadPath
from kvstore.workers.offload_stores import StorePath

__all__ = ["LinkedOffload", "NoOffload", "OffloadBackend", "Offloader", "Promotion"]


class Offloader:
    """The step loop's side of the seam (see the module docstring); every method runs under the worker's lock.

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
        self.wait_s = wait_s
        self.counters = OffloadCounters()
        self._jobs = OffloadThread(backend, kv_pool, self.counters, wake or (lambda: None))
        self._loads = LoadPath(
            backend, block_pool, self._jobs, self.counters, reserve_blocks=reserve_blocks, wait_s=wait_s
        )
        self._stores = StorePath(
            backend, block_pool, self._jobs, self.counters,
            max_store_blocks=max_store_blocks or block_pool.num_blocks, scan_limit=scan_limit, wait_s=wait_s,
        )  # fmt: skip

    @property
    def busy(self) -> bool:
        """Jobs are queued, running, or finished and not collected."""
        return self._jobs.busy

    @property
    def store_held_blocks(self) -> int:
        """Pool blocks held by store jobs that are not stuck: they return to the free queue within milliseconds.

        0 while a job has waited on the tier past ``wait_s``: the scheduler then preempts as usual
        rather than wait for blocks that may be held until the tier's deadline.
        """
        return 0 if self._jobs.slow(time.monotonic(), self.wait_s) else self._stores.held

    @property
    def has_done(self) -> bool:
        return self._jobs.has_done

    def state(self) -> OffloadState:
        """For scrapes, from any thread: plain ints and the counters, no lock."""
        n = self._jobs.in_flight
        return OffloadState(self.counters, n[JobKind.LOOKUP], n[JobKind.LOAD], n[JobKind.STORE], self._stores.held)

    def poll(self) -> None:
        """Collect finished jobs: release store holds, register loaded blocks, record lookup answers."""
        started = time.perf_counter()
        for job in self._jobs.collect():
            if job.kind is JobKind.STORE:
                self._stores.done(job)
            elif job.kind is JobKind.LOOKUP:
                self._loads.lookup_done(job)
            else:
                self._loads.load_done(job)
        self._spent(started)

    def admit(self, request: CacheRequest, gpu_hit: PrefixHit) -> Promotion | None:
        """The hit to admit ``request`` with, or None while its lookup or load runs (skip it for now)."""
        started = time.perf_counter()
        try:
            return self._loads.admit(request, gpu_hit, time.monotonic())
        finally:
            self._spent(started)

    def admitted(self, request: CacheRequest) -> None:
        """``request`` was admitted (``allocate_slots`` took its hit): drop the holds on it."""
        self._loads.admitted(request)

    def abort(self, request: CacheRequest) -> None:
        """A waiting ``request`` is dropped: forget its lookup/load (a running job's blocks are freed when it ends)."""
        self._loads.abort(request)

    def release_ready(self, keep: CacheRequest) -> int:
        """Drop the holds of loaded requests waiting to be admitted, but ``keep``'s; how many references went.

        For a scheduler whose head request cannot be allocated while nothing runs (see
        :mod:`~kvstore.workers.offload_loads`)."""
        return self._loads.release_ready(keep)

    def launch_stores(self) -> None:
        """Hold cached free blocks not yet stored, from the free queue's head, and queue one store job."""
        started = time.perf_counter()
        try:
            self._stores.launch(time.monotonic())
        finally:
            self._spent(started)

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        """The pool's eviction hook: never copies. A block evicted before it was stored loses its KV (counted)."""
        self._stores.on_evict(blocks)

    def held_refs(self) -> Counter[int]:
        """Pool references the offloader holds, by block id (for the scheduler's invariant check)."""
        refs: Counter[int] = Counter()
        self._stores.count_held(refs)
        self._loads.count_held(refs)
        return refs

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued job has run, then collect them; False on timeout.

        Waits on copies: for tests, invariant checks and failure recovery only, never on a step.
        """
        if not self._jobs.wait_idle(timeout):
            return False
        self.poll()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Drain, and queue the stores of blocks already free, until no job is left; False on timeout.

        Afterwards every cached free block is in the tier (or refused by it). Waits on copies, like :meth:`drain`.
        """
        for _ in range(self.block_pool.num_blocks + 1):
            if not self.drain(timeout):
                return False
            self.launch_stores()
            if not self.busy:
                break
        return True

    def release_all(self, timeout: float | None = None) -> bool:
        """Cancel the jobs not started, drain, drop every hold (READY requests fall back to their GPU hit).

        Waits for the job running, if any (False if it outlives ``timeout``).
        """
        self._jobs.cancel_all()  # a cancelled store releases its blocks unstored
        drained = self.drain(timeout)
        self._loads.give_up_all()
        return drained and not self.held_refs()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the offload thread after the job it is running (queued jobs are dropped). Idempotent."""
        self._jobs.close(timeout)

    def _spent(self, started: float) -> None:
        self.counters.step_loop_seconds += time.perf_counter() - started
