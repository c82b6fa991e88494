"""A worker's slot for its lower tier: which backend is attached, its Offloader, and the hooks they are wired into.

:meth:`OffloadSlot.attach` is the ONE place a tier is wired into a worker:
the block pool's eviction hook and the scheduler's admission step both
point at the slot's :class:`~kvstore.workers.offload.Offloader`, or, for
:class:`~kvstore.workers.offload_backend.NoOffload`, at nothing (evicted
KV is dropped, admissions use the GPU hit alone, no offload thread runs).
The step loop calls the slot unconditionally; with no tier every call is
a no-op, so the worker never asks "is there an offloader?".

Invariants
    - At most one Offloader per worker is alive: the one replaced is
      released (its jobs cancelled or waited for, every hold dropped) and
      its thread stopped before the new one is wired in.
    - Every method runs on the step loop's side, under the worker's lock
      (the caller publishes the pool events a release or a drain leaves);
      :meth:`~OffloadSlot.state` and :meth:`~OffloadSlot.link_state` are
      read by scrapes from any thread, lock-free (plain ints, ``connected``).

Failure modes
    Waiting methods (:meth:`~OffloadSlot.drain`, :meth:`~OffloadSlot.flush`,
    :meth:`~OffloadSlot.release`) wait on copies, bounded by their timeout:
    for tests, invariant checks, failure recovery and shutdown, never a step.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.block_pool import BlockPool
from kvstore.workers.kv_tensor_pool import KVTensorPool
from kvstore.workers.metrics import OffloadState, TierLinkState
from kvstore.workers.offload import Offloader
from kvstore.workers.offload_backend import LinkedOffload, NoOffload, OffloadBackend
from kvstore.workers.scheduler import NoAdmissions, Scheduler


class OffloadSlot:
    """The tier attached to one worker (none at first); see the module docstring."""

    def __init__(
        self, block_pool: BlockPool, kv_pool: KVTensorPool, scheduler: Scheduler, wake: Callable[[], None]
    ) -> None:
        self._block_pool = block_pool
        self._kv_pool = kv_pool
        self._scheduler = scheduler
        self._wake = wake  # for the offload thread: a job finished
        self.backend: OffloadBackend = NoOffload()
        self.offloader: Offloader | None = None

    def attach(self, backend: OffloadBackend, wait_s: float) -> bool:
        """Release the tier attached before (waiting for its running jobs) and wire ``backend`` in.

        True if a tier was released: its loads may have registered blocks, whose events the caller publishes.
        """
        old = self.offloader
        if old is not None:
            old.release_all()
            old.close()
        if isinstance(backend, NoOffload):
            offloader = None
            self._block_pool.on_evict = lambda blocks: None
            self._scheduler.offloader = NoAdmissions()
        else:
            offloader = Offloader(backend, self._block_pool, self._kv_pool, wait_s=wait_s, wake=self._wake)
            self._block_pool.on_evict = offloader.on_evict
            self._scheduler.offloader = offloader
        self.offloader = offloader
        self.backend = backend
        return old is not None

    # ------------------------------------------------------------ step loop

    @property
    def has_done(self) -> bool:
        """Finished jobs wait to be collected."""
        return self.offloader is not None and self.offloader.has_done

    @property
    def busy(self) -> bool:
        """Jobs are queued, running, or finished and not collected."""
        return self.offloader is not None and self.offloader.busy

    @property
    def step_loop_seconds(self) -> float:
        """Time the step loop has spent inside the offloader."""
        return 0.0 if self.offloader is None else self.offloader.counters.step_loop_seconds

    def poll(self) -> None:
        if self.offloader is not None:
            self.offloader.poll()

    def launch_stores(self) -> None:
        if self.offloader is not None:
            self.offloader.launch_stores()

    # ------------------------------------------------------------- waiting

    def drain(self, timeout: float | None) -> bool:
        """Wait for the queued jobs and collect them; False on timeout."""
        return self.offloader is None or self.offloader.drain(timeout)

    def flush(self, timeout: float | None) -> bool:
        """Drain, storing every cached free block (or having it refused); False on timeout."""
        return self.offloader is None or self.offloader.flush(timeout)

    def release(self, timeout: float | None) -> None:
        """Cancel what has not started, wait for the rest, drop every hold (READY requests fall back to their hit)."""
        if self.offloader is not None:
            self.offloader.release_all(timeout)

    def close(self) -> None:
        """Stop the offload thread (after :meth:`release`)."""
        if self.offloader is not None:
            self.offloader.close()

    # ------------------------------------------------------------- scrapes

    def state(self) -> OffloadState | None:
        offloader = self.offloader
        return None if offloader is None else offloader.state()

    def link_state(self) -> TierLinkState | None:
        """The link metrics of the backend, or None for one with no tier link (no tier, or a test's)."""
        backend = self.backend
        if isinstance(backend, LinkedOffload):
            return TierLinkState(backend.counters, backend.connected)
        return None
