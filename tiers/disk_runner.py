"""Batches of block I/Os on the disk tier's I/O threads, every one answered by its deadline.

An I/O (:class:`BlockIo`) moves one or more blocks -- a run of consecutive
slots -- and answers each of them.

Contracts
---------
- At most ``threads`` I/Os run at once, one per I/O thread.
- Every I/O has a deadline, time queued for a thread included: the caller
  has its answers by then. An I/O no thread took up by the deadline is
  abandoned without touching its buffer and settled at once; one already
  running keeps running in the background and is settled when it finishes.
  Its buffers belong to it until it is settled: that is when the caller's
  ``on_settled(ok)`` runs, exactly once per block, on the event loop.
- A storage error (``OSError``, ``IntegrityError``) is an answer -- the
  planner's ``settle`` turns it into False and counts it. Any other
  exception is a bug: it is raised once every I/O of its batch is settled.

Why a batch is one draining job per thread, not one job per I/O: each
thread takes the batch's next I/O as soon as it finishes one, so a free
thread never waits for the event loop, and the loop hears back once per
batch instead of once per block. On a machine with few cores, the loop's
turn for each completion is time the disk sits idle (docs/tiers.md has
the measurements). The jobs go through aiofiles' executor wrapper onto the
tier's own thread pool.

Why ``started`` and ``abandoned`` are decided under one lock: at the
deadline the loop and an I/O thread race for the same queued I/O, and
exactly one of them must win -- either the thread runs it or the loop
hands its buffer back, never both.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import aiofiles.os

from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.disk_format import IntegrityError

Settled = Callable[[bool], None]
"""Called once, on the event loop, when an I/O no longer touches its buffer; True if it succeeded."""

Request = tuple[BlockMeta, memoryview, Settled]
"""One block of a batch: its meta, the buffer to write from or read into, and its ``on_settled``."""


def settled_nothing(ok: bool) -> None:
    """The ``on_settled`` of a caller that has nothing to do once its buffer is free."""


class BlockIo:
    """One I/O of one or more blocks: ``job`` runs on an I/O thread unless the caller gave up first
    (its return value kept as ``result``), and ``settle`` runs on the event loop once the job no longer
    touches its buffers, turning the outcome into one answer per block, for the requests at
    ``positions`` of the batch (and calling the caller's ``on_settled`` for each)."""

    __slots__ = (
        "_lock",
        "_settle",
        "abandoned",
        "answer",
        "error",
        "finished",
        "job",
        "positions",
        "result",
        "started",
    )

    def __init__(
        self, positions: list[int], job: Callable[[], object], settle: Callable[[BlockIo], list[bool]]
    ) -> None:
        self._lock = threading.Lock()
        self.positions = positions
        self.job = job
        self._settle = settle
        self.started = False
        self.abandoned = False
        self.finished = False
        self.error: Exception | None = None
        self.result: object = None
        self.answer: list[bool] | None = None

    def run(self) -> None:
        """On an I/O thread: the job, unless abandoned; its exception is kept for ``settle``."""
        with self._lock:
            if self.abandoned:
                return
            self.started = True
        try:
            self.result = self.job()
        except Exception as exc:  # judged on the loop: storage errors are answers, anything else a bug
            self.error = exc
        with self._lock:
            self.finished = True

    def busy(self) -> bool:
        """On the event loop: True while a thread runs the job; one not yet started is abandoned."""
        with self._lock:
            if not self.started:
                self.abandoned = True
            return self.started and not self.finished

    def settle(self) -> list[bool]:
        """On the event loop, once not busy: the answers (settled once; later calls repeat them)."""
        if self.answer is None:
            self.answer = self._settle(self)
        return self.answer


Plan = Callable[[Sequence[Request]], tuple[list[bool | None], list[BlockIo]]]
"""Turns a batch into the answers known without I/O (None where an I/O answers) and the I/Os, each
naming the positions of the requests it answers."""


class IoRunner:
    """The disk tier's I/O threads and the deadline every I/O on them keeps (see the module docstring).

    ``deadline_expired`` counts, per operation name, the I/Os still unfinished at their deadline.
    Drive it from one event loop.
    """

    def __init__(self, threads: int, deadline_s: float, deadline_expired: Counter[str]) -> None:
        assert deadline_s > 0 and threads >= 1, "the disk tier checks its deadline and thread count"
        self.deadline_s = deadline_s
        self._threads = threads
        self._expired = deadline_expired
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kv-disk")
        self._batches: set[asyncio.Task[list[list[bool]]]] = set()  # running, answered or not

    async def run_batch(self, requests: Sequence[Request], plan: Plan, op: str) -> list[bool]:
        """Plan the batch -- each request answered at once (its ``on_settled`` called here) or by an
        I/O -- then run the I/Os together; one answer per request, in order."""
        planned, ios = plan(requests)
        for (_, _, on_settled), answer in zip(requests, planned, strict=True):
            if answer is not None:
                on_settled(answer)
        answers = list(planned)
        for io, ran in zip(ios, await self._run(ios, op), strict=True):
            for position, answer in zip(io.positions, ran, strict=True):
                answers[position] = answer
        assert all(answer is not None for answer in answers), "a request that no I/O answers"
        return [bool(answer) for answer in answers]

    async def aclose(self) -> None:
        """Wait (up to one deadline) for I/O still running, then stop the I/O threads."""
        if self._batches:
            await asyncio.wait(self._batches, timeout=self.deadline_s)
        self.close()

    def close(self) -> None:
        """Stop the I/O threads without waiting (I/O already running finishes on its own)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, ios: list[BlockIo], op: str) -> list[list[bool]]:
        """Run ``ios`` on the I/O threads and answer each by the deadline.

        At the deadline, I/Os no thread took up are abandoned and settled at once (their buffers
        untouched), finished ones are answered, and running ones answer False and settle when done.
        """
        if not ios:
            return []
        queue = deque(ios)
        drains = [_drain_async(queue, executor=self._executor) for _ in range(min(self._threads, len(ios)))]
        batch = asyncio.create_task(self._settle_batch(ios, drains))
        self._batches.add(batch)
        batch.add_done_callback(self._batches.discard)
        done, _ = await asyncio.wait((batch,), timeout=self.deadline_s)
        if done:
            return batch.result()
        answers = []
        for io in ios:
            if io.busy():
                answers.append([False] * len(io.positions))  # settles when its thread finishes it
            else:
                answers.append(io.settle())
            if not io.finished:
                self._expired[op] += len(io.positions)
        return answers

    async def _settle_batch(self, ios: list[BlockIo], drains: list[Awaitable[None]]) -> list[list[bool]]:
        """Once every draining job has ended (or was cancelled by close()): settle every I/O."""
        await asyncio.gather(*drains, return_exceptions=True)
        answers = []
        for io in ios:
            io.busy()  # nothing runs now; one never started (the pool was shut down) is abandoned
            answers.append(io.settle())
        bugs = [io.error for io in ios if io.error is not None and not isinstance(io.error, (OSError, IntegrityError))]
        if bugs:
            raise bugs[0]
        return answers


def _drain(queue: deque[BlockIo]) -> None:
    """On an I/O thread: run the batch's I/Os, taking the next as soon as one is done, until none is left."""
    while True:
        try:
            io = queue.popleft()
        except IndexError:
            return
        io.run()


# aiofiles' executor wrapper: awaitable, run on the tier's own thread pool (executor=...).
_drain_async = aiofiles.os.wrap(_drain)  # type: ignore[attr-defined]
