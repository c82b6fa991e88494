"""A request's output as it is produced: from the worker's step-loop thread to one consumer.

The step loop :meth:`~RequestStream.put`\\ s one :class:`StreamChunk` per
step that produced something and ends the stream with :meth:`close` (after
the chunk that carries the request's stats) or :meth:`fail`. The consumer
reads it on any thread (:meth:`__iter__`, :meth:`result`) or on an asyncio
loop (``async for``), and may :meth:`cancel` it: the worker then drops the
request within one step and frees its blocks.

Invariants: chunks arrive in order, each exactly once; after ``close`` or
``fail`` nothing more is put. The producer never blocks (the buffer is
unbounded, and a request's output is bounded by its ``max_tokens``) and
never fails: an asyncio reader whose loop was closed under it is forgotten.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from kvstore.worker_api import GenerateResult, StreamChunk, fold_stream


class _End:
    """Marks the end of the stream in the buffer (with the error that ended it, if any)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class RequestStream:
    """One request's chunks; see the module docstring. Thread-safe."""

    def __init__(self, request_id: str, n: int, on_cancel: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        self.n = n
        self._on_cancel = on_cancel
        self._items: deque[StreamChunk | _End] = deque()
        self._cond = threading.Condition()
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._ended = False
        self.cancelled = False

    # ------------------------------------------------------------- producer

    def put(self, chunk: StreamChunk) -> None:
        self._push(chunk)

    def close(self) -> None:
        self._push(_End(None))

    def fail(self, error: BaseException) -> None:
        self._push(_End(error))

    def _push(self, item: StreamChunk | _End) -> None:
        with self._cond:
            if self._ended:
                return
            self._ended = isinstance(item, _End)
            self._items.append(item)
            self._cond.notify_all()
            wakers = list(self._wakers)
        for waker in wakers:
            loop, event = waker
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # its loop is closed, the reader gone with it: forget it, never fail the producer
                with self._cond:
                    if waker in self._wakers:
                        self._wakers.remove(waker)

    # ------------------------------------------------------------- consumer

    def done(self) -> bool:
        """The producer has ended the stream (its last chunk may still be unread)."""
        with self._cond:
            return self._ended

    def cancel(self) -> None:
        """Ask the worker to drop the request (idempotent; harmless after it finished)."""
        if not self.cancelled:
            self.cancelled = True
            self._on_cancel(self)

    def __iter__(self) -> Iterator[StreamChunk]:
        while True:
            item = self._next(None)
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item

    def result(self, timeout: float | None = None) -> GenerateResult:
        """Wait for the whole request; raises the error that stopped it, or TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: list[StreamChunk] = []
        while True:
            item = self._next(deadline)
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return fold_stream(chunks, self.n)
            chunks.append(item)

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        event = asyncio.Event()
        waker = (asyncio.get_running_loop(), event)
        with self._cond:
            self._wakers.append(waker)
        try:
            while True:
                with self._cond:
                    item = self._items.popleft() if self._items else None
                    if item is None:
                        event.clear()
                if item is None:
                    await event.wait()
                    continue
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            with self._cond:
                if waker in self._wakers:  # (the producer drops a waker whose loop closed)
                    self._wakers.remove(waker)

    async def aresult(self) -> GenerateResult:
        """:meth:`result` for an asyncio consumer."""
        return fold_stream([chunk async for chunk in self], self.n)

    def _next(self, deadline: float | None) -> StreamChunk | _End:
        with self._cond:
            while not self._items:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"request {self.request_id!r} did not finish in time")
                self._cond.wait(remaining)
            return self._items.popleft()
