"""The offload thread: a worker's lower-tier calls, run one at a time off the step loop.

Shape
-----
The step loop hands a :class:`Job` (a ``lookup``, ``store`` or ``load``
over some blocks) to the :class:`OffloadThread` with :meth:`~OffloadThread.submit`
and, at the start of each step, takes the finished ones back with
:meth:`~OffloadThread.collect`. ONE thread makes the backend's blocking
calls, in this order: lookups first (an admission waits on them), then
loads and stores in the order they were submitted.

Data structures
    - two queues under ``_queue`` (a Condition, never held while a job
      runs): ``_lookups`` and ``_others``;
    - ``_done``: finished jobs, appended by the thread, drained by the step
      loop (a deque: one appender, one popper, no lock);
    - ``outstanding``: jobs submitted and not collected yet, and
      ``in_flight`` (their count by kind, plain ints read racily by
      scrapes). Both are the step loop's alone.

Invariants
    - A job is collected exactly once, after the thread set ``finished``;
      ``busy`` is true from its submission until then.
    - When the queue runs dry the thread calls the backend's ``idle()``
      (if it has one) before it counts itself idle, so :meth:`~OffloadThread.wait_idle`
      returning means the backend has nothing outstanding either.
    - The thread touches only the backend and the KV tensor rows of its
      jobs (blocks the submitter holds); never the pool or the worker.
    - A job ``cancelled`` before it starts is not run (it finishes with no
      result); one already running ends normally, and its submitter
      decides at collection what its result still means.

Failure modes
    - The backend raises: logged in full, the job's ``result`` is None and
      ``error`` the exception -- treated as having done nothing.
    - The backend hangs: the job stays outstanding; :meth:`~OffloadThread.slow`
      reports it once it has waited past the caller's ``wait_s``, so the
      caller stops queueing behind it. :meth:`~OffloadThread.close` stops
      the thread after the job it runs (queued jobs are dropped).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from kvstore.block_pool import KVCacheBlock
from kvstore.events import Medium
from kvstore.tiers.blocks import BlockMeta
from kvstore.workers.kv_tensor_pool import KVTensorPool
from kvstore.workers.metrics import OffloadCounters
from kvstore.workers.offload_backend import OffloadBackend

if TYPE_CHECKING:
    from kvstore.workers.offload_loads import Admission

logger = logging.getLogger(__name__)


class JobKind(enum.Enum):
    LOOKUP = "lookup"
    STORE = "store"
    LOAD = "load"


class Job:
    __slots__ = ("admission", "blocks", "cancelled", "error", "finished", "kind", "metas", "result", "submitted")

    def __init__(
        self, kind: JobKind, metas: list[BlockMeta], blocks: list[KVCacheBlock], admission: Admission | None
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


class OffloadThread:
    """The one thread that runs a worker's offload jobs (see the module docstring).

    Every method but the thread's own runs on the step loop, under the
    worker's lock. ``wake`` is called (on the offload thread) whenever a
    job finishes, so an idle step loop collects it promptly; the time the
    thread spends in the backend is added to ``counters.busy_seconds``.
    """

    def __init__(
        self,
        backend: OffloadBackend,
        kv_pool: KVTensorPool,
        counters: OffloadCounters,
        wake: Callable[[], None],
    ) -> None:
        self.backend = backend
        self.kv_pool = kv_pool
        self.counters = counters
        self._wake = wake
        self._queue = threading.Condition(threading.Lock())  # never held while a job runs
        self._lookups: deque[Job] = deque()
        self._others: deque[Job] = deque()
        self._stopping = False
        self._done: deque[Job] = deque()  # appended by the offload thread, drained by the step loop
        self._submitted = 0  # jobs handed to the thread and not collected yet
        self.outstanding: set[Job] = set()  # those jobs (for cancellation and the invariant check)
        self.in_flight = dict.fromkeys(JobKind, 0)  # those jobs by kind, for scrapes (plain ints: read racily)
        self._idle = threading.Condition(threading.Lock())  # the thread's "no job running" for wait_idle()
        self._running = False
        self._thread = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ step loop

    @property
    def busy(self) -> bool:
        """Jobs are queued, running, or finished and not collected."""
        return self._submitted > 0

    @property
    def has_done(self) -> bool:
        return bool(self._done)

    def submit(self, job: Job) -> None:
        self._submitted += 1
        self.outstanding.add(job)
        self.in_flight[job.kind] += 1
        with self._queue:
            (self._lookups if job.kind is JobKind.LOOKUP else self._others).append(job)
            self._queue.notify()

    def collect(self) -> Iterator[Job]:
        """The finished jobs, oldest first, each taken off the outstanding set as it is yielded."""
        while self._done:
            job = self._done.popleft()
            self._submitted -= 1
            self.outstanding.discard(job)
            self.in_flight[job.kind] -= 1
            yield job

    def slow(self, now: float, wait_s: float) -> bool:
        """Some job has waited on the tier longer than ``wait_s`` (the outstanding set is small: bounded jobs)."""
        return any(not job.finished and now - job.submitted > wait_s for job in self.outstanding)

    def cancel_all(self) -> None:
        """Mark every outstanding job cancelled: those not started are not run."""
        for job in self.outstanding:
            job.cancelled = True

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until every submitted job has finished (collected or not); False on timeout.

        Waits on copies: for tests, invariant checks and failure recovery only, never on a step.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._submitted > len(self._done) or self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Stop the thread after the job it is running (queued jobs are dropped). Idempotent."""
        with self._queue:
            self._stopping = True
            self._queue.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------- offload thread

    def _next_job(self) -> Job | None:
        with self._queue:
            while not (self._stopping or self._lookups or self._others):
                self._queue.wait()
            if self._stopping:
                return None
            return self._lookups.popleft() if self._lookups else self._others.popleft()

    def _run(self) -> None:
        kv = self.kv_pool.kv
        backend = self.backend
        idle: Callable[[], None] | None = getattr(backend, "idle", None)  # optional (offload_backend)
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
                elif job.kind is JobKind.LOOKUP:
                    job.result = backend.lookup(job.metas)
                elif job.kind is JobKind.STORE:
                    job.result = backend.store(job.metas, kv, [b.block_id for b in job.blocks])
                else:
                    job.result = tuple(backend.load(job.metas, kv, [b.block_id for b in job.blocks]))
            except BaseException as exc:  # not an outage (the backend absorbs those): a fault, logged in full
                job.error = exc
                job.result = None
                logger.exception(
                    "offload %s of %d blocks failed; treated as done nothing", job.kind.value, len(job.metas)
                )
            job.finished = True
            self._done.append(job)
            with self._queue:
                dry = not (self._lookups or self._others)
            if dry and idle is not None:  # answers still on their way are waited for while nothing else waits
                self._wake()  # the step loop may collect the job meanwhile: its blocks need nothing more
                try:
                    idle()
                except Exception:  # the backend absorbs its errors; one that escapes is logged, never fatal
                    logger.exception("the offload backend's idle() failed")
            self.counters.busy_seconds += time.perf_counter() - started  # this thread is its only writer
            with self._idle:
                self._running = False
                self._idle.notify_all()
            self._wake()
